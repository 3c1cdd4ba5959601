"""Fused CPU kernels for the model's non-matmul ops: RMSNorm, SiLU-and-mul, RoPE, KV write,
paged decode attention (AVX-512, and AMX tiles for bf16 attention where the CPU has them), bf16
prefill attention (AMX tiles, or AVX512-BF16 dot products on CPUs without AMX), and
Gemma 3's own: its RMSNorm with the sandwich residual add, QK-norm + RoPE, and GeGLU.

Why: a decode step of a small model is a few hundred tiny ops; in eager PyTorch each costs
5-50 us of dispatch, allocation and a separate pass over memory, which for SmolLM2 is more
time than the matmuls themselves. Each kernel here replaces a chain of PyTorch ops with one
pass (one ctypes call), vectorized with AVX-512 and parallel over rows with OpenMP.

Numerics follow the PyTorch ops they replace: float32 arithmetic, and in bfloat16 the result
of every PyTorch op in the replaced chain is rounded to bfloat16 at the same point
(round-to-nearest-even), so bf16 results match eager PyTorch to about one bf16 ulp and float32
results to float rounding. Paged attention accumulates in float32 with an exact two-pass
softmax (like SDPA's math; the order of additions differs).

All functions take CPU tensors of dtype float32 or bfloat16 (the "model dtype"), with unit
stride in the last dimension; row strides are passed through, so views into a fused QKV
output need no copy. Call :func:`available` first; the model falls back to PyTorch ops
otherwise (see :mod:`kvserve.kernels`). The C source is ``csrc/cpu/cpu_ops.c``, built at
install into one library per instruction set (see :mod:`kvserve.kernels`).

Every kernel function is also a PyTorch custom op, ``torch.ops.kvserve.<name>`` (:data:`OPS`;
``torch.library.custom_op`` with fake implementations, CPU only), so that ``torch.compile`` and
CUDA-graph capture can see them; each op runs the same Python function, hence the same kernel.
The model's eager path calls the functions directly, not the ops, because the op dispatcher
adds about as much time again as the kernels take: 10-33 us per call under
``torch.inference_mode`` (40-77 us under ``no_grad``) on top of 12-19 us for the direct call of
a one-token RMSNorm or SiLU-and-mul (2-core AVX-512 Xeon, torch 2.13), and a decode step on the
module path makes 6 kernel calls per layer (181 for SmolLM2's 30 layers). Measured on SmolLM2
bf16 single-stream decode with the one-call step off (one process alternating the two ways over
six rounds of 48 tokens, the machine shared, load 5-7 on 2 cores): 9.3 tok/s calling the
functions, 6.9 through ``torch.ops.kvserve`` (-26%; -10% to -43% per round), same tokens. The
default decode path (:class:`DecodeStep`, 11.8 tok/s in the same runs) makes no per-op call.
(Registering with the lower-level ``torch.library.Library.impl`` instead of ``custom_op`` costs
4-15 us per call: less, still too much for the eager path.)
:class:`DecodeStep` stays a plain ctypes call: it hands C a struct of raw layer pointers and the
gemv and tile kernels as C function pointers, which have no op-schema type, and it is one call per
decode step, so there is no per-op overhead to hide and nothing for a graph to fuse.
"""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Optional

import torch

from kvserve.worker import kv_quant
from kvserve.kernels import cpu_flags, load_library

#: Rows of work below which a kernel runs on one thread (waking the second costs more).
_PARALLEL_MIN_ELEMENTS = 1 << 14
#: Largest head_dim and GQA group the attention kernel handles.
MAX_HEAD_DIM = 256
MAX_GQA_GROUP = 64


#: Entry points a library built by an earlier kvserve may lack.
_OPTIONAL = ("kv_paged_attention_decode_lowbit", "kv_prefill_ranges", "kv_prefill_ranges_supported",
             "kv_lowbit_dequantize", "kv_lowbit_quantize", "kv_probe_colsum")


class _Lib:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        i64, vp, ci, cf = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        spec = {
            "kv_rms_norm": [vp, i64, vp, i64, vp, vp, i64, i64, i64, cf, ci, ci],
            "kv_silu_and_mul": [vp, i64, vp, i64, i64, i64, ci, ci],
            "kv_log_sum_exp": [vp, i64, vp, vp, i64, i64, ci],
            "kv_greedy": [vp, i64, ci, vp, vp, vp, i64, i64, ci, ci],
            "kv_apply_token_bitmask": [vp, i64, vp, i64, vp, i64, i64, ci],
            "kv_rope": [vp, i64, i64, i64, i64, vp, vp, vp, ci, ci],
            "kv_gemma_rms_norm": [vp, i64, vp, vp, i64, vp, vp, i64, i64, i64, cf, ci, ci],
            "kv_gemma_qk_norm_rope": [vp, i64, i64, i64, i64, i64, vp, vp, cf, vp, vp, vp, ci, ci],
            "kv_gelu_tanh_and_mul": [vp, i64, vp, i64, i64, i64, ci, ci],
            "kv_reshape_and_cache": [vp, i64, vp, i64, vp, vp, vp, i64, i64, i64],
            "kv_reshape_and_cache_q": [vp, i64, vp, i64, vp, vp, vp, i64, i64, i64, ci, ci],
            "kv_paged_attention_decode": [vp, i64, vp, vp, vp, i64, vp, vp, i64, i64, i64, i64, i64, i64, cf, i64, ci,
                                          ci, ci],
            "kv_paged_attention_prefill": [vp, i64, vp, vp, vp, i64, vp, i64, vp, i64, i64, i64, i64, i64, cf, ci, ci],
            "kv_paged_attention_decode_lowbit": [vp, i64, vp, vp, vp, vp, vp, vp, i64, vp, vp, i64, i64, i64, i64,
                                                 i64, i64, cf, i64, ci, ci, ci],
            "kv_prefill_ranges": [vp, i64, vp, vp, i64, vp, vp, i64, vp, i64, vp, i64, i64, i64, i64, cf, ci],
            "kv_prefill_ranges_supported": [i64, i64, i64],
            "kv_probe_colsum": [vp, i64, vp, i64, vp, i64, vp, i64, i64, vp, i64, i64, i64, i64, cf, ci],
            "kv_lowbit_dequantize": [vp, vp, i64, i64, i64, i64, ci, ci, vp, ci, ci],
            "kv_lowbit_quantize": [vp, i64, i64, i64, i64, ci, ci, ci, vp, ci],
        }
        for name, args in spec.items():
            if name in _OPTIONAL and not hasattr(lib, name):
                continue  # (a library built before that kernel: lowbit_available() / prefill_ranges_supported())
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = (ctypes.c_int if name.startswith(("kv_paged_attention", "kv_prefill_ranges", "kv_probe_colsum", "kv_greedy"))
                          else None)
            setattr(self, name[3:], fn)


@functools.lru_cache(maxsize=None)
def _raw_lib() -> Optional[ctypes.CDLL]:
    return load_library("cpu_ops")


@functools.lru_cache(maxsize=None)
def _lib() -> Optional[_Lib]:
    lib = _raw_lib()
    if lib is None:
        return None
    set_bf16_dot(True)
    set_amx(True)
    return _Lib(lib)


def _k() -> _Lib:
    lib = _lib()
    if lib is None:
        raise RuntimeError("kvserve CPU kernels are not available here (see kvserve.kernels; check available())")
    return lib


def set_bf16_dot(on: bool) -> bool:
    """Use AVX512_BF16 dot products (``VDPBF16PS``) in bf16 decode attention, and in bf16
    prefill attention where AMX does not run it (:func:`avx512bf16_prefill_supported`), when the
    CPU has them (the default); ``False`` forces the float32-FMA decode path and leaves prefill
    on such CPUs to SDPA. Returns what is now in effect."""
    lib = _raw_lib()
    eff = bool(on) and "avx512_bf16" in cpu_flags()
    if lib is not None:
        lib.kv_set_bf16_dot(int(eff))
    return eff


