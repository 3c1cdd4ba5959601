/* kvserve linear kernels on GGUF-quantized weights kept quantized (see
 * kvserve/worker/layers/quant.py, which packs the weights and holds the PyTorch reference).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), with w stored per block of 32 values along k
 * as unsigned integers u (4-bit or 8-bit) and two float32 numbers per block and row:
 *
 *     w[n, 32 b + t] = d[n, b] * u[n, 32 b + t] + m[n, b]
 *
 * Every GGUF type used here maps to that exactly: Q4_0 (u = q + 8, m = -8 d), Q4_1 (d, m as
 * stored), Q8_0 (u = q + 128, m = -128 d), Q4_K / Q5_K (d = super-block d * 6-bit scale,
 * m = -dmin * 6-bit min, per 32-value sub-block; Q5_K's 5-bit values stored as 8-bit), Q6_K
 * (per 16 values: d = super-block d * int8 scale, m = -32 d, u = the 6-bit value as 8-bit; the
 * sub16 layout below), and int4 checkpoints (u 4-bit, d = the group's scale, m = its minimum).
 *
 * Packed layout (kv_q* "packed" arguments), rows in groups of 4 (N padded to a multiple of 4
 * with zero rows), G = ceil(N / 4) groups, KB = K / 32 blocks:
 *   bits 4: qs [G][KB][4 rows][16 bytes]: byte t of a row = u[t] | u[t + 16] << 4 (ggml's own
 *           byte order for Q4_0/Q4_1), so one 64-byte load holds a block of 4 rows;
 *   bits 8: qs [G][KB][2 halves][4 rows][16 bytes]: half h of a row = u[16 h .. 16 h + 15];
 *   d, m:   [G][KB][4] float32; with sub16 (a scale and offset per 16 values: Q6_K, int4
 *           with groups of 16) [G][KB][2 halves][4] float32, half h for values 16 h .. 16 h + 15
 *           of the block (the low nibbles / first 16 bytes of a row are half 0 in both layouts).
 * A thread's share of the groups is one contiguous stream of memory.
 *
 * The activations are quantized to int8 per block of 32 (as llama.cpp's q8_0 activations for
 * ggml_vec_dot_q4_0_q8_0): s = max|x| / 127, q = round-to-nearest-even(x / s), so
 * |x - s q| <= s / 2 = max|x| / 254 element-wise. Then per block and row (AVX512-VNNI
 * VPDPBUSD, unsigned weight bytes times signed activation bytes, int32 sums, exact):
 *
 *     sum_t w x ~= s (d sum_t u q + m sum_t q),
 *
 * accumulated in float32 over the blocks (per 4-value lane, summed at the end). Rows are split
 * across OpenMP threads (torch's libgomp, as gemv.c). Each group of 4 weight rows is read once
 * per call and multiplied with every activation row (up to 8 at a time; further ones re-read
 * the group from L1), so the weight streams once from memory for any M.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TGT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define TGT_F32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define INLINE static inline __attribute__((always_inline))
#define QMB 8 /* activation rows per pass over a weight group */
#define QPF 1024 /* software prefetch distance in the packed weight, bytes */

/* The calling OpenMP thread's share [*g0, *g1) of G row groups: contiguous, as schedule(static). The
 * kernels call their group loop directly when they run on one thread: an OpenMP parallel region
 * costs ~0.6 us even with one thread (or a false if clause), and the one-call decode step calls
 * them on row chunks from inside its own team about 1,000 times a step per thread. */
static inline void thread_share(int64_t G, int64_t* g0, int64_t* g1) {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num(), per = (G + nt - 1) / nt;
    *g0 = t * per < G ? t * per : G;
    *g1 = *g0 + per < G ? *g0 + per : G;
}

#include "bf16.h"

/* 16 floats of x (f32, or bf16 when bf16 != 0) starting at element k. */
INLINE TGT_F32 __m512 load16(const void* x, int bf16, int64_t k) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + k))), 16));
    return _mm512_loadu_ps((const float*)x + k);
}

/* Quantize one row of K values (K % 32 == 0) per block of 32: xq int8, xs[b] = the scale,
 * xss[b] = scale * sum of the block's int8 values; xss16 (or NULL) [2 b + h] = scale * sum of
 * the int8 values of half h (for the sub16 layout). */
INLINE TGT_F32 void quantize_row(const void* x, int bf16, int64_t K, int8_t* xq, float* xs, float* xss,
                                 float* xss16) {
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 v0 = load16(x, bf16, 32 * b), v1 = load16(x, bf16, 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float s = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
        /* x * (1 / s) then round to nearest even; |result| <= 127 up to one rounding of the
         * reciprocal, clamped to be sure */
        const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inv), lo), hi));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inv), lo), hi));
        _mm_storeu_si128((__m128i*)(xq + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        xs[b] = s;
        xss[b] = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        if (xss16) {
            xss16[2 * b] = s * (float)_mm512_reduce_add_epi32(q0);
            xss16[2 * b + 1] = s * (float)_mm512_reduce_add_epi32(q1);
        }
    }
}

