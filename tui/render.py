"""Pure text renderings of the memory view: status line, certificate chart, retention bars.

No widgets here: each function turns agent data into Textual ``Content`` (styles name
theme variables such as ``$error``), so the pictures are unit-testable and the widgets
stay thin.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content

from agent import events as ev

BLOCKS = " ▁▂▃▄▅▆▇█"
GATE_MARK = "↻"
RESTORE_MARK = "↺"


def fmt_value(value: float | None) -> str:
    """A certificate or threshold, compactly ("–" when there is none)."""
    if value is None:
        return "–"
    return f"{value:.3g}"


def gate_text(threshold: float | None, gate_setting: str) -> str:
    if threshold is not None:
        return f"τ {fmt_value(threshold)}"
    return "gate off" if gate_setting.strip().lower() == "off" else f"gate {gate_setting} (no τ yet)"


def gate_note(event: ev.GateFired) -> str:
    """The line a gate event leaves in the chat."""
    where = "before answering" if event.phase == "question" else "mid-answer"
    why = (ev.gate_reason(event) if event.uncertified or event.points_at or event.second
           else f"certificate {fmt_value(event.value)} ≥ τ {fmt_value(event.threshold)}")
    note = f"{GATE_MARK} {ev.gate_words(event)} {where} ({why})"
    if event.truncated:
        note += " — only the most recent part fits the context"
    return note


def restore_note(event: ev.Restored) -> str:
    """The line a restore leaves in the chat."""
    return f"{RESTORE_MARK} {ev.restored_words(event)} before answering"


def deferred_note(event: ev.GateDeferred) -> str:
    """The line a gate that left the turn to its restore leaves in the chat."""
    return f"{RESTORE_MARK} {ev.deferred_words(event)}"


def logged_gate_note(tokens: int | None) -> str:
    """The same line for a logged turn (the log keeps the count, not the phase)."""
    return f"{GATE_MARK} {ev.reread_words(tokens)}"


@dataclass(frozen=True)
class StatusInfo:
    """What the status line shows; built by the app from config, memory view and last turn."""

    model: str
    policy: str
    budget: str
    gate: str
    phase: str
    memory: ev.MemoryView | None = None
    certificate: float | None = None


def status_line(info: StatusInfo) -> Content:
    m = info.memory
    parts: list[Content] = [
        Content.assemble((info.phase, "italic")),
        Content.assemble((info.model, "bold")),
        Content(f"policy {info.policy}"),
        Content("budget –" if info.policy == "full" else f"budget {info.budget}" if m is None or m.budget_words is None
                else f"budget {m.budget_words}"),
    ]
    if m is not None:
        budget = f" (≤{m.budget_cells})" if m.budget_cells is not None else ""
        parts.append(Content(f"cells {m.live_cells}/{m.allocated_cells}{budget}"))
        if m.full_cache_until is not None:
            parts.append(Content(ev.full_cache_words(m.full_cache_until)))
        if m.frame_offset:
            parts.append(Content(f"context shifted {m.frame_offset:,} positions"))
        if m.evicted_rows_bytes:
            parts.append(Content(f"evicted K/V {m.evicted_rows_bytes / (1 << 20):.0f} MiB in RAM"))
        if m.opened is not None:
            parts.append(Content(m.opened))
        if m.full_cache_reason is not None:
            # the fail-safe is a state the user should act on: in the warning colour, with the way out
            hint = f" ({m.full_cache_hint})" if m.full_cache_hint else ""
            parts.append(Content.assemble((f"{m.full_cache_reason}{hint}", "$warning")))
        parts.append(Content(f"{m.tok_per_s:.1f} tok/s" if m.tok_per_s else "– tok/s"))
        tau = m.gate_threshold
        if info.certificate is None:
            parts.append(Content(f"cert – │ {gate_text(tau, info.gate)}"))
        elif tau is not None and info.certificate >= tau:
            breach = f"cert {fmt_value(info.certificate)} ≥ τ {fmt_value(tau)}"
            parts.append(Content.assemble((breach, "bold $error")))
        elif tau is not None:
            parts.append(Content.assemble((f"cert {fmt_value(info.certificate)} < τ {fmt_value(tau)}", "$success")))
        else:
            parts.append(Content(f"cert {fmt_value(info.certificate)} │ {gate_text(tau, info.gate)}"))
    return Content(" │ ").join(parts)


def certificate_chart(certificates: list[tuple[int, float | None, bool]], threshold: float | None,
                      width: int, height: int) -> Content:
    """Bars of the turn certificate (newest at the right) with the gate line and re-read marks.

    Bars at or above τ use the error colour; the row holding τ draws ``─`` where no bar
    covers it; under each turn whose gate fired, a ``↻``.
    """
    width, height = max(1, width), max(1, height)
    shown = certificates[-width:]
    values = [v for _, v, _ in shown if v is not None]
    if not shown:
        return Content.assemble(("no turns yet", "$text-muted"))
    top = max(values + ([threshold] if threshold is not None else []), default=0.0) * 1.1
    rows: list[Content] = []
    gate_row = None
    if threshold is not None and top > 0:
        gate_row = height - 1 - min(height - 1, int(threshold / top * height))
    for r in range(height):
        level = (height - 1 - r) * 8
        cells: list[tuple[str, str]] = []
        for _, value, _fired in shown:
            if value is None:
                fill = 0
            else:
                # A certificate of 0 still shows as the lowest sliver: there is a value, unlike "·".
                eighths = max(1, round(value / top * height * 8)) if top > 0 else 1
                fill = max(0, min(8, eighths - level))
            over = value is not None and threshold is not None and value >= threshold
            if fill == 0 and r == gate_row:
                cells.append(("─", "$warning"))
            elif fill == 0 and r == height - 1 and value is None:
                cells.append(("·", "$text-muted"))
            else:
                cells.append((BLOCKS[fill], "$error" if over else "$success"))
        rows.append(Content.assemble(*cells))
    rows.append(Content.assemble(*((GATE_MARK if fired else " ", "bold $warning") for _, _, fired in shown)))
    return Content("\n").join(rows)


def chart_caption(certificates: list[tuple[int, float | None, bool]], threshold: float | None,
                  width: int) -> Content:
    shown = certificates[-max(1, width):]
    if not shown:
        return Content("")
    first, last = shown[0][0], shown[-1][0]
    span = f"T{first}" if first == last else f"T{first}–{last}"
    last_value = shown[-1][1]
    fired = sum(1 for _, _, f in certificates if f)
    tau = f"─ τ {fmt_value(threshold)}" if threshold is not None else "no gate"
    return Content(f"{span} · last {fmt_value(last_value)} · {tau} · {fired}{GATE_MARK}")


def share_bar(share: float, width: int) -> Content:
    """A horizontal bar for a share in [0, 1] (eighth-block resolution)."""
    share = min(1.0, max(0.0, share))
    eighths = round(share * width * 8)
    full, part = divmod(eighths, 8)
    # Partial cells use the left-aligned eighths so the bar reads left to right.
    text = "█" * full + (_LEFT[part] if part and full < width else "")
    style = "$success" if share >= 0.999 else "$warning" if share >= 0.25 else "$error"
    return Content.assemble((text.ljust(width, "░"), style))


_LEFT = " ▏▎▍▌▋▊▉█"


@dataclass(frozen=True)
class TurnRetention:
    """How much of one earlier turn (its question and its answer) is still cached."""

    turn: int
    user: float | None
    assistant: float | None
    reread: bool = False
    """The last turn's targeted re-read brought this turn's question or answer back."""


def retention_by_turn(retained: list[tuple[int, str, float]],
                      reread: tuple[int, ...] = ()) -> tuple[float | None, list[TurnRetention]]:
    """Group (index, role, share) per message into (system share, per-turn shares); ``reread``: the indices of
    the messages the last targeted re-read brought back."""
    system: float | None = None
    turns: list[TurnRetention] = []
    for index, role, share in sorted(retained):
        back = index in reread
        if role == "system":
            system = share
        elif role == "user":
            turns.append(TurnRetention(len(turns) + 1, share, None, back))
        elif turns and turns[-1].assistant is None:
            last = turns[-1]
            turns[-1] = TurnRetention(last.turn, last.user, share, last.reread or back)
        else:
            turns.append(TurnRetention(len(turns) + 1, None, share, back))
    return system, turns


def retention_rows(retained: list[tuple[int, str, float]], width: int, reread: tuple[int, ...] = ()) -> Content:
    """One line per turn: the share of its question and of its answer still in the cache; a turn the last
    targeted re-read brought back is marked ↻ in the warning colour."""
    system, turns = retention_by_turn(retained, reread)
    if system is None and not turns:
        return Content.assemble(("nothing cached yet", "$text-muted"))
    label_w = max(3, len(str(max(len(turns), 1))) + 1)
    # Each share takes its bar plus " 100% "; the line is label, space, two shares.
    bar_w = max(3, (width - label_w - 1 - 2 * 6 + 1) // 2)
    lines: list[Content] = []
    if system is not None:
        lines.append(Content.assemble(("sys".ljust(label_w), "$text-muted"), " ", share_bar(system, bar_w),
                                      f"{round(system * 100):>4}%"))
    for t in turns:
        label = (f"{GATE_MARK}{t.turn}".ljust(label_w), "$warning") if t.reread else \
            (f"T{t.turn}".ljust(label_w), "$text-muted")
        cells: list[Content | tuple[str, str] | str] = [label, " "]
        for share in (t.user, t.assistant):
            if share is None:
                cells += [Content(" " * bar_w), "     "]
            else:
                cells += [share_bar(share, bar_w), f"{round(share * 100):>4}% "]
        lines.append(Content.assemble(*cells).rstrip())
    return Content("\n").join(lines)


def cells_gauge(memory: ev.MemoryView, width: int) -> Content:
    """Live cells against the allocation, with the budget marked."""
    width = max(4, width)
    share = memory.live_cells / memory.allocated_cells if memory.allocated_cells else 0.0
    bar = share_bar(share, width).plain
    chars = list(bar)
    if memory.budget_cells is not None and memory.allocated_cells:
        at = min(width - 1, int(memory.budget_cells / memory.allocated_cells * width))
        chars[at] = "│"
    return Content.assemble(("".join(chars), "$primary"))
