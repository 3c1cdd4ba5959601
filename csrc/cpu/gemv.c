/* kvserve small-M linear kernels for x86-64 CPUs with AVX-512 (see kvserve/layers/linear.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n]),  w row-major [N, K] (the nn.Linear layout).
 *
 * Decoding reads every weight once per step for only a few tokens, so the work is a
 * matrix-vector product and the limit is memory bandwidth. The kernels walk the weight in
 * blocks of R = 4 rows, one row after the other (one sequential stream per thread); each
 * weight vector is multiplied with up to MB = 4 input rows at once (16 float32 accumulators),
 * so a weight vector loaded from memory is used by all of them; further groups of 4 input rows
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
/* Software prefetch distance along the weight stream, in bytes; 0: none. A block's rows are
 * read one after the other, so each thread reads one sequential stream, which the hardware
 * prefetchers follow: on the 2-core AMD EPYC (Zen 4) that reads 28-29 GB/s on 2 threads and
 * 18-21 GB/s on one (240 MB bf16 weight, K = 576), and prefetching 1-4 KiB ahead only lowered it.
 * (Reading the 4 rows side by side, 4 streams 1152 bytes apart, as before, gave 20-21 and 10-11
 * GB/s, with or without prefetching 8 KiB ahead: the AMX Xeon had needed that prefetch.) */
#ifndef KV_PF
#define KV_PF 0
#endif
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define TGT_F32 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 4")

#include "bf16.h"

/* Software prefetch KV_PF bytes ahead of offset `off` (bytes) of weight row r. */
#define PREFETCH_ROW(r, off)                                                             \
    do {                                                                                 \
        if (pf && KV_PF) _mm_prefetch((const char*)(wr[r]) + (off) + KV_PF, _MM_HINT_T0);  \
    } while (0)

/* The driver shared by every kernel: blocks of R weight rows split across OpenMP threads;
 * for each, the input rows in groups of up to MB, BLK(nm, ...) computing the dot products
 * s[i][r] = dot(x[m0 + i], w[n0 + r]) (nm is a constant in each case, so BLK is specialised),
 * then STORE writing output (row, col) from the float32 sum v. Expects x, ldx, w, M, N, K and
 * nthreads in scope. */
#define GEMV_DRIVER(WT, XT, BLK, STORE)                                                   \
    const int64_t nblk = (N + R - 1) / R;                                                \
    if (nthreads > 1) {                                                                  \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")               \
        for (int64_t b = 0; b < nblk; b++) GEMV_BLOCK(WT, XT, BLK, STORE);               \
    } else { /* (no parallel region: ~0.6 us even for one thread, see qgemv.c) */        \
        for (int64_t b = 0; b < nblk; b++) GEMV_BLOCK(WT, XT, BLK, STORE);               \
    }

/* Block b (weight rows b R .. b R + R - 1) of GEMV_DRIVER. */
#define GEMV_BLOCK(WT, XT, BLK, STORE)                                                   \
    do {                                                                                 \
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
    } while (0)

/* ---- bf16 ------------------------------------------------------------------------------ */

/* out[i][r] = dot(x[i], w[r]) for i < nm (a compile-time constant after inlining). */
INLINE TGT_BF16 void blk_bf16(const int nm, const uint16_t* x, int64_t ldx, const uint16_t* const* wr,
                              int64_t K, int pf, float out[MB][R]) {
    const int64_t kfull = K / 32 * 32;
    const int ktail = (int)(K - kfull);
    __m512 acc[MB][R];
    UNROLL for (int i = 0; i < nm; i++) UNROLL for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) { /* one row after the other: the block is one sequential stream */
        for (int64_t k = 0; k < kfull; k += 32) {
            PREFETCH_ROW(r, k * 2);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + k);
            UNROLL for (int i = 0; i < nm; i++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)_mm512_loadu_si512(x + i * ldx + k), wv);
        }
        if (ktail) {
            const __mmask32 tm = (__mmask32)((1u << ktail) - 1u);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tm, wr[r] + kfull);
            UNROLL for (int i = 0; i < nm; i++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)_mm512_maskz_loadu_epi16(tm, x + i * ldx + kfull), wv);
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
    for (int r = 0; r < R; r++) {
        for (int64_t k = 0; k < kfull; k += 16) {
            PREFETCH_ROW(r, k * 4);
            const __m512 wv = _mm512_loadu_ps(wr[r] + k);
            UNROLL for (int i = 0; i < nm; i++) acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), wv, acc[i][r]);
        }
        if (ktail) {
            const __mmask16 tm = (__mmask16)((1u << ktail) - 1u);
            const __m512 wv = _mm512_maskz_loadu_ps(tm, wr[r] + kfull);
            UNROLL for (int i = 0; i < nm; i++)
                acc[i][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, x + i * ldx + kfull), wv, acc[i][r]);
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
    for (int r = 0; r < R; r++) {
        for (int64_t k = 0; k < kfull; k += 16) {
            if ((k & 63) == 0) PREFETCH_ROW(r, k);
            const __m512 wv = i8_to_ps((__mmask16)0xffff, wr[r] + k);
            UNROLL for (int i = 0; i < nm; i++) acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), wv, acc[i][r]);
        }
        if (ktail) {
            const __mmask16 tm = (__mmask16)((1u << ktail) - 1u);
            const __m512 wv = i8_to_ps(tm, wr[r] + kfull);
            UNROLL for (int i = 0; i < nm; i++)
                acc[i][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, x + i * ldx + kfull), wv, acc[i][r]);
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