/* Public: quantize M rows of x [M, K] (row stride ldx elements) as the kernel does; for tests
 * and the PyTorch reference. xq [M, K], xs and xss [M, K / 32]. */
TGT_F32 void kv_q_quantize_act(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int8_t* xq, float* xs,
                               float* xss) {
    for (int64_t i = 0; i < M; i++)
        quantize_row(x_bf16 ? (const void*)((const uint16_t*)x + i * ldx) : (const void*)((const float*)x + i * ldx),
                     x_bf16, K, xq + i * K, xs + i * (K / 32), xss + i * (K / 32), NULL);
}

/* acc[i] (16 lanes: 4 per weight row) += s_i * d_row * dot(u, q_i) per lane; accm[i] (4 rows)
 * += m_row * s_i * sum(q_i), over every block of one group, for nm activation rows. SUB 16: a
 * d and m per half block (the two halves' dot products scaled apart; xss16 the halves' sums). */
#define QBLOCK(NM, BITS, SUB)                                                                                     \
    INLINE TGT_VNNI void qblock_##BITS##_##SUB##_##NM(const uint8_t* qs, const float* d, const float* m,       \
                                                      int64_t KB, const int8_t* xq, int64_t K, const float* xs, \
                                                      const float* xss, const float* xss16, float out[QMB][4]) { \
        __m512 acc[NM];                                                                                         \
        __m128 accm[NM];                                                                                        \
        for (int i = 0; i < NM; i++) acc[i] = _mm512_setzero_ps(), accm[i] = _mm_setzero_ps();                  \
        const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);                   \
        const __m512i low = _mm512_set1_epi8(0x0f);                                                             \
        const int64_t step = (BITS) == 4 ? 64 : 128;                                                            \
        const int64_t dstep = (SUB) == 16 ? 8 : 4;                                                              \
        for (int64_t b = 0; b < KB; b++) {                                                                      \
            const uint8_t* p = qs + b * step;                                                                   \
            _mm_prefetch((const char*)p + QPF, _MM_HINT_T0);                                                    \
            __m512i wl, wh;                                                                                     \
            if ((BITS) == 4) {                                                                                  \
                const __m512i w = _mm512_loadu_si512(p);                                                        \
                wl = _mm512_and_si512(w, low);                                                                  \
                wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);                                            \
            } else {                                                                                            \
                _mm_prefetch((const char*)p + QPF + 64, _MM_HINT_T0);                                           \
                wl = _mm512_loadu_si512(p);                                                                     \
                wh = _mm512_loadu_si512(p + 64);                                                                \
            }                                                                                                   \
            const float* db = d + dstep * b;                                                                    \
            const float* mb = m + dstep * b;                                                                    \
            const __m512 d16 = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(db)));           \
            const __m128 m4 = _mm_loadu_ps(mb);                                                                 \
            __m512 d16h = d16;                                                                                  \
            __m128 m4h = m4;                                                                                    \
            if ((SUB) == 16) {                                                                                  \
                d16h = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(db + 4)));               \
                m4h = _mm_loadu_ps(mb + 4);                                                                     \
            }                                                                                                   \
            for (int i = 0; i < NM; i++) {                                                                      \
                const int8_t* xb = xq + i * K + 32 * b;                                                         \
                const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xb));                 \
                const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xb + 16)));          \
                const float sc = xs[i * KB + b];                                                                \
                if ((SUB) == 16) {                                                                              \
                    const __m512i sl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, xl);                     \
                    const __m512i sh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wh, xh);                     \
                    const __m512 scv = _mm512_set1_ps(sc);                                                      \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sl), _mm512_mul_ps(d16, scv), acc[i]);          \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sh), _mm512_mul_ps(d16h, scv), acc[i]);         \
                    accm[i] = _mm_fmadd_ps(m4, _mm_set1_ps(xss16[2 * (i * KB + b)]), accm[i]);                  \
                    accm[i] = _mm_fmadd_ps(m4h, _mm_set1_ps(xss16[2 * (i * KB + b) + 1]), accm[i]);             \
                } else {                                                                                        \
                    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, xl);                            \
                    s = _mm512_dpbusd_epi32(s, wh, xh);                                                         \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d16, _mm512_set1_ps(sc)), acc[i]); \
                    accm[i] = _mm_fmadd_ps(m4, _mm_set1_ps(xss[i * KB + b]), accm[i]);                          \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < NM; i++) {                                                                          \
            /* lanes 4r..4r+3 belong to row r: sum them */                                                      \
            __m512 t = _mm512_add_ps(acc[i], _mm512_permute_ps(acc[i], 0x4e));                                  \
            t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));                                                   \
            const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);             \
            const __m128 r4 = _mm_add_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(pick, t)), accm[i]);      \
            _mm_storeu_ps(out[i], r4);                                                                          \
        }                                                                                                       \
    }

