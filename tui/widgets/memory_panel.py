"""The memory panel: what the model still has in its KV cache, and how sure it is.

Three parts, all drawn from the agent's ``MemoryView``: the cell gauge (live cells
against the allocation, the budget marked), the certificate per turn as a bar chart
with the gate line and a ↻ under every turn whose gate re-read the history, and, for
every earlier turn, the share of its question and of its answer still cached.
"""

from __future__ import annotations

from textual.app import ComposeResult, RenderResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label, Static

from agent import events as ev
from tui import render

CHART_ROWS = 6


class CertificateChart(Widget):
    """Turn certificates as bars, newest right; sized to the panel."""

    certificates: reactive[list[tuple[int, float | None, bool]]] = reactive(list, always_update=True)
    threshold: reactive[float | None] = reactive(None)

    def render(self) -> RenderResult:
        return render.certificate_chart(self.certificates, self.threshold, self.size.width, CHART_ROWS)


class MemoryPanel(Vertical):
    """The side panel; ``show`` takes a MemoryView, the ``note_*`` methods live events."""

    memory: reactive[ev.MemoryView | None] = reactive(None, always_update=True)

    def compose(self) -> ComposeResult:
        yield Label("Memory", classes="panel-title")
        yield Static(id="cells")
        yield Static(id="gauge")
        yield Static(id="last-event", classes="muted")
        yield Label("Certificate per turn", classes="panel-section")
        yield CertificateChart(id="chart")
        yield Static(id="caption", classes="muted")
        yield Label("Still cached per turn (Q · A)", classes="panel-section")
        with VerticalScroll(id="retained-scroll"):
            yield Static(id="retained")

    def show(self, memory: ev.MemoryView) -> None:
        self.memory = memory

    def watch_memory(self, memory: ev.MemoryView | None) -> None:
        if memory is None:
            self.query_one("#cells", Static).update("model not loaded")
            return
        width = max(8, self.content_size.width or 30)
        budget = f" · budget {memory.budget_cells}" if memory.budget_cells is not None else " · no budget"
        # how much it may forget: the budget in force and its certified loss (an evicting policy's)
        forget = f"\nbudget {memory.budget_words}" if memory.policy != "full" and memory.budget_words else ""
        self.query_one("#cells", Static).update(
            Content(f"{memory.live_cells}/{memory.allocated_cells} cells{budget}{forget}"))
        self.query_one("#gauge", Static).update(render.cells_gauge(memory, width))
        chart = self.query_one(CertificateChart)
        chart.threshold = memory.gate_threshold
        chart.certificates = list(memory.certificates)
        self.query_one("#caption", Static).update(
            render.chart_caption(memory.certificates, memory.gate_threshold, chart.size.width or width))
        self.query_one("#retained", Static).update(render.retention_rows(memory.retained, width - 1, memory.reread))

    def on_resize(self) -> None:
        self.memory = self.memory  # re-draw the width-dependent bars

    def note_eviction(self, event: ev.Evicted) -> None:
        self.query_one("#last-event", Static).update(
            Content(f"evicted: {event.cells_before}→{event.cells_after} cells, {event.ms:.0f} ms"))

    def note_restore(self, event: ev.Restored) -> None:
        self.query_one("#last-event", Static).update(Content(f"{render.RESTORE_MARK} {ev.restored_words(event)}"))

    def note_gate(self, event: ev.GateFired) -> None:
        what = f"{event.messages} message{'s' if event.messages != 1 else ''}, " if event.reread else ""
        self.query_one("#last-event", Static).update(
            Content.assemble((f"{render.GATE_MARK} gate fired: re-read {what}{event.reprefill_tokens} tokens",
                              "$warning")))
