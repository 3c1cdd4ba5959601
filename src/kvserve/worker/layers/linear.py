"""Linear layers: one interface (:class:`Linear`), the fastest measured kernel behind it.

A Llama-style model spends nearly all of its FLOPs and bytes in ``y = x @ W^T + b``. Which
kernel computes that best depends on how many tokens ``M`` share one pass over ``W``
(measured on a 2-core AVX-512/AMX Xeon, 2 threads; ``tests/worker/test_linear.py`` checks the numerics):

* **Decode (M <= 4 in bf16, M <= 8 in float32)**: every weight is read for only a few tokens,
  so the limit is memory bandwidth (~30 GB/s here). Eager ``F.linear`` in bf16 reaches only
  ~9-14 GB/s on these shapes (oneDNN's bf16 GEMV path plus ~30 us of fixed cost per call).
  :func:`gemv` is a small C kernel compiled on first use: 4 weight rows per block, 4 input
  rows at once, software prefetch, float32 accumulation with AVX512-BF16 ``VDPBF16PS`` (bf16)
  or FMA (float32), OpenMP over rows. It streams bf16 weights at ~22-28 GB/s: about 2x eager
  bf16 for a whole decode step's linears; in float32 it is on par with MKL at M = 1 and
  1.3-2x faster at M = 2-8.
* **Batched decode (5-64 tokens, bf16, CPUs with AMX-BF16)**: :func:`amx_linear`, a C kernel
  on AMX tiles (``TDPBF16PS``) over a weight packed once into tile layout, streams the weights
  1.1-1.9x faster than oneDNN at these sizes (see ``AMX_MAX_M_BF16``).
* **Prefill / batched decode (larger M)** is compute-bound: bf16 goes to oneDNN with the
  weight reordered once at load time (``torch.ops.mkldnn._reorder_linear_weight`` +
  ``_linear_pointwise``, the same prepacking inductor does with ``freezing=True``), 1.3-1.7x
  faster than ``F.linear`` at M = 32-1024 (AMX); float32 stays on ``F.linear`` (MKL), which
  prepacking does not beat.

Numerics: all paths accumulate in float32 and round once, like oneDNN and MKL; only the order
of the additions differs, so bf16 results match ``F.linear`` to within one bf16 ulp (in
practice bit for bit) and float32 results to ~1e-6 relative. Weight-only int8
(``quantization="int8"``) changes the model's numbers and is therefore opt-in, never a default.

Everything falls back to plain ``F.linear`` where a fast path is unavailable: CUDA or other
devices, CPUs without AVX-512 (bf16 gemv needs AVX512_BF16), no C compiler, autograd, or the
environment variable ``KVSERVE_DISABLE_CPU_KERNELS=1``. Under ``torch.compile`` the gemv
kernels are custom ops (``torch.ops.kvserve.cpu_gemv``) and large M uses ``F.linear``.

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

from kvserve.kernels import AMX_C_SOURCE, cpu_flags, load_library

#: Largest number of tokens (rows of ``x``) sent to the bf16 gemv kernel; above it oneDNN's
#: AMX/AVX-512 GEMM wins (measured crossover: gemv faster at M <= 4 on every model shape,
#: oneDNN faster on the large ones from M = 8).
GEMV_MAX_M_BF16 = 4
#: Same for float32 (gemv faster than MKL up to M = 8 on every model shape, mixed at 16).
GEMV_MAX_M_F32 = 8
#: Largest number of tokens sent to the AMX kernel (:func:`amx_linear`) when the CPU has
#: AMX-BF16. Measured with DRAM-resident weights (SmolLM2 shapes): 1.3-1.9x oneDNN's speed at
#: 5-32 tokens, 1.1-1.3x at 48-64, on par at 96, slower from 128; SmolLM2 decode steps of
#: 16-64 sequences took 1.4-1.8x less time with it.
AMX_MAX_M_BF16 = 64
#: Same for weight-only int8 (above it the weight is dequantized per call and GEMM runs).
GEMV_MAX_M_INT8 = 16

BACKENDS = ("auto", "eager", "gemv", "onednn")
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
 * matrix-vector product and the limit is memory bandwidth. The kernels walk the weight in
 * blocks of R = 4 rows (4 contiguous streams, software-prefetched KV_PF bytes ahead); each
 * block is multiplied with up to MB = 4 input rows at once (16 float32 accumulators), so a
 * weight vector loaded from memory is used by all of them; further groups of 4 input rows
 * re-read the block from L1/L2. Sums are float32 and rounded once at the end. Rows of W are
 * split across OpenMP threads; the library links against the libgomp that torch already
 * loaded (same SONAME), so it shares torch's thread pool instead of starting a second one.
 *
 *   kv_gemv_bf16: x, w, bias bf16; y bf16 (round-to-nearest-even), VDPBF16PS (AVX512_BF16).
 *   kv_gemv_f32:  x, w, bias f32;  y f32, FMA.
 *   kv_gemv_i8:   x f32, w int8 with per-row f32 scale, bias f32 or NULL; y bf16 or f32.
 *
 * Functions carry their own target attributes, so the file builds with any gcc >= 10 and
 * the caller decides at run time (from /proc/cpuinfo) which ones may be called.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define R 4
#define MB 4
/* Software prefetch distance along each weight row, in bytes. Without it the bf16 kernel
 * streams ~15 GB/s on the dev machine; 4-8 KiB ahead reaches ~27-29 GB/s (MKL sgemv's level). */
#ifndef KV_PF
#define KV_PF 8192
#endif
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define TGT_F32 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 4")

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

#define PREFETCH_BLOCK(off)                                                              \
    do {                                                                                 \
        if (pf) {                                                                        \
            UNROLL for (int r = 0; r < R; r++)                                           \
                _mm_prefetch((const char*)(wr[r]) + (off) + KV_PF, _MM_HINT_T0);         \
        }                                                                                \
    } while (0)

/* The driver shared by every kernel: blocks of R weight rows split across OpenMP threads;
 * for each, the input rows in groups of up to MB, BLK(nm, ...) computing the dot products
 * s[i][r] = dot(x[m0 + i], w[n0 + r]) (nm is a constant in each case, so BLK is specialised),
 * then STORE writing output (row, col) from the float32 sum v. Expects x, ldx, w, M, N, K and
 * nthreads in scope. */
#define GEMV_DRIVER(WT, XT, BLK, STORE)                                                   \
    const int64_t nblk = (N + R - 1) / R;                                                \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                   \
    for (int64_t b = 0; b < nblk; b++) {                                                 \
        const int64_t n0 = b * R;                                                        \
        const int64_t nr = (N - n0) < R ? (N - n0) : R;                                  \
        const WT* wr[R];                                                                 \
        for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;             \
        for (int64_t m0 = 0; m0 < M; m0 += MB) {                                         \
            const int64_t nm = (M - m0) < MB ? (M - m0) : MB;                            \
            const XT* xm = x + m0 * ldx;                                                 \
            const int pf = m0 == 0;                                                      \
            float s[MB][R];                                                              \
            switch (nm) {                                                                \
                case 1: BLK(1, xm, ldx, wr, K, pf, s); break;                            \
                case 2: BLK(2, xm, ldx, wr, K, pf, s); break;                            \
                case 3: BLK(3, xm, ldx, wr, K, pf, s); break;                            \
                default: BLK(4, xm, ldx, wr, K, pf, s); break;                           \
            }                                                                            \
            for (int64_t i = 0; i < nm; i++)                                             \
                for (int64_t r = 0; r < nr; r++) {                                       \
                    const int64_t row = m0 + i, col = n0 + r;                            \
                    const float v = s[i][r];                                             \
                    STORE;                                                               \
                }                                                                        \
        }                                                                                \
    }

/* ---- bf16 ------------------------------------------------------------------------------ */

/* out[i][r] = dot(x[i], w[r]) for i < nm (a compile-time constant after inlining). */
INLINE TGT_BF16 void blk_bf16(const int nm, const uint16_t* x, int64_t ldx, const uint16_t* const* wr,
                              int64_t K, int pf, float out[MB][R]) {
    const int64_t kfull = K / 32 * 32;
    const int ktail = (int)(K - kfull);
    __m512 acc[MB][R];
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kfull; k += 32) {
        PREFETCH_BLOCK(k * 2);
        __m512bh wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
        }
    }
    if (ktail) {
        const __mmask32 tm = (__mmask32)((1u << ktail) - 1u);
        __m512bh wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tm, wr[r] + kfull);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tm, x + i * ldx + kfull);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
        }
    }
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

TGT_BF16 void kv_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
                           uint16_t* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    GEMV_DRIVER(uint16_t, uint16_t, blk_bf16,
                y[row * ldy + col] = f32_to_bf16(bias ? v + bf16_to_f32(bias[col]) : v))
}

/* ---- f32 ------------------------------------------------------------------------------- */

INLINE TGT_F32 void blk_f32(const int nm, const float* x, int64_t ldx, const float* const* wr,
                            int64_t K, int pf, float out[MB][R]) {
    const int64_t kfull = K / 16 * 16;
    const int ktail = (int)(K - kfull);
    __m512 acc[MB][R];
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kfull; k += 16) {
        PREFETCH_BLOCK(k * 4);
        __m512 wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(wr[r] + k);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    if (ktail) {
        const __mmask16 tm = (__mmask16)((1u << ktail) - 1u);
        __m512 wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_ps(tm, wr[r] + kfull);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(tm, x + i * ldx + kfull);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

TGT_F32 void kv_gemv_f32(const float* x, int64_t ldx, const float* w, const float* bias,
                         float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    GEMV_DRIVER(float, float, blk_f32, y[row * ldy + col] = bias ? v + bias[col] : v)
}

/* ---- weight-only int8 ------------------------------------------------------------------ */

INLINE TGT_F32 __m512 i8_to_ps(__mmask16 m, const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

INLINE TGT_F32 void blk_i8(const int nm, const float* x, int64_t ldx, const int8_t* const* wr,
                           int64_t K, int pf, float out[MB][R]) {
    const int64_t kfull = K / 16 * 16;
    const int ktail = (int)(K - kfull);
    __m512 acc[MB][R];
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kfull; k += 16) {
        if ((k & 63) == 0) PREFETCH_BLOCK(k);
        __m512 wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = i8_to_ps((__mmask16)0xffff, wr[r] + k);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    if (ktail) {
        const __mmask16 tm = (__mmask16)((1u << ktail) - 1u);
        __m512 wv[R];
        UNROLL for (int r = 0; r < R; r++) wv[r] = i8_to_ps(tm, wr[r] + kfull);
        UNROLL for (int i = 0; i < nm; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(tm, x + i * ldx + kfull);
            UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

/* y (bf16 if out_bf16 else f32) = (x @ w^T) * scale + bias, x f32 [M, K] (ldx), w int8 [N, K]. */
TGT_F32 void kv_gemv_i8(const float* x, int64_t ldx, const int8_t* w, const float* scale,
                        const float* bias, void* y, int64_t ldy, int out_bf16, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
    GEMV_DRIVER(int8_t, float, blk_i8, {
        const float t = v * scale[col] + (bias ? bias[col] : 0.0f);
        if (out_bf16)
            ((uint16_t*)y)[row * ldy + col] = f32_to_bf16(t);
        else
            ((float*)y)[row * ldy + col] = t;
    })
}
/* ---- Batched-decode GEMM on AMX tiles (bf16, CPUs with AMX-BF16) ---------------------------
 * For 5-64 tokens oneDNN streams the weights at ~8-13 GB/s on the development machine; this
 * kernel reaches ~9-19 GB/s (more at fewer tokens; measured with 200 MB of weights, so from
 * DRAM). The weight is packed once (kv_amx_pack) into 1 KiB TDPBF16PS B tiles
 * [N/16][K/32][16 k-pairs][16 n][2], so each thread streams its share of output columns as
 * contiguous, software-prefetched runs (two at once for up to 32 rows); every B tile is
 * multiplied with up to 4 tiles of 16 input rows (C tiles 0-3; A tiles loaded from x in place,
 * rows past M from a zero-padded copy). float32 accumulation, bias added in float32, one
 * rounding to bf16 (RNE), like oneDNN. Needs N % 16 == 0, K % 32 == 0. */
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")))
#define KV_AMX_PF 4 /* B tiles prefetched ahead */

INLINE TGT_AMX __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bf16, round to nearest even (NaN stays NaN), as f32_to_bf16. */
INLINE TGT_AMX __m256i f32x16_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/*@AMX_C_SOURCE@*/
/* 1 if Linux grants the AMX tile state. */
int kv_amx_init(void) { return kv_amx_request(); }

void kv_amx_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
    const int64_t KB = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint32_t* t = (uint32_t*)(out + (nb * KB + kb) * 512);
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t n = 0; n < 16; n++) memcpy(t + kp * 16 + n, w + (nb * 16 + n) * K + kb * 32 + 2 * kp, 4);
        }
}

/* y rows [m0, m0 + 16 * nt) (clipped to M), columns [16 nb, 16 nb + 16) <- C tiles at c
 * (nt tiles of 16 x 16 float32, `stride` floats apart) + bias, rounded to bf16. */
INLINE TGT_AMX void amx_store_rows(const float* c, int64_t stride, int64_t nt, int64_t m0, int64_t M, int64_t nb,
                                   const uint16_t* bias, uint16_t* y, int64_t ldy) {
    __m512 bv = _mm512_setzero_ps();
    if (bias) bv = bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(bias + nb * 16)));
    for (int64_t t = 0; t < nt; t++) {
        const int64_t m = m0 + t * 16, rows = M - m < 16 ? M - m : 16;
        for (int64_t r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i*)(y + (m + r) * ldy + nb * 16),
                                f32x16_to_bf16(_mm512_add_ps(_mm512_load_ps(c + t * stride + r * 16), bv)));
    }
}

/* Up to 32 rows (ap[0..nt), nt <= 2) times two blocks of 16 columns, bp[0] and bp[1] (two = 0:
 * only bp[0]), on C tiles 0-3 = (row tile, column block) (0,0) (0,1) (1,0) (1,1): per 32-wide
 * k step two B tiles and two A tiles feed four products. The two column blocks lie far apart
 * in the packed weight, so each thread streams two runs of it at once. */
INLINE TGT_AMX void amx_tiles_2x2(const uint16_t* const* ap, const int64_t* la, int64_t nt, const uint16_t* const* bp,
                                  int two, int64_t KB, float* cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        for (int s = 0; s < 1 + two; s++) {
            const char* pf = (const char*)(bp[s] + (kb + KV_AMX_PF) * 512);
            for (int l = 0; l < 16; l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
        }
        _tile_loadd(6, bp[0] + kb * 512, 64);
        if (two) _tile_loadd(7, bp[1] + kb * 512, 64);
        _tile_loadd(4, ap[0] + kb * 32, la[0]);
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(1, 4, 7);
        if (nt > 1) {
            _tile_loadd(5, ap[1] + kb * 32, la[1]);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cb, 64);
    if (two) _tile_stored(1, cb + 256, 64);
    if (nt > 1) _tile_stored(2, cb + 512, 64);
    if (nt > 1 && two) _tile_stored(3, cb + 768, 64);
}

/* Up to 64 rows (ap[0..nt), nt <= 4) times one block of 16 columns (bp) on C tiles 0-3: each
 * B tile feeds up to four products. */
INLINE TGT_AMX void amx_tiles_4x1(const uint16_t* const* ap, const int64_t* la, int64_t nt, const uint16_t* bp,
                                  int64_t KB, float* cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        const char* pf = (const char*)(bp + (kb + KV_AMX_PF) * 512);
        for (int l = 0; l < 16; l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
        _tile_loadd(5, bp + kb * 512, 64);
        _tile_loadd(4, ap[0] + kb * 32, la[0]);
        _tile_dpbf16ps(0, 4, 5);
        if (nt > 1) { _tile_loadd(6, ap[1] + kb * 32, la[1]); _tile_dpbf16ps(1, 6, 5); }
        if (nt > 2) { _tile_loadd(7, ap[2] + kb * 32, la[2]); _tile_dpbf16ps(2, 7, 5); }
        if (nt > 3) { _tile_loadd(4, ap[3] + kb * 32, la[3]); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, cb, 64);
    if (nt > 1) _tile_stored(1, cb + 256, 64);
    if (nt > 2) _tile_stored(2, cb + 512, 64);
    if (nt > 3) _tile_stored(3, cb + 768, 64);
}

/* Returns 0, or -1 when a work buffer could not be allocated (y is then incomplete).
 * Up to 32 rows: amx_tiles_2x2 over pairs of column blocks (~15-20% faster there than one
 * block at a time, measured with DRAM-resident weights); more rows: amx_tiles_4x1 over
 * groups of 4 row tiles (the 2x2 blocking would read each B tile twice). Each C tile sums
 * its k steps in the same order either way, so the result does not depend on the blocking. */
TGT_AMX int kv_amx_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                          int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t NB = N / 16, KB = K / 32, MT = (M + 15) / 16, rem = M % 16;
    int failed = 0;
    if (M <= 0) return 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t* xpad = rem ? (uint16_t*)aligned_alloc(64, (size_t)(16 * K * 2)) : NULL;
        if (rem && !xpad) {
#pragma omp atomic write
            failed = 1;
        } else {
            kv_amx_config();
            if (rem) {
                memset(xpad, 0, (size_t)(16 * K * 2));
                for (int64_t r = 0; r < rem; r++) memcpy(xpad + r * K, x + (M - rem + r) * ldx, (size_t)(K * 2));
            }
            /* A tiles: row tile t of x in place, the last partial one from the padded copy */
            const uint16_t* ap[MT];
            int64_t la[MT];
            for (int64_t t = 0; t < MT; t++) {
                const int last = rem && t == MT - 1;
                ap[t] = last ? xpad : x + t * 16 * ldx;
                la[t] = (last ? K : ldx) * 2;
            }
            float cb[4 * 256] __attribute__((aligned(64)));
            const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t nb0 = NB * tid / nth, nb1 = NB * (tid + 1) / nth;
            if (MT <= 2) {
                const int64_t half = (nb1 - nb0 + 1) / 2; /* blocks nb0 + i and nb0 + half + i */
                for (int64_t i = 0; i < half; i++) {
                    const int64_t nb = nb0 + i, nb2 = nb0 + half + i;
                    const int two = nb2 < nb1;
                    const uint16_t* bp[2] = {packed + nb * KB * 512, packed + (two ? nb2 : nb) * KB * 512};
                    amx_tiles_2x2(ap, la, MT, bp, two, KB, cb);
                    amx_store_rows(cb, 512, MT, 0, M, nb, bias, y, ldy);
                    if (two) amx_store_rows(cb + 256, 512, MT, 0, M, nb2, bias, y, ldy);
                }
            } else {
                for (int64_t nb = nb0; nb < nb1; nb++)
                    for (int64_t mt0 = 0; mt0 < MT; mt0 += 4) {
                        const int64_t nt = MT - mt0 < 4 ? MT - mt0 : 4;
                        amx_tiles_4x1(ap + mt0, la + mt0, nt, packed + nb * KB * 512, KB, cb);
                        amx_store_rows(cb, 256, nt, mt0 * 16, M, nb, bias, y, ldy);
                    }
            }
            _tile_release();
        }
        free(xpad);
    }
    return failed ? -1 : 0;
}
"""

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
        self.amx_linear.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, c_int]
        self.amx_linear.restype = c_int
        self.has_f32 = {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags
        self.has_bf16 = self.has_f32 and "avx512_bf16" in flags
        self.has_amx = (self.has_bf16 and {"amx_tile", "amx_bf16", "avx512dq"} <= flags
                        and bool(lib.kv_amx_init()))


@functools.lru_cache(maxsize=None)
def cpu_kernels() -> Optional[_Kernels]:
    """Load (building on first use, see :func:`kvserve.kernels.load_library`) the gemv kernels.

    Returns None where they cannot be used (see :mod:`kvserve.kernels`).
    """
    lib = load_library("gemv", _C_SOURCE.replace("/*@AMX_C_SOURCE@*/", AMX_C_SOURCE))
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


def amx_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`amx_linear` can run ``weight``: bf16 CPU weight ``[N, K]`` with
    ``N % 16 == 0`` and ``K % 32 == 0``, on a CPU with AMX-BF16 (and the kernels built)."""
    k = cpu_kernels()
    return (k is not None and k.has_amx and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.shape[0] > 0)


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack ``weight [N, K]`` (bf16, see :func:`amx_supported`) into AMX B tiles for
    :func:`amx_linear`: a flat bf16 tensor of ``N·K`` elements laid out
    ``[N/16][K/32][16 k-pairs][16 columns][2]`` (a second copy of the weight)."""
    if not amx_supported(weight):
        raise ValueError(f"amx_pack needs a bf16 CPU weight [N, K] with N % 16 == 0 and K % 32 == 0 on a CPU "
                         f"with AMX-BF16, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.contiguous()
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    cpu_kernels().amx_pack(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` on AMX tiles with a weight packed by :func:`amx_pack`; for batched decode.

    Args:
        x: ``[M, K]`` bf16 with unit last stride.
        packed: the packed weight of ``[out_features, K]``.
        out_features: ``N``.
        bias: optional ``[N]`` bf16 contiguous.

    Returns:
        ``[M, N]`` bf16: float32 accumulation, bias added in float32, one rounding (RNE).

    Raises:
        MemoryError: if a work buffer cannot be allocated.
    """
    M, K = x.shape
    y = x.new_empty((M, out_features))
    nt = torch.get_num_threads() if out_features * K >= _PARALLEL_MIN_ELEMENTS else 1
    if cpu_kernels().amx_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), _ptr(bias), y.data_ptr(),
                                out_features, M, out_features, K, nt):
        raise MemoryError("amx_linear: could not allocate work buffers")
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
            (any dtype ``F.linear`` takes on the eager path), on any device.
        bias: optional ``[out_features]``, same dtype and device.
        quantization: ``None`` (default: the weight is used as given and results match
            ``F.linear``) or ``"int8"``: weight-only symmetric per-output-channel int8
            (a quarter of the fp32 bytes, half of bf16; activations stay in the model dtype).
            It changes the model's outputs, so it is only used on request.
        backend: where the fast paths apply (CPU, float32/bfloat16, no autograd):

            * ``"auto"`` (default): gemv kernel for ``M <= GEMV_MAX_M_*`` tokens; in bf16 on
              CPUs with AMX-BF16 the AMX kernel up to ``AMX_MAX_M_BF16`` tokens (a packed copy
              of the weight); above that oneDNN prepacked for bf16 (another packed copy) and
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
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self._packed: Optional[torch.Tensor] = None  # oneDNN layout; not a buffer (opaque tensor)
        self._amx: Optional[torch.Tensor] = None  # AMX tile layout (amx_pack)
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
        if backend in ("auto", "onednn") and weight.is_cpu and onednn_available() and (
                weight.dtype == torch.bfloat16 or (backend == "onednn" and weight.dtype == torch.float32)):
            self._packed = onednn_pack(self.weight)
        if backend == "auto" and amx_supported(self.weight):
            self._amx = amx_pack(self.weight)
        parts = ((["gemv"] if self._gemv_max_m else []) + (["amx"] if self._amx is not None else [])
                 + (["onednn"] if self._packed is not None else []))
        self.backend = "+".join(parts) or "eager"

    @staticmethod
    def _gemv_limit(backend: str, weight: torch.Tensor) -> int:
        """Largest M for the gemv kernel (0: never)."""
        if backend not in ("auto", "gemv") or not weight.is_cpu:
            return 0
        k = cpu_kernels()
        if k is None:
            return 0
        if weight.dtype == torch.bfloat16 and k.has_bf16:
            return GEMV_MAX_M_BF16
        if weight.dtype == torch.float32 and k.has_f32:
            return GEMV_MAX_M_F32
        return 0

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}, quantization={self.quantization}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "int8":
            return self._forward_int8(x)
        if (self._gemv_max_m or self._packed is not None or self._amx is not None) and x.is_cpu and x.dtype == self.weight.dtype \
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
            elif self._amx is not None and 0 < M <= AMX_MAX_M_BF16 and not torch.compiler.is_compiling():
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                y = amx_linear(x2, self._amx, self.out_features, self.bias)
            elif self._packed is not None and M > 0 and x.dtype == self._packed.dtype \
                    and not torch.compiler.is_compiling():
                y = onednn_linear(x2, self._packed, self.bias)
            else:
                return F.linear(x, self.weight, self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

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