#define QBLOCKS(BITS, SUB)                                                                                     \
    QBLOCK(1, BITS, SUB) QBLOCK(2, BITS, SUB) QBLOCK(3, BITS, SUB) QBLOCK(4, BITS, SUB) QBLOCK(5, BITS, SUB)  \
    QBLOCK(6, BITS, SUB) QBLOCK(7, BITS, SUB) QBLOCK(8, BITS, SUB)
QBLOCKS(4, 32) QBLOCKS(8, 32) QBLOCKS(4, 16) QBLOCKS(8, 16)

#define QDISPATCH(BITS, SUB, QS, D, MM, XQ, XS, XSS, XSS16)                             \
    switch (nm) {                                                                        \
        case 1: qblock_##BITS##_##SUB##_1(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 2: qblock_##BITS##_##SUB##_2(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 3: qblock_##BITS##_##SUB##_3(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 4: qblock_##BITS##_##SUB##_4(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 5: qblock_##BITS##_##SUB##_5(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 6: qblock_##BITS##_##SUB##_6(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        case 7: qblock_##BITS##_##SUB##_7(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
        default: qblock_##BITS##_##SUB##_8(QS, D, MM, KB, XQ, K, XS, XSS, XSS16, s); break; \
    }

/* Activation row i of kv_q_linear quantized (its codes, scales and sums in the buffers). */
INLINE TGT_VNNI void q_quantize_row(const void* x, int64_t ldx, int x_bf16, int64_t K, int64_t i, int8_t* xq,
                                    float* xs, float* xss, float* xss16) {
    const int64_t KB = K / 32;
    quantize_row(x_bf16 ? (const void*)((const uint16_t*)x + i * ldx) : (const void*)((const float*)x + i * ldx),
                 x_bf16, K, xq + i * K, xs + i * KB, xss + i * KB, xss16 ? xss16 + 2 * i * KB : NULL);
}

/* Row groups [g0, g1) of kv_q_linear on the calling thread, the activations already quantized. */
static TGT_VNNI void q_groups(const int8_t* xq, const float* xs, const float* xss, const float* xss16, int64_t M,
                              int64_t K, const uint8_t* qs, const float* d, const float* m, int bits, int sub16,
                              int64_t N, const float* bias, void* y, int64_t ldy, int y_bf16, int64_t g0, int64_t g1) {
    const int64_t KB = K / 32, gbytes = KB * (bits == 4 ? 64 : 128), gsc = KB * (sub16 ? 8 : 4);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t* gq = qs + g * gbytes;
        const float* gd = d + g * gsc;
        const float* gm = m + g * gsc;
        const int64_t nr = N - 4 * g < 4 ? N - 4 * g : 4;
        for (int64_t m0 = 0; m0 < M; m0 += QMB) {
            const int64_t nm = M - m0 < QMB ? M - m0 : QMB;
            float s[QMB][4];
            const int8_t* xqm = xq + m0 * K;
            const float* xsm = xs + m0 * KB;
            const float* xssm = xss + m0 * KB;
            const float* xss16m = xss16 ? xss16 + 2 * m0 * KB : NULL;
            if (bits == 4 && !sub16) {
                QDISPATCH(4, 32, gq, gd, gm, xqm, xsm, xssm, xss16m)
            } else if (!sub16) {
                QDISPATCH(8, 32, gq, gd, gm, xqm, xsm, xssm, xss16m)
            } else if (bits == 4) {
                QDISPATCH(4, 16, gq, gd, gm, xqm, xsm, xssm, xss16m)
            } else {
                QDISPATCH(8, 16, gq, gd, gm, xqm, xsm, xssm, xss16m)
            }
            for (int64_t i = 0; i < nm; i++)
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t row = m0 + i, col = 4 * g + r;
                    const float v = s[i][r] + (bias ? bias[col] : 0.0f);
                    if (y_bf16)
                        ((uint16_t*)y)[row * ldy + col] = f32_to_bf16(v);
                    else
                        ((float*)y)[row * ldy + col] = v;
                }
        }
    }
}

/* y [M, N] (row stride ldy; float32, or bf16 rounded to nearest even when y_bf16) =
 * x [M, K] (row stride ldx; f32, or bf16 when x_bf16) times the packed weight (see the top;
 * sub16: d and m per 16 values), + bias [N] float32 (or NULL). K % 32 == 0. Returns 0, or -1
 * when the scratch buffer for the quantized activations cannot be allocated (y untouched). */
