"""Linear layers: one interface (:class:`Linear`), the fastest measured kernel behind it.

A Llama-style model spends nearly all of its FLOPs and bytes in ``y = x @ W^T + b``. Which
kernel computes that best depends on how many tokens ``M`` share one pass over ``W``
(measured on a 2-core AVX-512/AMX Xeon, 2 threads; ``tests/worker/test_linear.py`` checks the numerics):

* **Decode (M <= 4 in bf16 with AMX; M <= 8 in float32)**: every weight is read for only a few tokens,
  so the limit is memory bandwidth (~30 GB/s here). Eager ``F.linear`` in bf16 reaches only
  ~9-14 GB/s on these shapes (oneDNN's bf16 GEMV path plus ~30 us of fixed cost per call).
  :func:`gemv` is a small C kernel (``csrc/cpu/gemv.c``, built at install): 4 weight rows per
  block, 4 input rows at once, software prefetch, float32 accumulation with AVX512-BF16
  ``VDPBF16PS`` (bf16) or FMA (float32), OpenMP over rows. It streams bf16 weights at ~22-28
  GB/s: about 2x eager bf16 for a whole decode step's linears; in float32 it is on par with MKL
  at M = 1 and 1.3-2x faster at M = 2-8.
* **Batched decode (5-64 tokens, bf16, CPUs with AMX-BF16)**: :func:`tile_linear`, a C kernel
  on AMX tiles (``TDPBF16PS``) over a weight packed once into tile layout, streams the weights
  1.1-1.9x faster than oneDNN at these sizes (see ``TILE_MAX_M_BF16``).
* **Every M (bf16, CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4)**: the same packed layout
  read as ``VDPBF16PS`` operands by register tiles of 4 rows x 96 columns (``kv_bf16p_linear``):
  faster than gemv from one token, 1.2-1.5x oneDNN's speed at 4-64 tokens on a 2-core EPYC,
  1.1-1.2x at 128-2048 alone and on par inside a prefill step (see ``TILE_MAX_M_BF16_NO_AMX``);
  gemv and oneDNN then serve only the weights it cannot take, and oneDNN keeps no copy of the
  others.
* **Prefill / batched decode (larger M)** is compute-bound: bf16 goes to oneDNN with the
  weight reordered once at load time (``torch.ops.mkldnn._reorder_linear_weight`` +
  ``_linear_pointwise``, the same prepacking inductor does with ``freezing=True``), 1.3-1.7x
  faster than ``F.linear`` at M = 32-1024 (AMX); float32 stays on ``F.linear`` (MKL), which
  prepacking does not beat.

* **GGUF-quantized weights** (``quantization="gguf"``, the default for GGUF files, and
  ``"gguf_int8"``): the weight stays in its file's quantization, repacked at load
  (:mod:`kvserve.worker.layers.quant`, ``csrc/cpu/qgemv.c``), ~3.5x fewer bytes per decode step
  than bf16 for Q4_1; small M on the quantized kernels (weight-only up to ``QGEMV_WO_MAX_M``,
  int8 activations up to ``QGEMV_MAX_M``), larger M on ``F.linear`` over row chunks dequantized
  into a scratch buffer (:func:`chunked_linear`).
* **int4 of float weights** (``quantization="int4"``, ``"int4_g16"`` ... ``"int4_g256"``):
  group-wise asymmetric int4 (gpt-fast, torchao) quantized at load
  (:func:`~kvserve.worker.layers.quant.quantize_int4`) into the same layout, on the same
  weight-only kernel and chunked path.

Numerics: all paths accumulate in float32 and round once, like oneDNN and MKL; only the order
of the additions differs, so bf16 results match ``F.linear`` to within one bf16 ulp (in
practice bit for bit) and float32 results to ~1e-6 relative. Weight-only int8
(``quantization="int8"``) changes the model's numbers and is therefore opt-in, never a default.

Everything falls back to plain ``F.linear`` where a fast path is unavailable: CUDA or other
devices, CPUs without AVX-512 (bf16 gemv needs AVX512_BF16), an install that built no kernels,
autograd, or the environment variable ``KVSERVE_DISABLE_CPU_KERNELS=1``. Under
``torch.compile`` the gemv kernels are custom ops (``torch.ops.kvserve.cpu_gemv``) and large M
uses ``F.linear``.

Sources: memory-bound decode and weight-only int8 as in gpt-fast (pytorch-labs/gpt-fast,
``quantize.py``) and llama.cpp's CPU matmul (``ggml-cpu``); prepacked oneDNN weights as in
inductor's ``mkldnn_fusion.py`` (freezing); ``VDPBF16PS`` per the Intel Intrinsics Guide
(``_mm512_dpbf16_ps``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import cpu_flags, load_library
from kvserve.worker.layers.quant import (INT4_GROUP_SIZES, GGUFWeight, PackedWeight, dequantize_packed, dequantize_rows,
                                        pack_gguf, q_kernels, qlinear, quantize_activations, quantize_int4,
                                        weight_only_available)

#: Largest number of tokens (rows of ``x``) sent to the bf16 gemv kernel on CPUs with AMX;
#: above it the AMX kernel runs (measured crossover: gemv faster at M <= 4 on every model shape,
#: oneDNN faster on the large ones from M = 8).
GEMV_MAX_M_BF16 = 4
#: The same on CPUs with AVX512_BF16 but no AMX, for the weights the tile kernel cannot take
#: (``N % 16`` or ``K % 32`` not 0; the others run on it from one token, see
#: ``TILE_MAX_M_BF16_NO_AMX``), with oneDNN above it. Measured 2026-12-04 (2-core AMD EPYC,
#: SmolLM2's linears x 30 layers plus the LM head, 269 MB of bf16 weights, so from DRAM; ms per
#: decode step's linears, gemv / oneDNN): 11.5 / 18.0 at 1 token, 11.5 / 16.6 at 2, 17.8 / 11.7
#: at 4, 31.8 / 18.3 at 16 (on 2026-12-03, on what may have been another host: gemv ahead up to 16).
GEMV_MAX_M_BF16_NO_AMX = 2
#: Same for float32 (gemv faster than MKL up to M = 8 on every model shape, mixed at 16).
GEMV_MAX_M_F32 = 8
#: Largest number of tokens sent to the tile kernel (:func:`tile_linear`) when the CPU has
#: AMX-BF16 (the AMX kernel; oneDNN above it). Measured with DRAM-resident weights (SmolLM2
#: shapes): 1.3-1.9x oneDNN's speed at 5-32 tokens, 1.1-1.3x at 48-64, on par at 96, slower from
#: 128; SmolLM2 decode steps of 16-64 sequences took 1.4-1.8x less time with it.
TILE_MAX_M_BF16 = 64
#: Without AMX the AVX512-BF16 tile kernel takes every M, from one token to prefill (no gemv),
#: and no oneDNN copy of the weight is made (``backend="onednn"`` still asks for one). Measured
#: 2026-12-04 (2-core AMD EPYC, SmolLM2's linears x 30 layers plus the LM head, from DRAM; tile
#: kernel / oneDNN / gemv, ms per step's linears): 9.1 / 18.0 / 11.5 at 1 token, 7.8 / 11.7 / 17.8
#: at 4, 9.7 / 15.5 / 22.2 at 8, 14.1 / 18.3 / 31.8 at 16; GFLOP/s tile kernel / oneDNN: 340 /
#: 287 at 32 tokens, 387 / 318 at 64, 409 / 375 at 128, 412 / 372 at 512, 412 / 351 at 2048 (this
#: machine's bf16 matmul peak as ``kvserve.roofline`` measures it: ~410-430). In the C decode
#: step one stream decoded at 122.8-141.6 tok/s on it against 115.0-120.4 on gemv's one-region
#: team path (interleaved runs). As every row's result then comes from the same kernel whatever
#: the batch, a request's bf16 outputs do not depend on the requests batched with it.
TILE_MAX_M_BF16_NO_AMX = 1 << 62
#: Same for weight-only int8 (above it the weight is dequantized per call and GEMM runs).
GEMV_MAX_M_INT8 = 16
#: Largest M sent to the int8-activation kernel on GGUF-quantized weights (``gguf_int8``,
#: :func:`quant.qlinear`); above it the weight is dequantized in chunks of rows and the float
#: matmul runs on each (``benchmarks/gguf_quant.py`` measures the crossover).
QGEMV_MAX_M = 64
#: Same for the weight-only kernel (``gguf``, float activations). Above 4 tokens it dequantizes
#: each group of 4 weight rows once into a scratch buffer; measured 2026-12-03 (AMD EPYC, 2
#: threads, SmolLM2's shapes in Q4_1 from DRAM, bf16 activations) 1.2-3.8x faster than the
#: chunked path at every M from 4 to 64; again 2026-12-03 10:40 (SmolLM2's four linear shapes
#: summed, quiet, best of 20): 1.23-1.45x at 64 tokens, 1.15-1.27x at 96 for Q4_0, Q4_1, Q8_0 and
#: Q6_K, 0.85-1.18x at 128, 0.95-1.12x at 160.
QGEMV_WO_MAX_M = 96
#: Bytes of one dequantized chunk of a GGUF-quantized weight (the scratch buffer, shared by all layers).
QCHUNK_BYTES = 1 << 21

BACKENDS = ("auto", "eager", "gemv", "onednn")
QUANTIZATIONS = (None, "int8", "gguf", "gguf_int8", *INT4_GROUP_SIZES)
#: The quantizations that keep GGUF-quantized weights quantized.
GGUF_QUANTIZATIONS = ("gguf", "gguf_int8")


# --------------------------------------------------------------------------------------
# The C kernels (csrc/cpu/gemv.c), built at install time
# --------------------------------------------------------------------------------------

#: Weights smaller than this many elements run on one thread (waking a second one costs more).
_PARALLEL_MIN_ELEMENTS = 1 << 15


class _Kernels:
    """ctypes handles of the C kernels and which of them this CPU may run."""

    def __init__(self, lib: ctypes.CDLL, flags: frozenset[str]) -> None:
        i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self.f32 = lib.kv_gemv_f32
        self.bf16 = lib.kv_gemv_bf16
        self.i8 = lib.kv_gemv_i8
        for fn in (self.f32, self.bf16):
            fn.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, c_int]
            fn.restype = None
        self.i8.argtypes = [vp, i64, vp, vp, vp, vp, i64, c_int, i64, i64, i64, c_int]
        self.i8.restype = None
        self.amx_pack = lib.kv_amx_pack
        self.amx_pack.argtypes = [vp, i64, i64, vp]
        self.amx_pack.restype = None
        self.amx_linear = lib.kv_amx_linear
        self.bf16p_linear = lib.kv_bf16p_linear
        for fn in (self.amx_linear, self.bf16p_linear):
            fn.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, c_int]
            fn.restype = c_int
        self.has_f32 = {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags
        self.has_bf16 = self.has_f32 and "avx512_bf16" in flags
        self.has_amx = (self.has_bf16 and {"amx_tile", "amx_bf16", "avx512dq"} <= flags
                        and bool(lib.kv_amx_init()))
        #: the kernel :func:`tile_linear` runs on a weight packed by :func:`tile_pack`: AMX
        #: tiles where the CPU has them, else AVX512-BF16 dot products (same layout, same arguments)
        self.tile_kernel = "amx" if self.has_amx else "avx512bf16"
        self.tile_linear = self.amx_linear if self.has_amx else self.bf16p_linear


@functools.lru_cache(maxsize=None)
def cpu_kernels() -> Optional[_Kernels]:
    """Load the gemv kernels (``csrc/cpu/gemv.c``, built at install; see
    :func:`kvserve.kernels.load_library`).

    Returns None where they cannot be used (see :mod:`kvserve.kernels`).
    """
    lib = load_library("gemv")
    return None if lib is None else _Kernels(lib, cpu_flags())


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether oneDNN prepacked linear ops exist in this torch build (CPU, bf16 capable)."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """Reorder ``weight [N, K]`` (bf16 or float32, CPU) once into oneDNN's blocked layout.

    The result is an opaque MKLDNN tensor for :func:`onednn_linear`, packed for any batch
    size (``batch_size=None``); it is a second copy of the weight.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` on a weight prepacked by :func:`onednn_pack`; ``x [M, K]`` -> ``[M, N]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` for a few rows, on the C kernel (CPU, bf16 or float32, contiguous weight).

    Args:
        x: ``[M, K]`` with unit stride in the last dimension; same dtype as ``weight``.
        weight: ``[N, K]`` contiguous, float32 or bfloat16, on the CPU.
        bias: optional ``[N]`` contiguous, same dtype.

    Returns:
        ``[M, N]`` in ``x.dtype`` (float32 accumulation, one rounding).

    Raises:
        RuntimeError: if the kernel for this dtype is not available (see :func:`cpu_kernels`).
    """
    k = cpu_kernels()
    M, K = x.shape
    N = weight.shape[0]
    if x.dtype == torch.bfloat16 and k is not None and k.has_bf16:
        fn = k.bf16
    elif x.dtype == torch.float32 and k is not None and k.has_f32:
        fn = k.f32
    else:
        raise RuntimeError(f"no CPU gemv kernel for {x.dtype} on this machine")
    y = x.new_empty((M, N))
    nt = torch.get_num_threads() if N * K >= _PARALLEL_MIN_ELEMENTS else 1
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), N,
       M, N, K, nt)
    return y


def tiles_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`tile_linear` can run ``weight``: bf16 CPU weight ``[N, K]`` with
    ``N % 16 == 0`` and ``K % 32 == 0``, on a CPU with AVX512-BF16 (AMX-BF16 or not; the
    kernels built)."""
    k = cpu_kernels()
    return (k is not None and k.has_bf16 and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.shape[0] > 0)


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack ``weight [N, K]`` (bf16, see :func:`tiles_supported`) for :func:`tile_linear`: a
    flat bf16 tensor of ``N·K`` elements laid out ``[N/16][K/32][16 k-pairs][16 columns][2]``,
    AMX's B tiles and, read as one run of ``K/2`` vectors per 16 columns, the B operand of
    ``VDPBF16PS`` (a second copy of the weight).

    Raises:
        ValueError: a weight :func:`tiles_supported` rejects (naming its shape and dtype).
    """
    if not tiles_supported(weight):
        raise ValueError(f"tile_pack needs a bf16 CPU weight [N, K] with N % 16 == 0 and K % 32 == 0 on a CPU "
                         f"with AVX512-BF16, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.contiguous()
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    cpu_kernels().amx_pack(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def tile_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with a weight packed by :func:`tile_pack`, for batched decode: on AMX tiles
    (``kv_amx_linear``) where the CPU has AMX-BF16, else on AVX512-BF16 register tiles of 4
    rows x 96 columns (``kv_bf16p_linear``, ``csrc/cpu/gemv.c``).

    Args:
        x: ``[M, K]`` bf16 with unit last stride.
        packed: the packed weight of ``[out_features, K]``.
        out_features: ``N``.
        bias: optional ``[N]`` bf16 contiguous.

    Returns:
        ``[M, N]`` bf16: float32 accumulation, bias added in float32, one rounding (RNE); each
        row's values do not depend on the other rows or on ``M``.

    Raises:
        MemoryError: if a work buffer cannot be allocated (AMX).
    """
    M, K = x.shape
    y = x.new_empty((M, out_features))
    nt = torch.get_num_threads() if out_features * K >= _PARALLEL_MIN_ELEMENTS else 1
    if cpu_kernels().tile_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), _ptr(bias), y.data_ptr(),
                                 out_features, M, out_features, K, nt):
        raise MemoryError("tile_linear: could not allocate work buffers")
    return y


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only int8 ``(x @ qweight^T) * scale + bias`` on the C kernel.

    Args:
        x: ``[M, K]`` float32 or bfloat16, unit stride in the last dimension.
        qweight: ``[N, K]`` int8, contiguous.
        scale: ``[N]`` float32 per-output-channel scales.
        bias: optional ``[N]`` float32.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    k = cpu_kernels()
    if k is None or not k.has_f32:
        raise RuntimeError("no CPU int8 gemv kernel on this machine")
    M, K = x.shape
    N = qweight.shape[0]
    xf = x.float() if x.dtype != torch.float32 else x
    y = x.new_empty((M, N))
    nt = torch.get_num_threads() if N * K >= _PARALLEL_MIN_ELEMENTS else 1
    k.i8(xf.data_ptr(), xf.stride(0), qweight.data_ptr(), scale.data_ptr(), _ptr(bias), y.data_ptr(), N,
         int(x.dtype == torch.bfloat16), M, N, K, nt)
    return y


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization (gpt-fast's ``WeightOnlyInt8``).

    Args:
        weight: ``[N, K]`` float tensor.

    Returns:
        ``(qweight [N, K] int8, scale [N] float32)`` with ``weight ≈ qweight * scale[:, None]``
        and ``|qweight| <= 127``.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


_scratch: dict[torch.dtype, torch.Tensor] = {}


def chunked_linear(x: torch.Tensor, p: PackedWeight, bias: Optional[torch.Tensor] = None,
                   int8: bool = False) -> torch.Tensor:
    """``x @ w^T + bias`` for many tokens on a GGUF-quantized weight, with the numbers of
    :func:`~kvserve.worker.layers.quant.qlinear`: the weight is dequantized ``QCHUNK_BYTES`` at
    a time (rows) into one scratch buffer shared by all layers (never a whole dequantized
    copy), and each chunk goes through ``F.linear``. Weight-only (``int8=False``): chunks in
    ``x.dtype`` (float32, or bf16 rounded as the kernel rounds them), so both paths multiply
    the same values with float32 sums (oneDNN/MKL here). ``int8``: ``x`` is first quantized to
    int8 per block of 32 exactly as the kernel does and dequantized (``s · q``), and the chunks
    are float32. Either way prefill and decode differ only in the order of float32 additions
    (as gemv against oneDNN for bf16 weights).

    Args:
        x: ``[M, K]`` float32 or bfloat16 (other dtypes compute in float32).
        p: the packed weight ``[N, K]``.
        bias: optional ``[N]`` float32.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    n, k = p.shape
    if int8:
        q, s = quantize_activations(x)
        xc, dt = (q.view(-1, k // 32, 32).float() * s.unsqueeze(-1)).view(-1, k), torch.float32
    else:
        dt = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        xc = x.to(dt)
    rows = max(16, QCHUNK_BYTES // (k * torch.finfo(dt).bits // 8) // 16 * 16)
    y = torch.empty((x.shape[0], n), dtype=dt)
    buf = _scratch.get(dt)
    if buf is None or buf.numel() < min(rows, n) * k:
        buf = _scratch[dt] = torch.empty(min(rows, n) * k, dtype=dt)
    for r0 in range(0, n, rows):
        cnt = min(rows, n - r0)
        w = dequantize_rows(p, r0, cnt, dt, out=buf)
        if cnt == n:
            torch.matmul(xc, w.t(), out=y)
        else:
            y[:, r0:r0 + cnt] = F.linear(xc, w)
    if bias is not None:
        y += bias.to(dt)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------
# torch.compile support: the kernels as custom ops (the ctypes call itself is opaque to Dynamo)
# --------------------------------------------------------------------------------------

@torch.library.custom_op("kvserve::cpu_gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return gemv(x, weight, bias)


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("kvserve::cpu_gemv_int8", mutates_args=())
def _gemv_int8_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    return gemv_int8(x, qweight, scale, bias)


@_gemv_int8_op.register_fake
def _(x, qweight, scale, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------

class Linear(nn.Module):
    """``y = x @ weight^T + bias`` with the kernel chosen per call from the number of tokens.

    Args:
        weight: ``[out_features, in_features]`` (the ``nn.Linear`` layout), float32 or bfloat16
            (any dtype ``F.linear`` takes on the eager path), on any device; or None, for a layer
            whose weight comes later (:meth:`set_weight`; the tensor-parallel layers of
            :mod:`kvserve.worker.layers.parallel_linear` set their shard so).
        bias: optional ``[out_features]``, same dtype and device.
        quantization: ``None`` (default: the weight is used as given and results match
            ``F.linear``) or ``"int8"``: weight-only symmetric per-output-channel int8
            (a quarter of the fp32 bytes, half of bf16; activations stay in the model dtype).
            It changes the model's outputs, so it is only used on request. ``"gguf"``: a
            GGUF-quantized weight (:class:`~kvserve.worker.layers.quant.GGUFWeight`, or a list
            of them: the row blocks of a fused layer) is kept quantized in the kernel layout
            (:func:`~kvserve.worker.layers.quant.pack_gguf`) and run on the weight-only
            :func:`~kvserve.worker.layers.quant.qlinear` for up to ``QGEMV_WO_MAX_M`` tokens
            (the dequantized model's numbers), else dequantized ``QCHUNK_BYTES`` at a time into
            a scratch buffer for ``F.linear`` (:func:`chunked_linear`); a float weight given to
            such a layer is used as with ``None``. ``"gguf_int8"``: the same with int8
            activations (llama.cpp's arithmetic, AVX512-VNNI; up to ``QGEMV_MAX_M`` tokens;
            numbers within :func:`~kvserve.worker.layers.quant.activation_error_bound`).
            ``"int4"`` (groups of 32) and ``"int4_g16"``, ``"int4_g64"``, ``"int4_g128"``,
            ``"int4_g256"``: a float weight is quantized at load to group-wise asymmetric int4
            (:func:`~kvserve.worker.layers.quant.quantize_int4`; ``in_features`` must be a
            multiple of the group size) and run as a GGUF-quantized weight with ``"gguf"``
            (weight-only); off the CPU the int4 values are dequantized back into a float
            weight (int4's numbers, not its memory).
        backend: where the fast paths apply (CPU, float32/bfloat16, no autograd):

            * ``"auto"`` (default): gemv kernel for ``M <= GEMV_MAX_M_*`` tokens; in bf16 on
              CPUs with AVX512-BF16 the tile kernel (:func:`tile_linear`: AMX or AVX512-BF16)
              up to ``TILE_MAX_M_BF16`` tokens (a packed copy of the weight); above that oneDNN prepacked for bf16 (another packed copy) and
              ``F.linear`` for float32.
            * ``"gemv"``: gemv for small M, ``F.linear`` above (no extra memory).
            * ``"onednn"``: oneDNN prepacked for every M.
            * ``"eager"``: always ``F.linear``.

            Anything unavailable on this machine degrades to ``F.linear``.

    Attributes:
        backend: what was resolved: the kernels in use joined by ``+`` (``"gemv+amx+onednn"``,
            ``"gemv+onednn"``, ``"gemv"``, ``"onednn"``) or ``"eager"``.

    Shapes: ``forward(x [..., in_features]) -> [..., out_features]`` in ``x.dtype``.

    Raises:
        ValueError: on a malformed weight/bias, unknown backend or quantization.
    """

    def __init__(self, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 quantization: Optional[str] = None, backend: str = "auto") -> None:
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.quantization = quantization
        self.requested_backend = backend
        self.out_features = self.in_features = 0
        self.weight = self.bias = None
        self._packed = self._tiles = None
        self._tile_max_m = 0
        self.qpacked = None  # quant.PackedWeight of a GGUF-quantized weight
        self._gemv_max_m = 0
        self.backend = "eager"
        if weight is not None:
            self.set_weight(weight, bias)
        elif bias is not None:
            raise ValueError("a bias needs a weight")

    def set_weight(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Use ``weight [out_features, in_features]`` and ``bias [out_features]`` (or None): kept as
        given (contiguous), int8-quantized if the layer is, and packed for the kernels of the
        layer's backend. Called once, by the constructor or by the loader of a layer built
        without its weight.

        Raises:
            ValueError: a weight that is not 2-D, a bias of the wrong shape.
        """
        if isinstance(weight, (GGUFWeight, list, tuple)):
            self.set_gguf_weight(list(weight) if isinstance(weight, (list, tuple)) else [weight], bias)
            return
        self.qpacked = None
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        backend, quantization = self.requested_backend, self.quantization
        if quantization in INT4_GROUP_SIZES:
            g = INT4_GROUP_SIZES[quantization]
            if weight.shape[1] % g:
                raise ValueError(f"quantization={quantization!r}: the layer's in_features ({weight.shape[1]}) must be "
                                 f"a multiple of the int4 group size {g}")
            packed = quantize_int4(weight, g)
            if weight.is_cpu:
                self.set_gguf_weight([], bias, packed=packed)
                return
            weight = dequantize_packed(packed).to(device=weight.device, dtype=weight.dtype)
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self._packed: Optional[torch.Tensor] = None  # oneDNN layout; not a buffer (opaque tensor)
        self._tiles: Optional[torch.Tensor] = None  # tile layout (tile_pack)
        self._tile_max_m = 0  # the tile kernel runs up to this many tokens
        if quantization == "int8":
            q, scale = quantize_int8(weight)
            self.weight = None
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)  # float32 [N]
            self.register_buffer("bias_f32", None if bias is None else bias.float().contiguous())
            k = cpu_kernels()
            self._gemv_max_m = GEMV_MAX_M_INT8 if weight.is_cpu and backend != "eager" and k is not None and k.has_f32 else 0
            self.backend = "gemv" if self._gemv_max_m else "eager"
            return
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self._gemv_max_m = self._gemv_limit(backend, weight)
        k = cpu_kernels()
        if backend == "auto" and tiles_supported(self.weight):
            self._tiles = tile_pack(self.weight)
            self._tile_max_m = TILE_MAX_M_BF16 if k.has_amx else TILE_MAX_M_BF16_NO_AMX
            if not k.has_amx:
                self._gemv_max_m = 0  # the tile kernel from one token on (see TILE_MAX_M_BF16_NO_AMX)
        if backend in ("auto", "onednn") and weight.is_cpu and onednn_available() and (
                weight.dtype == torch.bfloat16 or (backend == "onednn" and weight.dtype == torch.float32)) \
                and self._tile_max_m < TILE_MAX_M_BF16_NO_AMX:
            self._packed = onednn_pack(self.weight)
        parts = ((["gemv"] if self._gemv_max_m else []) + ([k.tile_kernel] if self._tiles is not None else [])
                 + (["onednn"] if self._packed is not None else []))
        self.backend = "+".join(parts) or "eager"

    def set_gguf_weight(self, parts: list, bias: Optional[torch.Tensor] = None,
                        packed: Optional[PackedWeight] = None) -> None:
        """Keep GGUF-quantized ``parts`` (:class:`GGUFWeight` ``[n_i, K]`` each, concatenated by
        rows) quantized in the kernel layout, or share an already ``packed`` weight (a tied LM
        head); ``bias [sum n_i]`` (or None) is kept as float32.

        Raises:
            ValueError: parts with different ``K``, a bias of the wrong shape.
        """
        p = packed if packed is not None else pack_gguf(parts)
        n, k = p.shape
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be [{n}], got shape {tuple(bias.shape)}")
        self.out_features, self.in_features = n, k
        self.qpacked = p
        self.weight = None
        self._packed = self._tiles = None
        self._tile_max_m = 0
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        self.int8_activations = self.quantization == "gguf_int8"
        ok = q_kernels() is not None if self.int8_activations else weight_only_available()
        limit = QGEMV_MAX_M if self.int8_activations else QGEMV_WO_MAX_M
        self._gemv_max_m = limit if ok and self.requested_backend != "eager" else 0
        self.backend = "qgemv+chunked" if self._gemv_max_m else "chunked"

    @property
    def is_quantized(self) -> bool:
        """Whether the weight is held quantized (``"int8"``, a GGUF-quantized or int4 weight)."""
        return self.quantization == "int8" or self.qpacked is not None

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weight as held (packed copies for oneDNN and the tile kernels not counted)."""
        if self.qpacked is not None:
            return self.qpacked.nbytes
        if self.quantization == "int8":
            return self.qweight.numel() + self.scale.numel() * 4
        return 0 if self.weight is None else self.weight.numel() * self.weight.element_size()

    @staticmethod
    def _gemv_limit(backend: str, weight: torch.Tensor) -> int:
        """Largest M for the gemv kernel (0: never)."""
        if backend not in ("auto", "gemv") or not weight.is_cpu:
            return 0
        k = cpu_kernels()
        if k is None:
            return 0
        if weight.dtype == torch.bfloat16 and k.has_bf16:
            return GEMV_MAX_M_BF16 if k.has_amx else GEMV_MAX_M_BF16_NO_AMX
        if weight.dtype == torch.float32 and k.has_f32:
            return GEMV_MAX_M_F32
        return 0

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}, quantization={self.quantization}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qpacked is not None:
            return self._forward_gguf(x)
        if self.quantization == "int8":
            return self._forward_int8(x)
        if (self._gemv_max_m or self._packed is not None or self._tiles is not None) and x.is_cpu and x.dtype == self.weight.dtype \
                and not x.requires_grad:
            x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # reshape/view cost ~1.5 us each
            M = x2.shape[0]
            if 0 < M <= self._gemv_max_m:
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                if torch.compiler.is_compiling():
                    y = torch.ops.kvserve.cpu_gemv(x2, self.weight, self.bias)
                else:
                    y = gemv(x2, self.weight, self.bias)
            elif self._tiles is not None and 0 < M <= self._tile_max_m and not torch.compiler.is_compiling():
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                y = tile_linear(x2, self._tiles, self.out_features, self.bias)
            elif self._packed is not None and M > 0 and x.dtype == self._packed.dtype \
                    and not torch.compiler.is_compiling():
                y = onednn_linear(x2, self._packed, self.bias)
            else:
                return F.linear(x, self.weight, self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def _forward_gguf(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        if 0 < M <= self._gemv_max_m and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
            y = qlinear(x2, self.qpacked, self.bias_f32, int8=self.int8_activations)
        else:
            y = chunked_linear(x2, self.qpacked, self.bias_f32, int8=self.int8_activations)
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        if 0 < M <= self._gemv_max_m and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if torch.compiler.is_compiling():
                y = torch.ops.kvserve.cpu_gemv_int8(x2, self.qweight, self.scale, self.bias_f32)
            else:
                y = gemv_int8(x2, self.qweight, self.scale, self.bias_f32)
        else:
            # Dequantize per call (int8 -> bf16/fp32 is exact for |q| <= 127), then the
            # compute-bound GEMM in the activation dtype, scaled per output column.
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)
