"""Linear layers: one interface (:class:`Linear`), the fastest measured kernel behind it.

A Llama-style model spends nearly all of its FLOPs and bytes in ``y = x @ W^T + b``. Which
kernel computes that best depends on how many tokens ``M`` share one pass over ``W``:

* **Decode (small M)** reads every weight for one or a few tokens: a matrix-vector product
  whose limit is memory bandwidth. On the 2-core AVX-512 Xeon kvserve is developed on, eager
  ``F.linear`` in bf16 streams weights at only ~9-14 GB/s (oneDNN, with tens of microseconds of
  fixed cost per call), far below the ~34 GB/s the memory delivers. ``backend="gemv"`` calls a
  small C kernel (AVX512-BF16 ``VDPBF16PS``, float32 accumulation, 4 weight rows per
  stream block, OpenMP over rows) compiled on first use; see ``notes/perf_study.md`` for the
  numbers.
* **Prefill / batched decode (large M)** is compute-bound: oneDNN (AMX in bf16, through
  ``F.linear``) or MKL (fp32) are already near the machine's matmul peak, so they are used.

Numerics: the gemv kernels accumulate in float32 and round once, like oneDNN and MKL; only
the order of the additions differs, so bf16 results match ``F.linear`` to within one bf16 ulp
(in practice usually bit-for-bit) and float32 results to ~1e-6 relative. Weight-only int8
(``quantization="int8"``) changes the model's numbers and is therefore opt-in, never a default.

Everything falls back to plain ``F.linear`` where the fast path is unavailable: CUDA or other
devices, CPUs without AVX-512 (bf16 needs AVX512_BF16), no C compiler, autograd, or the
environment variable ``KVSERVE_DISABLE_CPU_KERNELS=1``.

Sources: the memory-bound decode GEMV argument and weight-only int8 follow gpt-fast
(pytorch-labs/gpt-fast, ``quantize.py``) and llama.cpp's CPU matmul (``ggml-cpu``);
``VDPBF16PS`` is documented in the Intel Intrinsics Guide (``_mm512_dpbf16_ps``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

#: Largest number of tokens (rows of ``x``) sent to the gemv kernel; above it the layer uses
#: the large-M backend (measured crossover on the development machine, see perf_study.md).
GEMV_MAX_M = 8
#: Same for weight-only int8: above it the weight is dequantized per call and oneDNN/MKL run.
INT8_GEMV_MAX_M = 16

BACKENDS = ("auto", "eager", "gemv")
QUANTIZATIONS = (None, "int8")


# --------------------------------------------------------------------------------------
# The C kernels, built on first use
# --------------------------------------------------------------------------------------

_C_SOURCE = r"""
/* kvserve small-M linear kernels for x86-64 CPUs with AVX-512 (see linear.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n]),  w row-major [N, K] (the nn.Linear layout).
 *
 * Decoding reads every weight once per step for only a few tokens, so the work is a
 * matrix-vector product and the limit is memory bandwidth. The kernels stream R = 4 weight
 * rows at a time (one contiguous stream each, software-prefetched KV_PF bytes ahead), keep that 4-row block in L1 while they loop
 * over the M input rows, accumulate in float32 and round once at the end. Rows are split
 * across OpenMP threads; the library links against the libgomp that torch already loaded
 * (same SONAME), so it shares torch's thread pool instead of starting a second one.
 *
 *   kv_gemv_bf16: x, w, bias bf16; y bf16 (round-to-nearest-even), VDPBF16PS (AVX512_BF16).
 *   kv_gemv_f32:  x, w, bias f32;  y f32, FMA.
 *   kv_gemv_i8:   x f32, w int8 with per-row f32 scale, bias f32 or NULL; y bf16 or f32.
 *
 * Functions carry their own target attributes, so the file builds with any gcc >= 10 and
 * the caller decides at run time (from /proc/cpuinfo) which ones may be called.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define R 4
/* Software prefetch distance along each weight row, in bytes. Without it the kernel streams
 * ~15 GB/s; 4-8 KiB ahead reaches ~27-29 GB/s (MKL sgemv's level) on the dev machine. */
