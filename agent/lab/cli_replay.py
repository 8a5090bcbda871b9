"""`certchat replay` and `certchat demo`: replay scripts under policies, merge shards, run the demo.

Forms of ``replay`` (the work lives in ``agent.lab.replay``):

    certchat replay SCRIPT… [--policy …] [--budget 10%] [--seeds N] [--out DIR] [--json] [--shard i/n]
        (without --budget: what the chat runs on the model — the budget its record certifies for the configured
        risk, or the full cache only, said in one line; a --study without --budget runs 10%)
    certchat replay --locomo FILE [--qa-category 1,2,4] [--max-sessions N] [--max-probes N]
    certchat replay --conversation ID [--db PATH]
    certchat replay --study attribution|gating|coverage …
    certchat replay merge DIR… [--out DIR] [--json]
    certchat replay convert-locomo FILE… --out DIR
    certchat replay make-long [--history 8k,16k,32k] [--seed N] [--probes N] [--locomo FILE…] --out DIR
    certchat replay make-varied [--seed N] [--count K] --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from agent import config as config_mod
from agent import models, paths
from agent.cli import errors as cli_errors
from agent.eviction import policies as policies_mod

DEFAULT_POLICIES = ",".join(policies_mod.REPLAY_NAMES)
STUDY_BUDGET = "10%"
"""What a certificate study runs without --budget (it needs an evicting budget, certified or not)."""


def _default_out(kind: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return paths.data_dir() / "replays" / f"{kind}-{stamp}"


def _base_config(args: argparse.Namespace) -> config_mod.Config:
    cfg = config_mod.load()
    return cfg.replace(model=args.model, threads=args.threads, gpu_layers=getattr(args, "gpu_layers", None),
                       evict_at=getattr(args, "evict_at", None), sketch_layers=getattr(args, "sketch_layers", None),
                       evict_from=getattr(args, "evict_from", None))


def _emit(doc: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    from agent.lab.replay import aggregate, report  # noqa: PLC0415

    if args.json:
        print(aggregate.json_line(doc["aggregate"]))
        return
    print(report.markdown_table(doc["aggregate"], doc["meta"]))
    print(f"results: {out}", file=sys.stderr)


def _load_scripts(args: argparse.Namespace) -> list[Any]:
    from agent.lab.replay import locomo, logged, script  # noqa: PLC0415

    scripts = [script.load(p) for p in args.scripts]
    if args.locomo:
        options = locomo.Options(categories=locomo.parse_categories(args.qa_category),
                                 max_sessions=args.max_sessions, max_probes=args.max_probes)
        for path in args.locomo:
            scripts += locomo.load(path, options)
    if args.conversation is not None:
        from memory_store.store import Store  # noqa: PLC0415

        store = Store(args.db or paths.db_path(), create=False)
        try:
            scripts.append(logged.from_store(store, args.conversation))
        finally:
            store.close()
    if not scripts:
        raise _Usage("give SCRIPT files, --locomo FILE or --conversation ID (see `certchat replay --help`)")
    return scripts


class _Usage(cli_errors.UsageError):
    """Wrong combination of arguments."""


def chat_budgets(args: argparse.Namespace, model: str | None, policies: list[str]) -> tuple[list[str], list[str]]:
    """The (policies, budgets) a replay runs: ``--budget``'s; without it, what the chat runs on ``model`` (default:
    the configured one) — its configured budget, ``auto`` resolved as the cache manager resolves it
    (``agent.eviction.budget.resolve``): the budget the model's record certifies for the configured risk, or none,
    and then only the policies that keep the full cache (``full``). Says which in one line."""
    from agent.eviction import budget as budget_mod  # noqa: PLC0415
    from agent.gate import calibration  # noqa: PLC0415
    from agent.lab.replay import runner  # noqa: PLC0415

    if args.budget is not None:
        return policies, runner.parse_budgets(args.budget)
    if all(runner.base_policy(p) == "full" for p in policies):
        return policies, []  # the full cache runs no budget
    cfg = _base_config(args)
    path = models.resolve(model or cfg.model)
    found = calibration.of_file(path)
    in_force = budget_mod.resolve(cfg.kv_budget, cfg.loss_risk, True, found, budget_mod.model_name(found, path))
    if in_force.budget is None:
        print(f"{in_force.reason}: replaying the full cache only, as the chat runs it (--budget runs a budget anyway)",
              file=sys.stderr)
        return ([p for p in policies if runner.base_policy(p) == "full"] or ["full"]), []
    budget = str(in_force.budget)
    print(in_force.notice or f"budget {in_force.words()} ({'auto' if cfg.kv_budget.auto else 'configured'}), "
          "as the chat runs it", file=sys.stderr)
    return policies, [budget]


def _settings(args: argparse.Namespace, out: Path, policies: list[str] | None = None,
              budgets: list[str] | None = None) -> Any:
    from agent.lab.replay import batch, runner  # noqa: PLC0415
    from agent.lab.replay.report import command_line  # noqa: PLC0415

    protocols = tuple(p.strip() for p in args.protocol.split(",") if p.strip())
    return batch.Settings(
        out=out, policies=policies if policies is not None else runner.parse_policies(args.policy),
        budgets=budgets if budgets is not None else runner.parse_budgets(args.budget or STUDY_BUDGET),
        seeds=args.seeds, gate=args.gate, protocols=protocols, model=args.model, temperature=args.temperature,
        max_tokens=args.max_tokens, n_ctx=args.n_ctx, threads=args.threads, shard=args.shard,
        plots=not args.no_plots, progress=not args.no_progress, command=command_line(getattr(args, "argv", None)),
        generate_fillers=args.generate_fillers, score_replies=args.score_replies)


def _cmd_replay(args: argparse.Namespace) -> int:
    first = args.scripts[0] if args.scripts else None
    if first == "merge" and not Path(first).exists():
        return _cmd_merge(args)
    if first == "convert-locomo" and not Path(first).exists():
        return _cmd_convert(args)
    if first == "make-long" and not Path(first).exists():
        return _cmd_make_long(args)
    if first == "make-varied" and not Path(first).exists():
        return _cmd_make_varied(args)
    from agent.lab.replay import runner  # noqa: PLC0415

    if args.seeds < 1:
        raise _Usage("--seeds: must be at least 1")
    runner.parse_policies(args.policy)  # flags first: a typo should not wait for a script to load
    if args.budget is not None:
        runner.parse_budgets(args.budget)
    if args.study and args.from_results:
        return _cmd_study_from(args)
    scripts = _load_scripts(args)
    if args.study:
        from agent.lab.replay import studies  # noqa: PLC0415

        out = args.out or _default_out(f"study-{args.study}")
        result = studies.run_study(args.study, scripts, _settings(args, out), _base_config(args))
        print(studies.render(result) if not args.json else studies.json_line(result))
        if args.write_calibration and args.study == "gating":
            record = studies.calibration_record(result, args.write_calibration, rule=args.calibration_rule)
            print(f"calibration: {studies.write_calibration(record)}", file=sys.stderr)
        return 0
    from agent.lab.replay import batch  # noqa: PLC0415

    out = args.out or _default_out("replay")
    policies, budgets = chat_budgets(args, args.model, runner.parse_policies(args.policy))
    doc = batch.run(scripts, _settings(args, out, policies, budgets), _base_config(args))
    _emit(doc, args, out)
    return 0


def _cmd_study_from(args: argparse.Namespace) -> int:
    """Analyse results already on disk (no replay): attribution or gating."""
    import json  # noqa: PLC0415

    from agent.lab.replay import aggregate, studies  # noqa: PLC0415

    if args.study == "coverage":
        raise _Usage("--from-results: the coverage study needs the model's tensors; run it without --from-results")
    files = aggregate.result_files(args.from_results)
    meta, runs = aggregate.merge([aggregate.read_results(f) for f in files])
    result = studies.analyse(args.study, aggregate.results_document(meta, runs))
    from agent.lab.replay.report import command_line  # noqa: PLC0415

    result["command"] = command_line(getattr(args, "argv", None))
    out = args.out or args.from_results[0]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"study-{args.study}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(studies.render(result) if not args.json else studies.json_line(result))
    print(f"study: {path}", file=sys.stderr)
    if args.write_calibration:
        record = studies.calibration_record(result, args.write_calibration, rule=args.calibration_rule)
        print(f"calibration: {studies.write_calibration(record)}", file=sys.stderr)
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from agent.lab.replay import aggregate, batch  # noqa: PLC0415

    dirs = [Path(p) for p in args.scripts[1:]]
    if not dirs:
        raise _Usage("replay merge: name the shard folders (or results files) to merge")
    files = aggregate.result_files(dirs)
    meta, runs = aggregate.merge([aggregate.read_results(f) for f in files])
    out = args.out or dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    doc = aggregate.write_results(out / "results.json", meta, runs)
    batch.write_reports(doc, out, plots=not args.no_plots)
    _emit(doc, args, out)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from agent.lab.replay import locomo, script  # noqa: PLC0415

    files = [Path(p) for p in args.scripts[1:]] + list(args.locomo or [])
    if not files or args.out is None:
        raise _Usage("replay convert-locomo FILE… --out DIR")
    options = locomo.Options(categories=locomo.parse_categories(args.qa_category),
                             max_sessions=args.max_sessions, max_probes=args.max_probes)
    for path in files:
        for s in locomo.load(path, options):
            written = script.save(s, args.out / f"{s.name}.jsonl")
            print(f"{written}: {len(s.steps) - len(s.probes)} turns, {len(s.probes)} probes")
    return 0


def _cmd_make_long(args: argparse.Namespace) -> int:
    from agent.lab.replay import longchat  # noqa: PLC0415

    if args.out is None or len(args.scripts) > 1:
        raise _Usage("replay make-long [--history 8k,16k,32k] [--seed N] [--probes N] --out DIR")
    sizes = [longchat.parse_size(t) for t in (args.history or "16k").split(",") if t.strip()]
    files = longchat.source_files(args.locomo)
    tokenizer = args.model or longchat.FIXTURE_MODEL
    counter = longchat.counter_for(tokenizer)
    try:
        for size in sizes:
            trained = counter.context_length()
            s = longchat.generate(args.seed, size, counter, files, probes=args.probes,
                                  beyond=trained if 0 < trained < size else 0)
            s.meta["tokenizer"] = tokenizer
            path = longchat.save(s, args.out, tokenizer)
            print(f"{path}: {longchat.describe(s)}")
    finally:
        counter.close()
    return 0


def _cmd_make_varied(args: argparse.Namespace) -> int:
    from agent.lab.replay import recall_varied  # noqa: PLC0415

    if args.out is None or len(args.scripts) > 1:
        raise _Usage("replay make-varied [--seed N] [--count K] --out DIR")
    if args.count < 1:
        raise _Usage("--count: must be at least 1")
    for seed in range(args.seed, args.seed + args.count):
        script = recall_varied.scenario(seed)
        path = recall_varied.save(script, args.out)
        print(f"{path}: {recall_varied.describe(script)}")
    return 0


def _long_scripts(args: argparse.Namespace) -> list[Any]:
    """The demo's scripts: --script files, the quick fixture, or one generated at --history."""
    from agent.lab.replay import longchat  # noqa: PLC0415

    if sum(map(bool, (args.script, args.quick, args.history))) > 1:
        raise _Usage("demo long: give one of --quick (the committed 8k script), --history SIZE or --script FILE")
    if args.script:
        return [longchat.load(p) for p in args.script]
    if args.quick:
        path = longchat.fixture_path(*longchat.QUICK_FIXTURE)
        if not path.exists():
            raise FileNotFoundError(f"{path}: the quick long-chat fixture is missing; run `certchat replay "
                                    f"make-long --history {longchat.QUICK_FIXTURE[0]} --out {path.parent}`")
        return [longchat.load(path)]
    size = longchat.parse_size(args.history or "16k")
    counter = longchat.counter_for()
    try:
        s = longchat.generate(args.seed, size, counter, longchat.source_files(args.locomo), probes=args.probes)
    finally:
        counter.close()
    s.meta["tokenizer"] = longchat.FIXTURE_MODEL
    return [s]


