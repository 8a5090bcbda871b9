"""Bad input and machine faults through the console script: one line naming the problem and the fix, the
right exit status, no traceback, and the log as it should be afterwards."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent import paths
from memory_store import ReadOnlyError, Store
from tests.reliability_support import ROOT, cli, env, one_line_error

FAST = ["--model", "smollm2-135m", "--policy", "full", "--max-tokens", "8", "--threads", "2", "--n-ctx", "1024"]


@pytest.fixture
def db() -> Path:
    with Store(paths.db_path()) as store:
        conv = store.create_conversation("Kept", model="smollm2-135m")
        store.append_user_message(conv.id, "The kettle is blue.")
        store.append_message(conv.id, "assistant", "Noted: blue.")
    return paths.db_path()


def _contents(path: Path) -> list[tuple[str, str]]:
    with Store(path) as store:
        return [(m.role, m.content) for c in store.list_conversations() for m in store.messages(c.id)]


# -- input that is not UTF-8 -------------------------------------------------------------------

def test_ask_with_non_utf8_stdin_is_answered_and_says_so(small_model: Path) -> None:
    # The diagnostics log is a full disk: every record would fail to write.
    paths.logs_dir().mkdir(parents=True, exist_ok=True)
    (paths.logs_dir() / "certchat.log").symlink_to("/dev/full")
    r = cli("ask", *FAST, "--json", input=b"caf\xe9 au lait, please\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Logging error" not in r.stderr, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(notes) == 2, r.stderr
    assert "not valid UTF-8" in notes[0] and "replaced with \ufffd" in notes[0]
    assert "cannot write the diagnostics log" in notes[1] and "diagnostics are off" in notes[1]
    cid = json.loads(r.stdout.strip().splitlines()[-1])["conversation_id"]
    with Store(paths.db_path()) as store:
        user = [m for m in store.messages(cid) if m.role == "user"]
    assert [m.content for m in user] == ["caf\ufffd au lait, please\n"]


def test_repl_with_non_utf8_line_keeps_going(small_model: Path) -> None:
    r = cli("repl", *FAST, input=b"hello \xff\xfe there\nsecond line\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert sum("not valid UTF-8" in line for line in r.stderr.splitlines()) == 1
    with Store(paths.db_path()) as store:
        (conv,) = store.list_conversations()
        users = [m.content for m in store.messages(conv.id) if m.role == "user"]
    assert users == ["hello \ufffd\ufffd there", "second line"]


# -- log export ----------------------------------------------------------------------------------

def test_export_to_a_missing_directory(db: Path, tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "out.jsonl"
    r = cli("log", "export", "1", "-o", str(target))
    assert r.returncode == 1
    one_line_error(r.stderr, "does not exist", "create it first")
    assert not target.parent.exists()


def test_export_to_a_directory(db: Path, tmp_path: Path) -> None:
    r = cli("log", "export", "1", "-o", str(tmp_path))
    assert r.returncode == 1
    one_line_error(r.stderr, "is a directory", "give a file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.iterdir()
                                                                if not p.name.endswith(".tmp"))


def _limit_file_size(limit: int):
    def apply() -> None:
        # A file-size limit fails writes as a full disk would (EFBIG; SQLite reports SQLITE_FULL).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _limited(args: list[str], limit: int, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, env=env(), cwd=ROOT,
                          preexec_fn=_limit_file_size(limit), timeout=300, input=stdin)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def test_export_that_runs_out_of_space_leaves_no_half_file(db: Path, tmp_path: Path) -> None:
    with Store(db) as store:
        store.append_user_message(1, "x" * 200_000)
    target = tmp_path / "out.md"
    target.write_text("the previous export\n")
    r = _limited(["log", "export", "1", "--format", "md", "-o", str(target)], 50_000)
    assert r.returncode == 1
    one_line_error(r.stderr, f"cannot export to {target}", "nothing was written")
    assert target.read_text() == "the previous export\n"  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out.md"]  # no temporary file left behind
    ok = cli("log", "export", "1", "--format", "md", "-o", str(target))
    assert ok.returncode == 0 and "x" * 1000 in target.read_text()


# -- the database on a full or read-only disk ----------------------------------------------------

def test_full_disk_during_import_names_it_and_keeps_the_log(db: Path, tmp_path: Path) -> None:
    before = _contents(db)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"role": "user", "content": "y" * 3_000_000}) + "\n")
    size = db.stat().st_size + sum(p.stat().st_size for p in db.parent.glob("*.db-*"))
    r = _limited(["log", "import", str(big)], size + 200_000)
    assert r.returncode == 1
    one_line_error(r.stderr, "disk is full", "everything committed before it is kept", "free some space")
    assert _contents(db) == before


def test_read_only_store_reads_and_refuses_writes_in_one_line(db: Path) -> None:
    with Store(db, read_only=True) as store:
        (conv,) = store.list_conversations()
        assert [m.content for m in store.messages(conv.id)] == ["The kettle is blue.", "Noted: blue."]
        with pytest.raises(ReadOnlyError, match="read-only.*log list"):
            store.append_user_message(conv.id, "more")
    assert _contents(db) == [("user", "The kettle is blue."), ("assistant", "Noted: blue.")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_log_list_and_show_on_a_read_only_data_dir(db: Path) -> None:
    for p in [db.parent, *db.parent.iterdir()]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        r = cli("log", "list")
        assert r.returncode == 0 and "Kept" in r.stdout, r.stderr
        r = cli("log", "show", "1")
        assert r.returncode == 0 and "The kettle is blue." in r.stdout, r.stderr
    finally:
        for p in [db.parent, *db.parent.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)


# -- ids and libraries ---------------------------------------------------------------------------

@pytest.mark.parametrize("ident", [str(2**63), str(2**64 + 5), "-1"])
def test_log_show_with_an_id_out_of_range(db: Path, ident: str) -> None:
    r = cli("log", "show", "--", ident) if ident.startswith("-") else cli("log", "show", ident)
    assert r.returncode == 1
    one_line_error(r.stderr, f"no conversation {ident}")
    assert _contents(db)[0] == ("user", "The kettle is blue.")


def test_native_lib_dir_without_the_library(tmp_path: Path) -> None:
    r = cli("ask", *FAST, "hello", extra_env={"CERTCHAT_NATIVE_LIB_DIR": str(tmp_path)})
    assert r.returncode == 1
    one_line_error(r.stderr, f"CERTCHAT_NATIVE_LIB_DIR={tmp_path}", "no libllama.so", "unset it")


def test_native_lib_dir_with_a_library_that_is_not_libllama(tmp_path: Path) -> None:
    from native import runtime  # noqa: PLC0415

    real = runtime.built_libs().lib_dir
    (tmp_path / "libllama.so").write_bytes((real / "libggml-base.so").read_bytes())
    r = cli("ask", *FAST, "hello", extra_env={"CERTCHAT_NATIVE_LIB_DIR": str(tmp_path)})
    assert r.returncode == 1
    one_line_error(r.stderr, "libllama.so cannot be used", "certchat build", "CERTCHAT_NATIVE_LIB_DIR")


# -- models the patched cache cannot serve -------------------------------------------------------

@pytest.mark.parametrize(("arch", "needle"), [("bloom", "uses ALiBi positions"), ("mamba", "is a recurrent model")])
def test_alibi_and_recurrent_models_are_refused_before_the_first_turn(tmp_path: Path, arch: str, needle: str) -> None:
    from tests import patch_support as ps  # noqa: PLC0415

    model = ps.tiny_model(arch, tmp_path)
    r = cli("ask", "--model", str(model), "--policy", "poisson", "--threads", "2", "hello")
    assert r.returncode == 1
    one_line_error(r.stderr, needle, "use ")
    with Store(paths.db_path()) as store:
        assert store.list_conversations() == []  # refused before anything was logged


# -- how an error from the core is rendered ------------------------------------------------------

def test_core_errors_render_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from agent import logs  # noqa: PLC0415
    from agent.cli import errors as cli_errors  # noqa: PLC0415
    from native.patched import NotPatched, PatchError  # noqa: PLC0415
    from native.poisson import BudgetInfeasible, DesignError  # noqa: PLC0415

    cases = [
        (DesignError("weights must be finite\nat index 3"), ["eviction core refused this turn",
                                                              "weights must be finite at index 3", "in the log"]),
        (BudgetInfeasible("budget 3 below the protected 8 cells"), ["eviction core refused", "--budget"]),
        (PatchError("llama_set_attn_certificate", -2, "ALiBi model"), ["cannot serve this model", "without ALiBi"]),
        (NotPatched("libllama is a stock build, certchat needs patch level >= 3: rebuild with `certchat build`"),
         ["stock build", "certchat build"]),
        (KeyError("boom"), ["internal error (KeyError", str(logs.log_file()), "please report it"]),
    ]
    for err, needles in cases:
        assert cli_errors.report("ask", err) == 1
        line = one_line_error(capsys.readouterr().err, "certchat ask: ", *needles)
        assert "\n" not in line


# -- a real full disk and a real read-only file system (root only: a small tmpfs) ------------------

@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a small tmpfs (where the test may: root on Linux); yields (mount point, remount-read-only)."""
    point = tmp_path / "fs"
    point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root)")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)

    try:
        yield point, read_only
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _seed(db_path: Path) -> None:
    with Store(db_path) as store:
        conv = store.create_conversation("Kept")
        store.append_user_message(conv.id, "The kettle is blue.")
        store.append_message(conv.id, "assistant", "Noted: blue.")