#ifndef KV_PF
#define KV_PF 8192
#endif
#define PREFETCH_ROWS(off)                                                      \
    do {                                                                        \
        if (m == 0) {                                                           \
            _mm_prefetch((const char*)(wr[0]) + (off) + KV_PF, _MM_HINT_T0);    \
            _mm_prefetch((const char*)(wr[1]) + (off) + KV_PF, _MM_HINT_T0);    \
            _mm_prefetch((const char*)(wr[2]) + (off) + KV_PF, _MM_HINT_T0);    \
            _mm_prefetch((const char*)(wr[3]) + (off) + KV_PF, _MM_HINT_T0);    \
        }                                                                       \
    } while (0)
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define TGT_F32 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

TGT_BF16 void kv_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
                           uint16_t* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblk = (N + R - 1) / R;
    const int64_t kfull = K / 32 * 32;
    const int ktail = (int)(K - kfull);
    const __mmask32 tmask = ktail ? (__mmask32)((1u << ktail) - 1u) : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n0 = b * R;
        const int64_t nr = (N - n0) < R ? (N - n0) : R;
        const uint16_t* wr[R];
        for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t* xm = x + m * ldx;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int64_t k = 0; k < kfull; k += 32) {
                PREFETCH_ROWS(k * 2);
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
                a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(wr[0] + k));
                a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(wr[1] + k));
                a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(wr[2] + k));
                a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(wr[3] + k));
            }
            if (ktail) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tmask, xm + kfull);
                a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_maskz_loadu_epi16(tmask, wr[0] + kfull));
                a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_maskz_loadu_epi16(tmask, wr[1] + kfull));
                a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_maskz_loadu_epi16(tmask, wr[2] + kfull));
                a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_maskz_loadu_epi16(tmask, wr[3] + kfull));
            }
            float s[R] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                          _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
            uint16_t* ym = y + m * ldy + n0;
            for (int r = 0; r < nr; r++)
                ym[r] = f32_to_bf16(bias ? s[r] + bf16_to_f32(bias[n0 + r]) : s[r]);
        }
    }
}

TGT_F32 void kv_gemv_f32(const float* x, int64_t ldx, const float* w, const float* bias,
                         float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblk = (N + R - 1) / R;
    const int64_t kfull = K / 16 * 16;
    const int ktail = (int)(K - kfull);
    const __mmask16 tmask = ktail ? (__mmask16)((1u << ktail) - 1u) : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n0 = b * R;
        const int64_t nr = (N - n0) < R ? (N - n0) : R;
        const float* wr[R];
        for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * ldx;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int64_t k = 0; k < kfull; k += 16) {
                PREFETCH_ROWS(k * 4);
                __m512 xv = _mm512_loadu_ps(xm + k);
                a0 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr[0] + k), a0);
                a1 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr[1] + k), a1);
                a2 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr[2] + k), a2);
                a3 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr[3] + k), a3);
            }
            if (ktail) {
                __m512 xv = _mm512_maskz_loadu_ps(tmask, xm + kfull);
                a0 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tmask, wr[0] + kfull), a0);
                a1 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tmask, wr[1] + kfull), a1);
                a2 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tmask, wr[2] + kfull), a2);
                a3 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tmask, wr[3] + kfull), a3);
            }
            float s[R] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                          _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
            float* ym = y + m * ldy + n0;
            for (int r = 0; r < nr; r++) ym[r] = bias ? s[r] + bias[n0 + r] : s[r];
        }
    }
}