def _cmd_demo_long(args: argparse.Namespace) -> int:
    from agent.lab.replay import aggregate, batch, longchat, longdemo, runner  # noqa: PLC0415
    from agent.lab.replay.report import command_line  # noqa: PLC0415

    if args.from_results:
        files = aggregate.result_files(args.from_results)
        meta, runs = aggregate.merge([aggregate.read_results(f) for f in files])
        doc = aggregate.results_document(meta, runs)
        out = args.out or args.from_results[0]
    else:
        if args.seeds < 1:
            raise _Usage("--seeds: must be at least 1")
        policies = runner.parse_policies(args.policy)
        if args.budget is not None:
            runner.parse_budgets(args.budget)
        runner.shard([], args.shard)  # a bad --shard fails before the model loads
        scripts = _long_scripts(args)
        out = args.out or _default_out("long" + ("-quick" if args.quick else ""))
        for s in scripts:
            if s.meta.get("generator") == "agent.lab.replay.longchat" and not args.script and not args.quick:
                print(f"{longchat.save(s, out)}: {longchat.describe(s)}", file=sys.stderr)
            else:
                print(f"{s.source}: {longchat.describe(s)}", file=sys.stderr)
        # the demo measures the chat as it ships: without --budget, what the chat runs on the model
        policies, budgets = chat_budgets(args, args.model or longchat.FIXTURE_MODEL, policies)
        max_tokens = args.max_tokens or (longchat.QUICK_MAX_TOKENS if args.quick else 32)
        settings = batch.Settings(
            out=out, policies=policies, budgets=budgets, seeds=args.seeds, gate=args.gate,
            model=args.model or longchat.FIXTURE_MODEL, max_tokens=max_tokens, n_ctx=args.n_ctx,
            threads=args.threads, shard=args.shard, plots=not args.no_plots, progress=not args.no_progress,
            generate_fillers=args.generate_fillers, score_replies=args.score_replies, lockstep=args.lockstep,
            command=command_line(getattr(args, "argv", None)),
            extra_meta={"quick": bool(args.quick), "history": args.history})
        doc = longdemo.run(scripts, settings, _base_config(args))
    out.mkdir(parents=True, exist_ok=True)
    longdemo.write_reports(doc, out, plot=not args.no_plots)
    if args.json:
        print(longdemo.json_line(doc))
    else:
        print(longdemo.table(doc))
        print(f"results: {out}", file=sys.stderr)
    return 0


