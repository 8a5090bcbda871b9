"""Results as people read them: a Markdown table, PNG plots, and the provenance line.

Every table says what produced it (model, machine, budgets, seeds, the command), so a
number copied out of it still carries its conditions.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.eviction import policies
from agent.lab.replay import figures
from agent.lab.replay.aggregate import table


def certified(policy: str) -> bool:
    """Whether a (base) policy's runs carry a certificate worth plotting: the sampled designs and the gated system."""
    return policy == policies.GATED or (policy in policies.POLICIES and policies.POLICIES[policy].sampled)


POLICY_LABEL = {"poisson+gate": "poisson+gate (certchat)"}


def plot_thresholds(ax: Any, runs: list[dict[str, Any]]) -> None:
    """τ as dashed lines: a fixed τ across the plot, an adaptive one (each turn's own bar, recorded per step)
    as a dashed step line per gated run."""
    fixed: set[float] = set()
    for r in runs:
        bars = [(s["turn"], s["gate_threshold"]) for s in r["steps"] if s.get("gate_threshold") is not None]
        if len({b for _, b in bars}) > 1:
            ax.step([t for t, _ in bars], [b for _, b in bars], where="mid", color="k", lw=0.8, ls="--")
        else:
            fixed |= {b for _, b in bars} or ({r["gate_threshold"]} - {None})
    for tau in fixed:
        ax.axhline(tau, color="k", lw=0.8, ls="--")