static inline __m512 TGT_F32 i8_to_ps(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

static inline __m512 TGT_F32 i8_to_ps_mask(__mmask16 m, const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

/* y (bf16 if out_bf16 else f32) = (x @ w^T) * scale + bias, x f32 [M, K] (ldx), w int8 [N, K]. */
TGT_F32 void kv_gemv_i8(const float* x, int64_t ldx, const int8_t* w, const float* scale,
                        const float* bias, void* y, int64_t ldy, int out_bf16, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
    const int64_t nblk = (N + R - 1) / R;
    const int64_t kfull = K / 16 * 16;
    const int ktail = (int)(K - kfull);
    const __mmask16 tmask = ktail ? (__mmask16)((1u << ktail) - 1u) : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n0 = b * R;
        const int64_t nr = (N - n0) < R ? (N - n0) : R;
        const int8_t* wr[R];
        for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * ldx;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int64_t k = 0; k < kfull; k += 16) {
                if ((k & 63) == 0) PREFETCH_ROWS(k);
                __m512 xv = _mm512_loadu_ps(xm + k);
                a0 = _mm512_fmadd_ps(xv, i8_to_ps(wr[0] + k), a0);
                a1 = _mm512_fmadd_ps(xv, i8_to_ps(wr[1] + k), a1);
                a2 = _mm512_fmadd_ps(xv, i8_to_ps(wr[2] + k), a2);
                a3 = _mm512_fmadd_ps(xv, i8_to_ps(wr[3] + k), a3);
            }
            if (ktail) {
                __m512 xv = _mm512_maskz_loadu_ps(tmask, xm + kfull);
                a0 = _mm512_fmadd_ps(xv, i8_to_ps_mask(tmask, wr[0] + kfull), a0);
                a1 = _mm512_fmadd_ps(xv, i8_to_ps_mask(tmask, wr[1] + kfull), a1);
                a2 = _mm512_fmadd_ps(xv, i8_to_ps_mask(tmask, wr[2] + kfull), a2);
                a3 = _mm512_fmadd_ps(xv, i8_to_ps_mask(tmask, wr[3] + kfull), a3);
            }
            float s[R] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                          _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
            for (int r = 0; r < nr; r++) {
                float v = s[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
                if (out_bf16)
                    ((uint16_t*)y)[m * ldy + n0 + r] = f32_to_bf16(v);
                else
                    ((float*)y)[m * ldy + n0 + r] = v;
            }
        }
    }
}
"""

_CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (``/proc/cpuinfo``; empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvserve")
    return Path(root) / "kernels"


def _build(cc: str) -> Path:
    """Compile the kernels into the cache (atomic rename, safe with parallel processes)."""
    tag = hashlib.sha256((_C_SOURCE + " ".join(_CFLAGS) + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"kvserve_cpu_kernels_{tag}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_C_SOURCE)
        tmp_so = Path(tmp) / "kernels.so"
        subprocess.run([cc, *_CFLAGS, str(src), "-o", str(tmp_so)], check=True, capture_output=True, timeout=120)
        fd, staged = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        shutil.copyfile(tmp_so, staged)
        os.replace(staged, out)
    return out


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
        self.has_f32 = {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags
        self.has_bf16 = self.has_f32 and "avx512_bf16" in flags


@functools.lru_cache(maxsize=None)
def cpu_kernels() -> Optional[_Kernels]:
    """Load (building on first use) the gemv kernels; None where they cannot be used.

    The shared library is cached under ``$KVSERVE_CACHE_DIR/kernels`` (default
    ``~/.cache/kvserve/kernels``), keyed by a hash of the source, so the ~1 s build happens once
    per machine. It is loaded after torch, so its ``libgomp.so.1`` resolves to the OpenMP
    runtime torch already uses (one thread pool, no oversubscription).
    """
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags()
    if not {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags:
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None
    try:
        path = _build(cc)
        return _Kernels(ctypes.CDLL(str(path)), flags)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"kvserve: CPU gemv kernels unavailable, using F.linear ({e}; {detail[-500:]!r})",
                      RuntimeWarning, stacklevel=2)
        return None


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
    y = torch.empty((M, N), dtype=x.dtype)
    if x.dtype == torch.bfloat16 and k is not None and k.has_bf16:
        fn = k.bf16
    elif x.dtype == torch.float32 and k is not None and k.has_f32:
        fn = k.f32
    else:
        raise RuntimeError(f"no CPU gemv kernel for {x.dtype} on this machine")
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), _ptr(bias), y.data_ptr(), N, M, N, K, torch.get_num_threads())
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
    y = torch.empty((M, N), dtype=x.dtype)
    k.i8(xf.data_ptr(), xf.stride(0), qweight.data_ptr(), scale.data_ptr(), _ptr(bias), y.data_ptr(), N,
         int(x.dtype == torch.bfloat16), M, N, K, torch.get_num_threads())
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
            (or any dtype ``F.linear`` takes, on the eager path), on any device.
        bias: optional ``[out_features]``, same dtype and device.
        quantization: ``None`` (default: the weight is used as given, results match
            ``F.linear``) or ``"int8"``: weight-only symmetric per-channel int8 (weights use a
            quarter of the fp32 bytes, a half of bf16; activations stay in the model dtype).
            A quantization, so only on request.
        backend: ``"auto"`` (default): the gemv kernel for ``M <= GEMV_MAX_M`` tokens on CPUs
            that have it, ``F.linear`` otherwise; ``"eager"``: always ``F.linear``;
            ``"gemv"``: same as auto (kept explicit for benchmarks). Wherever the fast kernel
            cannot run (CUDA, no AVX-512, no compiler, autograd) the layer uses ``F.linear``.

    Attributes:
        backend: the resolved backend, ``"gemv"`` or ``"eager"`` (what small-M calls use).

    Shapes: ``forward(x [..., in_features]) -> [..., out_features]`` in ``x.dtype``.

    Raises:
        ValueError: on a malformed weight/bias, unknown backend or quantization.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 quantization: Optional[str] = None, backend: str = "auto") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.quantization = quantization
        self.backend = self._resolve(backend, weight, quantization)
        if quantization == "int8":
            q, scale = quantize_int8(weight)
            self.weight = None
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)  # float32 [N]
            self.register_buffer("bias_f32", None if bias is None else bias.float().contiguous())
            self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        else:
            self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    @staticmethod
    def _resolve(backend: str, weight: torch.Tensor, quantization: Optional[str]) -> str:
        if backend == "eager" or weight.device.type != "cpu":
            return "eager"
        k = cpu_kernels()
        if k is None:
            return "eager"
        if quantization == "int8":
            return "gemv" if k.has_f32 else "eager"
        if weight.dtype == torch.bfloat16 and k.has_bf16:
            return "gemv"
        if weight.dtype == torch.float32 and k.has_f32:
            return "gemv"
        return "eager"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}, quantization={self.quantization}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "int8":
            return self._forward_int8(x)
        if self.backend == "gemv" and x.dtype == self.weight.dtype and not x.requires_grad:
            x2 = x.reshape(-1, self.in_features)
            if 0 < x2.shape[0] <= GEMV_MAX_M:
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                if torch.compiler.is_compiling():
                    y = torch.ops.kvserve.cpu_gemv(x2, self.weight, self.bias)
                else:
                    y = gemv(x2, self.weight, self.bias)
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        if self.backend == "gemv" and 0 < M <= INT8_GEMV_MAX_M and x.dtype in (torch.float32, torch.bfloat16):
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if torch.compiler.is_compiling():
                y = torch.ops.kvserve.cpu_gemv_int8(x2, self.qweight, self.scale, self.bias_f32)
            else:
                y = gemv_int8(x2, self.qweight, self.scale, self.bias_f32)
        else:
            # Dequantize per call (int8 -> x.dtype is exact for |q| <= 127), then the
            # compute-bound matmul in the activation dtype; scale per output column.
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)