def _cmd_demo_recall30(args: argparse.Namespace) -> int:
    from agent.lab.replay import batch, recall30, runner  # noqa: PLC0415
    from agent.lab.replay.report import command_line  # noqa: PLC0415

    seeds = recall30.QUICK_SEEDS if args.quick else recall30.SEEDS
    if args.regenerate_fixtures:
        recall30.generate_fixtures(seeds, model=args.model or recall30.FIXTURE_MODEL, threads=args.threads,
                                   log=lambda line: print(line, file=sys.stderr))
        return 0
    scripts = [recall30.load_fixture(s) for s in seeds]
    out = args.out or _default_out("recall30" + ("-quick" if args.quick else ""))
    settings = batch.Settings(
        out=out, policies=runner.parse_policies(args.policy), budgets=runner.parse_budgets(args.budget),
        seeds=1 if args.quick else args.seeds, gate=args.gate, model=args.model or recall30.FIXTURE_MODEL,
        max_tokens=args.max_tokens, threads=args.threads, plots=not args.no_plots, progress=not args.no_progress,
        generate_fillers=args.generate_fillers, score_replies=args.score_replies,
        command=command_line(getattr(args, "argv", None)), extra_meta={"demo": "recall30", "quick": bool(args.quick),
                    "fixtures": [str(recall30.fixture_path(s)) for s in seeds]})
    doc = batch.run(scripts, settings, _base_config(args))
    _emit(doc, args, out)
    return 0


