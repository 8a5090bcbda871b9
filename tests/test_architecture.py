"""The dependency rules of docs/ARCHITECTURE.md, read from the source (ast; nothing is imported or loaded)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "tui", "native", "memory_store", "scripts")
PRODUCT = ("agent", "tui")
SKIPPED = ("agent/lab/replay/fixtures",)


def _sources(*tops: str) -> Iterator[Path]:
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(SKIPPED):
                yield path


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in the file, wherever it sits (functions included)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _offenders(paths: Iterator[Path], banned: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in paths for line, module in _imports(path)
            if module == banned or module.startswith(banned + ".")]


def test_only_native_imports_llama_cpp() -> None:
    outside = (p for p in _sources(*PACKAGES) if not p.relative_to(ROOT).as_posix().startswith("native/"))
    assert _offenders(outside, "llama_cpp") == []


def test_the_product_never_imports_the_lab() -> None:
    product = (p for p in _sources(*PRODUCT) if not p.relative_to(ROOT).as_posix().startswith("agent/lab/"))
    assert _offenders(product, "agent.lab") == []


def test_native_and_the_store_are_leaves() -> None:
    leaves = list(_sources("native", "memory_store"))
    assert leaves, "no sources found"
    found = [o for banned in ("agent", "tui") for o in _offenders(iter(leaves), banned)]
    found += _offenders(iter(_sources("native")), "memory_store") + _offenders(iter(_sources("memory_store")), "native")
    assert found == []


def test_the_checks_see_imports_inside_functions(tmp_path: Path) -> None:
    # a late import (PLC0415-marked, to keep start-up fast) must count as much as one at the top
    path = tmp_path / "late.py"
    path.write_text("def f():\n    from llama_cpp.llama_chat_format import X\n    import agent.lab.bench\n",
                    encoding="utf-8")
    assert list(_imports(path)) == [(2, "llama_cpp.llama_chat_format"), (3, "agent.lab.bench")]