def set_amx(on: bool) -> bool:
    """Run bf16 decode attention on AMX tiles (``TDPBF16PS``) when the CPU has AMX-BF16 and
    Linux grants the tile state (the default); ``False`` forces the AVX-512 kernels. Returns
    what is now in effect. AMX is used for ``head_dim % 32 == 0`` and ``block_size % 16 == 0``."""
    lib = _raw_lib()
    if lib is None:
        return False
    want = bool(on) and {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()
    return bool(lib.kv_set_amx(int(want)))


def available() -> bool:
    """Whether the kernels can run here (the install built them and this CPU has AVX-512)."""
    return _lib() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether ``t`` can go to these kernels: CPU, float32 or bfloat16, no autograd, kernels built."""
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and not t.requires_grad
            and available())


def supports_attention_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_attention_decode` (and :class:`DecodeStep`) handle this shape."""
    return (0 < head_dim <= MAX_HEAD_DIM and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GQA_GROUP)


def _threads(work: int, items: int) -> int:
    """OpenMP threads for a kernel whose parallel loop has ``items`` iterations (rows, or
    attention's (sequence, KV head) pairs) over ``work`` elements in all: one below
    ``_PARALLEL_MIN_ELEMENTS``, else torch's thread count, but never more than ``items``. A
    thread with no iteration still has to wake up and join, which on a 2-vCPU VM costs ~60 us
    (e.g. the greedy sampler's one logits row: 98 against 31 us)."""
    if work < _PARALLEL_MIN_ELEMENTS:
        return 1
    return max(1, min(torch.get_num_threads(), items))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with unit stride in the last dimension, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add (vLLM's
    ``fused_add_rms_norm``).

    Args:
        x: ``[M, dim]`` float32 or bfloat16, unit last stride.
        weight: ``[dim]`` contiguous, same dtype.
        eps: added to the mean square.
        residual: optional ``[M, dim]`` same dtype, unit last stride; updated in place to
            ``x + residual`` (rounded to the dtype), which is then normalized.

    Returns:
        ``[M, dim]`` new tensor: ``weight * to_dtype(h * rsqrt(mean(h², -1) + eps))`` with ``h``
        the float32 input (``x``, or the updated ``residual``), as Hugging Face's LlamaRMSNorm.
    """
    _rows(x, "x")
    M, dim = x.shape
    out = torch.empty((M, dim), dtype=x.dtype)
    ldr = 0
    if residual is not None:
        _rows(residual, "residual")
        ldr = residual.stride(0)
    _k().rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), ldr,
                  weight.data_ptr(), out.data_ptr(), dim, M, dim, float(eps), int(x.dtype == torch.bfloat16),
                  _threads(M * dim, M))
    return out


def _gated(x: torch.Tensor, kernel) -> torch.Tensor:
    """``kernel(gate) * up`` for ``x = [gate | up]`` ``[M, 2·I]`` on a C kernel of the
    ``kv_silu_and_mul`` signature; returns ``[M, I]`` in ``x.dtype``."""
    _rows(x, "x")
    M, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x must have an even number of columns (gate | up), got {two_i}")
    inter = two_i // 2
    out = torch.empty((M, inter), dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), out.data_ptr(), inter, M, inter, int(x.dtype == torch.bfloat16),
           _threads(M * inter, M))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``to_dtype(silu(gate)) * up`` for ``x = [gate | up]``.

    Args:
        x: ``[M, 2·I]`` float32 or bfloat16, unit last stride.

    Returns:
        ``[M, I]`` new tensor in ``x.dtype``.
    """
    return _gated(x, _k().silu_and_mul)


def log_sum_exp(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x - row_max)))`` per row, in one pass over ``x`` (the log partition of
    the sampler's logprobs; ``torch`` would write and reread an ``[M, V]`` temporary).

    Args:
        x: ``[M, V]`` float32, unit last stride, finite or ``-inf`` (``-inf`` adds nothing).
        row_max: ``[M]`` or ``[M, 1]`` float32, each row's maximum (finite).

    Returns:
        ``[M, 1]`` float32.
    """
    _rows(x, "x")
    if x.dtype != torch.float32 or row_max.dtype != torch.float32:
        raise ValueError(f"log_sum_exp needs float32 x and row_max, got {x.dtype} and {row_max.dtype}")
    M, V = x.shape
    mx = row_max.reshape(-1).contiguous()
    if mx.numel() != M:
        raise ValueError(f"row_max must have {M} elements (one per row of x), got {mx.numel()}")
    out = torch.empty((M, 1), dtype=torch.float32)
    _k().log_sum_exp(x.data_ptr(), x.stride(0), mx.data_ptr(), out.data_ptr(), M, V, _threads(M * V, M))
    return out


def apply_token_bitmask_(x: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
    """Set to -inf, in place, the entries of ``x`` that a token bitmask does not allow
    (structured output): mask row ``m`` applies to row ``rows[m]`` of x (row ``m`` when
    ``rows`` is None); column ``v`` is kept when bit ``v % 32`` of word ``v // 32`` is set
    (columns at or past ``32·W`` are cleared).

    Args:
        x: ``[B, V]`` float32, unit last stride.
        bitmask: ``[M, W]`` int32 contiguous.
        rows: ``[M]`` int64 contiguous, distinct, each in ``[0, B)`` (not checked), or None (M = B).

    Raises:
        ValueError: wrong dtypes or shapes.
    """
    _rows(x, "x")
    if x.dtype != torch.float32 or bitmask.dtype != torch.int32 or bitmask.dim() != 2 \
            or not bitmask.is_contiguous():
        raise ValueError(f"apply_token_bitmask_ needs float32 x and a contiguous 2-D int32 bitmask, got "
                         f"{x.dtype} and {bitmask.dtype} {tuple(bitmask.shape)}")
    M, W = bitmask.shape
    if rows is None and M != x.shape[0] or rows is not None and (rows.dtype != torch.int64 or rows.numel() != M
                                                                 or not rows.is_contiguous()):
        raise ValueError(f"apply_token_bitmask_: {M} mask rows need {M} int64 row indices (or x with {M} rows)")
    if M and x.shape[1]:
        _k().apply_token_bitmask(x.data_ptr(), x.stride(0), bitmask.data_ptr(), W,
                                 None if rows is None else rows.data_ptr(), M, x.shape[1],
                                 _threads(M * x.shape[1], M))


def greedy(logits: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Greedy choice per row in one read of the logits, without upcasting them: the token, the
    row maximum and the log partition ``log(sum(exp(x - max)))`` (what :func:`log_sum_exp`
    gives on the float32 copy of the row, bit for bit), so the token's logprob is ``-log_z``.

    Args:
        logits: ``[M, V]`` float32 or bfloat16, unit last stride.

    Returns:
        ``(tokens [M] int64 (the first index of the row maximum, as ``numpy.argmax``),
        row_max [M] float32, log_z [M] float32)``, or None when some row's maximum is not
        finite (a NaN or an infinity: the caller takes its general path).
    """
    tokens, row_max, log_z, bad = _greedy_run(logits, logprob=False)
    return None if logits.shape[1] == 0 or bad else (tokens, row_max, log_z)


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`greedy`'s kernel call: ``tokens`` has -1 in rows whose maximum is not finite."""
    return _greedy_run(logits, logprob=False)[:3]


def greedy_sample(logits: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`greedy` as the sampler's fast path needs it, in one call and two allocations:
    ``(tokens [M] int64, logprobs [M] float32)``, the logprob being ``-log_z`` (the same
    float32 number ``0.0 - log_z`` gives). Right after a decode step has streamed the weights
    through the caches every further PyTorch op costs tens of microseconds, so the rows' maxima
    are checked in C, not with ``(tokens < 0).any()``.

    Args:
        logits: ``[M, V]`` float32 or bfloat16 on the CPU, unit last stride.

    Returns:
        None when some row's maximum is not finite, or ``M`` or ``V`` is 0 (the caller takes
        its general path).
    """
    tokens, _, logprobs, bad = _greedy_run(logits, logprob=True)
    return None if bad or 0 in logits.shape else (tokens, logprobs)


def _greedy_run(logits: torch.Tensor, logprob: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, int]:
    """Check ``logits`` and run ``kv_greedy``: ``(tokens, row_max (None with logprob), log_z (with
    logprob: the token's logprob -log_z), the number of rows whose maximum is not finite)``."""
    _rows(logits, "logits")
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"greedy needs float32 or bfloat16 logits, got {logits.dtype}")
    M, V = logits.shape
    tokens = torch.empty(M, dtype=torch.int64)
    row_max = None if logprob else torch.empty(M, dtype=torch.float32)
    out = torch.empty(M, dtype=torch.float32)
    bad = 0
    if M and V:
        bad = _k().greedy(logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16), tokens.data_ptr(),
                          None if row_max is None else row_max.data_ptr(), out.data_ptr(), M, V, _threads(M * V, M),
                          int(logprob))
    return tokens, row_max, out, bad


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Apply rotary position embeddings (Su et al. 2021, ``rotate_half`` layout) in place.

    Args:
        x: ``[T, ≥ num_heads·head_dim]`` float32 or bfloat16, unit last stride; the first
            ``num_heads·head_dim`` columns of each row (e.g. the q and k heads of a fused QKV
            output) are rotated in place.
        num_heads: heads per row to rotate.
        head_dim: values per head (even).
        positions: ``[T]`` int64 contiguous, each in ``[0, cos.shape[0])`` (not checked).
        cos, sin: ``[max_positions, head_dim]`` contiguous tables in ``x.dtype``.
    """
    _rows(x, "x")
    T = x.shape[0]
    _k().rope(x.data_ptr(), x.stride(0), T, num_heads, head_dim, positions.data_ptr(), cos.data_ptr(),
              sin.data_ptr(), int(x.dtype == torch.bfloat16), _threads(T * num_heads * head_dim, T))


def _same_dtype(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} like the input, got {t.dtype}")


def _vector(w: torch.Tensor, dim: int, name: str) -> torch.Tensor:
    if w.dim() != 1 or w.shape[0] != dim or not w.is_contiguous():
        raise ValueError(f"{name} must be contiguous [{dim}], got shape {tuple(w.shape)} strides {w.stride()}")
    return w


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (zero-centred weight): ``to_dtype(x / sqrt(mean(x², -1) + eps) · (1 + weight))``
    computed in float32 and rounded once at the end (Hugging Face's ``Gemma3RMSNorm``).

    Args:
        x: ``[M, dim]`` float32 or bfloat16, unit last stride (any row stride).
        weight: ``[dim]`` contiguous, ``x.dtype``.
        eps: added to the mean square.

    Returns:
        ``[M, dim]`` new contiguous tensor in ``x.dtype``.

    Raises:
        ValueError: on a shape, stride or dtype the kernel cannot take.
    """
    _rows(x, "x")
    M, dim = x.shape
    _vector(weight, dim, "weight")
    _same_dtype(x.dtype, weight=weight)
    out = torch.empty((M, dim), dtype=x.dtype)
    _k().gemma_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), None, 0, None, out.data_ptr(), dim, M, dim,
                        float(eps), int(x.dtype == torch.bfloat16), _threads(M * dim, M))
    return out


