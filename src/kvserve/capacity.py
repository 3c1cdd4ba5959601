"""Capacity planner: what a memory budget holds for a model, from its config alone.

Reads only the model's config (GGUF metadata or ``config.json``; no weights) and answers, for
a dtype, a KV-cache budget and a context length:

- the weights' memory (parameters · dtype bytes) and the bytes a decode step reads for them
  (every matmul weight, the LM head included, but only a few rows of an untied embedding);
- the KV cache's bytes per token, ``2 · layers · kv_heads · head_dim · dtype_bytes`` (an 8-bit
  cache: ``head_dim + 4`` bytes per head, the float32 scale included; :mod:`kvserve.worker.kv_quant`),
  and the pool the engine would allocate: blocks, tokens, sequences of ``max_model_len`` and of the
  given context length (the same sizing as :func:`kvserve.core.kv_cache_manager.plan_kv_cache`);
- decode rooflines by batch size: a decode step of ``b`` sequences at context ``c`` reads the
  weights once and every sequence's K/V, so at memory bandwidth ``B`` it takes at least
  ``(W + b·c·kv) / B`` seconds and yields at most ``b·B / (W + b·c·kv)`` tokens/s; at matmul
  rate ``F`` it also takes at least ``2·P·b / F`` seconds (``P`` parameters in matmuls); the
  bound is the smaller of the two (Williams et al. 2009, "Roofline").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvserve.worker import kv_quant
from kvserve.worker import kv_quant_lowbit
from kvserve.config import ModelConfig
from kvserve.core.kv_cache_manager import GiB, KVCacheSpec, plan_kv_cache

#: batch sizes of the roofline table (capped at what the pool holds)
BATCH_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class CapacityPlan:
    """The sizes for one model, dtype and budget.

    Attributes:
        config: the model's config.
        dtype: weights/activations dtype.
        kv_cache_dtype: the pools' dtype (``dtype``, or int8 / float8_e4m3fn for an 8-bit cache).
        kv: the KV pool the engine would allocate.
        context_len: the typical context (tokens) the per-batch figures assume.
        weight_bytes: weight memory at ``dtype`` (bytes).
        weight_bytes_per_step: weight bytes one decode step reads.
        matmul_params: parameters in matmuls (2 FLOPs each per token).
    """

    config: ModelConfig
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    kv: KVCacheSpec
    context_len: int
    weight_bytes: int
    weight_bytes_per_step: int
    matmul_params: int

    @property
    def max_sequences(self) -> int:
        """Sequences of ``context_len`` tokens the pool holds at once (whole blocks each)."""
        blocks = math.ceil(self.context_len / self.kv.block_size)
        return self.kv.num_blocks // blocks

    def decode_step_bytes(self, batch: int) -> float:
        """Bytes one decode step of ``batch`` sequences at ``context_len`` reads."""
        return self.weight_bytes_per_step + batch * self.context_len * self.kv.bytes_per_token

    def decode_tokens_per_s(self, batch: int, bandwidth: float, flops: Optional[float] = None) -> float:
        """Roofline bound on decode throughput (tokens/s) for ``batch`` sequences.

        Args:
            bandwidth: memory bandwidth, bytes/s.
            flops: matmul rate in FLOP/s, or None to bound by memory only.
        """
        t = self.decode_step_bytes(batch) / bandwidth
        if flops:
            t = max(t, 2.0 * self.matmul_params * batch / flops)
        return batch / t

    def format(self, bandwidth: Optional[float] = None, flops: Optional[float] = None,
               batch_sizes: Sequence[int] = BATCH_SIZES) -> str:
        """A human-readable report; the roofline table needs ``bandwidth`` (bytes/s)."""
        c, kv = self.config, self.kv
        dname = str(self.dtype).removeprefix("torch.")
        if kv_quant.is_lowbit(self.kv_cache_dtype):
            per_head = (f"{'4' if self.kv_cache_dtype == torch.uint4 else '2'}-bit codes + float16 scales and zeros "
                        f"per block, averaged; + {kv.residual_blocks} residual blocks in {dname}")
        elif kv_quant.is_quantized(self.kv_cache_dtype):
            kname = str(self.kv_cache_dtype).removeprefix("torch.")
            per_head = f"({c.head_dim} + 4 scale) · 1 byte, {kname}"
        else:
            per_head = f"{c.head_dim} · {torch.empty((), dtype=self.kv_cache_dtype).element_size()} bytes"
        lines = [
            f"model {c.name} ({c.architecture}): {c.num_parameters() / 1e6:.1f}M parameters, {c.num_layers} layers, "
            f"{c.num_heads} query / {c.num_kv_heads} KV heads of {c.head_dim}",
            f"weights: {self.weight_bytes / 1e6:.0f} MB in {dname}; a decode step reads "
            f"{self.weight_bytes_per_step / 1e6:.0f} MB of them",
            f"KV cache: {kv.bytes_per_token} bytes/token (2 · {c.num_layers} layers · {c.num_kv_heads} KV heads · "
            f"{per_head}), {kv.bytes_per_token * kv.block_size / 1024:.0f} KiB per block of "
            f"{kv.block_size} tokens",
            f"budget {kv.num_blocks * kv.block_size * kv.bytes_per_token / GiB:.2f} GiB: {kv.num_blocks} blocks = "
            f"{kv.capacity_tokens} tokens; {kv.max_concurrent_full_sequences:.1f} sequences of max_model_len="
            f"{kv.max_model_len}, {self.max_sequences} of {self.context_len} tokens",
        ]
        if bandwidth:
            head = f"decode roofline at {bandwidth / 1e9:.1f} GB/s"
            if flops:
                head += f" and {flops / 1e9:.0f} GFLOP/s"
            lines += ["", f"{head}, context {self.context_len} tokens:",
                      "| batch | bytes read per step | bound step ms | bound tokens/s | bound by |",
                      "|---|---|---|---|---|"]
            for b in batch_sizes:
                if b > self.max_sequences:
                    break
                tps = self.decode_tokens_per_s(b, bandwidth, flops)
                mem_bound = self.decode_step_bytes(b) / bandwidth >= (2.0 * self.matmul_params * b / flops if flops else 0)
                lines.append(f"| {b} | {self.decode_step_bytes(b) / 1e6:.0f} MB | {1e3 * b / tps:.1f} | {tps:.0f} | "
                             f"{'memory' if mem_bound else 'compute'} |")
        return "\n".join(lines)


def plan_capacity(config: ModelConfig | str | Path, dtype: str | torch.dtype = "bfloat16",
                  kv_cache_memory: float = 2.0, max_model_len: Optional[int] = None, block_size: int = 16,
                  context_len: Optional[int] = None, kv_cache_dtype: str = "auto") -> CapacityPlan:
    """Size weights and KV pool for a model without loading its weights.

    Args:
        config: a :class:`ModelConfig`, or a model path (GGUF file or Hugging Face folder).
        dtype: "bfloat16", "float32", "float16" or a torch dtype.
        kv_cache_memory: KV pool budget in GiB (the engine's ``kv_cache_memory``).
        max_model_len: longest sequence (tokens); default as the engine: min(model context, 4096).
        block_size: tokens per KV block.
        context_len: typical context of a running sequence (tokens), in [1, max_model_len];
            default ``max_model_len // 2``.
        kv_cache_dtype: "auto" (the model dtype), "int8", "fp8" / "fp8_e4m3", "int4", "int2" (the engine's).

    Raises:
        ValueError: a field out of range (named), or a budget that holds no block.
        kvserve.worker.loader.ModelLoadError / UnsupportedModelError: an unreadable or unsupported model.
    """
    from kvserve.engine.llm_engine import parse_dtype
    from kvserve.worker.loader import load_model_config, resolve_model_path

    cfg = config if isinstance(config, ModelConfig) else load_model_config(resolve_model_path(config))
    tdt = parse_dtype(dtype)
    kv_quant.check_kv_cache_dtype(kv_cache_dtype)
    kv_quant.check_head_dim(cfg.head_dim, kv_cache_dtype)
    kdt = kv_quant.storage_dtype(kv_cache_dtype, tdt)
    for name, v, lo in (("block_size", block_size, 1), ("max_model_len", max_model_len, 2),
                        ("context_len", context_len, 1)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
            raise ValueError(f"{name} must be an integer ≥ {lo}, got {v!r}")
    max_len = max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's context "
                         f"length), got {max_len}")
    ctx = context_len if context_len is not None else max(1, max_len // 2)
    if ctx > max_len:
        raise ValueError(f"context_len must be in [1, max_model_len={max_len}], got {ctx}")
    from kvserve.engine.llm_engine import MAX_KV_CACHE_GIB

    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)) or not (
            0 < kv_cache_memory <= MAX_KV_CACHE_GIB):
        raise ValueError(f"kv_cache_memory must be in (0, {MAX_KV_CACHE_GIB}] GiB, got {kv_cache_memory!r}")
    from kvserve.engine.args import EngineArgs

    residual = (kv_quant_lowbit.num_residual_slots(EngineArgs.max_num_seqs, block_size)  # (as the engine at
                if kv_quant.is_lowbit(kdt) else 0)  # its defaults, without speculation)
    spec = plan_kv_cache(cfg, kdt, kv_cache_memory, block_size, max_len, residual_blocks=residual, model_dtype=tdt)
    dbytes = torch.empty((), dtype=tdt).element_size()
    matmul_params = cfg.num_parameters(include_embeddings=False)
    return CapacityPlan(config=cfg, dtype=tdt, kv_cache_dtype=kdt, kv=spec, context_len=ctx,
                        weight_bytes=cfg.num_parameters() * dbytes,
                        weight_bytes_per_step=matmul_params * dbytes, matmul_params=matmul_params)
