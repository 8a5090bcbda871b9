"""Generate docs/RESULTS.md (and its plots) from replay results and study files.

    python scripts/make_results.py \
        --section "recall30=/path/to/recall30-run" \
        --section "LoCoMo=/path/to/locomo-run" \
        --study "recall30=/path/to/study-gating.json" --study /path/to/study-attribution.json \
        --long "LoCoMo in full=/path/to/conv-a,/path/to/conv-a-25pct,/path/to/conv-b" \
        [--transfer "Calibration per model=docs/results/data/calibration/transfer.json"] \
        [--lost "Lost probes, 16k=/path/to/script-a,/path/to/script-b|poisson+gate"] \
        [--notes notes.md] [--out docs/RESULTS.md]

Each ``--section TITLE=DIR`` is a folder holding ``results*.json`` (shards are merged); its
table, provenance (model, machine, budgets, seeds, the command) and plots go into the
page. ``--long TITLE=DIR,DIR…`` merges `certchat demo long` results folders (one per
conversation and budget) into a table per conversation — recall, turn time against the same
conversation's full cache, what a user waited for an answer — and their pooled side-by-side
table. ``--lost TITLE=DIR,DIR…[|COLUMN]`` accounts for every probe those folders' full cache
answered and the gated column (default ``poisson+gate``) did not (``agent.lab.lost_probes``).
``--study`` adds a study's rendering. Nothing in the page is typed by hand except
the optional notes file, which is included verbatim under "Notes".
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.lab.replay import aggregate, longdemo, report, studies  # noqa: E402

PAPER = [
    ("recall at a 10% budget, gated vs top-k (thirty-turn recall)", "0.97 vs 0.09"),
    ("recall for facts 26–30 turns old, gated vs top-k", "97% vs 2%"),
    ("certificate coverage of the realized attention-output error", "96.9–97.7%"),
    ("attribution AUC, certificate vs output confidence", "0.65–0.75 vs 0.47–0.54"),
    ("gain of certificate gating over random gating at the same recompute rate", "1.7–1.8×"),
    ("real long-term conversations (LoCoMo-style), gated vs full cache", "the full-cache score"),
]


def _slug(text: str) -> str:
    import re  # noqa: PLC0415

    return re.sub("-+", "-", "".join(c if c.isalnum() else "-" for c in text.lower())).strip("-")[:40].strip("-")


def _section(title: str, folder: Path, out_dir: Path, plots_dir: Path) -> tuple[list[str], dict]:
    files = aggregate.result_files([folder])
    meta, runs = aggregate.merge([aggregate.read_results(f) for f in files])
    doc = aggregate.results_document(meta, runs)
    lines = [f"## {title}", ""]
    if meta.get("scripts"):
        names = ", ".join(s["name"] for s in meta["scripts"])
        probes = sum(s["probes"] for s in meta["scripts"])
        lines += [f"Scripts: {names} ({probes} probes in all).", ""]
    lines.append(report.markdown_table(doc["aggregate"], meta))
    prefix = _slug(title) + "-"
    for png in report.plots(doc, plots_dir, prefix=prefix):
        rel = png.relative_to(out_dir)
        lines += [f"![{title}: {png.stem[len(prefix):].replace('_', ' ')}]({rel.as_posix()})", ""]
    return lines, doc


def _long(title: str, folders: list[Path]) -> list[str]:
    files = aggregate.result_files(folders)
    docs = [aggregate.read_results(f) for f in files]
    meta, runs = aggregate.merge(docs)
    doc = aggregate.results_document(meta, runs)
    meta.pop("commit", None)  # each file's own, below
    several = len({d["meta"].get("machine") for d in docs}) > 1
    if several:
        # turn times compare within a file (a conversation's full run and its budgets on one machine)
        meta["machine"] = "each file's own"
    origin = "folder: commit" + (", machine" if several else "") + " — " + ", ".join(
        f"{f.parent.name}: {d['meta'].get('commit', '?')}" + (f", {d['meta'].get('machine')}" if several else "")
        for f, d in zip(files, docs))
    return [f"## {title}", "", longdemo.by_script_table(doc), "Pooled over the conversations:", "",
            longdemo.table(doc, footer=False).rstrip("\n"), "",
            f"Merged from {len(files)} results files ({origin}). " + report.provenance(meta), "", ""]


def _lost(title: str, folders: list[Path], column: str) -> list[str]:
    from agent.lab import lost_probes  # noqa: PLC0415

    lost = lost_probes.account(folders, column)
    command = ("python -m agent.lab.lost_probes " + " ".join(shlex.quote(str(f)) for f in folders)
               + f" --gated {shlex.quote(column)}")
    return [f"## {title}", "",
            f"{len(lost)} probes the full cache answered and `{column}` did not, by what the gate "
            "did (never fired: the reading stayed under its bar; fired on other messages; the fact back — copied, "
            "re-read or never evicted — and still wrong):", "", lost_probes.summary(lost).rstrip("\n"), "",
            lost_probes.table(lost).rstrip("\n"), "", f"Reproduce: `{command}`", "", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", action="append", default=[], help="TITLE=DIR with results*.json")
    parser.add_argument("--study", action="append", default=[], help="[TITLE=]a study-*.json file")
    parser.add_argument("--long", action="append", default=[],
                        help="TITLE=DIR,DIR… of `certchat demo long` results: per conversation and pooled")
    parser.add_argument("--transfer", action="append", default=[],
                        help="TITLE=FILE: a per-model calibration table (python -m agent.lab.transfer --out FILE)")
    parser.add_argument("--lost", action="append", default=[],
                        help="TITLE=DIR,DIR…[|COLUMN] of `certchat demo long` results: every probe the gated "
                        "column (default poisson+gate) lost, classed")
    parser.add_argument("--notes", type=Path, help="a Markdown file included verbatim under Notes")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "RESULTS.md")
    args = parser.parse_args(argv)

    seen: dict[str, str] = {}
    for spec in args.section:
        title = spec.split("=", 1)[0]
        if (slug := _slug(title)) in seen:
            parser.error(f"--section titles {seen[slug]!r} and {title!r} name the same plot files ({slug}-*.png): "
                         "make them differ in their first 40 characters")
        seen[slug] = title
    out: Path = args.out
    out_dir = out.parent
    plots_dir = out_dir / "results"
    for old in plots_dir.glob("*.png") if plots_dir.exists() else []:
        old.unlink()  # plots of sections no longer in the page
    lines = ["# certchat — measured results", "",
             "Generated by `scripts/make_results.py` from replay results files; every table ends with the model, "
             "machine, budgets, seeds and the command that reproduces it. Policies: `full` (no eviction), `window` "
             "(sinks + recent), `topk` (SnapKV-style, deterministic), `random` (uniform Poisson), `poisson` "
             "(importance-proportional Poisson with −log π biases, no gate), `poisson+gate` (certchat: Poisson "
             "eviction plus the certificate gate that re-prefills from the log). This page holds the figures of "
             "today's defaults; the studies behind them, earlier designs' figures and the benchmarks that are not "
             "replays (speed, reopening a chat) are in [results/NOTES.md](results/NOTES.md), by topic.", "",
             "Regenerate this page: `python scripts/make_results.py "
             + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)) + "`", "",
             "## The paper's claims (targets)", "", "| claim | paper |", "|---|---|"]
    lines += [f"| {claim} | {value} |" for claim, value in PAPER]
    lines.append("")
    for spec in args.section:
        if "=" not in spec:
            parser.error(f"--section: expected TITLE=DIR, got {spec!r}")
        title, folder = spec.split("=", 1)
        section, _ = _section(title, Path(folder), out_dir, plots_dir)
        lines += section
    for spec in args.long:
        if "=" not in spec:
            parser.error(f"--long: expected TITLE=DIR,DIR…, got {spec!r}")
        title, folders = spec.split("=", 1)
        lines += _long(title, [Path(f) for f in folders.split(",") if f])
    for spec in args.lost:
        if "=" not in spec:
            parser.error(f"--lost: expected TITLE=DIR,DIR…, got {spec!r}")
        title, rest = spec.split("=", 1)
        folders, _, column = rest.partition("|")
        lines += _lost(title, [Path(f) for f in folders.split(",") if f], column or "poisson+gate")
    for spec in args.transfer:
        import json  # noqa: PLC0415

        from agent.lab import transfer  # noqa: PLC0415

        title, _, file = spec.partition("=")
        lines += [f"## {title}", "", transfer.render(json.loads(Path(file).read_text(encoding="utf-8")))]
    for spec in args.study:
        import json  # noqa: PLC0415

        label, _, file = spec.rpartition("=")
        path = Path(file)
        result = json.loads(path.read_text(encoding="utf-8"))
        title = result["study"] + (f" — {label}" if label else "")
        lines += [f"## Study: {title}", "", studies.render(result)]
        if result["study"] == "gating":
            prefix = _slug(f"study-{label or path.parent.name}") + "-"
            for png in report.gating_plot(result, plots_dir, prefix=prefix):
                lines += [f"![{title}: {png.stem}]({png.relative_to(out_dir).as_posix()})", ""]
    if args.notes:
        lines += ["## Notes", "", args.notes.read_text(encoding="utf-8")]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