TGT_VNNI int kv_q_linear(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t* qs,
                         const float* d, const float* m, int bits, int sub16, int64_t N, const float* bias, void* y,
                         int64_t ldy, int y_bf16, int nthreads) {
    const int64_t KB = K / 32, G = (N + 3) / 4;
    if (M <= 0 || N <= 0) return 0;
    /* the quantized activations: a per-thread buffer kept between calls for small batches
     * (decode: no malloc per call), a fresh one for large */
    static __thread int8_t* keep = NULL;
    static __thread size_t keep_cap = 0;
    const size_t need = (size_t)(M * K + 4 * M * KB * 4) + 64;
    int8_t* xq;
    int own = 0;
    if (need <= keep_cap) {
        xq = keep;
    } else if (need <= (1u << 20)) {
        int8_t* nb = (int8_t*)realloc(keep, need);
        if (!nb) return -1;
        keep = xq = nb;
        keep_cap = need;
    } else {
        xq = (int8_t*)malloc(need);
        if (!xq) return -1;
        own = 1;
    }
    float* xs = (float*)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    float* xss = xs + M * KB;
    float* xss16 = sub16 ? xss + M * KB : NULL; /* [M][KB][2] */
    if (M * K >= 4096 && nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t i = 0; i < M; i++) q_quantize_row(x, ldx, x_bf16, K, i, xq, xs, xss, xss16);
    } else {
        for (int64_t i = 0; i < M; i++) q_quantize_row(x, ldx, x_bf16, K, i, xq, xs, xss, xss16);
    }
    if (nthreads <= 1) {
        q_groups(xq, xs, xss, xss16, M, K, qs, d, m, bits, sub16, N, bias, y, ldy, y_bf16, 0, G);
    } else {
#pragma omp parallel num_threads(nthreads)
        {
            int64_t g0, g1;
            thread_share(G, &g0, &g1);
            q_groups(xq, xs, xss, xss16, M, K, qs, d, m, bits, sub16, N, bias, y, ldy, y_bf16, g0, g1);
        }
    }
    if (own) free(xq);
    return 0;
}

/* ---- Weight-only: float activations ---------------------------------------------------------
 * The same packed weight, dequantized in registers to exactly the float32 values the loader's
 * dequantization gives (d * u + m, one rounding; bf16 models: then rounded to bf16, RNE, as the
 * dequantized bf16 model holds them) and multiplied with the activations as the float kernels
 * do (float32 FMA; bf16: VDPBF16PS on bf16 pairs, float32 accumulation). The numbers are those
 * of the dequantized model up to the order of the float32 additions (as gemv against oneDNN),
 * so prefill (dequantized chunks + F.linear) and decode agree to that order. */
#define WMB 4

/* one block (32 values) of row r of a group as 2 x 16 float32; d, m: the block's scales
 * (dh: 4 with sub16, the second half's four, else 0). 4-bit values under one scale pair (not
 * sub16) are looked up in the block's table of its 16 possible values (d * j + m, j = 0..15: the
 * same fma per value, so the same numbers) with VPERMPS, which reads the low 4 bits of each
 * index: 5 vector operations instead of 7. */
INLINE TGT_BF16 void wo_deq(const uint8_t* p, int bits, int r, const float* d, const float* m, int dh, __m512* lo,
                            __m512* hi) {
    __m512i ul, uh;
    if (bits == 4) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * r)));
        if (!dh) {
            const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d[r]), iota, _mm512_set1_ps(m[r]));
            *lo = _mm512_permutexvar_ps(w, table);
            *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table);
            return;
        }
        ul = _mm512_and_si512(w, _mm512_set1_epi32(0x0f));
        uh = _mm512_srli_epi32(w, 4);
    } else {
        ul = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * r)));
        uh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 64 + 16 * r)));
    }
    *lo = _mm512_fmadd_ps(_mm512_set1_ps(d[r]), _mm512_cvtepi32_ps(ul), _mm512_set1_ps(m[r]));
    *hi = _mm512_fmadd_ps(_mm512_set1_ps(d[dh + r]), _mm512_cvtepi32_ps(uh), _mm512_set1_ps(m[dh + r]));
}

/* The same block as 32 bf16 (each value rounded once, RNE, as the dequantized bf16 model holds
 * it). 4-bit values under one scale pair: the 16-value table rounded to bf16 and held twice
 * (lanes 0-15 and 16-31), looked up with VPERMW on the values widened to 16 bits, the high
 * nibbles shifted down in the upper 16 lanes; VPERMW reads the low 5 bits of an index, so the
 * low lanes need no mask (bit 4, a bit of the high nibble, selects the table's second copy):
 * 5 vector operations instead of 8. */
