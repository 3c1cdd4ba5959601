"""Quantized KV cache (``kv_cache_dtype``): 8-bit K/V with one scale per token and KV head.

Formats (``EngineArgs.kv_cache_dtype``, vLLM's names):

* ``"auto"``: the model dtype (bfloat16 or float32), no quantization.
* ``"int8"``: symmetric int8, ``x ≈ q · s`` with ``s = max|x| / 127`` over the head's
  ``head_dim`` values and ``q = round_half_even(x / s)`` in [-127, 127]; the error of every value
  is at most ``s / 2`` (half a step).
* ``"fp8"`` / ``"fp8_e4m3"``: OCP FP8 E4M3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa
  bits, max 448), ``x ≈ q · s`` with ``s = max|x| / 448`` and ``q = fp8(x / s)`` rounded to
  nearest even; the error is at most half a step of ``q``'s binade: ``2^-4 · |x|`` relative for
  ``|x / s| ≥ 2^-6``, ``2^-10 · s`` absolute below.

The scale is per token and KV head (as llama.cpp's 8-bit caches scale small blocks, and unlike
vLLM's per-layer fp8 scales, which need calibration to be accurate), dynamic (computed at
write time from the values themselves: nothing to calibrate) and stored as a float32 right
after the head's ``head_dim`` codes. A pool is one tensor per layer for K and for V,
``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` of dtype ``torch.int8`` or
``torch.float8_e4m3fn`` (the dtype names the format; the last 4 "elements" of each row are the
scale's bytes). Copying token rows of a pool (prefix-cache partial blocks, forks) therefore
copies their scales along, and a token's stored K/V never depends on what else was in its batch:
quantization is deterministic, per token.

Every reader dequantizes ``q · s`` in float32 and rounds to the model dtype (the PyTorch paths
through :func:`dequantize`, the C kernels in :mod:`kvserve.kernels.cpu_ops` bit for bit the same
way), then attends as with an unquantized cache.
"""

from __future__ import annotations

from typing import Optional

import torch

#: Accepted ``kv_cache_dtype`` values (``"int4"``/``"int2"``: :mod:`kvserve.worker.kv_quant_lowbit`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8", "int4", "int2")
#: The 2-/4-bit formats (KIVI: :mod:`kvserve.worker.kv_quant_lowbit`).
LOWBIT_DTYPES = ("int4", "int2")
#: Bytes of the per-(token, KV head) scale stored after the codes (a float32).
SCALE_BYTES = 4
#: Largest code magnitude of each format.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Format id the C kernels take (``fmt``): 0 = model dtype, 1 = int8, 2 = fp8 e4m3.
C_FORMAT = {torch.int8: 1, torch.float8_e4m3fn: 2}


def check_kv_cache_dtype(value, field: str = "kv_cache_dtype") -> str:
    """Return ``value`` if it is one of :data:`KV_CACHE_DTYPES`.

    Raises:
        ValueError: naming ``field`` and the allowed values.
    """
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"{field} must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")
    return value


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype of a ``kv_cache_dtype``: the model dtype for ``"auto"``, ``torch.int8`` or
    ``torch.float8_e4m3fn``; for ``"int4"``/``"int2"`` the marker dtypes ``torch.uint4``/``torch.uint2``
    (the pools are :class:`kvserve.worker.kv_quant_lowbit.LowBitPool` s of uint8 bytes).

    Raises:
        ValueError: for a value outside :data:`KV_CACHE_DTYPES`.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in LOWBIT_DTYPES:
        return torch.uint4 if kv_cache_dtype == "int4" else torch.uint2
    return torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn


def is_lowbit(cache) -> bool:
    """Whether a pool (or pool dtype) is a 2-/4-bit one (:mod:`kvserve.worker.kv_quant_lowbit`)."""
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype in (torch.uint4, torch.uint2)


def is_quantized(cache: torch.Tensor | torch.dtype) -> bool:
    """Whether a pool (or pool dtype) holds 8-bit codes plus scales."""
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype in QMAX


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of a pool: ``head_dim``, or ``head_dim + 4`` (codes, then the scale)."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """``head_dim`` of a pool ``[..., row_elements]``."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def bytes_per_head_token(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token of one KV head takes in a K (or V) pool, scale included."""
    return row_elements(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def check_head_dim(head_dim: int, kv_cache_dtype: str) -> None:
    """8-bit pools keep the float32 scale 4-byte aligned: ``head_dim`` must be a multiple of 4.

    Raises:
        ValueError: naming ``kv_cache_dtype`` and the model's ``head_dim``.
    """
    if kv_cache_dtype != "auto" and head_dim % 4:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a head_dim divisible by 4, the model's is "
                         f"{head_dim}; use kv_cache_dtype='auto'")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantize K or V rows.

    Args:
        x: ``[..., head_dim]`` float32 or bfloat16 (one row per token and head).
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        ``[..., head_dim + 4]`` of ``dtype``: the codes, then the float32 scale's bytes. A row of
        zeros gets scale 1 and zero codes.
    """
    hd = x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    y = xf / scale
    if dtype == torch.int8:
        codes = y.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty((*x.shape[:-1], hd + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    out[..., :hd] = codes
    out[..., hd:] = scale.contiguous().view(torch.uint8)
    return out.view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes · scale`` in float32, rounded to ``dtype``.

    Args:
        rows: ``[..., head_dim + 4]`` int8 or float8_e4m3fn rows of a pool (any leading shape).
        dtype: the model dtype of the result.

    Returns:
        ``[..., head_dim]`` of ``dtype``.
    """
    hd = rows.shape[-1] - SCALE_BYTES
    b = rows.view(torch.uint8)
    scale = b[..., hd:].contiguous().view(torch.float32)
    codes = b[..., :hd].view(rows.dtype).float()
    return (codes * scale).to(dtype)


def write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot_mapping[t]] = quantize(x[t])`` for a pool viewed as slots.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` quantized pool.
        x: ``[T, num_kv_heads, head_dim]`` model dtype.
        slot_mapping: ``[T]`` int64 flat slots (non-negative).
    """
    kvh, row = cache.shape[2], cache.shape[3]
    flat = cache.view(torch.uint8).view(-1, kvh, row)
    flat.index_copy_(0, slot_mapping, quantize(x, cache.dtype).view(torch.uint8))


def gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized K or V of ``slots``: ``[*slots.shape, num_kv_heads, head_dim]`` in ``dtype``;
    an unquantized pool is gathered as it is."""
    kvh, row = cache.shape[2], cache.shape[3]
    if not is_quantized(cache):
        return cache.view(-1, kvh, row).index_select(0, slots.reshape(-1)).view(*slots.shape, kvh, row)
    flat = cache.view(torch.uint8).view(-1, kvh, row)
    rows = flat.index_select(0, slots.reshape(-1)).view(cache.dtype)
    return dequantize(rows, dtype).view(*slots.shape, kvh, row - SCALE_BYTES)


def describe(kv_cache_dtype: str, dtype: Optional[torch.dtype]) -> str:
    """``"int8 (per-token-head scales)"`` / ``"bfloat16"``: the pool format for logs."""
    if dtype is not None and is_lowbit(dtype):
        return (f"{'int4' if dtype == torch.uint4 else 'int2'} (KIVI: K per channel over each block, V per token in "
                f"groups of 32 channels, float16 scales and zeros; partial blocks in the model dtype)")
    if dtype is None or not is_quantized(dtype):
        return str(dtype).replace("torch.", "") if dtype is not None else kv_cache_dtype
    return f"{'int8' if dtype == torch.int8 else 'fp8_e4m3'} (+ float32 scale per token and KV head)"