def _add_run_flags(p: argparse.ArgumentParser, policies: str, seeds: int, budget: str | None = None) -> None:
    """``budget``: the default of --budget; None: what the chat runs on the model (:func:`chat_budgets`)."""
    p.add_argument("--policy", default=policies,
                   help=f"comma-separated: {', '.join(policies_mod.REPLAY_NAMES)} (default {policies})")
    shown = (budget.replace("%", "%%") if budget is not None
             else "what the chat runs on the model: the budget its record certifies for the risk, or the full cache "
                  f"only; a --study runs {STUDY_BUDGET.replace('%', '%%')}")
    p.add_argument("--budget", default=budget, help=f"KV budget(s), comma-separated: 10%% or 1024 (default {shown})")
    p.add_argument("--seeds", type=int, default=seeds, help="seeds 0…N−1 for the randomised policies")
    p.add_argument("--gate", default="auto", help="gate threshold τ for poisson+gate, or 'auto' (calibrated)")
    p.add_argument("--model", help="registry name or GGUF path (default: the configured model)")
    p.add_argument("--sketch-layers", dest="sketch_layers",
                   help="keep an evicted-key sketch of these layers (e.g. 11,13,15,20,22) and record sketch.max")
    p.add_argument("--out", type=Path, help="folder for results.json, table.md, plots and replay.db")
    p.add_argument("--json", action="store_true", help="print the aggregate as one JSON object on the last line")
    p.add_argument("--max-tokens", type=int, default=64, dest="max_tokens", help="longest generated answer")
    p.add_argument("--threads", type=int)
    p.add_argument("--evict-at", choices=config_mod.EVICT_AT, dest="evict_at",
                   help="when evicting policies evict: after the question is prefilled, or at the end of the turn "
                        "(default: the config's evict_at)")
    p.add_argument("--evict-from", type=int, dest="evict_from", metavar="TOKENS",
                   help="history length below which evicting policies run the full cache (default: the config's "
                        "evict_from; 0 evicts from the first turn; per policy: poisson+gate@evict_from=0)")
    p.add_argument("--generate-fillers", action="store_true", dest="generate_fillers",
                   help="also answer every scripted turn (then restore the script's reply), so the answer-phase "
                        "certificate and confidence exist on fillers; the studies need it")
    p.add_argument("--score-replies", action="store_true", dest="score_replies",
                   help="record the model's teacher-forced log-probability of every scripted reply and report it "
                        "by position in the chat (whether it stays coherent, e.g. past the trained context); "
                        "slower turns")
    p.add_argument("--no-plots", action="store_true", dest="no_plots")
    p.add_argument("--no-progress", action="store_true", dest="no_progress")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay conversation scripts under eviction policies and score recall",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scripts", nargs="*", metavar="SCRIPT",
                   help="JSONL scripts (docs/REPLAY_FORMAT.md); or `merge DIR…`; or `convert-locomo FILE…`")
    _add_run_flags(p, DEFAULT_POLICIES, 1)
    p.add_argument("--protocol", default="multi-round",
                   help="multi-round (evict after every turn), one-shot (evict once per probe), or both")
    p.add_argument("--shard", help="run only shard i of n (i/n, 1-based); combine with `replay merge`")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    p.add_argument("--n-ctx", type=int, dest="n_ctx", help="KV cells (default: sized to the longest script)")
    p.add_argument("--conversation", type=int, help="replay a logged conversation from the SQLite store")
    p.add_argument("--db", type=Path, help="the store for --conversation (default: the configured one)")
    p.add_argument("--locomo", type=Path, action="append", help="a LoCoMo JSON file (repeatable)")
    p.add_argument("--qa-category", default="1,2,3,4", dest="qa_category",
                   help="LoCoMo QA categories: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop")
    p.add_argument("--max-sessions", type=int, dest="max_sessions", help="LoCoMo: keep the first N sessions")
    p.add_argument("--max-probes", type=int, dest="max_probes", help="LoCoMo: at most N questions, evenly spaced")
    p.add_argument("--history", help="make-long: script length(s) in tokens, e.g. 8k,16k,32k (k = 1,000)")
    p.add_argument("--seed", type=int, default=0, help="make-long, make-varied: the (first) script's seed (default 0)")
    p.add_argument("--count", type=int, default=1, help="make-varied: how many chats, seeds N, N+1, … (default 1)")
    p.add_argument("--probes", type=int, help="make-long: probes per script (default one per ~800 tokens)")
    p.add_argument("--study", choices=("coverage", "attribution", "gating"),
                   help="run a certificate study instead of a plain replay")
    p.add_argument("--from-results", type=Path, action="append", dest="from_results",
                   help="with --study attribution|gating: analyse these results folders instead of replaying")
    p.add_argument("--write-calibration", metavar="STATISTIC", dest="write_calibration",
                   help="with --study gating: save τ of this statistic (e.g. question.q) as the agent's default "
                        "(agent/gate/gate_calibration.json)")
    p.add_argument("--calibration-rule", choices=("fillers", "probes", "adaptive"), default="fillers",
                   dest="calibration_rule",
                   help="which τ --write-calibration saves: filler gate rate ≤ 10%% (fillers), every "
                        "eviction-broken calibration probe gated (probes), or a floor at 2.5%% of fillers that "
                        "rises with each conversation's recent statistics (adaptive; sketch statistics)")
    p.set_defaults(func=cli_errors.guard(_cmd_replay))

    demo = sub.add_parser("demo", help="built-in demonstrations")
    demo_sub = demo.add_subparsers(dest="demo_command", metavar="DEMO", required=True)
    d = demo_sub.add_parser("recall30", help="thirty-turn recall at a 10%% budget: full, topk, poisson, gated")
    _add_run_flags(d, "full,topk,poisson,poisson+gate", 3, budget="10%")
    d.add_argument("--quick", action="store_true", help="two scenarios, one seed (a few minutes on 2 CPU cores)")
    d.add_argument("--regenerate-fixtures", action="store_true", dest="regenerate_fixtures",
                   help="regenerate the committed filler replies (full cache, greedy) and exit")
    # Its 1.2k-token chats are shorter than the shipped evict_from: the demo is about what eviction forgets.
    d.set_defaults(func=cli_errors.guard(_cmd_demo_recall30), command="demo", evict_from=0)

    lg = demo_sub.add_parser("long", help="a long chat (16k tokens by default): recall and time per turn, "
                                          "full against evicted and gated")
    # the long demo measures the chat as it ships: without --budget, what the chat runs on the model
    _add_run_flags(lg, "full,topk,poisson,poisson+gate", 1)
    lg.set_defaults(max_tokens=None)
    lg.add_argument("--quick", action="store_true",
                    help="the committed ~8k-token fixture (under 15 minutes on 2 CPU cores)")
    lg.add_argument("--history", help="generate a script of this many tokens (default 16k; k = 1,000)")
    lg.add_argument("--seed", type=int, default=0, help="the generated script's seed (default 0)")
    lg.add_argument("--probes", type=int, help="probes in the generated script (default one per ~800 tokens)")
    lg.add_argument("--locomo", type=Path, action="append",
                    help="LoCoMo files to draw the dialogue from (default: the shared ones)")
    lg.add_argument("--script", type=Path, action="append",
                    help="run these scripts instead (any replay script, e.g. a converted LoCoMo conversation)")
    lg.add_argument("--shard", help="run only shard i of n (i/n); combine with --from-results or `replay merge`")
    lg.add_argument("--n-ctx", type=int, dest="n_ctx", help="KV cells (default: the longest history + an answer)")
    lg.add_argument("--lockstep", action="store_true",
                    help="run a script's policies side by side, a turn of each in turn, each on an engine of its own "
                         "(a KV cache each): their turn times then share the machine's drift, as a time bar needs")
    lg.add_argument("--from-results", type=Path, action="append", dest="from_results",
                    help="print the table and plots of these results folders (e.g. shards) without running")
    lg.set_defaults(func=cli_errors.guard(_cmd_demo_long), command="demo")