def test_read_only_data_dir_lists_and_shows_and_refuses_to_chat(tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
    point, read_only = tmpfs
    monkeypatch.setenv("CERTCHAT_DATA_DIR", str(point))
    _seed(paths.db_path())
    read_only()
    r = cli("log", "list")
    assert r.returncode == 0 and "Kept" in r.stdout and "Traceback" not in r.stderr, r.stderr
    r = cli("log", "show", "1")
    assert r.returncode == 0 and "The kettle is blue." in r.stdout, r.stderr
    r = cli("ask", *FAST, "--conversation", "1", "more")
    assert r.returncode == 1
    one_line_error(r.stderr, "the log is read-only", "log list", "pass --db")


def test_full_disk_names_it_keeps_the_log_and_leaves_no_half_export(tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
    point, _ = tmpfs
    monkeypatch.setenv("CERTCHAT_DATA_DIR", str(point / "data"))
    _seed(paths.db_path())
    with Store(paths.db_path()) as store:
        store.append_user_message(1, "y" * 150_000)  # the export needs more room than will be left
    before = _contents(paths.db_path())
    filler = point / "filler"
    with filler.open("wb", buffering=0) as f:  # fill the file system but for ~60 KB
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    filler.write_bytes(filler.read_bytes()[:-60_000])
    big = Path(os.environ["CERTCHAT_CONFIG"]).parent / "big.jsonl"
    big.write_text(json.dumps({"role": "user", "content": "z" * 400_000}) + "\n")
    r = cli("log", "import", str(big))
    assert r.returncode == 1
    one_line_error(r.stderr, "disk", "full", "everything committed before it is kept")
    assert _contents(paths.db_path()) == before
    target = point / "out.md"
    r = cli("log", "export", "1", "--format", "md", "-o", str(target))
    assert r.returncode == 1
    one_line_error(r.stderr, f"cannot export to {target}", "the disk is full", "nothing was written")
    assert not target.exists() and not list(point.glob(".out.md.*"))