INLINE TGT_BF16 __m512bh wo_deq_bf16(const uint8_t* p, int bits, int r, const float* d, const float* m, int dh) {
    if (bits == 4 && !dh) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(d[r]), iota, _mm512_set1_ps(m[r]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);
        const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x00040004, 0x00040004, 0x00040004,
                                                 0x00040004, 0x00040004, 0x00040004, 0x00040004, 0x00040004);
        const __m512i u = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p + 16 * r))));
        return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(u, shifts), table);
    }
    __m512 lo, hi;
    wo_deq(p, bits, r, d, m, dh, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* acc[i][r] += (the 32 values of weight row r at column k) . (those of activation row i), for nm rows
 * of x: bf16 weights w[r] and x, VDPBF16PS. Both weight paths (decoded in registers, read from
 * the scratch buffer) run it; nm is a constant where it is inlined, so acc stays in registers. */
INLINE TGT_BF16 void wo_mac_bf16(__m512 acc[][4], int nm, const __m512bh w[4], const void* x, int64_t ldx,
                                 int64_t k) {
    for (int i = 0; i < nm; i++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t*)x + i * ldx + k);
        for (int r = 0; r < 4; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w[r], xv);
    }
}

/* The same with float32 weights (halves wl[r], wh[r]) and x: two FMAs. */
INLINE TGT_BF16 void wo_mac_f32(__m512 acc[][4], int nm, const __m512 wl[4], const __m512 wh[4], const void* x,
                                int64_t ldx, int64_t k) {
    for (int i = 0; i < nm; i++) {
        const float* xr = (const float*)x + i * ldx + k;
        const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
        for (int r = 0; r < 4; r++) acc[i][r] = _mm512_fmadd_ps(x1, wh[r], _mm512_fmadd_ps(x0, wl[r], acc[i][r]));
    }
}

/* out[i][r] = the horizontal sums of acc, for nm rows. */
INLINE TGT_BF16 void wo_sums(__m512 acc[][4], int nm, float out[WMB][4]) {
    for (int i = 0; i < nm; i++)
        for (int r = 0; r < 4; r++) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

#define WO_BLOCK(NM)                                                                                               \
    INLINE TGT_BF16 void wo_block_##NM(const uint8_t* qs, const float* d, const float* m, int bits, int sub16,     \
                                       int64_t KB, const void* x, int64_t ldx, int bf, float out[WMB][4]) {       \
        __m512 acc[NM][4];                                                                                         \
        for (int i = 0; i < NM; i++)                                                                               \
            for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();                                           \
        const int64_t step = bits == 4 ? 64 : 128, dstep = sub16 ? 8 : 4;                                          \
        const int dh = sub16 ? 4 : 0;                                                                              \
        for (int64_t b = 0; b < KB; b++) {                                                                         \
            const uint8_t* p = qs + b * step;                                                                      \
            _mm_prefetch((const char*)p + QPF, _MM_HINT_T0);                                                       \
            if (bits == 8) _mm_prefetch((const char*)p + QPF + 64, _MM_HINT_T0);                                   \
            if (bf) {                                                                                              \
                __m512bh w[4];                                                                                     \
                for (int r = 0; r < 4; r++) w[r] = wo_deq_bf16(p, bits, r, d + dstep * b, m + dstep * b, dh);     \
                wo_mac_bf16(acc, NM, w, x, ldx, 32 * b);                                                           \
            } else {                                                                                               \
                __m512 wl[4], wh[4];                                                                               \
                for (int r = 0; r < 4; r++) wo_deq(p, bits, r, d + dstep * b, m + dstep * b, dh, &wl[r], &wh[r]);  \
                wo_mac_f32(acc, NM, wl, wh, x, ldx, 32 * b);                                                       \
            }                                                                                                      \
        }                                                                                                          \
        wo_sums(acc, NM, out);                                                                                     \
    }
WO_BLOCK(1) WO_BLOCK(2) WO_BLOCK(3) WO_BLOCK(4)

/* Batches of more than WMB rows: each group of 4 weight rows is dequantized once into a per-thread
 * scratch buffer (4 x K values, L1/L2-resident: the same bf16 or float32 values wo_deq gives), and
 * every group of up to WMB activation rows runs on it. Redoing the dequantization for every group
 * of activation rows cost more than the dot products (SmolLM2 Q4_1 decode steps of 9 sequences
 * spent 2.6x the time of 4); the sums are the same, in the same order, bit for bit. */
