"""`certchat doctor`: what is installed, what is loaded, and where everything lives."""

from __future__ import annotations

import importlib.metadata
import platform
import sqlite3
from pathlib import Path
from typing import Any

from agent import config as config_mod
from agent import models, paths
from agent.chat.saved_state import SavedStates, state_dir
from agent.eviction import budget as budget_mod
from agent.eviction import policies
from agent.gate import calibration, certification, sentence_encoder
from memory_store.locking import LOCK_SUFFIX
from native import llama, patched, runtime


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> dict[str, Any]:
    """Everything doctor knows, as one JSON-able object."""
    out: dict[str, Any] = {
        "certchat": _version("certchat"),
        "python": platform.python_version(),
        "llama_cpp_python": _version("llama-cpp-python"),
        "textual": _version("textual"),
        "sqlite_utils": _version("sqlite-utils"),
        "sqlite": sqlite3.sqlite_version,
        "numpy": _version("numpy"),
        "data_dir": str(paths.data_dir()),
        "cache_dir": str(paths.cache_dir()),
        "config_path": str(paths.config_path()),
        "db_path": str(paths.db_path()),
        "patched": False,
        "patch_version": None,
        "cuda": False,
        "gpu_offload": False,
        "library_path": None,
        "core_library": None,
        "core_cuda_library": None,
        "errors": [],
    }
    out["warnings"] = []
    # SQLite's WAL-reset bug (3.7.0–3.51.2) needs a checkpoint overlapping a commit; the store rules that out.
    out["log_writes"] = (f"commits and checkpoints serialised under {paths.db_path().name}{LOCK_SUFFIX}, "
                         "no autocheckpoints (safe from SQLite's WAL-reset bug)")
    try:
        cfg: config_mod.Config | config_mod.ConfigError = config_mod.load()
    except config_mod.ConfigError as err:
        cfg = err
    out["saved_states"] = _saved_states(cfg)
    out["models"] = {}
    for name in models.REGISTRY:
        found = models.state(name)
        out["models"][name] = {"present": found == "ok", "state": found, "path": str(models.model_file(name)),
                               "gate_calibrated": calibration.covers(models.REGISTRY[name].sha256)}
        if found == "damaged":
            out["errors"].append(models.damaged_message(name))
    out["gate"] = gate_report(cfg)
    out["restore"] = restore_report(cfg)
    if out["restore"].get("warning"):
        out["warnings"].append(out["restore"]["warning"])
    try:
        libs = runtime.built_libs()
        out["cuda"] = libs.cuda
        out["build_key"] = libs.key
        out["library_path"] = str(runtime.llama_cdll()._name)
        level = patched.patch_version()
        out["patched"] = level is not None
        out["patch_version"] = level
        out["gpu_offload"] = llama.supports_gpu_offload()
        for key, cuda in (("core_library", False), ("core_cuda_library", True)):
            try:
                out[key] = str(runtime.core_library_path(cuda))
            except runtime.NativeNotBuilt:
                pass
    except (runtime.NativeNotBuilt, OSError) as err:
        out["errors"].append(str(err))
    return out


def _saved_states(cfg: config_mod.Config | config_mod.ConfigError) -> dict[str, Any]:
    """The saved chat states beside the log: how many, their size, and the disk budget they are pruned under (the
    default's where the config does not load)."""
    budget_mb = (cfg if isinstance(cfg, config_mod.Config) else config_mod.Config()).saved_states_mb
    states = SavedStates.beside(paths.db_path(), budget_mb).states()
    return {"dir": str(state_dir(paths.db_path())), "count": len(states), "bytes": sum(s.size for s in states),
            "budget_bytes": budget_mb * 1024 * 1024}


def gate_report(cfg: config_mod.Config | config_mod.ConfigError) -> dict[str, Any]:
    """Whether the configured model's gate is calibrated, and so whether an evicting policy evicts under gate
    "auto" (agent.eviction.budget: on a model the calibration does not cover the chat keeps the full cache)."""
    if isinstance(cfg, config_mod.ConfigError):
        return {"error": str(cfg)}
    registry = models.REGISTRY.get(cfg.model)
    path = Path(cfg.model).expanduser()
    try:
        sha = registry.sha256 if registry else models.gguf_sha256(path) if path.is_file() else None
    except OSError:
        sha = None
    found = calibration.for_model(sha) if sha else None
    reason = calibration.full_cache_reason(found, cfg.evict_at)
    calibrated = reason is None if sha else None
    evicts = policies.from_config(cfg).evicts
    held = cfg.gate_threshold.auto and evicts and calibrated is False
    # the budget the chat runs (agent.eviction.budget.resolve, as the cache manager resolves it) and its line
    name = budget_mod.model_name(found, models.model_file(cfg.model) if registry else path)
    in_force = budget_mod.resolve(cfg.kv_budget, cfg.loss_risk, evicts, found, name)
    return {"model": cfg.model, "gate": cfg.gate, "policy": cfg.policy, "evict_at": cfg.evict_at,
            "calibrated": calibrated, "calibration": str(found.path) if calibrated and found is not None else None,
            "note": f"{reason}; {calibration.UNCALIBRATED_HOW}" if held else None,
            "budget": cfg.budget, "risk": cfg.risk,
            "budget_in_force": str(in_force.budget) if in_force.budget is not None and not held else None,
            "certified_risk": in_force.certified_risk if in_force.budget is not None and not held else None,
            "budget_line": None if held or not evicts else in_force.reason or in_force.notice or in_force.words(),
            "certified": _certified(found)}


