"""The bars a gate holds its signals against: its own statistic at the turn's τ, and any calibrated signal that fires
a turn on its own at a fixed τ (``agent.gate.calibration.SecondSignal``, the record it is read from)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.gate import calibration, signals
from agent.gate.signals import Signal


@dataclass(frozen=True)
class Bar:
    """A signal and the level that fires the gate on it."""

    signal: Signal
    tau: float | None = None
    """A fixed τ; None for the gate's own bar, whose τ is worked out each turn (configured, or calibrated and
    following the conversation)."""
    min_sampled: int = 0
    """Read only where the kept sample holds at least this many cells: below that the statistic reads on another
    scale than the one its τ was fitted on."""

    def applies(self, sampled_cells: int) -> bool:
        """Whether the signal is read at all with this many cells in the kept sample."""
        return sampled_cells >= self.min_sampled

    def fires(self, value: float | None, sampled_cells: int) -> bool:
        """Whether a reading fires this bar on its own: read, and reaching its fixed τ."""
        return self.applies(sampled_cells) and calibration.breach(value, self.tau)

    @classmethod
    def own(cls, statistic: str) -> Bar:
        """The gate's bar on its configured statistic."""
        return cls(signals.get(statistic))

    @classmethod
    def calibrated(cls, second: calibration.SecondSignal) -> Bar:
        """A calibrated second signal's bar: its fixed τ, read in the certificate form shown."""
        return cls(signals.get(second.statistic), second.tau, second.min_sampled)
