"""What every replay plot shares: pyplot on a file-only backend, and labelling, saving and closing a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: plots go to files, never to a display."""
    import matplotlib  # noqa: PLC0415 — heavy; only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def save(fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str, title: str, title_size: float = 9,
         **legend: Any) -> Path:
    """Label ``ax``, title it, give it a legend (``legend``: its options beside a small font), write ``fig`` to
    ``path`` as a PNG and close it; returns ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.legend(**{"fontsize": 7, **legend})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


__all__ = ["pyplot", "save"]