INLINE TGT_BF16 void wo_deq_group(const uint8_t* qs, const float* d, const float* m, int bits, int sub16, int64_t KB,
                                  int64_t K, int bf, void* buf) {
    const int64_t step = bits == 4 ? 64 : 128, dstep = sub16 ? 8 : 4;
    const int dh = sub16 ? 4 : 0;
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t* p = qs + b * step;
        _mm_prefetch((const char*)p + QPF, _MM_HINT_T0);
        if (bits == 8) _mm_prefetch((const char*)p + QPF + 64, _MM_HINT_T0);
        for (int r = 0; r < 4; r++) {
            if (bf) {
                _mm512_storeu_si512((uint16_t*)buf + r * K + 32 * b,
                                    (__m512i)wo_deq_bf16(p, bits, r, d + dstep * b, m + dstep * b, dh));
            } else {
                __m512 lo, hi;
                wo_deq(p, bits, r, d + dstep * b, m + dstep * b, dh, &lo, &hi);
                _mm512_storeu_ps((float*)buf + r * K + 32 * b, lo);
                _mm512_storeu_ps((float*)buf + r * K + 32 * b + 16, hi);
            }
        }
    }
}

#define WOS_BLOCK(NM)                                                                                              \
    INLINE TGT_BF16 void wos_block_##NM(const void* buf, int64_t K, const void* x, int64_t ldx, int bf,            \
                                        float out[WMB][4]) {                                                       \
        __m512 acc[NM][4];                                                                                         \
        for (int i = 0; i < NM; i++)                                                                               \
            for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();                                           \
        for (int64_t k = 0; k < K; k += 32) {                                                                      \
            if (bf) {                                                                                              \
                __m512bh w[4];                                                                                     \
                for (int r = 0; r < 4; r++) w[r] = (__m512bh)_mm512_loadu_si512((const uint16_t*)buf + r * K + k); \
                wo_mac_bf16(acc, NM, w, x, ldx, k);                                                                \
            } else {                                                                                               \
                __m512 wl[4], wh[4];                                                                               \
                for (int r = 0; r < 4; r++) {                                                                      \
                    wl[r] = _mm512_loadu_ps((const float*)buf + r * K + k);                                        \
                    wh[r] = _mm512_loadu_ps((const float*)buf + r * K + k + 16);                                   \
                }                                                                                                  \
                wo_mac_f32(acc, NM, wl, wh, x, ldx, k);                                                            \
            }                                                                                                      \
        }                                                                                                          \
        wo_sums(acc, NM, out);                                                                                     \
    }
WOS_BLOCK(1) WOS_BLOCK(2) WOS_BLOCK(3) WOS_BLOCK(4)

/* Rows m0 .. m0 + nm - 1, columns 4 g .. 4 g + nr - 1 of y from the sums s (+ bias). */
INLINE TGT_BF16 void wo_store(const float s[WMB][4], int64_t m0, int64_t nm, int64_t g, int64_t nr, const float* bias,
                              int bf, void* y, int64_t ldy) {
    for (int64_t i = 0; i < nm; i++)
        for (int64_t r = 0; r < nr; r++) {
            const int64_t row = m0 + i, col = 4 * g + r;
            const float v = s[i][r] + (bias ? bias[col] : 0.0f);
            if (bf) ((uint16_t*)y)[row * ldy + col] = f32_to_bf16(v);
            else ((float*)y)[row * ldy + col] = v;
        }
}

/* Row groups [g0, g1) of kv_q_linear_wo on the calling thread. */
static TGT_BF16 void wo_groups(const void* x, int64_t ldx, int bf, int64_t M, int64_t K, const uint8_t* qs,
                               const float* d, const float* m, int bits, int sub16, int64_t N, const float* bias,
                               void* y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t KB = K / 32, gbytes = KB * (bits == 4 ? 64 : 128), gsc = KB * (sub16 ? 8 : 4);
    void* buf = M > WMB && g1 > g0 ? aligned_alloc(64, (size_t)(4 * K * (bf ? 2 : 4))) : NULL;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t nr = N - 4 * g < 4 ? N - 4 * g : 4;
        const uint8_t* gq = qs + g * gbytes;
        const float *gd = d + g * gsc, *gm = m + g * gsc;
        if (buf) wo_deq_group(gq, gd, gm, bits, sub16, KB, K, bf, buf);
        for (int64_t m0 = 0; m0 < M; m0 += WMB) {
            const int64_t nm = M - m0 < WMB ? M - m0 : WMB;
            const void* xm = bf ? (const void*)((const uint16_t*)x + m0 * ldx) : (const void*)((const float*)x + m0 * ldx);
            float s[WMB][4];
            if (buf) {
                switch (nm) {
                    case 1: wos_block_1(buf, K, xm, ldx, bf, s); break;
                    case 2: wos_block_2(buf, K, xm, ldx, bf, s); break;
                    case 3: wos_block_3(buf, K, xm, ldx, bf, s); break;
                    default: wos_block_4(buf, K, xm, ldx, bf, s); break;
                }
            } else {
                switch (nm) {
                    case 1: wo_block_1(gq, gd, gm, bits, sub16, KB, xm, ldx, bf, s); break;
                    case 2: wo_block_2(gq, gd, gm, bits, sub16, KB, xm, ldx, bf, s); break;
                    case 3: wo_block_3(gq, gd, gm, bits, sub16, KB, xm, ldx, bf, s); break;
                    default: wo_block_4(gq, gd, gm, bits, sub16, KB, xm, ldx, bf, s); break;
                }
            }
            wo_store(s, m0, nm, g, nr, bias, bf, y, ldy);
        }
    }
    free(buf);
}

