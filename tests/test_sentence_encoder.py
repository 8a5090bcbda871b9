"""The NumPy sentence encoder against sentence-transformers' own vectors for the same texts (recorded once in
tests/minilm_reference.json with sentence-transformers and PyTorch, which the project does not install), and the
properties the restore's rank relies on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.gate import sentence_encoder
from agent.gate.sentence_encoder import SentenceEncoder

REFERENCE = json.loads((Path(__file__).parent / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


def test_vectors_equal_the_reference_implementations(encoder: SentenceEncoder) -> None:
    got = encoder.encode(REFERENCE["texts"])
    want = np.array(REFERENCE["vectors"], dtype=np.float32)
    assert got.shape == want.shape == (len(REFERENCE["texts"]), 384)
    assert np.abs(got - want).max() < 1e-4


def test_a_batch_of_mixed_lengths_gives_each_text_its_own_vector(encoder: SentenceEncoder) -> None:
    texts = ["ok", "My cat is called Purrnickel and she sleeps on the windowsill all afternoon.", "Hi there."]
    together = encoder.encode(texts)
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    assert np.abs(together - alone).max() < 1e-5  # padding is masked out
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


def test_a_paraphrase_is_nearer_than_an_unrelated_fact(encoder: SentenceEncoder) -> None:
    q, cat, lock = encoder.encode(["What did I name my feline?", "My cat is called Purrnickel.",
                                   "The code of my bike lock is 9305."])
    assert q @ cat > q @ lock + 0.3


def test_a_text_past_the_trained_length_is_cut_not_refused(encoder: SentenceEncoder) -> None:
    vec = encoder.encode(["word " * 2000])
    assert vec.shape == (1, 384) and np.isfinite(vec).all()


def test_a_missing_package_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentence_encoder.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(sentence_encoder.EncoderMissing) as err:
        sentence_encoder.model_dir()
    assert sentence_encoder.PACKAGE in str(err.value) and "\n" not in str(err.value)
