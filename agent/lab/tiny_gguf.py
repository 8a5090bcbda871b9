"""Write a tiny GGUF with random weights for the patch tests (and the GPU check machine).

Three architectures, each a few MB:

* ``qwen2``  - grouped-query attention like the default model (4 layers, 4 query / 2 KV heads);
               small enough to travel to a lent GPU machine with the patched source;
* ``bloom``  - ALiBi positions: the patch must refuse the bias and the certificate;
* ``mamba``  - a pure recurrent model: no KV cache, the patch must refuse it.

The vocabulary is a SentencePiece-style list of byte tokens plus a few words, enough for
llama.cpp to load the model; the tests feed token ids directly. Weights come from a seeded
generator, so a given (arch, seed, dtype) always writes the same file. ``--dtype f32`` keeps
every activation unrounded (F16 and quantized weights round the activations they multiply),
which makes logits comparable at 1e-5 across different summation orders.

    python -m agent.lab.tiny_gguf qwen2 /tmp/tiny-qwen2.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

ARCHS = ("qwen2", "bloom", "mamba")

N_VOCAB = 512
N_EMBD = 256
N_LAYER = 4
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 512
N_CTX = 4096


def _vocab(writer: gguf.GGUFWriter) -> None:
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
    while len(tokens) < N_VOCAB:
        tokens.append(f"\u2581w{len(tokens)}".encode())
        types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


class _Weights:
    def __init__(self, writer: gguf.GGUFWriter, seed: int, dtype: type) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype

    def mat(self, name: str, ne0: int, ne1: int, scale: float | None = None) -> None:
        # ggml's {ne0, ne1} is numpy's (ne1, ne0)
        s = scale if scale is not None else 1.0 / np.sqrt(ne0)
        self.writer.add_tensor(name, (self.rng.standard_normal((ne1, ne0)) * s).astype(self.dtype))

    def vec(self, name: str, n: int, value: float | None = None) -> None:
        if value is not None:
            data = np.full(n, value, dtype=np.float32)
        else:
            data = self.rng.standard_normal(n).astype(np.float32) * 0.02
        self.writer.add_tensor(name, data)


def _qwen2(writer: gguf.GGUFWriter, w: _Weights) -> None:
    head_dim = N_EMBD // N_HEAD
    n_gqa = head_dim * N_HEAD_KV
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    w.mat("token_embd.weight", N_EMBD, N_VOCAB, 1.0)
    w.vec("output_norm.weight", N_EMBD, 1.0)
    w.mat("output.weight", N_EMBD, N_VOCAB)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", N_EMBD, 1.0)
        # a larger query/key scale makes the attention peaked enough for the tests to see biases
        w.mat(p + "attn_q.weight", N_EMBD, N_EMBD, 0.25)
        w.vec(p + "attn_q.bias", N_EMBD)
        w.mat(p + "attn_k.weight", N_EMBD, n_gqa, 0.25)
        w.vec(p + "attn_k.bias", n_gqa)
        w.mat(p + "attn_v.weight", N_EMBD, n_gqa)
        w.vec(p + "attn_v.bias", n_gqa)
        w.mat(p + "attn_output.weight", N_EMBD, N_EMBD)
        w.vec(p + "ffn_norm.weight", N_EMBD, 1.0)
        w.mat(p + "ffn_gate.weight", N_EMBD, N_FF)
        w.mat(p + "ffn_up.weight", N_EMBD, N_FF)
        w.mat(p + "ffn_down.weight", N_FF, N_EMBD)


def _bloom(writer: gguf.GGUFWriter, w: _Weights) -> None:
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_layer_norm_eps(1e-5)
    w.mat("token_embd.weight", N_EMBD, N_VOCAB, 1.0)
    w.vec("token_embd_norm.weight", N_EMBD, 1.0)
    w.vec("token_embd_norm.bias", N_EMBD)
    w.vec("output_norm.weight", N_EMBD, 1.0)
    w.vec("output_norm.bias", N_EMBD)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", N_EMBD, 1.0)
        w.vec(p + "attn_norm.bias", N_EMBD)
        w.mat(p + "attn_qkv.weight", N_EMBD, 3 * N_EMBD)
        w.vec(p + "attn_qkv.bias", 3 * N_EMBD)
        w.mat(p + "attn_output.weight", N_EMBD, N_EMBD)
        w.vec(p + "attn_output.bias", N_EMBD)
        w.vec(p + "ffn_norm.weight", N_EMBD, 1.0)
        w.vec(p + "ffn_norm.bias", N_EMBD)
        w.mat(p + "ffn_up.weight", N_EMBD, N_FF)
        w.vec(p + "ffn_up.bias", N_FF)
        w.mat(p + "ffn_down.weight", N_FF, N_EMBD)
        w.vec(p + "ffn_down.bias", N_EMBD)


def _mamba(writer: gguf.GGUFWriter, w: _Weights) -> None:
    d_inner, d_state, d_conv, dt_rank = 2 * N_EMBD, 16, 4, 16
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    w.mat("token_embd.weight", N_EMBD, N_VOCAB, 1.0)
    w.vec("output_norm.weight", N_EMBD, 1.0)
    w.mat("output.weight", N_EMBD, N_VOCAB)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", N_EMBD, 1.0)
        w.mat(p + "ssm_in.weight", N_EMBD, 2 * d_inner)
        conv = (w.rng.standard_normal((d_inner, d_conv)) * 0.5).astype(np.float32)
        w.writer.add_tensor(p + "ssm_conv1d.weight", conv)
        w.vec(p + "ssm_conv1d.bias", d_inner)
        w.mat(p + "ssm_x.weight", d_inner, dt_rank + 2 * d_state)
        w.mat(p + "ssm_dt.weight", dt_rank, d_inner)
        w.vec(p + "ssm_dt.bias", d_inner)
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        w.writer.add_tensor(p + "ssm_a", a)
        w.vec(p + "ssm_d", d_inner, 1.0)
        w.mat(p + "ssm_out.weight", d_inner, N_EMBD)


def write_tiny_gguf(arch: str, path: Path, seed: int = 0, dtype: str = "f16") -> Path:
    """Write the tiny ``arch`` model with ``dtype`` (f16 or f32) matrices to ``path`` and return the path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    if dtype not in ("f16", "f32"):
        raise ValueError(f"unknown dtype {dtype!r}: choose f16 or f32")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"certchat-tiny-{arch}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    _vocab(writer)
    weights = _Weights(writer, seed, np.float16 if dtype == "f16" else np.float32)
    {"qwen2": _qwen2, "bloom": _bloom, "mamba": _mamba}[arch](writer, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("path", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16", help="type of the weight matrices")
    args = ap.parse_args()
    out = write_tiny_gguf(args.arch, args.path, args.seed, args.dtype)
    print(f"{out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