/* y [M, N] = x [M, K] times the packed weight (see above; sub16: d and m per 16 values), + bias
 * [N] float32 or NULL; x and y both float32 (bf = 0) or both bf16 (bf = 1; needs AVX512_BF16).
 * K % 32 == 0. Up to WMB rows: dequantized in registers, one pass; more: through the scratch
 * buffer (wo_deq_group; where it cannot be allocated, in registers once per WMB rows). */
TGT_BF16 void kv_q_linear_wo(const void* x, int64_t ldx, int bf, int64_t M, int64_t K, const uint8_t* qs,
                             const float* d, const float* m, int bits, int sub16, int64_t N, const float* bias,
                             void* y, int64_t ldy, int nthreads) {
    const int64_t G = (N + 3) / 4;
    if (M <= 0 || N <= 0) return;
    if (nthreads <= 1) {
        wo_groups(x, ldx, bf, M, K, qs, d, m, bits, sub16, N, bias, y, ldy, 0, G);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int64_t g0, g1;
        thread_share(G, &g0, &g1);
        wo_groups(x, ldx, bf, M, K, qs, d, m, bits, sub16, N, bias, y, ldy, g0, g1);
    }
}

/* kv_q_linear behind the gemv kernels' signature (gemv.c: x, ldx, w, bias, y, ldy, M, N, K,
 * nthreads), so that the one-call decode step (cpu_ops.c kv_decode_step) runs it: `w` points
 * to a kv_qweight_t describing the packed weight (its bias there; `bias` is ignored), x and y
 * in the dtype it names. If the activation buffer cannot be allocated, y is filled with NaN.
 * A descriptor with `dense` set describes a float weight instead (a model whose linears are
 * quantized but whose LM head is not, as with int4): `qs` is the [N, K] weight and `dense` a
 * gemv of gemv.c's signature (kv_gemv_bf16 / kv_gemv_f32), called with the descriptor's bias. */
typedef void (*kv_gemv_fn)(const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t,
                           int);
typedef struct {
    const uint8_t* qs;
    const float* d;
    const float* m;
    const float* bias;
    int64_t bits;
    int64_t bf16;
    int64_t int8_act; /* 1: kv_q_linear (int8 activations), 0: kv_q_linear_wo */
    int64_t sub16;    /* d and m per 16 values */
    kv_gemv_fn dense; /* non-NULL: a float weight (qs) for this gemv; bias in its dtype */
} kv_qweight_t;

TGT_BF16 void kv_q_gemv(const void* x, int64_t ldx, const void* w, const void* bias, void* y, int64_t ldy, int64_t M,
                        int64_t N, int64_t K, int nthreads) {
    (void)bias;
    const kv_qweight_t* q = (const kv_qweight_t*)w;
    if (q->dense) {
        q->dense(x, ldx, q->qs, q->bias, y, ldy, M, N, K, nthreads);
        return;
    }
    if (!q->int8_act) {
        kv_q_linear_wo(x, ldx, (int)q->bf16, M, K, q->qs, q->d, q->m, (int)q->bits, (int)q->sub16, N, q->bias, y, ldy,
                       nthreads);
        return;
    }
    if (kv_q_linear(x, ldx, (int)q->bf16, M, K, q->qs, q->d, q->m, (int)q->bits, (int)q->sub16, N, q->bias, y, ldy,
                    (int)q->bf16, nthreads)) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) {
                if (q->bf16) ((uint16_t*)y)[i * ldy + n] = 0x7fc0;
                else ((float*)y)[i * ldy + n] = __builtin_nanf("");
            }
    }
}

TGT_F32 static void deq_row_f32(const uint8_t* qs, const float* d, const float* m, int bits, int sub16, int64_t KB,
                                int64_t row, float* out) {
    const int64_t g = row / 4, r = row % 4, ds = sub16 ? 8 : 4, dh = sub16 ? 4 : 0;
    const int64_t gbytes = KB * (bits == 4 ? 64 : 128);
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int64_t b = 0; b < KB; b++) {
        const int64_t at = (g * KB + b) * ds + r;
        __m512i ul, uh;
        if (bits == 4) {
            const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qs + g * gbytes + b * 64 + 16 * r)));
            ul = _mm512_and_si512(w, low);
            uh = _mm512_srli_epi32(w, 4);
        } else {
            const uint8_t* p = qs + g * gbytes + b * 128 + 16 * r;
            ul = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
            uh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 64)));
        }
        _mm512_storeu_ps(out + 32 * b, _mm512_fmadd_ps(_mm512_set1_ps(d[at]), _mm512_cvtepi32_ps(ul),
                                                       _mm512_set1_ps(m[at])));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_fmadd_ps(_mm512_set1_ps(d[at + dh]), _mm512_cvtepi32_ps(uh),
                                                            _mm512_set1_ps(m[at + dh])));
    }
}