def restore_report(cfg: config_mod.Config | config_mod.ConfigError) -> dict[str, Any]:
    """What ``restore`` brings back before a question, and whether the sentence encoder it ranks by is installed."""
    if isinstance(cfg, config_mod.ConfigError):
        return {"error": str(cfg)}
    try:
        encoder: str | None = str(sentence_encoder.model_dir())
        missing = None
    except sentence_encoder.EncoderMissing as err:
        encoder, missing = None, str(err)
    warn = (f"restore ranks by words only: {missing}" if missing and cfg.restore and cfg.restore_by == "meaning"
            else None)
    return {"restore": cfg.restore, "restore_by": cfg.restore_by, "encoder": encoder,
            "encoder_version": _version(sentence_encoder.PACKAGE), "warning": warn}


def _certified(found: calibration.ModelCalibration | None) -> list[dict[str, Any]] | None:
    """Each budget the model's record measured on long chats: its loss and the risk it is certified at."""
    cert = found.certification if found is not None else None
    if cert is None:
        return None
    risks = certification.certified_risks(cert.trials, cert.confidence, cert.min_probes)
    return [{"budget": t.budget, "lost": t.lost, "n": t.n, "certified_risk": risks[t.budget]}
            for t in sorted(cert.trials, key=lambda t: -t.share)]


def render(data: dict[str, Any]) -> str:
    """Human-readable report."""
    yes = {True: "yes", False: "no"}
    lines = [
        f"certchat {data['certchat']}  (Python {data['python']}, llama-cpp-python {data['llama_cpp_python']}, "
        f"textual {data['textual']}, SQLite {data['sqlite']})",
        f"llama.cpp library : {data['library_path'] or 'not loaded'}",
        f"  carries our patch: {yes[data['patched']]}"
        + (f" (patch version {data['patch_version']})" if data["patch_version"] is not None else ""),
        f"  backend          : {'CUDA' if data['cuda'] else 'CPU'}",
        f"design core       : {data['core_library'] or 'missing'}"
        + (f"; CUDA variant {data['core_cuda_library']}" if data["core_cuda_library"] else ""),
        "models:",
    ]
    for name, info in data["models"].items():
        shown = {"ok": "present", "damaged": "DAMAGED"}.get(info.get("state", ""), "not pulled")
        gate = "gate calibrated" if info.get("gate_calibrated") else "gate not calibrated"
        lines.append(f"  {name:<20} {shown:<10} {gate:<19} {info['path']}")
    lines.append(_gate_line(data.get("gate", {})))
    lines.append(_restore_line(data.get("restore", {})))
    lines += [
        f"data dir          : {data['data_dir']}",
        f"cache dir         : {data['cache_dir']}",
        f"config            : {data['config_path']}",
        f"database          : {data['db_path']}",
    ]
    if data.get("log_writes"):
        lines.append(f"log writes        : {data['log_writes']}")
    saved = data.get("saved_states")
    if saved:
        lines.append(f"saved chat states : {saved['count']} in {saved['dir']}, {saved['bytes'] / 2**20:.1f} MiB of "
                     f"{saved['budget_bytes'] / 2**20:.0f} MiB" if saved["budget_bytes"] else
                     f"saved chat states : off (saved_states_mb = 0); {saved['count']} left in {saved['dir']}")
    lines += [f"warning: {text}" for text in data.get("warnings", [])]
    lines += [f"problem: {err}" for err in data["errors"]]
    return "\n".join(lines)


def _restore_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"restore           : unknown ({r['error']})"
    encoder = (f"sentence encoder {sentence_encoder.PACKAGE} {r['encoder_version']}" if r.get("encoder")
               else "sentence encoder not installed")
    if not r.get("restore"):
        return f"restore           : off; {encoder}"
    return f"restore           : the best {r['restore']} evicted messages by {r['restore_by']}; {encoder}"


def _gate_line(gate: dict[str, Any]) -> str:
    if "error" in gate:
        return f"gate              : unknown ({gate['error']})"
    state = {True: "calibrated", False: "not calibrated", None: "model not found"}[gate.get("calibrated")]
    line = f"gate              : {gate.get('gate')} on {gate.get('model')} (evict_at {gate.get('evict_at')}): {state}"
    if gate.get("calibration"):
        line += f" ({gate['calibration']})"
    line += f"\n  {gate['note']}" if gate.get("note") else ""
    if gate.get("budget_line"):
        line += f"\nbudget            : {gate.get('budget')} at risk {gate.get('risk')}: {gate['budget_line']}"
    if gate.get("certified"):
        rows = ", ".join(f"{c['budget']} lost {c['lost']} of {c['n']}"
                         + ("" if c["certified_risk"] is None else f" (≤ {certification.percent(c['certified_risk'])})")
                         for c in gate["certified"])
        line += f"\ncertified         : on long chats, {rows}; risk at or above a budget's bound certifies it"
    return line