def machine() -> str:
    """A one-line description of this machine (CPU cores, model name, GPU if any)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} CPU cores ({cpu}), {platform.system()} {platform.machine()}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parents[3])
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "certchat " + " ".join(shlex.quote(a) for a in args)


def _fmt(value: Any, sd: Any = None, pct: bool = False, digits: int | None = None) -> str:
    """A cell: a share as 12%, a ratio with ``digits`` decimals, a count with thousands separators."""
    if value is None:
        return "—"
    if pct:
        text = f"{100 * value:.0f}%"
        return text + (f" ± {100 * sd:.0f}" if sd is not None else "")
    if digits is not None:
        return f"{value:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")
    return f"{value:,.0f}" + (f" ± {sd:,.0f}" if sd is not None else "")


def provenance(meta: dict[str, Any]) -> str:
    bits = [f"model `{meta.get('model')}`", f"machine: {meta.get('machine')}",
            f"budgets {', '.join(meta.get('budgets') or []) or '— (full cache only)'}", f"seeds {meta.get('seeds')}",
            f"protocols {', '.join(meta.get('protocols', ['multi-round']))}",
            f"temperature {meta.get('temperature', 0.0)}", f"gate τ {meta.get('gate', 'auto')}"]
    if meta.get("commit"):
        bits.append(f"commit {meta['commit']}")
    commands = meta.get("commands") or [meta.get("command")]
    return "; ".join(bits) + ". Reproduce: " + " and ".join(f"`{c}`" for c in commands)


def markdown_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One table per protocol: recall, long-range recall, gate rates, re-prefill cost, speed."""
    trows = table(rows)
    has_f1 = any(r["f1"] is not None for r in trows)
    out: list[str] = []
    for protocol in sorted({r["protocol"] for r in trows}):
        out.append(f"**Protocol: {protocol}**\n")
        head = ["policy", "budget", "recall", "recall d≥25"] + (["token F1"] if has_f1 else []) + [
            "gate rate (probes / fillers)", "re-prefilled tokens (every turn)", "decode tok/s", "peak cells",
            "seeds", "probes"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in (r for r in trows if r["protocol"] == protocol):
            cells = [POLICY_LABEL.get(r["policy"], r["policy"]), r["budget"],
                     _fmt(r["recall"], r["recall_sd"], digits=2),
                     _fmt(r["recall_distance_ge_25"], r["recall_distance_ge_25_sd"], digits=2)
                     + f" (n={r['n_probes_distance_ge_25']})"]
            if has_f1:
                cells.append(_fmt(r["f1"], r["f1_sd"], digits=3))
            cells += [f"{_fmt(r['gate_rate'], pct=True)} ({_fmt(r['gate_rate_probes'], pct=True)} / "
                      f"{_fmt(r['gate_rate_fillers'], pct=True)})",
                      f"{_fmt(r['reprefill_tokens'], r['reprefill_tokens_sd'])} "
                      f"({_fmt(r['reprefill_tokens_every_turn'])})",
                      _fmt(r["decode_tok_s"], digits=1), _fmt(r["peak_live_cells"]), str(r["seeds"]),
                      str(r["n_probes"])]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out.append(provenance(meta))
    return "\n".join(out) + "\n"


def plots(doc: dict[str, Any], out_dir: Path, prefix: str = "") -> list[Path]:
    """recall by policy, recall against distance, the gate statistic per turn — as PNG files."""
    plt = figures.pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rows = table(doc["aggregate"])
    title_tail = f"{doc['meta'].get('model')} · {doc['meta'].get('machine_short', '')}".rstrip(" ·")

    # 1. recall per policy, one group of bars per (protocol, budget); full as a reference line
    fig, ax = plt.subplots(figsize=(8, 4))
    groups = sorted({(r["protocol"], r["budget"]) for r in rows if r["policy"].split("@")[0] != "full"},
                    key=lambda g: (g[0], float(g[1][:-1]) if g[1].endswith("%") else 1e9))
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"].split("@")[0] != "full"))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        for g, (protocol, budget) in enumerate(groups):
            match = [r for r in rows if r["policy"] == policy and r["protocol"] == protocol and r["budget"] == budget]
            if not match or match[0]["recall"] is None:
                continue
            x, y = g + i * width, match[0]["recall"]
            ax.bar(x, y, width, yerr=match[0]["recall_sd"] or 0.0, capsize=2, color=f"C{i + 1}",
                   label=POLICY_LABEL.get(policy, policy) if g == 0 else None)
            ax.text(x, y + 0.02, f"{y:.2f}", ha="center", fontsize=7)
    for n, r in enumerate(r for r in rows if r["policy"].split("@")[0] == "full" and r["recall"] is not None):
        ax.axhline(r["recall"], color="C0", ls="--", lw=1, label=f"full cache ({r['protocol']})" if n == 0 else None)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{b}\n{p}" if len({g[0] for g in groups}) > 1 else b for p, b in groups])
    ax.set_ylim(0, 1.12)
    written.append(figures.save(fig, ax, out_dir / f"{prefix}recall.png", xlabel="KV budget",
                                ylabel="recall (containment)", title=f"Recall by policy and budget ({title_tail})",
                                ncol=2, loc="upper left"))

    # 2. recall against distance (turns between the fact and the probe)
    by: dict[tuple[str, str], dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for run in doc["runs"]:
        for s in run["steps"]:
            if s["kind"] == "probe" and s.get("distance") is not None:
                by[(run["policy"], run["budget"])][_bin(s["distance"])].append(bool(s["correct"]))
    if by:
        fig, ax = plt.subplots(figsize=(8, 4))
        for (policy, budget), bins in sorted(by.items()):
            xs = sorted(bins)
            ax.plot(xs, [sum(bins[x]) / len(bins[x]) for x in xs], marker="o",
                    label=f"{POLICY_LABEL.get(policy, policy)} {budget if policy != 'full' else ''}".strip())
        ax.set_ylim(-0.02, 1.05)
        written.append(figures.save(fig, ax, out_dir / f"{prefix}recall_by_distance.png",
                                    xlabel="distance (user turns between fact and probe; binned)", ylabel="recall",
                                    title=f"Recall against distance ({title_tail})", ncol=2))

    # 3. the gate statistic per turn: probes against fillers, with τ
    # deterministic designs certify 0 by construction (π = 1): only the randomised ones are informative
    cert_runs = [r for r in doc["runs"] if certified(r["policy"].split("@", 1)[0])
                 and any(s["certificate"] is not None for s in r["steps"])]
    if cert_runs:
        fig, ax = plt.subplots(figsize=(8, 4))
        for kind, marker in (("filler", "."), ("fact", "^"), ("probe", "x")):
            pts = [(s["turn"], s["certificate"]) for r in cert_runs for s in r["steps"]
                   if s["kind"] == kind and s["certificate"] is not None]
            if pts:
                turns, values = zip(*pts)
                ax.scatter(turns, values, marker=marker, s=14, label=kind, alpha=0.7)
        plot_thresholds(ax, cert_runs)
        written.append(figures.save(fig, ax, out_dir / f"{prefix}certificate_by_turn.png", xlabel="user turn",
                                    ylabel="turn certificate (gate statistic)",
                                    title=f"Gate statistic per turn ({title_tail})"))
    return written


def _bin(distance: int) -> int:
    """Distances grouped so that every point has a few probes: exact below 10, then by 5s, then 50s."""
    if distance < 10:
        return distance
    if distance < 100:
        return (distance // 5) * 5
    return (distance // 50) * 50


def gating_plot(result: dict[str, Any], out_dir: Path, prefix: str = "",
                statistics: tuple[str, ...] = ("question.q", "question.max", "answer.q", "turn_index")
                ) -> list[Path]:
    """Recall against recompute rate (share of all turns re-prefilled): certificate gates vs random."""
    plt = figures.pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for row in result["rows"]:
        if row["policy"].split("@")[0] != "poisson":
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [p["rate"] for p in row["random"]]
        ax.plot(rates, [p["recall"] for p in row["random"]], "k--", label="random gating")
        for i, name in enumerate(statistics):
            curve = row["statistics"].get(name, {}).get("over_turns") or []
            pts = [(p["rate"], p["recall"]) for p in curve if p["recall"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=name)
        ax.axhline(row["recall_full"], color="C0", ls=":", lw=1, label="full cache")
        ax.set_ylim(-0.02, 1.05)
        written.append(figures.save(
            fig, ax, out_dir / f"{prefix}gating-{row['budget'].rstrip('%')}-{row['protocol']}.png",
            xlabel="recompute rate (share of all user turns re-prefilled)", ylabel="probe recall",
            title=f"Gating at matched recompute rates: {row['policy']} {row['budget']} {row['protocol']} "
                  f"({result['meta'].get('model')})", title_size=8))
    return written