TGT_BF16 static void f32_to_bf16_row(const float* in, uint16_t* out, int64_t K) {
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i*)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + k)));
}

/* Rows [r0, r1) of the packed weight as float32 (out_bf16 = 0) or bf16 (1; needs AVX512_BF16),
 * out [(r1 - r0), K] row-major: d * u + m with one rounding (FMA; equal to ggml's dequantization
 * for every type here: d * u is exact in float32 for all but Q6_K, whose d * (u - 32) ggml rounds
 * once, as the FMA does). Returns 0, or -1 when a row buffer cannot be allocated (out then
 * incomplete). */
TGT_F32 int kv_q_dequant(const uint8_t* qs, const float* d, const float* m, int bits, int sub16, int64_t K, int64_t r0,
                         int64_t r1, void* out, int out_bf16, int nthreads) {
    const int64_t KB = K / 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float* tmp = out_bf16 ? (float*)aligned_alloc(64, (size_t)K * 4) : NULL;
        if (out_bf16 && !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = r0; row < r1; row++) {
            if (out_bf16) {
                if (tmp) {
                    deq_row_f32(qs, d, m, bits, sub16, KB, row, tmp);
                    f32_to_bf16_row(tmp, (uint16_t*)out + (row - r0) * K, K);
                }
            } else {
                deq_row_f32(qs, d, m, bits, sub16, KB, row, (float*)out + (row - r0) * K);
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}

/* Rows ids[0 .. n) of the packed weight dequantized, as kv_q_dequant gives them (an embedding
 * lookup on a quantized table): out [n, K] row-major, float32 (out_bf16 = 0) or bf16 (1: the
 * float32 values rounded to nearest even; needs AVX512_BF16). Each id must be in [0, N) (not
 * checked here). Rows are split across nthreads. Returns 0, or -1 when a row buffer cannot be
 * allocated (out then incomplete). */
TGT_F32 int kv_q_gather(const uint8_t* qs, const float* d, const float* m, int bits, int sub16, int64_t K,
                        const int64_t* ids, int64_t n, void* out, int out_bf16, int nthreads) {
    const int64_t KB = K / 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float* tmp = out_bf16 ? (float*)aligned_alloc(64, (size_t)K * 4) : NULL;
        if (out_bf16 && !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (!out_bf16) deq_row_f32(qs, d, m, bits, sub16, KB, ids[i], (float*)out + i * K);
            else if (tmp) {
                deq_row_f32(qs, d, m, bits, sub16, KB, ids[i], tmp);
                f32_to_bf16_row(tmp, (uint16_t*)out + i * K, K);
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}

/* kv_q_gemv for the output rows [n0, n1) of the weight only (n0 a multiple of 4: the packed
 * weight's row groups; n1 a multiple of 4 or N), on the calling thread: the one-call decode
 * step (cpu_ops.c, decode_step_team) splits each GEMV's rows between its threads with it. */
TGT_BF16 void kv_q_gemv_rows(const void* x, int64_t ldx, const void* w, const void* bias, void* y, int64_t ldy,
                             int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    (void)N;
    (void)bias;
    const kv_qweight_t* q = (const kv_qweight_t*)w;
    const int64_t es = q->bf16 ? 2 : 4;
    if (q->dense) { /* a float [N, K] weight (and bias) in the activations' dtype: rows n0..n1 */
        q->dense(x, ldx, q->qs + n0 * K * es, q->bias ? (const char*)q->bias + n0 * es : NULL, (char*)y + n0 * es, ldy,
                 M, n1 - n0, K, 1);
        return;
    }
    const int64_t KB = K / 32, g0 = n0 / 4, gbytes = KB * (q->bits == 4 ? 64 : 128), gsc = KB * (q->sub16 ? 8 : 4);
    kv_qweight_t part = *q;
    part.qs = q->qs + g0 * gbytes;
    part.d = q->d + g0 * gsc;
    part.m = q->m + g0 * gsc;
    part.bias = q->bias ? q->bias + n0 : NULL;
    kv_q_gemv(x, ldx, &part, bias, (char*)y + n0 * es, ldy, M, n1 - n0, K, 1);
}