#include "amx.h"
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

/* ---- GEMM with AVX512_BF16 on the packed layout (CPUs without AMX: every M, 1 to prefill) --
 * The weight packed by kv_amx_pack is, for each block of 16 output columns, a contiguous run
 * of K/2 64-byte vectors, one per pair of k: [16 columns][2 k] bf16, exactly the B operand of
 * VDPBF16PS. A register tile of BP_MR input rows x BP_NV column blocks (24 float32
 * accumulators) walks that run once: per k pair, BP_NV vector loads and BP_MR 32-bit
 * broadcasts of x feed BP_MR * BP_NV dot products. Each thread owns a range of column blocks
 * and, for each group of BP_NV of them, runs every row tile over it, so a group's weights come
 * from DRAM once and from L2 for the other row tiles. Every output is one float32 sum over k
 * pairs in order, whatever the tiling or M (so a row's result does not depend on the batch it
 * is in); bias added in float32, one rounding to bf16 (RNE). Needs N % 16 == 0, K % 2 == 0
 * (the packing needs K % 32 == 0). Same arguments as kv_amx_linear. */
#ifndef BP_MR
#define BP_MR 4
#endif
#ifndef BP_NV
#define BP_NV 6
#endif

INLINE TGT_BF16 void bf16p_tile(const int mr, const int nv, const uint16_t* x, int64_t ldx, const uint16_t* b,
                                int64_t bstride, int64_t K2, int64_t col0, const uint16_t* bias, uint16_t* y,
                                int64_t ldy) {
    __m512 acc[BP_MR][BP_NV];
    _Pragma("GCC unroll 8") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 8") for (int v = 0; v < nv; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < K2; kk++) {
        __m512bh bv[BP_NV];
        _Pragma("GCC unroll 8") for (int v = 0; v < nv; v++)
            bv[v] = (__m512bh)_mm512_loadu_si512(b + v * bstride + kk * 32);
        _Pragma("GCC unroll 8") for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * kk, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 8") for (int v = 0; v < nv; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, bv[v]);
        }
    }
    _Pragma("GCC unroll 8") for (int v = 0; v < nv; v++) {
        __m512 bvf = _mm512_setzero_ps();
        if (bias)
            bvf = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + col0 + v * 16))), 16));
        _Pragma("GCC unroll 8") for (int i = 0; i < mr; i++)
            _mm256_storeu_si256((__m256i*)(y + i * ldy + col0 + v * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][v], bvf)));
    }
}

#define BP_TILE(MR, NV) bf16p_tile(MR, NV, xm, ldx, bp, bstride, K2, col0, bias, ym, ldy)
#define BP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define BP_ROWS(NV)                                       \
    switch (mr) {                                         \
        case 1: BP_TILE(1, NV); break;                    \
        case 2: BP_TILE(BP_MIN(2, BP_MR), NV); break;     \
        case 3: BP_TILE(BP_MIN(3, BP_MR), NV); break;     \
        case 4: BP_TILE(BP_MIN(4, BP_MR), NV); break;     \
        case 5: BP_TILE(BP_MIN(5, BP_MR), NV); break;     \
        case 6: BP_TILE(BP_MIN(6, BP_MR), NV); break;     \
        case 7: BP_TILE(BP_MIN(7, BP_MR), NV); break;     \
        default: BP_TILE(BP_MR, NV); break;               \
    }

TGT_BF16 int kv_bf16p_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                             int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t NB = N / 16, K2 = K / 2, bstride = 16 * K;
    if (M <= 0) return 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t nb0 = NB * tid / nth, nb1 = NB * (tid + 1) / nth;
        for (int64_t nb = nb0; nb < nb1; nb += BP_NV) {
            const int nv = nb1 - nb < BP_NV ? (int)(nb1 - nb) : BP_NV;
            const uint16_t* bp = packed + nb * bstride;
            const int64_t col0 = nb * 16;
            for (int64_t m0 = 0; m0 < M; m0 += BP_MR) {
                const int mr = M - m0 < BP_MR ? (int)(M - m0) : BP_MR;
                const uint16_t* xm = x + m0 * ldx;
                uint16_t* ym = y + m0 * ldy;
                switch (nv) {
                    case 1: BP_ROWS(1); break;
                    case 2: BP_ROWS(BP_MIN(2, BP_NV)); break;
                    case 3: BP_ROWS(BP_MIN(3, BP_NV)); break;
                    case 4: BP_ROWS(BP_MIN(4, BP_NV)); break;
                    case 5: BP_ROWS(BP_MIN(5, BP_NV)); break;
                    case 6: BP_ROWS(BP_MIN(6, BP_NV)); break;
                    case 7: BP_ROWS(BP_MIN(7, BP_NV)); break;
                    default: BP_ROWS(BP_NV); break;
                }
            }
        }
    }
    return 0;
}
