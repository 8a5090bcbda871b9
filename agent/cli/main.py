"""The ``certchat`` console script: parses arguments and dispatches; the work lives elsewhere."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys

from agent import paths

# The chat's own subcommand modules, each adding itself with register(subparsers). The Textual UI's
# `chat` and the lab's `replay`, `demo` and `bench` contribute theirs through the "certchat.commands"
# entry points, so the command line never imports the layers above it or the lab.
_PLUGINS = ("agent.cli.log", "agent.cli.chat")
ENTRY_POINTS = "certchat.commands"


def _cmd_build(args: argparse.Namespace) -> int:
    from native import build  # noqa: PLC0415 — keep `certchat --help` fast

    opts = build.BuildOptions(cache_dir=paths.native_dir(), cuda=args.cuda, cuda_arch=args.cuda_arch,
                              jobs=args.jobs, quiet=args.quiet, cpu=args.cpu)
    try:
        build.build(opts)
    except build.BuildError as err:
        print(f"certchat build: {err}", file=sys.stderr)
        return 1
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from agent import config as config_mod  # noqa: PLC0415
    from agent import models  # noqa: PLC0415
    from agent.gate import calibration, certification  # noqa: PLC0415

    risk = config_mod.load().loss_risk

    def setting(name: str) -> str:
        return calibration.setting_line(calibration.for_model(models.REGISTRY[name].sha256), risk, name)

    rows = [
        {"name": m.name, "present": models.is_pulled(m.name), "path": str(models.model_file(m.name)),
         "size_mb": m.size_mb, "default": m.name == models.DEFAULT_MODEL, "description": m.description,
         "risk": risk, "budget_auto": setting(m.name)}
        for m in models.REGISTRY.values()
    ]
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    for row in rows:
        mark = "*" if row["default"] else " "
        state = "present   " if row["present"] else "not pulled"
        print(f"{mark} {row['name']:<20} {state} {row['size_mb']:>4} MB  {row['description']}")
        print(f"  {'':<20} budget auto at risk {certification.percent(risk)}: {row['budget_auto']}")
    print("(* default; `certchat models pull NAME` installs one)")
    return 0


def _cmd_models_pull(args: argparse.Namespace) -> int:
    from agent import models  # noqa: PLC0415

    names = list(models.REGISTRY) if args.all else args.names or [models.DEFAULT_MODEL]
    try:
        for name in names:
            print(models.pull(name))
    except models.ModelError as err:
        print(f"certchat models: {err}", file=sys.stderr)
        return 1
    return 0


def _cmd_models_verify(args: argparse.Namespace) -> int:
    from agent import models  # noqa: PLC0415

    names = args.names or list(models.REGISTRY)
    unknown = [n for n in names if n not in models.REGISTRY]
    if unknown:
        print(f"certchat models: unknown model {unknown[0]!r}; known: {', '.join(models.REGISTRY)}", file=sys.stderr)
        return 2
    bad = 0
    for name in names:
        found = models.state(name, full=True)
        if found == "damaged":
            bad += 1
            print(f"certchat models: {models.damaged_message(name)}", file=sys.stderr)
        else:
            print(f"{name:<20} {'ok (sha256 verified)' if found == 'ok' else 'not pulled'}")
    return 1 if bad else 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from agent.cli import doctor  # noqa: PLC0415

    data = doctor.report()
    print(json.dumps(data) if args.json else doctor.render(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="certchat",
        description="A terminal chat assistant that evicts most of its KV cache and knows when the eviction hurt.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("build", help="build the patched llama.cpp and the design core (cached by content hash)")
    p.add_argument("--cuda", action="store_true", default=os.environ.get("CERTCHAT_CUDA") == "1",
                   help="build the CUDA backend (also CERTCHAT_CUDA=1)")
    p.add_argument("--cuda-arch", default=None, help="CUDA architecture, e.g. 90; detected when a GPU is present")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--cpu", choices=("native", "avx2"), default=os.environ.get("CERTCHAT_CPU", "native"),
                   help="x86 kernels for this CPU (native) or for any AVX2 CPU (avx2; also CERTCHAT_CPU=avx2)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_build)

    models_p = sub.add_parser("models", help="list or pull the offline models")
    models_sub = models_p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = models_sub.add_parser("list", help="the models certchat can install offline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models_list)
    p = models_sub.add_parser("pull", help="download, verify and store models (default: the default model)")
    p.add_argument("names", nargs="*")
    p.add_argument("--all", action="store_true", help="every model in the registry")
    p.set_defaults(func=_cmd_models_pull)
    p = models_sub.add_parser("verify", help="rehash pulled models against the registry (finds damaged files)")
    p.add_argument("names", nargs="*")
    p.set_defaults(func=_cmd_models_verify)

    p = sub.add_parser("doctor", help="versions, the loaded library and whether it carries our patch, paths")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_doctor)

    for module_name in _PLUGINS:
        importlib.import_module(module_name).register(sub)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        entry.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from agent import logs  # noqa: PLC0415

    logs.configure()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what was typed, for results that record their command
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the last line of defence: one line, the traceback goes to the log file
        from agent.cli import errors as cli_errors  # noqa: PLC0415

        return cli_errors.report(getattr(args, "command", None), err)



__all__ = ["main", "build_parser"]
