"""Message content and token ids round-trip exactly: through the store, a reopen, and JSONL."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest

from memory_store import Store
from memory_store.export import export_jsonl, import_jsonl

CONTROL = "".join(chr(c) for c in range(32)) + "\x7f" + "".join(chr(c) for c in range(0x80, 0xA0))
rng = random.Random(1234)
HUGE = "".join(rng.choices("abc défg 東京 🐈\n\t\x00", k=800_000))  # > 1 MB as UTF-8

CASES = {
    "empty": "",
    "huge": HUGE,
    "non_ascii": "Tromsø, Zürich, 東京, Москва, عربى, 🐈‍⬛ family: 👨‍👩‍👧 — \u200b zero width, \u2028 line sep, é vs é",
    "control": f"nul:\x00 bell:\x07 esc:\x1b[31mred\x1b[0m cr:\r lf:\n crlf:\r\n tab:\t all:{CONTROL}",
    "whitespace_only": " \n\t \r\n ",
    "bom_and_specials": "\ufeffstart \ufffd replacement \U0010ffff last plane",
}


def test_huge_case_is_over_a_megabyte() -> None:
    assert len(CASES["huge"].encode("utf-8")) > 1_000_000


@pytest.mark.parametrize("name", sorted(CASES))
def test_content_round_trips_exactly(tmp_path: Path, name: str) -> None:
    text = CASES[name]
    path = tmp_path / "log.db"
    with Store(path) as store:
        c = store.create_conversation(title=text[:200])
        user = store.append_user_message(c.id, text)
        system = store.append_message(c.id, "system", text)
        with store.stream_assistant(c.id) as stream:
            # Streamed in awkward pieces (7 code points split pairs like \r\n).
            step = 7 if len(text) < 10_000 else 65_536
            for i in range(0, len(text), step):
                stream.append(text[i : i + step])
        assert store.get_message(user.id).content == text
    with Store(path) as store:
        messages = store.messages(c.id)
        assert [m.content for m in messages] == [text, text, text]
        assert [m.id for m in messages[:2]] == [user.id, system.id]
        assert store.get_conversation(c.id).title == text[:200]
        buffer = io.StringIO()
        export_jsonl(store, c.id, buffer)
        jsonl = tmp_path / "c.jsonl"
        jsonl.write_text(buffer.getvalue(), encoding="utf-8")
        copy = import_jsonl(store, jsonl)
        assert [m.content for m in store.messages(copy.id)] == [text, text, text]
        assert store.get_conversation(copy.id).title == text[:200]


def test_token_ids_round_trip_exactly(tmp_path: Path) -> None:
    generator = np.random.default_rng(7)
    ids = generator.integers(0, 2**31, size=50_000, dtype=np.int64)
    ids[:4] = [0, 1, 2**31 - 1, 2**31 - 2]  # the extremes
    path = tmp_path / "log.db"
    with Store(path) as store:
        c = store.create_conversation()
        m = store.append_user_message(c.id, "t", tokens=ids.tolist(), first_pos=3)
        with store.stream_assistant(c.id, first_pos=3 + len(ids)) as stream:
            for chunk in np.array_split(ids[:1000], 37):
                stream.append("", chunk)
        empty = store.append_message(c.id, "assistant", "", tokens=[], first_pos=9_000_000)
    with Store(path) as store:
        loaded = store.messages(c.id)
        assert loaded[0].tokens.dtype == np.int32
        assert np.array_equal(loaded[0].tokens, ids) and loaded[0].first_pos == 3
        assert np.array_equal(loaded[1].tokens, ids[:1000])
        assert loaded[2].tokens is not None and len(loaded[2].tokens) == 0 and loaded[2].id == empty.id
        assert store.get_message(m.id).positions.tolist()[:2] == [3, 4]
        buffer = io.StringIO()
        export_jsonl(store, c.id, buffer)
        jsonl = tmp_path / "t.jsonl"
        jsonl.write_text(buffer.getvalue(), encoding="utf-8")
        copy = store.messages(import_jsonl(store, jsonl).id)
        for original, imported in zip(loaded, copy):
            assert np.array_equal(original.tokens, imported.tokens)
            assert original.first_pos == imported.first_pos


def test_tokens_of_a_never_tokenized_message_stay_unknown(tmp_path: Path) -> None:
    with Store(tmp_path / "log.db") as store:
        c = store.create_conversation()
        m = store.append_user_message(c.id, "not yet")
        assert store.get_message(m.id).tokens is None
        assert store.get_message(m.id).positions is None
