"""Command palette (Ctrl+P): every chat command, policy, budget and gate choice.

The app lists what it can do (``palette_commands``, with the key each answers to after the
config's remaps); ``CertchatCommands`` matches those against what the user types.
Textual's own system commands (themes, keys, quit) sit beside them in the palette.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from textual.command import DiscoveryHit, Hit, Hits, Provider


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[], object]


class PaletteApp(Protocol):
    """What the palette needs of the app: its entries."""

    def palette_commands(self) -> list[Command]: ...


class CertchatCommands(Provider):
    """Matches the app's commands by fuzzy name."""

    def _commands(self) -> list[Command]:
        app: PaletteApp = self.app  # type: ignore[assignment]
        return app.palette_commands()

    async def discover(self) -> Hits:
        for command in self._commands():
            yield DiscoveryHit(command.name, command.run, help=command.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in self._commands():
            score = matcher.match(command.name)
            if score > 0:
                yield Hit(score, matcher.highlight(command.name), command.run, help=command.help)