def gemma_add_rms_norm_(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float,
                        next_weight: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Gemma's sandwich-norm residual add, in place, optionally followed by the next norm:
    ``residual += gemma_rms_norm(x, weight)``, then ``gemma_rms_norm(residual, next_weight)``.

    In bfloat16 the norm is rounded to bfloat16 before the add and the sum is rounded again,
    as PyTorch's ``h + norm(a)``; the next norm reads the rounded sum.

    Args:
        x: ``[M, dim]`` float32 or bfloat16, unit last stride (e.g. the attention or MLP output).
        weight: ``[dim]`` contiguous, ``x.dtype``: the norm applied to ``x`` (post-attention or
            post-feed-forward).
        residual: ``[M, dim]`` ``x.dtype``, unit last stride, not overlapping ``x``: the residual
            stream, updated in place.
        eps: added to the mean square (both norms).
        next_weight: optional ``[dim]`` contiguous, ``x.dtype``: the norm of the updated
            residual to return (pre-feed-forward, or the next layer's input norm).

    Returns:
        ``[M, dim]`` new tensor ``gemma_rms_norm(residual, next_weight)``, or None without
        ``next_weight``.

    Raises:
        ValueError: on a shape, stride or dtype the kernel cannot take.
    """
    _rows(x, "x")
    _rows(residual, "residual")
    M, dim = x.shape
    if tuple(residual.shape) != (M, dim):
        raise ValueError(f"residual must have x's shape {(M, dim)}, got {tuple(residual.shape)}")
    _vector(weight, dim, "weight")
    _same_dtype(x.dtype, weight=weight, residual=residual)
    out = None
    if next_weight is not None:
        _vector(next_weight, dim, "next_weight")
        _same_dtype(x.dtype, next_weight=next_weight)
        out = torch.empty((M, dim), dtype=x.dtype)
    _k().gemma_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), residual.data_ptr(), residual.stride(0),
                        None if out is None else next_weight.data_ptr(), None if out is None else out.data_ptr(),
                        dim, M, dim, float(eps), int(x.dtype == torch.bfloat16), _threads(M * dim, M))
    return out


def gemma_qk_norm_rope_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Gemma's QK-norm then RoPE on the q and k heads of a fused QKV output, in place: each
    head is :func:`gemma_rms_norm`-ed (``q_weight`` for the query heads, ``k_weight`` for the
    key heads), rounded to the dtype, then rotated as :func:`rope_` does.

    Args:
        qkv: ``[T, ≥ (num_heads + num_kv_heads)·head_dim]`` float32 or bfloat16, unit last
            stride (any row stride); the first ``num_heads`` heads of each row are q, the next
            ``num_kv_heads`` k; columns after them (v) are not touched.
        num_heads, num_kv_heads: query and key heads per row.
        head_dim: values per head (even).
        q_weight, k_weight: ``[head_dim]`` contiguous, ``qkv.dtype``.
        eps: the norms' epsilon.
        positions: ``[T]`` int64 contiguous, each in ``[0, cos.shape[0])`` (not checked).
        cos, sin: ``[max_positions, head_dim]`` contiguous tables in ``qkv.dtype`` (the layer
            type's: Gemma 3's local and global layers differ).

    Raises:
        ValueError: on a shape, stride or dtype the kernel cannot take.
    """
    _rows(qkv, "qkv")
    T = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(f"qkv [{T}, {qkv.shape[1]}] cannot hold {num_heads}+{num_kv_heads} heads of even "
                         f"head_dim {head_dim}")
    _vector(q_weight, head_dim, "q_weight")
    _vector(k_weight, head_dim, "k_weight")
    _same_dtype(qkv.dtype, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin)
    if positions.dtype != torch.int64 or positions.shape != (T,) or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous int64 [{T}], got {positions.dtype} {tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim or not (
            cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [max_positions, {head_dim}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    _k().gemma_qk_norm_rope(qkv.data_ptr(), qkv.stride(0), T, num_heads, num_kv_heads, head_dim,
                            q_weight.data_ptr(), k_weight.data_ptr(), float(eps), positions.data_ptr(),
                            cos.data_ptr(), sin.data_ptr(), int(qkv.dtype == torch.bfloat16),
                            _threads(T * (num_heads + num_kv_heads) * head_dim, T))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (Shazeer 2020): ``to_dtype(gelu_tanh(gate)) * up`` for ``x = [gate | up]``,
    as ``F.gelu(gate, approximate="tanh") * up`` (bfloat16: gelu rounded before the multiply).

    Args:
        x: ``[M, 2·I]`` float32 or bfloat16, unit last stride (any row stride).

    Returns:
        ``[M, I]`` new tensor in ``x.dtype``.

    Raises:
        ValueError: when ``x`` is not 2-D with unit last stride and an even number of columns.
    """
    return _gated(x, _k().gelu_tanh_and_mul)


def _kv_format(cache: torch.Tensor) -> int:
    """The C kernels' ``fmt`` of a pool: 0 (model dtype), 1 (int8), 2 (fp8 e4m3)."""
    return kv_quant.C_FORMAT.get(cache.dtype, 0)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V into its cache slot (vLLM's ``reshape_and_cache``); into 8-bit
    pools quantized, each token and KV head with its own scale (:mod:`kvserve.worker.kv_quant`; bit for
    bit as :func:`kvserve.worker.kv_quant.quantize`).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``, heads and values contiguous within a token (token
            stride free, so views into a fused QKV output work).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, same
            dtype as ``k``; or 8-bit pools ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``
            (``torch.int8``/``torch.float8_e4m3fn``).
        slot_mapping: ``[T]`` int64 contiguous flat slots (``block · block_size + offset``);
            negative slots are skipped.
    """
    fmt = _kv_format(k_cache)
    if fmt:
        _k().reshape_and_cache_q(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                 v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], k_cache.shape[2],
                                 k.shape[2], int(k.dtype == torch.bfloat16), fmt)
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    _k().reshape_and_cache(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], row, k.element_size())


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: Optional[torch.Tensor] = None, max_context_len: Optional[int] = None,
                           window: Optional[int] = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (PagedAttention, Kwon et
    al. 2023), with GQA and an exact float32 softmax; optionally over a sliding window only.

    Args:
        q: ``[D, num_heads, head_dim]``; heads and values contiguous within a row (row stride free).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, in
            ``q.dtype``, or 8-bit pools (``head_dim + 4`` last, :mod:`kvserve.worker.kv_quant`): each
            sequence's context is then dequantized to ``q.dtype`` into a per-thread buffer (codes
            times scale, rounded as :func:`kvserve.worker.kv_quant.dequantize` does) that the same
            kernels read.
        block_tables: ``[D, max_blocks]`` int64, unit last stride; row d lists sequence d's blocks.
        context_lens: ``[D]`` int64 contiguous, tokens to attend to (≥ 1, including the new one,
            whose K/V must already be in the cache).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        out: optional ``[D, num_heads, head_dim]`` destination, heads contiguous within a row.
        max_context_len: ``max(context_lens)`` if the caller knows it (saves a reduction);
            only used to decide whether to use more than one thread.
        window: sliding window in tokens (Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023), or
            None for all of the context: the new token at position ``p = context_len - 1`` sees
            the keys at positions ``(p - window, p]``. The block-table walk starts at the first
            block overlapping the window, so a sequence reads at most ``window + block_size - 1``
            keys whatever its context length, and the table entries before that block are never
            read (they may hold anything, e.g. -1 for blocks freed by the KV manager).

    Returns:
        ``out`` (or a new tensor) with ``softmax(q·Kᵀ·scale)·V`` per head, in ``q.dtype``.

    bfloat16 runs on AMX tiles where the CPU has them (:func:`set_amx`; ~2x the AVX-512
    kernel at 64 sequences of 450 tokens on the development machine, 29 vs 13 GB/s of KV),
    else on AVX512-BF16 dot products (:func:`set_bf16_dot`); float32 on AVX-512 FMAs. Off AMX
    a sequence attending to more than 512 keys is split along its keys into work items of
    whole blocks whose partial softmax results are merged (flash-decoding, Dao et al. 2023);
    the split depends on the sequence's own length only, so its output does not depend on the
    batch or the thread count. With bf16 caches on AVX512-BF16 and at least 4 (sequence, split)
    pairs a thread, a work item is a whole pair, every KV head in one pass over its token rows
    (memory streams through the whole pass instead of the first KV head's item; same sums in the
    same order as an item per KV head).

    Raises:
        ValueError: for head_dim > 256, a GQA group > 64 or heads not divisible by KV heads.
        MemoryError: if the kernel's work buffers cannot be allocated.
    """
    D, H, hd = q.shape
    KVH, bs = k_cache.shape[2], k_cache.shape[1]
    if not supports_attention_shape(H, KVH, hd):
        raise ValueError(f"paged_attention_decode: unsupported shape (heads {H}, kv_heads {KVH}, head_dim {hd})")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention_decode: window must be >= 1 token or None, got {window}")
    if out is None:
        out = torch.empty((D, H, hd), dtype=q.dtype)
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if D else 0
    read = max_context_len if window is None else min(max_context_len, window + bs - 1)  # keys read per sequence
    rc = _k().paged_attention_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), out.stride(0), D, H, KVH, hd, bs,
        float(scale), window or 0, int(q.dtype == torch.bfloat16), _kv_format(k_cache),
        _threads(D * H * read * hd // 64, D * KVH))
    if rc:
        raise MemoryError("paged_attention_decode: could not allocate work buffers")
    return out


def amx_prefill_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int) -> bool:
    """Whether :func:`paged_attention_prefill` runs here for this shape on AMX tiles: bf16, AMX
    enabled (:func:`set_amx`), ``head_dim % 32 == 0``, ``block_size % 16 == 0``, GQA group <= 16."""
    return _prefill_path(dtype, num_heads, num_kv_heads, head_dim, block_size) == 1


def avx512bf16_prefill_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                 block_size: int) -> bool:
    """Whether :func:`paged_attention_prefill` runs here for this shape on AVX512-BF16 dot
    products (``VDPBF16PS``; the kernel for CPUs without AMX): bf16, the ``cpu_ops_avx512bf16``
    library loaded (a CPU with AVX512_BF16), :func:`set_bf16_dot` on, AMX off or unavailable
    (:func:`set_amx`) or not applicable to the shape, ``head_dim % 32 == 0``, ``head_dim <= 256``,
    GQA group <= 64; any block size."""
    return _prefill_path(dtype, num_heads, num_kv_heads, head_dim, block_size) == 2


def prefill_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int) -> bool:
    """Whether :func:`paged_attention_prefill` runs here for this shape, on either kernel
    (:func:`amx_prefill_supported` or :func:`avx512bf16_prefill_supported`)."""
    return _prefill_path(dtype, num_heads, num_kv_heads, head_dim, block_size) != 0


def _prefill_path(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The C library's choice for bf16 prefill (``kv_prefill_path``): 1 AMX, 2 AVX512-BF16, 0 none."""
    if dtype != torch.bfloat16 or not available():
        return 0
    lib = _raw_lib()
    if not hasattr(lib, "kv_prefill_path"):  # (a library built before the AVX512-BF16 kernel)
        ok = (bool(lib.kv_amx_enabled()) and head_dim % 32 == 0 and block_size % 16 == 0 and num_kv_heads > 0
              and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16)
        return int(ok)
    i64 = ctypes.c_int64
    return int(lib.kv_prefill_path(i64(num_heads), i64(num_kv_heads), i64(head_dim), i64(block_size)))


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, chunks: torch.Tensor, scale: float,
                            out: torch.Tensor) -> None:
    """Causal attention of prefill chunks over their paged context, on AMX tiles or, on CPUs
    without AMX, on AVX512-BF16 dot products.

    Same math as :func:`paged_attention_decode` applied to every token of a chunk (token ``t``
    of a chunk attends to the first ``num_past + t + 1`` tokens of its sequence, float32
    softmax, probabilities rounded to bf16 for P·V, float32 accumulation). Needs
    :func:`prefill_supported`; the C library picks the kernel:

    * AMX (:func:`amx_prefill_supported`): a work item is 16 tokens of one query head, whose
      scores against 16 keys are one tile (K read from the cache as stored); V is packed once
      per chunk and KV head into the tiles' transposed layout; exact two-pass softmax.
    * AVX512-BF16 (:func:`avx512bf16_prefill_supported`; ``csrc/cpu/cpu_ops.c``,
      ``prefill_dp``): flash-attention style (Dao et al. 2022, "FlashAttention": blocks of 64
      keys with an online softmax, running max and sum per row). A work item is up to 16
      tokens of a chunk and one KV head (at most 64 rows of tokens x its G query heads, which
      share every K/V block loaded); K and V are packed once per chunk and KV head into the
      pair layouts of ``VDPBF16PS``, which computes both Q·Kᵀ and P·V.

    Args:
        q: ``[T, num_heads, head_dim]`` bf16, heads contiguous within a row (row stride free).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` bf16 contiguous,
            already holding the chunks' own K/V; or 8-bit pools (:mod:`kvserve.worker.kv_quant`), whose
            chunks' contexts are first dequantized to bf16 into a work buffer.
        block_tables: ``[P, max_blocks]`` int64, unit last stride: row p for chunk p.
        chunks: ``[P, 3]`` int64 contiguous: (first row of the chunk in ``q``, its tokens,
            tokens of its sequence cached before it).
        scale: softmax scale.
        out: ``[T, num_heads, head_dim]`` bf16 destination (rows of the chunks are written).

    Raises:
        ValueError: if neither kernel supports the shape or dtype here (bf16 only; AMX:
            ``head_dim % 32 == 0``, ``block_size % 16 == 0``, GQA group <= 16; AVX512-BF16:
            ``head_dim % 32 == 0``, ``head_dim <= 256``, GQA group <= 64).
        MemoryError: if work buffers cannot be allocated.
    """
    T, H, hd = q.shape
    KVH, bs = k_cache.shape[2], k_cache.shape[1]
    if not prefill_supported(q.dtype, H, KVH, hd, bs):
        raise ValueError(f"paged_attention_prefill: unsupported here (dtype {q.dtype}, heads {H}, kv_heads {KVH}, "
                         f"head_dim {hd}, block_size {bs}; needs bf16 with head_dim % 32 == 0 on AMX or "
                         f"AVX512_BF16)")
    rc = _k().paged_attention_prefill(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), chunks.data_ptr(), chunks.shape[0], out.data_ptr(), out.stride(0), H, KVH, hd, bs,
        float(scale), _kv_format(k_cache), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("paged_attention_prefill: could not allocate work buffers")
    if rc:
        raise ValueError("paged_attention_prefill: AMX path unavailable")


def prefill_ranges_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`prefill_ranges` runs here: bf16, the ``cpu_ops_avx512bf16`` library loaded
    (a CPU with AVX512_BF16) and :func:`set_bf16_dot` on, ``head_dim % 32 == 0``,
    ``head_dim <= 256``, GQA group <= 64."""
    if dtype != torch.bfloat16 or not available():
        return False
    k = _k()
    if not hasattr(k, "prefill_ranges_supported"):
        return False
    return bool(k.prefill_ranges_supported(num_heads, num_kv_heads, head_dim))


def _check_two_sources(fn: str, q: torch.Tensor, sources: tuple, ranges: torch.Tensor) -> tuple[int, int]:
    """The argument checks :func:`prefill_ranges` and :func:`probe_colsum` share: support here, each
    source ``(name, tensor, which)`` contiguous bf16 ``[L, num_kv_heads, head_dim]`` (``which``: "d"
    or "f"), q's heads contiguous, ``ranges`` ``[n, 3]`` int64 within the sources. Returns
    ``(Ld, Lf)``; raises ValueError naming ``fn`` and the field."""
    n, H, hd = q.shape
    KVH = sources[0][1].shape[1]
    if not prefill_ranges_supported(q.dtype, H, KVH, hd) or (fn == "probe_colsum" and not hasattr(_k(), fn)):
        raise ValueError(f"{fn}: unsupported here (dtype {q.dtype}, heads {H}, kv_heads {KVH}, "
                         f"head_dim {hd}; needs bf16, head_dim % 32 == 0 and AVX512_BF16)")
    lens = {which: t.shape[0] for _, t, which in sources}
    for name, t, which in sources:
        L = lens[which]
        if t.dtype != torch.bfloat16 or tuple(t.shape) != (L, KVH, hd) or not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous bf16 [{L}, {KVH}, {hd}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    Ld, Lf = lens["d"], lens["f"]
    if q.stride(2) != 1 or q.stride(1) != hd:
        raise ValueError(f"{fn}: q's heads must be contiguous within a row")
    if ranges.dtype != torch.int64 or tuple(ranges.shape) != (n, 3) or not ranges.is_contiguous():
        raise ValueError(f"{fn}: ranges must be contiguous int64 [{n}, 3], got {ranges.dtype} "
                         f"{tuple(ranges.shape)}")
    if n and (int(ranges[:, 0].min()) < 0 or int(ranges[:, 0].max()) > Ld or int(ranges[:, 1:].min()) < 0
              or int(ranges[:, 1:].max()) > Lf):
        raise ValueError(f"{fn}: ranges must lie in [0, {Ld}] (D) and [0, {Lf}] (F)")
    return Ld, Lf


def prefill_ranges(q: torch.Tensor, k_d: torch.Tensor, v_d: torch.Tensor, k_f: torch.Tensor, v_f: torch.Tensor,
                   ranges: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``n`` query tokens over two key/value sources with a key range per token:
    token ``t`` attends to keys ``[0, ranges[t, 0])`` of source D and keys
    ``[ranges[t, 1], ranges[t, 2])`` of source F, one softmax over both (float32 scores and
    softmax, probabilities rounded to bf16 for P·V, float32 accumulation: the math of
    :func:`paged_attention_prefill`'s AVX512-BF16 kernel, flash-attention style, Dao et al.
    2022); a token whose ranges are both empty gets zeros.

    The 2-/4-bit KV caches' prefill (:func:`kvserve.worker.attention.prefill_lowbit`) uses it:
    D is the chunk's context as a decode step reads it (full blocks dequantized), F the
    model-dtype rows of the blocks the chunk touches, and each token's ranges say which copy of
    each key it sees, where PyTorch would need a boolean mask over both copies for every query.

    Args:
        q: ``[n, num_heads, head_dim]`` bf16, heads contiguous within a row (row stride free).
        k_d, v_d: ``[Ld, num_kv_heads, head_dim]`` bf16 contiguous (``Ld`` may be 0).
        k_f, v_f: ``[Lf, num_kv_heads, head_dim]`` bf16 contiguous (``Lf`` may be 0).
        ranges: ``[n, 3]`` int64 contiguous: (end in D, start in F, end in F), with
            ``0 <= ranges[:, 0] <= Ld`` and ``0 <= ranges[:, 1], ranges[:, 2] <= Lf``.
        scale: softmax scale.
        out: optional ``[n, num_heads, head_dim]`` bf16 destination (heads contiguous).

    Returns:
        ``out`` (a new tensor when not given).

    Raises:
        ValueError: unsupported here (:func:`prefill_ranges_supported`), or shapes, dtypes or
            ranges out of bounds.
        MemoryError: if work buffers cannot be allocated.
    """
    n, H, hd = q.shape
    KVH = k_d.shape[1]
    Ld, Lf = _check_two_sources("prefill_ranges", q, (("k_d", k_d, "d"), ("v_d", v_d, "d"), ("k_f", k_f, "f"),
                                                      ("v_f", v_f, "f")), ranges)
    if out is None:
        out = torch.empty((n, H, hd), dtype=q.dtype)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (n, H, hd) or out.stride(2) != 1 or out.stride(1) != hd:
        raise ValueError(f"prefill_ranges: out must be bf16 [{n}, {H}, {hd}] with heads contiguous, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if n == 0:
        return out
    rc = _k().prefill_ranges(q.data_ptr(), q.stride(0), k_d.data_ptr(), v_d.data_ptr(), Ld, k_f.data_ptr(),
                             v_f.data_ptr(), Lf, ranges.data_ptr(), n, out.data_ptr(), out.stride(0), H, KVH, hd,
                             float(scale), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("prefill_ranges: could not allocate work buffers")
    if rc:
        raise ValueError("prefill_ranges: unsupported here")
    return out


def probe_colsum_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`probe_colsum` runs here: as :func:`prefill_ranges_supported`, and a library
    that has the kernel."""
    return prefill_ranges_supported(dtype, num_heads, num_kv_heads, head_dim) and hasattr(_k(), "probe_colsum")


def probe_colsum(q: torch.Tensor, k_d: torch.Tensor, k_f: torch.Tensor, ranges: torch.Tensor, scale: float,
                 num_cols: int, f_offset: int = 0) -> torch.Tensor:
    """Column sums of softmax attention probabilities: the attention scores H2O and SnapKV rank
    keys by (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"; Li et al. 2024, "SnapKV"), for
    :func:`kvserve.worker.attention.record_kv_probes`.

    Token ``t`` attends to keys ``[0, ranges[t, 0])`` of source D and ``[ranges[t, 1],
    ranges[t, 2])`` of source F with one ``softmax(q·kᵀ · scale)`` over both (as
    :func:`prefill_ranges`: bf16 products, float32 sums, exp and softmax); the result adds each
    probability to its key's column, per KV head, over the tokens and the head's query heads.

    Args:
        q: ``[n, num_heads, head_dim]`` bf16, heads contiguous within a row (row stride free).
        k_d: ``[Ld, num_kv_heads, head_dim]`` bf16 contiguous (``Ld`` may be 0); key ``j`` is
            column ``j``.
        k_f: ``[Lf, num_kv_heads, head_dim]`` bf16 contiguous (``Lf`` may be 0); key ``j`` is
            column ``f_offset + j``.
        ranges: ``[n, 3]`` int64 contiguous: (end in D, start in F, end in F), with
            ``0 <= ranges[:, 0] <= Ld`` and ``0 <= ranges[:, 1], ranges[:, 2] <= Lf``.
        scale: softmax scale.
        num_cols: columns of the result, ``>= Ld`` and ``>= f_offset + Lf``.
        f_offset: column of F's first key (``>= 0``).

    Returns:
        ``[num_kv_heads, num_cols]`` float32 (a token that sees no key adds nothing).

    Raises:
        ValueError: unsupported here (:func:`probe_colsum_supported`), or shapes, dtypes, ranges
            or columns out of bounds.
        MemoryError: if work buffers cannot be allocated.
    """
    n, H, hd = q.shape
    KVH = k_d.shape[1]
    Ld, Lf = _check_two_sources("probe_colsum", q, (("k_d", k_d, "d"), ("k_f", k_f, "f")), ranges)
    if f_offset < 0 or num_cols < Ld or num_cols < f_offset + Lf:
        raise ValueError(f"probe_colsum: num_cols must be >= {Ld} (Ld) and >= f_offset + {Lf} (Lf) with "
                         f"f_offset >= 0, got num_cols {num_cols}, f_offset {f_offset}")
    out = torch.zeros((KVH, num_cols), dtype=torch.float32)
    if n == 0:
        return out
    rc = _k().probe_colsum(q.data_ptr(), q.stride(0), k_d.data_ptr(), Ld, k_f.data_ptr(), Lf, ranges.data_ptr(), n,
                           int(f_offset), out.data_ptr(), num_cols, H, KVH, hd, float(scale), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("probe_colsum: could not allocate work buffers")
    if rc:
        raise ValueError("probe_colsum: unsupported here")
    return out


class _LayerPtrs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "ln2", "gu_w", "down_w", "k_cache", "v_cache",
                 "qkv_p", "o_p", "gu_p", "down_p")]


class DecodeStep:
    """A whole decode step of a Llama-family model in one C call (``kv_decode_step`` in
    ``csrc/cpu/cpu_ops.c``; ctypes only, no torch op: see the module docstring).

    For a few tokens the per-op overhead of eager PyTorch (5-20 us per op, ~15 ops per layer)
    costs more than the matmuls; this runs the same kernels the model's modules run for such
    batches (gemv or tile linears, fused RMSNorm/RoPE/SiLU, KV write, paged decode attention)
    from C, so the logits are bit-identical to the module path.

    Args:
        layers: per layer a dict of contiguous CPU tensors in the model dtype: ``ln1``, ``ln2``
            ``[E]``; ``qkv_w`` ``[(H + 2·KVH)·hd, E]``, ``qkv_b`` (or None), ``o_w`` ``[E, H·hd]``,
            ``gu_w`` ``[2·I, E]``, ``down_w`` ``[E, I]``, ``q_norm``/``k_norm`` ``[hd]`` (or None),
            ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, hd]``; and, when ``amx`` is
            given, ``qkv_p``, ``o_p``, ``gu_p``, ``down_p``: the weights packed by
            ``kvserve.worker.layers.linear.tile_pack``.
        final_norm: ``[E]``; lm_head: ``[V, E]``; cos, sin: RoPE tables ``[max_positions, hd]``.
        gemv: the ctypes gemv function for the dtype (``kvserve.worker.layers.linear``), used for up to
            ``gemv_max_tokens`` tokens.
        num_heads, num_kv_heads, head_dim, eps: the model's attention shape and RMSNorm epsilon.
        max_tokens: largest batch (tokens) this step accepts.
        gemv_max_tokens: the gemv limit (defaults to ``max_tokens``); above it the linears run on
            ``amx`` with the packed weights.
        amx: optional tile linear function on packed weights (``_Kernels.tile_linear``: the
            ctypes ``kv_amx_linear``, or ``kv_bf16p_linear`` on CPUs without AMX); lm_head_packed:
            the packed LM head for it.
        window: every layer's sliding window in tokens (Mistral), or None: attention as in
            :func:`paged_attention_decode` with that ``window``.
        shapes: ``(dtype, vocab_size, intermediate_size)`` when the weights are not plain
            tensors: GGUF-quantized linears pass ``kvserve.worker.layers.quant.gemv_descriptor``
            tensors as weights and ``kv_q_gemv`` as ``gemv`` (biases in the descriptors).
        gemv_rows: for such weights, the ctypes function computing output rows ``[n0, n1)`` of
            ``gemv`` on the calling thread (``kv_q_gemv_rows``), which the team path needs (see
            ``team``); plain tensors are split by the step itself.

    Attributes:
        team: run batches of at most ``gemv_max_tokens`` tokens as one OpenMP region whose
            threads split every GEMV's rows between them and wait for each other at a
            spin-then-yield barrier, instead of one region per operation, whose idle threads fall
            asleep between operations (``decode_step_team`` in ``csrc/cpu/cpu_ops.c``); the
            logits are bit-identical either way. True by default where it applies (more than one
            thread; plain weights, or packed ones with ``gemv_rows``); a call whose attention
            would take more than one thread (many sequences, long contexts: its thread 0 runs
            attention alone) takes the per-operation path.
        profile: None (the default), or an int64 tensor ``[len(PHASES)]`` to which each call
            adds the wall time in ns it spent in each phase (``PHASES``, summed over the
            layers; two clock reads per phase, ~1 us per step on SmolLM2); for
            ``benchmarks/decode_breakdown.py``.
    """

    #: The phases :attr:`profile` times, in its order ("norm": the RMSNorms with their residual
    #: adds, and the embedding copy; "rope": RoPE and Qwen3's QK-norm).
    PHASES = ("norm", "qkv", "rope", "kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down", "lm_head")

    def __init__(self, layers: list[dict], final_norm: torch.Tensor, lm_head: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, gemv, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 max_tokens: int, gemv_max_tokens: Optional[int] = None, amx=None,
                 lm_head_packed: Optional[torch.Tensor] = None, window: Optional[int] = None,
                 shapes: Optional[tuple[torch.dtype, int, int]] = None, gemv_rows=None) -> None:
        self._keep = (layers, final_norm, lm_head, cos, sin, lm_head_packed)  # the C side holds raw pointers
        self.window = window
        self.dtype = lm_head.dtype if shapes is None else shapes[0]
        self.E, self.V = final_norm.shape[0], lm_head.shape[0] if shapes is None else shapes[1]
        self.H, self.KVH, self.hd = num_heads, num_kv_heads, head_dim
        self.I = layers[0]["down_w"].shape[1] if shapes is None else shapes[2]
        self.eps, self.max_tokens = float(eps), max_tokens
        self.gemv_max_tokens = max_tokens if gemv_max_tokens is None else gemv_max_tokens
        if self.gemv_max_tokens < max_tokens and (amx is None or lm_head_packed is None
                                                  or any(l.get("qkv_p") is None for l in layers)):
            raise ValueError("DecodeStep: batches above gemv_max_tokens need amx and packed weights")
        self.block_size = layers[0]["k_cache"].shape[1]
        self._layers = (_LayerPtrs * len(layers))(*[
            _LayerPtrs(*[None if l.get(n) is None else l[n].data_ptr() for n, _ in _LayerPtrs._fields_])
            for l in layers])
        self._gemv = ctypes.cast(gemv, ctypes.c_void_p).value
        self._amx = None if amx is None else ctypes.cast(amx, ctypes.c_void_p).value
        self._ptrs = (final_norm.data_ptr(), lm_head.data_ptr(), None if lm_head_packed is None
                      else lm_head_packed.data_ptr(), cos.data_ptr(), sin.data_ptr())
        e = lambda n: torch.empty((max_tokens, n), dtype=self.dtype)  # noqa: E731
        # Work buffers for the largest batch; a batch of M uses their first M rows.
        self._scratch = (e(self.E), e(self.E), e(self.E), e((self.H + 2 * self.KVH) * self.hd),
                         e(self.H * self.hd), e(2 * self.I), e(self.I))
        fn = _k().lib.kv_decode_step
        i64, vp, cf, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self.kv_format = _kv_format(layers[0]["k_cache"])
        fn.argtypes = [vp, i64, vp, vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, cf, vp,
                       vp, vp, vp, vp, i64, vp, i64, i64, cf, i64, vp, vp, vp, i64, vp, ci, ci, ci, ci, vp, ci, vp]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._profile: Optional[torch.Tensor] = None
        self._gemv_rows = None if gemv_rows is None else ctypes.cast(gemv_rows, ctypes.c_void_p).value
        self._team_ok = shapes is None or gemv_rows is not None
        self._team = self._team_ok
        phases = getattr(_k().lib, "kv_decode_step_phases", None)  # (absent from libraries built before it)
        self._profile_phases = None if phases is None else int(phases())

    @property
    def team(self) -> bool:
        return self._team

    @team.setter
    def team(self, on: bool) -> None:
        """Raises ValueError when turned on for packed weights given without ``gemv_rows``."""
        if on and not self._team_ok:
            raise ValueError("DecodeStep.team needs gemv_rows for weights that are not plain tensors")
        self._team = bool(on)

    @property
    def profile(self) -> Optional[torch.Tensor]:
        return self._profile

    @profile.setter
    def profile(self, t: Optional[torch.Tensor]) -> None:
        """Raises ValueError unless ``t`` is None or a contiguous CPU int64 tensor ``[len(PHASES)]``;
        RuntimeError when the loaded library predates the profile (rebuild: ``pip install -e .``)."""
        if t is not None and self._profile_phases != len(self.PHASES):
            raise RuntimeError("DecodeStep.profile: the loaded cpu_ops library does not time phases "
                               "(built before they were added); rebuild it with `pip install -e .`")
        if t is not None and (t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous()
                              or tuple(t.shape) != (len(self.PHASES),)):
            raise ValueError(f"DecodeStep.profile must be None or a contiguous CPU int64 tensor of shape "
                             f"({len(self.PHASES)},), got {t.dtype} {tuple(t.shape)} on {t.device}")
        self._profile = t

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """Run every layer for ``M`` decode tokens, one per sequence.

        Args:
            hidden: ``[M, E]`` contiguous token embeddings (model dtype).
            positions, slot_mapping, context_lens: ``[M]`` int64 contiguous.
            block_tables: ``[M, max_blocks]`` int64, unit last stride.
            max_context_len: ``max(context_lens)`` (tokens).

        Returns:
            ``[M, vocab_size]`` logits in the model dtype (a new tensor).

        Raises:
            ValueError: if ``M`` exceeds ``max_tokens``.
            MemoryError: if attention's or the AMX linears' work buffers cannot be allocated.
        """
        M = hidden.shape[0]
        if not 0 < M <= self.max_tokens:
            raise ValueError(f"DecodeStep takes 1..{self.max_tokens} tokens, got {M}")
        residual, delta, x, qkv, attn, gu, act = self._scratch
        logits = torch.empty((M, self.V), dtype=self.dtype)
        read = max_context_len if self.window is None else min(max_context_len, self.window + self.block_size - 1)
        nt = torch.get_num_threads()
        fin, head, head_p, cos, sin = self._ptrs
        rc = self._fn(ctypes.addressof(self._layers), len(self._layers), self._gemv, self._amx, self.gemv_max_tokens,
                      M, hidden.data_ptr(), residual.data_ptr(), delta.data_ptr(), x.data_ptr(), qkv.data_ptr(),
                      attn.data_ptr(), gu.data_ptr(), act.data_ptr(),
                      self.E, self.H, self.KVH, self.hd, self.I, self.eps, positions.data_ptr(), cos, sin,
                      slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                      context_lens.data_ptr(), max_context_len, self.block_size, self.hd**-0.5, self.window or 0,
                      fin, head, head_p, self.V, logits.data_ptr(), int(self.dtype == torch.bfloat16), self.kv_format,
                      nt, _threads(M * self.H * read * self.hd // 64, M * self.KVH),
                      None if self._profile is None else self._profile.data_ptr(),
                      int(self._team), self._gemv_rows)
        if rc:
            raise MemoryError("decode step: could not allocate attention or linear work buffers")
        return logits


# --------------------------------------------------------------------------------------
# The kernels as PyTorch custom ops (torch.ops.kvserve.*), for torch.compile and CUDA-graph
# capture to see them (a ctypes call is opaque to Dynamo). Each op wraps the Python function
# above; the fake (meta) implementations give the output shapes without running anything.
# Registered for CPU tensors only: another device raises NotImplementedError in the dispatcher
# instead of handing a device pointer to C.
def lowbit_available() -> bool:
    """Whether the C decode kernel over 2-/4-bit pools is here (:func:`paged_attention_decode_lowbit`)."""
    return available() and hasattr(_lib(), "paged_attention_decode_lowbit")


def lowbit_dequantize_supported(data: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`lowbit_dequantize` (and :func:`lowbit_quantize`) run for this pool data
    (or these rows) and model dtype: a CPU tensor, float32 or bfloat16, the kernels built with them."""
    return (data.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and available()
            and hasattr(_lib(), "lowbit_dequantize") and hasattr(_lib(), "lowbit_quantize"))


def lowbit_quantize(x: torch.Tensor, bits: int, is_key: bool) -> torch.Tensor:
    """Whole blocks quantized in C: the bytes of :func:`kvserve.worker.kv_quant_lowbit.quantize_blocks`
    bit for bit (KIVI, Liu et al. 2024: K per channel over the block's tokens, V per token in
    groups of 32 channels; float16 scale and zero rounded outward; codes rounded half to even),
    without its intermediate tensors.

    Args:
        x: ``[N, block_size, num_kv_heads, head_dim]`` float32 or bfloat16 on the CPU
            (``head_dim % 4 == 0``).
        bits: 4 or 2.
        is_key: K layout (per-channel parameters) or V layout (per token and group).

    Returns:
        ``[N, num_kv_heads, block_bytes]`` uint8.

    Raises:
        ValueError: unsupported here (:func:`lowbit_dequantize_supported`), ``bits`` not 2 or 4, or
            ``head_dim`` not a multiple of 4.
    """
    if not lowbit_dequantize_supported(x, x.dtype):
        raise ValueError(f"lowbit_quantize: unsupported here (device {x.device}, dtype {x.dtype})")
    N, bs, KVH, hd = x.shape
    if bits not in (2, 4) or hd % 4:
        raise ValueError(f"lowbit_quantize: bits must be 2 or 4 and head_dim a multiple of 4, got {bits}, {hd}")
    ng = -(-hd // 32)
    bb = bs * hd * bits // 8 + 4 * (hd if is_key else bs * ng)
    x = x.contiguous()
    out = torch.empty((N, KVH, bb), dtype=torch.uint8)
    if N:
        _k().lowbit_quantize(x.data_ptr(), N, KVH, bs, hd, bits, int(is_key), int(x.dtype == torch.bfloat16),
                             out.data_ptr(), _threads(x.numel() * 8, N * KVH))
    return out


def lowbit_dequantize(data: torch.Tensor, blocks: torch.Tensor, bits: int, is_key: bool, block_size: int,
                      head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Full blocks of a 2-/4-bit pool dequantized in C: the values of
    :func:`kvserve.worker.kv_quant_lowbit.dequantize_blocks` of ``data[blocks]``, bit for bit
    (``code · scale + zero`` in float32, one rounding to ``dtype``), without its intermediate
    tensors.

    Args:
        data: ``[num_blocks, num_kv_heads, block_bytes]`` uint8 contiguous (a pool's ``data``).
        blocks: ``[N]`` int64 block ids, each in ``[0, num_blocks)``.
        bits, is_key, block_size, head_dim: the pool's format (:class:`kvserve.worker.kv_quant_lowbit.LowBitPool`).
        dtype: float32 or bfloat16.

    Returns:
        ``[N, block_size, num_kv_heads, head_dim]`` of ``dtype``.

    Raises:
        ValueError: unsupported here (:func:`lowbit_dequantize_supported`), or a block id out of range.
    """
    if not lowbit_dequantize_supported(data, dtype):
        raise ValueError(f"lowbit_dequantize: unsupported here (device {data.device}, dtype {dtype})")
    blocks = blocks.to(torch.int64).contiguous()
    N, KVH = blocks.numel(), data.shape[1]
    if N and (int(blocks.min()) < 0 or int(blocks.max()) >= data.shape[0]):
        raise ValueError(f"lowbit_dequantize: blocks must be in [0, {data.shape[0]})")
    out = torch.empty((N, block_size, KVH, head_dim), dtype=dtype)
    if N:
        _k().lowbit_dequantize(data.contiguous().data_ptr(), blocks.data_ptr(), N, KVH, block_size, head_dim, bits,
                               int(is_key), out.data_ptr(), int(dtype == torch.bfloat16),
                               _threads(out.numel(), N * KVH))
    return out


def paged_attention_decode_lowbit(q: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor, k_residual: torch.Tensor,
                                  v_residual: torch.Tensor, residual_map: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float, bits: int,
                                  out: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Decode attention (one new token per sequence) over 2-/4-bit pools (KIVI,
    :mod:`kvserve.worker.kv_quant_lowbit`): for each sequence and KV head the C kernel dequantizes
    the full blocks (``code · scale + zero`` in float32, rounded to ``q.dtype``; K per channel, V per
    token and group of 32 channels) and copies the partial ones from their residual slot into a
    per-thread buffer, then runs the same attention as :func:`paged_attention_decode` over it
    (GQA, exact float32 softmax; with ``window``, over the last ``window`` keys only, the blocks
    before the window's first one never read). :func:`paged_attention_decode_pools` takes the
    :class:`~kvserve.worker.kv_quant_lowbit.LowBitPool` s.

    Args:
        q: ``[D, num_heads, head_dim]`` float32 or bfloat16, heads and values contiguous in a row.
        k_data, v_data: ``[num_blocks, num_kv_heads, block_bytes]`` uint8 contiguous (the pools' full blocks).
        k_residual, v_residual: ``[R, block_size, num_kv_heads, head_dim]`` in ``q.dtype``, contiguous.
        residual_map: ``[num_blocks]`` int64, the step's read map
            (:func:`kvserve.worker.kv_quant_lowbit.read_map`): a slot for partial blocks, ``-1`` for full ones.
        block_tables: ``[D, max_blocks]`` int64, unit last stride.
        context_lens: ``[D]`` int64, tokens to attend to (≥ 1, the new one's K/V written).
        scale: softmax scale.
        bits: 4 or 2.
        out: optional ``[D, num_heads, head_dim]`` destination (heads contiguous in a row).
        window: a sliding window (tokens, ≥ 1), or None for all keys.

    Returns:
        ``out`` (or a new tensor) ``[D, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: a dtype other than float32/bfloat16, a residual in another dtype, ``bits`` not 2 or 4,
            a ``window`` below 1.
        MemoryError: a work buffer could not be allocated.
    """
    if q.dtype not in (torch.float32, torch.bfloat16) or k_residual.dtype != q.dtype or v_residual.dtype != q.dtype:
        raise ValueError(f"paged_attention_decode_lowbit: q and the residuals must be float32 or bfloat16 alike, got "
                         f"{q.dtype}, {k_residual.dtype}, {v_residual.dtype}")
    if bits not in (2, 4):
        raise ValueError(f"paged_attention_decode_lowbit: bits must be 2 or 4, got {bits}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention_decode_lowbit: window must be ≥ 1 or None, got {window}")
    D, H, hd = q.shape
    if out is None:
        out = torch.empty_like(q)
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    ctx = context_lens.contiguous()
    rmap = residual_map.contiguous()
    KVH, bs = k_data.shape[1], k_residual.shape[1]
    maxL = int(ctx.max()) if D else 0
    if window is not None:
        maxL = min(maxL, window + bs - 1)  # (keys read from the window's first block on)
    nthreads = torch.get_num_threads() if D * KVH * maxL * hd >= _PARALLEL_MIN_ELEMENTS else 1
    rc = _k().paged_attention_decode_lowbit(
        q.data_ptr(), q.stride(0), k_data.data_ptr(), v_data.data_ptr(), k_residual.data_ptr(), v_residual.data_ptr(),
        rmap.data_ptr(), bt.data_ptr(), bt.stride(0), ctx.data_ptr(), out.data_ptr(), out.stride(0), D, H, KVH, hd, bs,
        float(scale), window or 0, bits, int(q.dtype == torch.bfloat16), nthreads)
    if rc:
        raise MemoryError("paged_attention_decode_lowbit: a work buffer could not be allocated")
    return out


def paged_attention_decode_pools(q: torch.Tensor, k_cache, v_cache, residual_map: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 out: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """:func:`paged_attention_decode_lowbit` on a layer's K and V
    :class:`~kvserve.worker.kv_quant_lowbit.LowBitPool` s.

    Raises:
        ValueError: as :func:`paged_attention_decode_lowbit`.
    """
    return paged_attention_decode_lowbit(q, k_cache.data, v_cache.data, k_cache.residual, v_cache.residual,
                                         residual_map, block_tables, context_lens, scale, k_cache.bits, out, window)


# --------------------------------------------------------------------------------------

_Tensor = torch.Tensor
#: The functions the ops run, bound now (an op keeps running the kernel even if a test or a
#: benchmark replaces the module attribute, e.g. by the op itself).
_py = types.SimpleNamespace(
    rms_norm=rms_norm, silu_and_mul=silu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul, log_sum_exp=log_sum_exp,
    apply_token_bitmask_=apply_token_bitmask_, greedy=_greedy, rope_=rope_, gemma_rms_norm=gemma_rms_norm,
    gemma_add_rms_norm_=gemma_add_rms_norm_, gemma_qk_norm_rope_=gemma_qk_norm_rope_,
    reshape_and_cache=reshape_and_cache, paged_attention_decode=paged_attention_decode,
    paged_attention_prefill=paged_attention_prefill, paged_attention_decode_lowbit=paged_attention_decode_lowbit,
    prefill_ranges=prefill_ranges, lowbit_quantize=lowbit_quantize, lowbit_dequantize=lowbit_dequantize,
    probe_colsum=probe_colsum)


@torch.library.custom_op("kvserve::rms_norm", mutates_args=("residual",), device_types="cpu")
def _rms_norm_op(x: _Tensor, weight: _Tensor, eps: float, residual: Optional[_Tensor]) -> _Tensor:
    return _py.rms_norm(x, weight, eps, residual)


@_rms_norm_op.register_fake
def _(x, weight, eps, residual):
    return x.new_empty(x.shape)


@torch.library.custom_op("kvserve::silu_and_mul", mutates_args=(), device_types="cpu")
def _silu_and_mul_op(x: _Tensor) -> _Tensor:
    return _py.silu_and_mul(x)


@_silu_and_mul_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("kvserve::gelu_tanh_and_mul", mutates_args=(), device_types="cpu")
def _gelu_tanh_and_mul_op(x: _Tensor) -> _Tensor:
    return _py.gelu_tanh_and_mul(x)


@_gelu_tanh_and_mul_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("kvserve::log_sum_exp", mutates_args=(), device_types="cpu")
def _log_sum_exp_op(x: _Tensor, row_max: _Tensor) -> _Tensor:
    return _py.log_sum_exp(x, row_max)


@_log_sum_exp_op.register_fake
def _(x, row_max):
    return x.new_empty((x.shape[0], 1))


@torch.library.custom_op("kvserve::apply_token_bitmask_", mutates_args=("x",), device_types="cpu")
def _apply_token_bitmask_op(x: _Tensor, bitmask: _Tensor, rows: Optional[_Tensor]) -> None:
    _py.apply_token_bitmask_(x, bitmask, rows)


@_apply_token_bitmask_op.register_fake
def _(x, bitmask, rows):
    return None


@torch.library.custom_op("kvserve::greedy", mutates_args=(), device_types="cpu")
def _greedy_op(logits: _Tensor) -> tuple[_Tensor, _Tensor, _Tensor]:
    """:func:`greedy` without its None: ``(tokens, row_max, log_z)``, tokens -1 in rows whose
    maximum is not finite."""
    return _py.greedy(logits)


@_greedy_op.register_fake
def _(logits):
    M = logits.shape[0]
    return (logits.new_empty(M, dtype=torch.int64), logits.new_empty(M, dtype=torch.float32),
            logits.new_empty(M, dtype=torch.float32))


@torch.library.custom_op("kvserve::rope_", mutates_args=("x",), device_types="cpu")
def _rope_op(x: _Tensor, num_heads: int, head_dim: int, positions: _Tensor, cos: _Tensor, sin: _Tensor) -> None:
    _py.rope_(x, num_heads, head_dim, positions, cos, sin)


@_rope_op.register_fake
def _(x, num_heads, head_dim, positions, cos, sin):
    return None


@torch.library.custom_op("kvserve::gemma_rms_norm", mutates_args=(), device_types="cpu")
def _gemma_rms_norm_op(x: _Tensor, weight: _Tensor, eps: float) -> _Tensor:
    return _py.gemma_rms_norm(x, weight, eps)


@_gemma_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("kvserve::gemma_add_rms_norm_", mutates_args=("residual",), device_types="cpu")
def _gemma_add_rms_norm_op(x: _Tensor, weight: _Tensor, residual: _Tensor, eps: float,
                           next_weight: Optional[_Tensor]) -> _Tensor:
    """:func:`gemma_add_rms_norm_`; without ``next_weight`` it returns an empty ``[0, dim]``
    tensor instead of None (an op's outputs cannot be optional)."""
    out = _py.gemma_add_rms_norm_(x, weight, residual, eps, next_weight)
    return x.new_empty((0, x.shape[1])) if out is None else out


@_gemma_add_rms_norm_op.register_fake
def _(x, weight, residual, eps, next_weight):
    return x.new_empty((0 if next_weight is None else x.shape[0], x.shape[1]))


@torch.library.custom_op("kvserve::gemma_qk_norm_rope_", mutates_args=("qkv",), device_types="cpu")
def _gemma_qk_norm_rope_op(qkv: _Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: _Tensor,
                           k_weight: _Tensor, eps: float, positions: _Tensor, cos: _Tensor, sin: _Tensor) -> None:
    _py.gemma_qk_norm_rope_(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, positions, cos, sin)


@_gemma_qk_norm_rope_op.register_fake
def _(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, positions, cos, sin):
    return None


@torch.library.custom_op("kvserve::reshape_and_cache", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def _reshape_and_cache_op(k: _Tensor, v: _Tensor, k_cache: _Tensor, v_cache: _Tensor, slot_mapping: _Tensor) -> None:
    _py.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


@_reshape_and_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


@torch.library.custom_op("kvserve::paged_attention_decode", mutates_args=("out",), device_types="cpu")
def _paged_attention_decode_op(q: _Tensor, k_cache: _Tensor, v_cache: _Tensor, block_tables: _Tensor,
                               context_lens: _Tensor, scale: float, out: _Tensor, max_context_len: Optional[int],
                               window: Optional[int]) -> None:
    """:func:`paged_attention_decode` into ``out`` (an op cannot return an alias of an input)."""
    _py.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len, window)


@_paged_attention_decode_op.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len, window):
    return None


@torch.library.custom_op("kvserve::paged_attention_prefill", mutates_args=("out",), device_types="cpu")
def _paged_attention_prefill_op(q: _Tensor, k_cache: _Tensor, v_cache: _Tensor, block_tables: _Tensor,
                                chunks: _Tensor, scale: float, out: _Tensor) -> None:
    _py.paged_attention_prefill(q, k_cache, v_cache, block_tables, chunks, scale, out)


@_paged_attention_prefill_op.register_fake
def _(q, k_cache, v_cache, block_tables, chunks, scale, out):
    return None


@torch.library.custom_op("kvserve::paged_attention_decode_lowbit", mutates_args=("out",), device_types="cpu")
def _paged_attention_decode_lowbit_op(q: _Tensor, k_data: _Tensor, v_data: _Tensor, k_residual: _Tensor,
                                      v_residual: _Tensor, residual_map: _Tensor, block_tables: _Tensor,
                                      context_lens: _Tensor, scale: float, bits: int, out: _Tensor,
                                      window: Optional[int] = None) -> None:
    _py.paged_attention_decode_lowbit(q, k_data, v_data, k_residual, v_residual, residual_map, block_tables,
                                      context_lens, scale, bits, out, window)


@_paged_attention_decode_lowbit_op.register_fake
def _(q, k_data, v_data, k_residual, v_residual, residual_map, block_tables, context_lens, scale, bits, out,
      window=None):
    return None


@torch.library.custom_op("kvserve::prefill_ranges", mutates_args=("out",), device_types="cpu")
def _prefill_ranges_op(q: _Tensor, k_d: _Tensor, v_d: _Tensor, k_f: _Tensor, v_f: _Tensor, ranges: _Tensor,
                       scale: float, out: _Tensor) -> None:
    """:func:`prefill_ranges` into ``out``."""
    _py.prefill_ranges(q, k_d, v_d, k_f, v_f, ranges, scale, out)


@_prefill_ranges_op.register_fake
def _(q, k_d, v_d, k_f, v_f, ranges, scale, out):
    return None


@torch.library.custom_op("kvserve::lowbit_quantize", mutates_args=(), device_types="cpu")
def _lowbit_quantize_op(x: _Tensor, bits: int, is_key: bool) -> _Tensor:
    return _py.lowbit_quantize(x, bits, is_key)


@_lowbit_quantize_op.register_fake
def _(x, bits, is_key):
    N, bs, KVH, hd = x.shape
    return x.new_empty((N, KVH, bs * hd * bits // 8 + 4 * (hd if is_key else bs * -(-hd // 32))), dtype=torch.uint8)


@torch.library.custom_op("kvserve::lowbit_dequantize", mutates_args=(), device_types="cpu")
def _lowbit_dequantize_op(data: _Tensor, blocks: _Tensor, bits: int, is_key: bool, block_size: int, head_dim: int,
                          dtype: torch.dtype) -> _Tensor:
    return _py.lowbit_dequantize(data, blocks, bits, is_key, block_size, head_dim, dtype)


@_lowbit_dequantize_op.register_fake
def _(data, blocks, bits, is_key, block_size, head_dim, dtype):
    return data.new_empty((blocks.numel(), block_size, data.shape[1], head_dim), dtype=dtype)


@torch.library.custom_op("kvserve::probe_colsum", mutates_args=(), device_types="cpu")
def _probe_colsum_op(q: _Tensor, k_d: _Tensor, k_f: _Tensor, ranges: _Tensor, scale: float, num_cols: int,
                     f_offset: int = 0) -> _Tensor:
    return _py.probe_colsum(q, k_d, k_f, ranges, scale, num_cols, f_offset)


@_probe_colsum_op.register_fake
def _(q, k_d, k_f, ranges, scale, num_cols, f_offset=0):
    return q.new_empty((k_d.shape[1], num_cols), dtype=torch.float32)


#: The registered ops (``torch.ops.kvserve.<name>``), by the Python function each wraps.
OPS = ("rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "log_sum_exp", "apply_token_bitmask_", "greedy", "rope_",
       "gemma_rms_norm", "gemma_add_rms_norm_", "gemma_qk_norm_rope_", "reshape_and_cache", "paged_attention_decode",
       "paged_attention_prefill", "paged_attention_decode_lowbit", "prefill_ranges", "lowbit_quantize",
       "lowbit_dequantize", "probe_colsum")

