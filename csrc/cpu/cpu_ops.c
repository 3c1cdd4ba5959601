/* kvserve fused CPU ops (see kvserve/kernels/cpu_ops.py). Every function takes `bf` = 1 for bfloat16 data
 * (uint16 storage), 0 for float32; the always-inline helpers specialise on it. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <omp.h>

/* KV_AVX512BF16 (defined by setup.py for the cpu_ops_avx512bf16 variant, which the loader picks
 * on CPUs with AVX512_BF16): float32 -> bf16 rounding by VCVTNEPS2BF16, one instruction instead
 * of seven (SiLU-and-mul and RMSNorm ~1.3x faster), and the AVX512-BF16 prefill attention
 * kernel (prefill_dp) that bf16 prefill runs on where AMX is absent. */
#ifdef KV_AVX512BF16
#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))
#else
#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAXV 16 /* head_dim <= 256 */

INLINE TGT __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

INLINE TGT __m512 bf16x16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16, round to nearest even, NaN kept quiet (as c10::BFloat16; VCVTNEPS2BF16
 * also flushes float32 denormals, below 1.2e-38 in magnitude, to zero). */
INLINE TGT __m256i ps_to_bf16x16(__m512 v) {
#ifdef KV_AVX512BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

INLINE TGT __m512 ld(const void* p, int64_t i, __mmask16 m, int bf) {
    if (bf) return bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t*)p + i));
    return _mm512_maskz_loadu_ps(m, (const float*)p + i);
}

INLINE TGT void st(void* p, int64_t i, __m512 v, __mmask16 m, int bf) {
    if (bf) _mm256_mask_storeu_epi16((uint16_t*)p + i, m, ps_to_bf16x16(v));
    else _mm512_mask_storeu_ps((float*)p + i, m, v);
}

/* The value a PyTorch op in the model dtype would store: identity in float32. */
INLINE TGT __m512 rnd(__m512 v, int bf) { return bf ? bf16x16_to_ps(ps_to_bf16x16(v)) : v; }

INLINE const void* at(const void* p, int64_t i, int bf) { return (const char*)p + i * (bf ? 2 : 4); }
INLINE void* atw(void* p, int64_t i, int bf) { return (char*)p + i * (bf ? 2 : 4); }

/* exp(x), Cephes expf polynomial on [-ln2/2, ln2/2] and 2^n by VSCALEFPS (~1 ulp). */
INLINE TGT __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ---- RMSNorm, optionally fused with the residual add --------------------------------------
 * With residual (vLLM's fused_add_rms_norm):  residual = x + residual;  out = norm(residual).
 * Without:                                      out = norm(x).
 * norm(h) = w * to_dtype(h * rsqrt(mean(h^2) + eps)), h in float32 (Hugging Face LlamaRMSNorm). */
/* 1 / sqrt(mean(x^2) + eps) over a row of dim values, in float32, broadcast to a vector. */
INLINE TGT __m512 inv_rms(const void* x, int64_t dim, float eps, int bf) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = ld(x, i, tail_mask(dim - i), bf);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
}

INLINE TGT void rms_norm_row(const void* x, void* res, const void* w, void* out, int64_t dim, float eps, int bf) {
    const void* src = x;
    if (res) {
        for (int64_t i = 0; i < dim; i += 16) {
            __mmask16 m = tail_mask(dim - i);
            st(res, i, _mm512_add_ps(ld(x, i, m, bf), ld(res, i, m, bf)), m, bf);
        }
        src = res;
    }
    const __m512 vinv = inv_rms(src, dim, eps, bf);
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = tail_mask(dim - i);
        __m512 h = rnd(_mm512_mul_ps(ld(src, i, m, bf), vinv), bf);
        st(out, i, _mm512_mul_ps(ld(w, i, m, bf), h), m, bf);
    }
}

TGT void kv_rms_norm(const void* x, int64_t ldx, void* res, int64_t ldr, const void* w, void* out, int64_t ldo,
                     int64_t M, int64_t dim, float eps, int bf, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (bf)
            rms_norm_row(at(x, m * ldx, 1), res ? atw(res, m * ldr, 1) : NULL, w, atw(out, m * ldo, 1), dim, eps, 1);
        else
            rms_norm_row(at(x, m * ldx, 0), res ? atw(res, m * ldr, 0) : NULL, w, atw(out, m * ldo, 0), dim, eps, 0);
    }
}

/* ---- SiLU-and-mul (SwiGLU): out = to_dtype(silu(gate)) * up, x = [gate | up] ------------ */
INLINE TGT void silu_mul_row(const void* x, void* out, int64_t I, int bf) {
    for (int64_t i = 0; i < I; i += 16) {
        __mmask16 m = tail_mask(I - i);
        __m512 g = ld(x, i, m, bf), u = ld(x, I + i, m, bf);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        st(out, i, _mm512_mul_ps(rnd(s, bf), u), m, bf);
    }
}

TGT void kv_silu_and_mul(const void* x, int64_t ldx, void* out, int64_t ldo, int64_t M, int64_t I, int bf,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (bf) silu_mul_row(at(x, m * ldx, 1), atw(out, m * ldo, 1), I, 1);
        else silu_mul_row(at(x, m * ldx, 0), atw(out, m * ldo, 0), I, 0);
    }
}

/* ---- Log partition of logit rows (the sampler's logprobs) ----------------------------------
 * lse_row = log(sum_v exp(x[v] - mx)), mx the row maximum (finite); -inf logits add 0. Float32
 * or bf16 rows (bf16 values widen exactly, so a bf16 row gives the float of its float32 copy). */
INLINE TGT float lse_row(const void* row, int64_t V, float mxv, int bf) {
    const __m512 vm = _mm512_set1_ps(mxv), ninf = _mm512_set1_ps(-INFINITY);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t v = 0;
    for (; v + 32 <= V; v += 32) {
        const __m512 a = ld(row, v, 0xffff, bf), b = ld(row, v + 16, 0xffff, bf);
        acc0 = _mm512_add_ps(acc0, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, ninf, _CMP_NEQ_OQ),
                                                       exp_ps(_mm512_sub_ps(a, vm))));
        acc1 = _mm512_add_ps(acc1, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, ninf, _CMP_NEQ_OQ),
                                                       exp_ps(_mm512_sub_ps(b, vm))));
    }
    for (; v < V; v += 16) {
        const __mmask16 t = tail_mask(V - v);
        const __m512 a = ld(row, v, t, bf);
        acc0 = _mm512_add_ps(acc0, _mm512_maskz_mov_ps(t & _mm512_cmp_ps_mask(a, ninf, _CMP_NEQ_OQ),
                                                       exp_ps(_mm512_sub_ps(a, vm))));
    }
    return logf(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)));
}

/* out[m] = lse_row of float32 row m with its maximum mx[m]. */
TGT void kv_log_sum_exp(const float* x, int64_t ldx, const float* mx, float* out, int64_t M, int64_t V,
                        int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) out[m] = lse_row(x + m * ldx, V, mx[m], 0);
}

/* ---- Token bitmask (structured output), in place ------------------------------------------
 * Mask row m (int32, W words) applies to row rows[m] of x (float32, stride ldx; row m when rows
 * is NULL): column v keeps its value where bit v % 32 of word v / 32 is set and becomes -inf
 * otherwise (columns at or past 32 * W included). Branch-free: 16 columns per masked blend. */
TGT void kv_apply_token_bitmask(float* x, int64_t ldx, const int32_t* mask, int64_t W, const int64_t* rows,
                                int64_t M, int64_t V, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float* row = x + (rows ? rows[m] : m) * ldx;
        const uint32_t* bits = (const uint32_t*)(mask + m * W);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (int64_t v = 0; v < V; v += 16) {
            const __mmask16 t = tail_mask(V - v);
            const int64_t w = v >> 5;
            const __mmask16 keep = w < W ? (__mmask16)(bits[w] >> (v & 31)) : (__mmask16)0;
            const __m512 a = _mm512_maskz_loadu_ps(t, row + v);
            _mm512_mask_storeu_ps(row + v, t, _mm512_mask_mov_ps(ninf, keep, a));
        }
    }
}

/* ---- Greedy choice over logit rows --------------------------------------------------------
 * Per row m of x (float32 or bf16, stride ldx): token[m] = the first index of the row maximum,
 * row_max[m] (unless row_max is NULL) = that maximum and log_z[m] = lse_row, or with logprob != 0
 * its negation -lse_row, the token's logprob; token[m] = -1 (and log_z[m] NaN) when the maximum
 * is not finite (a NaN or +-inf in the row's max). Returns the number of such rows. */
TGT int kv_greedy(const void* x, int64_t ldx, int bf, int64_t* token, float* row_max, float* log_z, int64_t M,
                  int64_t V, int nthreads, int logprob) {
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad) if (nthreads > 1)
    for (int64_t m = 0; m < M; m++) {
        const void* row = at(x, m * ldx, bf);
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t v = 0; v < V; v += 16) {
            const __mmask16 t = tail_mask(V - v);
            const __m512 a = ld(row, v, t, bf);
            nan |= _mm512_mask_cmp_ps_mask(t, a, a, _CMP_UNORD_Q);
            vmax = _mm512_mask_max_ps(vmax, t, vmax, a);
        }
        const float mxv = _mm512_reduce_max_ps(vmax);
        if (row_max) row_max[m] = mxv;
        if (nan || !isfinite(mxv)) {
            token[m] = -1;
            log_z[m] = NAN;
            bad++;
            continue;
        }
        const __m512 vm = _mm512_set1_ps(mxv);
        int64_t idx = -1;
        for (int64_t v = 0; v < V && idx < 0; v += 16) {
            const __mmask16 t = tail_mask(V - v);
            const __mmask16 eq = _mm512_mask_cmp_ps_mask(t, ld(row, v, t, bf), vm, _CMP_EQ_OQ);
            if (eq) idx = v + __builtin_ctz((unsigned)eq);
        }
        token[m] = idx;
        const float lz = lse_row(row, V, mxv, bf);
        log_z[m] = logprob ? 0.0f - lz : lz;
    }
    return bad;
}

/* ---- RoPE (GPT-NeoX / Hugging Face rotate_half layout), in place ---------------------------
 * x: T rows (stride ldx) of nheads heads of hd values; row t rotated by position pos[t]:
 *   x1' = x1*cos1 - x2*sin1,  x2' = x2*cos2 + x1*sin2  (x1, x2 the two halves; tables [P, hd]),
 * rounded like `x * cos + rotate_half(x) * sin` in the model dtype. */
INLINE TGT void rope_row(void* x, int64_t nheads, int64_t hd, const void* c, const void* s, int bf) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < nheads; h++) {
        void* xh = atw(x, h * hd, bf);
        for (int64_t i = 0; i < half; i += 16) {
            __mmask16 m = tail_mask(half - i);
            __m512 x1 = ld(xh, i, m, bf), x2 = ld(xh, half + i, m, bf);
            __m512 c1 = ld(c, i, m, bf), c2 = ld(c, half + i, m, bf);
            __m512 s1 = ld(s, i, m, bf), s2 = ld(s, half + i, m, bf);
            __m512 y1 = _mm512_add_ps(rnd(_mm512_mul_ps(x1, c1), bf),
                                      rnd(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1), bf));
            __m512 y2 = _mm512_add_ps(rnd(_mm512_mul_ps(x2, c2), bf), rnd(_mm512_mul_ps(x1, s2), bf));
            st(xh, i, y1, m, bf);
            st(xh, half + i, y2, m, bf);
        }
    }
}

TGT void kv_rope(void* x, int64_t ldx, int64_t T, int64_t nheads, int64_t hd, const int64_t* pos, const void* cos,
                 const void* sin, int bf, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        if (bf) rope_row(atw(x, t * ldx, 1), nheads, hd, at(cos, pos[t] * hd, 1), at(sin, pos[t] * hd, 1), 1);
        else rope_row(atw(x, t * ldx, 0), nheads, hd, at(cos, pos[t] * hd, 0), at(sin, pos[t] * hd, 0), 0);
    }
}

/* ---- Gemma RMSNorm (zero-centred weight), optionally the sandwich residual add --------------
 * gnorm(x; w) = to_dtype((x * rsqrt(mean(x^2) + eps)) * (1 + w)), x and 1 + w in float32,
 * rounded once at the end (Hugging Face Gemma3RMSNorm). In place is allowed (out == x). */
INLINE TGT void gemma_norm_row(const void* x, const void* w, void* out, int64_t dim, float eps, int bf) {
    const __m512 vinv = inv_rms(x, dim, eps, bf);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = tail_mask(dim - i);
        __m512 h = _mm512_mul_ps(ld(x, i, m, bf), vinv);
        st(out, i, _mm512_mul_ps(h, _mm512_add_ps(one, ld(w, i, m, bf))), m, bf);
    }
}

/* Sandwich step: res = res + gnorm(x; w) (the norm rounded to the dtype, then the add rounded,
 * as PyTorch's `h + norm(a)`); then, when w2 is given, out = gnorm(res; w2) (the next norm). */
INLINE TGT void gemma_add_norm_row(const void* x, void* res, const void* w, const void* w2, void* out, int64_t dim,
                                   float eps, int bf) {
    const __m512 vinv = inv_rms(x, dim, eps, bf);
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 acc2 = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = tail_mask(dim - i);
        __m512 n = rnd(_mm512_mul_ps(_mm512_mul_ps(ld(x, i, m, bf), vinv), _mm512_add_ps(one, ld(w, i, m, bf))), bf);
        __m512 r = rnd(_mm512_add_ps(ld(res, i, m, bf), n), bf);
        st(res, i, r, m, bf);
        acc2 = _mm512_fmadd_ps(r, r, acc2);
    }
    if (!w2) return;
    const __m512 vinv2 = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc2) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = tail_mask(dim - i);
        __m512 h = _mm512_mul_ps(ld(res, i, m, bf), vinv2);
        st(out, i, _mm512_mul_ps(h, _mm512_add_ps(one, ld(w2, i, m, bf))), m, bf);
    }
}

/* res == NULL: out = gnorm(x; w).  Else: res = res + gnorm(x; w), and out = gnorm(res; w2) when
 * w2 (and out) are given. M rows of dim values; row strides ldx, ldr, ldo. */
TGT void kv_gemma_rms_norm(const void* x, int64_t ldx, const void* w, void* res, int64_t ldr, const void* w2,
                           void* out, int64_t ldo, int64_t M, int64_t dim, float eps, int bf, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (!res) {
            if (bf) gemma_norm_row(at(x, m * ldx, 1), w, atw(out, m * ldo, 1), dim, eps, 1);
            else gemma_norm_row(at(x, m * ldx, 0), w, atw(out, m * ldo, 0), dim, eps, 0);
        } else if (bf) {
            gemma_add_norm_row(at(x, m * ldx, 1), atw(res, m * ldr, 1), w, w2, w2 ? atw(out, m * ldo, 1) : NULL, dim,
                               eps, 1);
        } else {
            gemma_add_norm_row(at(x, m * ldx, 0), atw(res, m * ldr, 0), w, w2, w2 ? atw(out, m * ldo, 0) : NULL, dim,
                               eps, 0);
        }
    }
}

/* ---- Gemma QK-norm + RoPE, in place ----------------------------------------------------------
 * x: T rows (stride ldx) holding H query heads then KVH key heads of hd values (a fused QKV
 * output; v after them is untouched). Each head: gnorm with qw (query) or kw (key), rounded to
 * the dtype, then rope_row at position pos[t] (tables [P, hd]). */
INLINE TGT void qk_norm_rope_row(void* x, int64_t H, int64_t KVH, int64_t hd, const void* qw, const void* kw,
                                 float eps, const void* c, const void* s, int bf) {
    for (int64_t h = 0; h < H + KVH; h++) {
        void* xh = atw(x, h * hd, bf);
        gemma_norm_row(xh, h < H ? qw : kw, xh, hd, eps, bf);
        rope_row(xh, 1, hd, c, s, bf);
    }
}

TGT void kv_gemma_qk_norm_rope(void* x, int64_t ldx, int64_t T, int64_t H, int64_t KVH, int64_t hd, const void* qw,
                               const void* kw, float eps, const int64_t* pos, const void* cos, const void* sin, int bf,
                               int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        if (bf)
            qk_norm_rope_row(atw(x, t * ldx, 1), H, KVH, hd, qw, kw, eps, at(cos, pos[t] * hd, 1),
                             at(sin, pos[t] * hd, 1), 1);
        else
            qk_norm_rope_row(atw(x, t * ldx, 0), H, KVH, hd, qw, kw, eps, at(cos, pos[t] * hd, 0),
                             at(sin, pos[t] * hd, 0), 0);
    }
}

/* ---- GeGLU: out = to_dtype(gelu_tanh(gate)) * up, x = [gate | up] --------------------------
 * gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), evaluated in the order of
 * PyTorch's vectorized kernel (GeluKernel.cpp). tanh: Cephes tanhf, an odd polynomial for
 * |y| < 0.625, else 1 - 2 / (exp(2|y|) + 1) with the sign of y (~2 ulp), and exactly +-1 for
 * |y| > 8.6643 as PyTorch's vectorized tanh (Sleef) gives, so that gelu of gates below about
 * -4.9 is 0 as in PyTorch, not a value of ~1e-7. */
INLINE TGT __m512 tanh_ps(__m512 y) {
    const __m512 a = _mm512_abs_ps(y), one = _mm512_set1_ps(1.0f);
    const __m512 z = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), y, y);
    __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp_ps(_mm512_add_ps(a, a)), one)));
    big = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(8.664339742f), _CMP_GT_OQ), big, one);
    big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), /* the sign of y */
                                              _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN))));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
}

INLINE TGT __m512 gelu_tanh_ps(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                       _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g),
                         _mm512_add_ps(_mm512_set1_ps(1.0f), tanh_ps(inner)));
}

INLINE TGT void gelu_mul_row(const void* x, void* out, int64_t I, int bf) {
    for (int64_t i = 0; i < I; i += 16) {
        __mmask16 m = tail_mask(I - i);
        st(out, i, _mm512_mul_ps(rnd(gelu_tanh_ps(ld(x, i, m, bf)), bf), ld(x, I + i, m, bf)), m, bf);
    }
}

TGT void kv_gelu_tanh_and_mul(const void* x, int64_t ldx, void* out, int64_t ldo, int64_t M, int64_t I, int bf,
                              int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (bf) gelu_mul_row(at(x, m * ldx, 1), atw(out, m * ldo, 1), I, 1);
        else gelu_mul_row(at(x, m * ldx, 0), atw(out, m * ldo, 0), I, 0);
    }
}

/* ---- 8-bit KV cache (kv_quant.py) ----------------------------------------------------------
 * A pool row of one token and KV head is hd codes, then the head's float32 scale s; the value
 * is code * s in float32, rounded to the model dtype by whoever reads it. fmt 1: int8 codes,
 * s = max|x| / 127, code = round_half_even(x / s); fmt 2: FP8 E4M3 (OCP e4m3fn, max 448), s =
 * max|x| / 448, code = e4m3(x / s) rounded to nearest even. Both bit for bit as kv_quant.py's
 * PyTorch ops (IEEE division, round to nearest even; a zero row gets s = 1). */
#define KV_QROW(hd) ((hd) + 4) /* bytes of a pool row */

/* 16 e4m3 codes -> float32 (exact; normals by moving the bits, subnormals m * 2^-9). */
INLINE TGT __m512 fp8_to_ps(__m128i b) {
    const __m512i v = _mm512_cvtepu8_epi32(b);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512 nrm = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(7))),
                                     _mm512_set1_ps(1.0f / 512.0f));
    const __m512 r = _mm512_mask_mov_ps(sub, _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x78)), nrm);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),
                                               _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24)));
}

/* float32 -> e4m3 codes (|y| <= 448 expected; larger magnitudes saturate to 448), round to
 * nearest even as c10's conversion: below 2^-6 by adding 2^14 (whose float32 ulp is the e4m3
 * subnormal step 2^-9), above by rounding the mantissa to 3 bits. */
INLINE TGT __m128i ps_to_fp8(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)), 24);
    const __m512 a = _mm512_abs_ps(y);
    const __m512i ua = _mm512_castps_si512(a);
    __m512i n = _mm512_add_epi32(ua, _mm512_and_si512(_mm512_srli_epi32(ua, 20), _mm512_set1_epi32(1)));
    n = _mm512_srli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(0x7ffff - (120 << 23))), 20);
    n = _mm512_min_epi32(n, _mm512_set1_epi32(0x7e));
    const __m512i d = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, _mm512_set1_ps(16384.0f))),
                                       _mm512_set1_epi32(0x46800000));
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f / 64.0f), _CMP_LT_OQ);
    return _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_mask_mov_epi32(n, small, d), sign));
}

/* Dequantized values i .. i + 15 (mask m) of a pool row with scale vs, in float32. */
INLINE TGT __m512 ldq8(const uint8_t* row, int64_t i, __mmask16 m, __m512 vs, int fmt) {
    const __m128i b = _mm_maskz_loadu_epi8(m, row + i);
    const __m512 f = fmt == 1 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)) : fp8_to_ps(b);
    return _mm512_mul_ps(f, vs);
}

/* Quantize one row x (hd values, model dtype) into dst (hd codes + the scale). */
INLINE TGT void quant_row(const void* x, uint8_t* dst, int64_t hd, int bf, int fmt) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(ld(x, i, tail_mask(hd - i), bf)));
    const float a = _mm512_reduce_max_ps(amax);
    const float s = a > 0.0f ? a / (fmt == 1 ? 127.0f : 448.0f) : 1.0f;
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < hd; i += 16) {
        const __mmask16 m = tail_mask(hd - i);
        const __m512 y = _mm512_div_ps(ld(x, i, m, bf), vs);
        __m128i c;
        if (fmt == 1) {
            __m512i r = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            c = _mm512_cvtepi32_epi8(r);
        } else {
            c = ps_to_fp8(y);
        }
        _mm_mask_storeu_epi8(dst + i, m, c);
    }
    memcpy(dst + hd, &s, 4);
}

/* KV-cache write into 8-bit pools [.., KVH, hd + 4]: cache[slot[t]] = quantized k[t], v[t]
 * (KVH heads of hd model-dtype values per token, token strides ldk/ldv; slot < 0 skipped). */
TGT void kv_reshape_and_cache_q(const void* k, int64_t ldk, const void* v, int64_t ldv, void* k_cache, void* v_cache,
                                const int64_t* slots, int64_t T, int64_t KVH, int64_t hd, int bf, int fmt) {
    const int64_t rb = KV_QROW(hd);
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        uint8_t* kr = (uint8_t*)k_cache + slots[t] * KVH * rb;
        uint8_t* vr = (uint8_t*)v_cache + slots[t] * KVH * rb;
        for (int64_t h = 0; h < KVH; h++) {
            if (bf) {
                quant_row(at(k, t * ldk + h * hd, 1), kr + h * rb, hd, 1, fmt);
                quant_row(at(v, t * ldv + h * hd, 1), vr + h * rb, hd, 1, fmt);
            } else {
                quant_row(at(k, t * ldk + h * hd, 0), kr + h * rb, hd, 0, fmt);
                quant_row(at(v, t * ldv + h * hd, 0), vr + h * rb, hd, 0, fmt);
            }
        }
    }
}

/* Keys [0, L) of KV heads [g0, g0 + ns) of one sequence (block table bt, block size bs) of an
 * 8-bit pool, dequantized into dst [Lpad][ns][hd] in the model dtype (rows L .. Lpad - 1
 * zero). The attention kernels then read dst as a one-block cache of ns KV heads. */
INLINE TGT void dequant_ctx(const uint8_t* cache, const int64_t* bt, int64_t L, int64_t Lpad, int64_t bs, int64_t KVH,
                            int64_t hd, int64_t g0, int64_t ns, void* dst, int bf, int fmt) {
    const int64_t rb = KV_QROW(hd);
    for (int64_t j = 0; j < L; j++) {
        const uint8_t* src = cache + ((bt[j / bs] * bs + j % bs) * KVH + g0) * rb;
        if (j + 8 < L) { /* the row 8 keys ahead */
            const char* nx = (const char*)(cache + ((bt[(j + 8) / bs] * bs + (j + 8) % bs) * KVH + g0) * rb);
            for (int64_t b = 0; b < ns * rb; b += 64) _mm_prefetch(nx + b, _MM_HINT_T0);
        }
        for (int64_t h = 0; h < ns; h++) {
            const uint8_t* r = src + h * rb;
            float s;
            memcpy(&s, r + hd, 4);
            const __m512 vs = _mm512_set1_ps(s);
            for (int64_t i = 0; i < hd; i += 16) {
                const __mmask16 m = tail_mask(hd - i);
                if (bf) st(dst, (j * ns + h) * hd + i, ldq8(r, i, m, vs, fmt), m, 1);
                else st(dst, (j * ns + h) * hd + i, ldq8(r, i, m, vs, fmt), m, 0);
            }
        }
    }
    if (Lpad > L) memset(atw(dst, L * ns * hd, bf), 0, (size_t)((Lpad - L) * ns * hd * (bf ? 2 : 4)));
}

/* ---- KV-cache write: cache[slot[t]] = k[t], v[t] (rows of `row` elements; slot < 0 skipped) */
void kv_reshape_and_cache(const void* k, int64_t ldk, const void* v, int64_t ldv, void* k_cache, void* v_cache,
                          const int64_t* slots, int64_t T, int64_t row, int64_t esize) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy((char*)k_cache + slots[t] * row * esize, (const char*)k + t * ldk * esize, row * esize);
        memcpy((char*)v_cache + slots[t] * row * esize, (const char*)v + t * ldv * esize, row * esize);
    }
}

/* ---- Paged decode attention ----------------------------------------------------------------
 * One query token per sequence d (row stride ldq, H heads of hd), attending over the first
 * ctx[d] tokens of its sequence, read through its block table (stride bt_stride) from caches
 * [num_blocks, bs, KVH, hd]. GQA: the G = H / KVH query heads of KV head g share each loaded
 * K/V vector. Exact two-pass softmax in float32: scores, max, exp and sum, then P @ V.
 *
 * Scores are computed 16 keys at a time: 16 partial-product vectors are summed horizontally
 * together by a transpose-and-add tree (45 shuffles/adds for 16 dot products instead of a
 * full reduction each). P @ V keeps its G x NV accumulators in registers when G and NV are
 * small compile-time constants (the common GQA shapes). */

/* Software prefetch of rows [j0, j1) (clipped to L) of one KV head through the block table:
 * `bytes` from element `off` of each token row (rs elements per token). */
#define KV_PFD 48 /* keys ahead */
INLINE void prefetch_rows(const void* cache, int64_t esize, const int64_t* bt, int64_t j0, int64_t j1, int64_t L,
                          int64_t bs, int64_t rs, int64_t off, int64_t bytes) {
    if (j1 > L) j1 = L;
    if (j0 >= j1) return;
    /* (block, offset) stepped along, not divided out per key: a 64-bit division per key cost more
     * than the key's dot products) */
    int64_t blk = j0 / bs, o = j0 % bs;
    for (int64_t j = j0; j < j1; j++) {
        const char* p = (const char*)cache + ((bt[blk] * bs + o) * rs + off) * esize;
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        if (++o == bs) o = 0, blk++;
    }
}

/* r[i] = sum of the 16 lanes of v[i], i < 16. */
INLINE TGT __m512 hsum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
}

/* Softmax numerators in place over G rows of L scores (sc[h * L + j]), exact max-shifted
 * float32; inv_sum[h] = 1 / sum of row h (of the float32 numerators). With `ms` (not NULL)
 * ms[h] = row h's maximum and ms[G + h] its sum of numerators (a split's part for
 * merge_splits). bf16_out: the numerators are stored rounded to bf16 (nearest even, ps_to_bf16x16),
 * row h's over the first half of its own floats (element j's 2 bytes land on float j / 2,
 * already read), for the VDPBF16PS P @ V. */
INLINE TGT void softmax_rows(float* sc, int64_t G, int64_t L, float* inv_sum, float* ms, const int bf16_out) {
    for (int64_t h = 0; h < G; h++) {
        float* s = sc + h * L;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < L; j += 16) mx = _mm512_mask_max_ps(mx, tail_mask(L - j), mx, _mm512_loadu_ps(s + j));
        const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < L; j += 16) {
            __mmask16 m = tail_mask(L - j);
            __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmax)));
            if (bf16_out) _mm256_mask_storeu_epi16((uint16_t*)s + j, m, ps_to_bf16x16(e));
            else _mm512_mask_storeu_ps(s + j, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv_sum[h] = 1.0f / total;
        if (ms) {
            ms[h] = _mm512_cvtss_f32(vmax);
            ms[G + h] = total;
        }
    }
}

/* G, NV: query heads per KV head and 16-float vectors per head (compile-time after inlining,
 * or runtime in the generic instance). kt: scratch for 16 converted keys [16][NV*16].
 * part: NULL to write the G heads' outputs to out, or a split's part [G * hd + 2 * G] floats
 * (the outputs normalized by the split's own softmax sum, in float32, then the rows' maxima and
 * sums: softmax_rows) for merge_splits; out is then not written. */
INLINE TGT void attn_core(const int64_t G, const int64_t NV, const void* q, const void* kc, const void* vc,
                          const int64_t* bt, int64_t J, int64_t L, void* out, int64_t KVH, int64_t g, int64_t hd,
                          int64_t bs, float scale, float* sc, float* qf, float* kt, int bf, float* part) {
    const int64_t rs = KVH * hd; /* elements between consecutive tokens of one KV head */
    const int64_t Lw = L - J;    /* keys attended: [J, L) */
    /* Software prefetch of upcoming tokens. The KV heads of a token are adjacent and the
     * work items of one sequence run g = 0, 1, ... in turn, so the first one prefetches whole
     * token rows (sequential DRAM reads; the rows stay in L2 for the other heads). */
    const int64_t pf_bytes = (g == 0 ? rs : hd) * (bf ? 2 : 4);
    for (int64_t h = 0; h < G; h++)
        for (int64_t v = 0; v < NV; v++)
            _mm512_storeu_ps(qf + (h * NV + v) * 16, _mm512_mul_ps(ld(q, (g * G + h) * hd + v * 16,
                                                                      tail_mask(hd - v * 16), bf), _mm512_set1_ps(scale)));
    /* pass 1: scores, 16 keys per step (chunks never cross a block) */
    for (int64_t j0 = J; j0 < L;) {
        const int64_t blk = bt[j0 / bs], o0 = j0 % bs;
        int64_t n = bs - o0 < 16 ? bs - o0 : 16;
        if (L - j0 < n) n = L - j0;
        const int64_t base = (blk * bs + o0) * rs + g * hd;
        prefetch_rows(kc, bf ? 2 : 4, bt, j0 + KV_PFD, j0 + n + KV_PFD, L, bs, rs, g * hd, pf_bytes);
        for (int64_t jj = 0; jj < n; jj++)
            for (int64_t v = 0; v < NV; v++)
                _mm512_storeu_ps(kt + (jj * NV + v) * 16, ld(kc, base + jj * rs + v * 16, tail_mask(hd - v * 16), bf));
        for (int64_t h = 0; h < G; h++) {
            __m512 P[16];
            for (int jj = 0; jj < 16; jj++) P[jj] = _mm512_setzero_ps();
            for (int64_t jj = 0; jj < n; jj++)
                for (int64_t v = 0; v < NV; v++)
                    P[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (h * NV + v) * 16), _mm512_loadu_ps(kt + (jj * NV + v) * 16), P[jj]);
            _mm512_mask_storeu_ps(sc + h * Lw + (j0 - J), tail_mask(n), hsum16(P));
        }
        j0 += n;
    }
    float inv_sum[64];
    softmax_rows(sc, G, Lw, inv_sum, part ? part + G * hd : NULL, 0);
    /* pass 2: P @ V, accumulators in registers when G * NV is a small constant */
    __m512 acc[G][NV];
    for (int64_t h = 0; h < G; h++)
        for (int64_t v = 0; v < NV; v++) acc[h][v] = _mm512_setzero_ps();
    for (int64_t j0 = J; j0 < L;) { /* the rest of j0's block, then whole blocks */
        const int64_t blk = bt[j0 / bs], o0 = j0 % bs, n = (L - j0) < bs - o0 ? (L - j0) : bs - o0;
        const int64_t base = (blk * bs + o0) * rs + g * hd;
        prefetch_rows(vc, bf ? 2 : 4, bt, j0 + KV_PFD, j0 + n + KV_PFD, L, bs, rs, g * hd, pf_bytes);
        for (int64_t o = 0; o < n; o++) {
            __m512 vv[16]; /* (fixed size: a VLA here was a stack allocation per key) */
            for (int64_t v = 0; v < NV; v++) vv[v] = ld(vc, base + o * rs + v * 16, tail_mask(hd - v * 16), bf);
            for (int64_t h = 0; h < G; h++) {
                const __m512 p = _mm512_set1_ps(sc[h * Lw + (j0 - J) + o]);
                for (int64_t v = 0; v < NV; v++) acc[h][v] = _mm512_fmadd_ps(p, vv[v], acc[h][v]);
            }
        }
        j0 += n;
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t v = 0; v < NV; v++) {
            const __m512 o = _mm512_mul_ps(acc[h][v], _mm512_set1_ps(inv_sum[h]));
            if (part) _mm512_mask_storeu_ps(part + h * hd + v * 16, tail_mask(hd - v * 16), o);
            else st(out, (g * G + h) * hd + v * 16, o, tail_mask(hd - v * 16), bf);
        }
}

/* bf16 caches on CPUs with AVX512_BF16 (hd % 32 == 0): both products on VDPBF16PS, which
 * multiplies pairs of bf16 exactly and accumulates in float32. Q·K reads K as stored (no
 * conversion); P·V pairs consecutive keys, with the probabilities rounded to bf16 as
 * PyTorch's CPU flash attention does for bf16 inputs (VCVTNEPS2BF16, once per row; a denormal
 * probability becomes 0, as VDPBF16PS would read it anyway), and un-interleaves the dims at the end.
 * Same loop structure and softmax as attn_core. */
#define TGT_DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

/* Prefetch into L2 of the token rows of keys [j, j + keys), clipped to key j's block and to L
 * (nothing if j >= L): every KV head of each token (rs elements a token, bf16). attn_core_dp
 * issues it for KV head 0 only, KV_PFD keys ahead (the Q·K pass a 16-key chunk at a time, the
 * P·V pass a block at a time), so the items of the other KV heads of the sequence (run next on
 * the same thread) find the rows in L2. History on the 2-core Zen 4 (64 sequences of 450 tokens,
 * SmolLM2's 3 KV heads, blocks in random order, from DRAM): a prefetch per key and KV head
 * (prefetch_rows, 2-6 lines each; its loop took ~23% of the kernel's samples) was replaced by the
 * first 4 lines of the block 48 keys ahead, leaving the rest to the hardware prefetcher (same
 * speed from DRAM, ~1.2x on cache-resident contexts); that read 5-6 GB/s of KV on one thread,
 * against 26 GB/s for a streaming sum. Whole rows into L2 (_MM_HINT_T1; into L1 with T0 was no
 * faster than 4 lines, the prefetches queueing behind the loads) read 7.5-8 GB/s: 1.4-1.5x from
 * DRAM (1.35x at 16 x 2,000 tokens), ~4% slower when the context is already in cache. */
INLINE void prefetch_block(const uint16_t* cache, const int64_t* bt, int64_t j, int64_t L, int64_t bs, int64_t rs,
                           int64_t keys) {
    if (j >= L) return;
    const int64_t o = j % bs;
    int64_t n = bs - o < keys ? bs - o : keys;
    if (L - j < n) n = L - j;
    const char* p = (const char*)(cache + (bt[j / bs] * bs + o) * rs);
    for (int64_t b = 0; b < n * rs * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* Scores of 16 consecutive keys (rows kb, kb + rs, ...) for HN query heads (qh, qh + hd, ...),
 * times `scale`, stored to dst[h * Lw + 0..15]. Keys outer, heads inner: each K row is loaded
 * once for the group, and the 16 per-key partial-sum vectors of a head are folded as they come
 * (two keys: unpacklo/hi + add; then shuffle_ps, then shuffle_f32x4 twice), the same tree and
 * order as hsum16, so the sums are bit for bit those of a hsum16 over the 16 vectors. With
 * heads outer (the previous loop) the 16 vectors of a head were live at once, K was reloaded per
 * head and GCC spilled: 2-core Zen 4, 3 heads of 64 dims, cache-resident: the Q·K pass took
 * about half of the kernel. */
INLINE TGT_DP void qk16_dp(const int HN, const int64_t NW, const uint16_t* qh, int64_t hd, const uint16_t* kb,
                           int64_t rs, float* dst, int64_t Lw, __m512 vscale) {
    __m512bh qv[HN][NW];
    for (int h = 0; h < HN; h++)
        for (int64_t w = 0; w < NW; w++) qv[h][w] = (__m512bh)_mm512_loadu_si512(qh + h * hd + w * 32);
    __m512 t0[HN], u0[HN], w0[HN];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const uint16_t* k0 = kb + (2 * i) * rs;
        const uint16_t* k1 = k0 + rs;
#pragma GCC unroll 8
        for (int h = 0; h < HN; h++) {
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], (__m512bh)_mm512_loadu_si512(k0));
            __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], (__m512bh)_mm512_loadu_si512(k1));
            for (int64_t w = 1; w < NW; w++) {
                a = _mm512_dpbf16_ps(a, qv[h][w], (__m512bh)_mm512_loadu_si512(k0 + w * 32));
                b = _mm512_dpbf16_ps(b, qv[h][w], (__m512bh)_mm512_loadu_si512(k1 + w * 32));
            }
            const __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            if (!(i & 1)) { t0[h] = t; continue; }
            const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0[h], t, 0x44), _mm512_shuffle_ps(t0[h], t, 0xee));
            if (!(i & 2)) { u0[h] = u; continue; }
            const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u0[h], u, 0x88), _mm512_shuffle_f32x4(u0[h], u, 0xdd));
            if (!(i & 4)) { w0[h] = w; continue; }
            const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(w0[h], w, 0x88), _mm512_shuffle_f32x4(w0[h], w, 0xdd));
            _mm512_storeu_ps(dst + h * Lw, _mm512_mul_ps(r, vscale));
        }
    }
}

/* KV heads g0 .. g0 + ng - 1 of one sequence (G query heads each) over keys [J, L): ng = 1 is a
 * work item of one KV head; ng = KVH reads each token row once for all heads (decode_item's
 * `rows` items). sc: ng * G rows of L - J scores; acc (ng > 1 only): ng * G * hd floats, the
 * P·V accumulators of the KV heads between blocks; part: as attn_core, the part of KV head
 * g0 + i at part + i * (G * hd + 2 * G). The item reading KV head 0 prefetches the rows ahead
 * (prefetch_block, every KV head of a token). */
INLINE TGT_DP void attn_core_dp(const int64_t G, const int64_t NW, const uint16_t* q, const uint16_t* kc,
                                const uint16_t* vc, const int64_t* bt, int64_t J, int64_t L, uint16_t* out,
                                int64_t KVH, int64_t g0, int64_t ng, int64_t hd, int64_t bs, float scale, float* sc,
                                float* acc, float* part) {
    const int64_t rs = KVH * hd, Lw = L - J, ps = G * hd + 2 * G;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = J; j0 < L;) {
        const int64_t blk = bt[j0 / bs], o0 = j0 % bs;
        int64_t n = bs - o0 < 16 ? bs - o0 : 16;
        if (L - j0 < n) n = L - j0;
        if (g0 == 0) prefetch_block(kc, bt, j0 + KV_PFD, L, bs, rs, 16);
        for (int64_t i = 0; i < ng; i++) {
            const int64_t g = g0 + i;
            const uint16_t* kb = kc + (blk * bs + o0) * rs + g * hd;
            float* sg = sc + i * G * Lw + (j0 - J);
            if (n == 16) {
                /* heads in groups whose query vectors, K rows and pending sums fit the 32 registers */
                const int64_t HG = NW <= 2 ? 3 : NW <= 4 ? 2 : 1;
                for (int64_t h0 = 0; h0 < G; h0 += HG) {
                    const int64_t hn = G - h0 < HG ? G - h0 : HG;
                    const uint16_t* qh = q + (g * G + h0) * hd;
                    if (hn == 3) qk16_dp(3, NW, qh, hd, kb, rs, sg + h0 * Lw, Lw, vscale);
                    else if (hn == 2) qk16_dp(2, NW, qh, hd, kb, rs, sg + h0 * Lw, Lw, vscale);
                    else qk16_dp(1, NW, qh, hd, kb, rs, sg + h0 * Lw, Lw, vscale);
                }
            } else { /* the partial chunk of a block or of the context: a head at a time */
                for (int64_t h = 0; h < G; h++) {
                    __m512 P[16];
                    for (int jj = 0; jj < 16; jj++) P[jj] = _mm512_setzero_ps();
                    for (int64_t w = 0; w < NW; w++) {
                        const __m512bh qw = (__m512bh)_mm512_loadu_si512(q + (g * G + h) * hd + w * 32);
                        for (int64_t jj = 0; jj < n; jj++)
                            P[jj] = _mm512_dpbf16_ps(P[jj], qw, (__m512bh)_mm512_loadu_si512(kb + jj * rs + w * 32));
                    }
                    _mm512_mask_storeu_ps(sg + h * Lw, tail_mask(n), _mm512_mul_ps(hsum16(P), vscale));
                }
            }
        }
        j0 += n;
    }
    float inv_sum[ng * G];
    for (int64_t i = 0; i < ng; i++) /* probabilities in bf16 */
        softmax_rows(sc + i * G * Lw, G, Lw, inv_sum + i * G, part ? part + i * ps + G * hd : NULL, 1);
    /* P @ V over pairs of keys: lane i of lo/hi holds dim 32w + 8(i/4) + i%4 (+ 4 for hi). One
     * KV head keeps its accumulators in registers throughout; several take turns at every block,
     * swapping their accumulators through acc, so that the rows stream from memory evenly (the
     * swaps cost ~20% where the context is cache-resident; windows of 2-8 blocks were no faster
     * from DRAM). The keys pair up within each block's run either way: the same bits. */
    __m512 lo[G][NW], hi[G][NW];
    for (int64_t h = 0; h < G; h++)
        for (int64_t w = 0; w < NW; w++) lo[h][w] = hi[h][w] = _mm512_setzero_ps();
    if (ng > 1) memset(acc, 0, sizeof(float) * (size_t)(ng * G * hd));
    for (int64_t j0 = J; j0 < L;) { /* the rest of j0's block, then whole blocks */
        const int64_t blk = bt[j0 / bs], o0 = j0 % bs, n = (L - j0) < bs - o0 ? (L - j0) : bs - o0;
        if (g0 == 0) prefetch_block(vc, bt, j0 + KV_PFD, L, bs, rs, n);
        for (int64_t i = 0; i < ng; i++) {
            const uint16_t* vb = vc + (blk * bs + o0) * rs + (g0 + i) * hd;
            const uint16_t* pr = (const uint16_t*)(sc + i * G * Lw) + (j0 - J); /* head h's: pr + 2 h Lw */
            float* ai = acc + i * G * hd;
            if (ng > 1)
                for (int64_t h = 0; h < G; h++)
                    for (int64_t w = 0; w < NW; w++) {
                        lo[h][w] = _mm512_loadu_ps(ai + h * hd + w * 32);
                        hi[h][w] = _mm512_loadu_ps(ai + h * hd + w * 32 + 16);
                    }
            /* whole pairs; the pair's probabilities broadcast straight from memory as a float
             * (VBROADCASTSS: a load; VPBROADCASTD from a register competes with VDPBF16PS on Zen 4) */
            for (int64_t o = 0; o + 1 < n; o += 2) {
                __m512i a[8], b[8]; /* (fixed size: a VLA here was a stack allocation per pair of keys) */
                for (int64_t w = 0; w < NW; w++) {
                    const __m512i v0 = _mm512_loadu_si512(vb + o * rs + w * 32);
                    const __m512i v1 = _mm512_loadu_si512(vb + (o + 1) * rs + w * 32);
                    a[w] = _mm512_unpacklo_epi16(v0, v1);
                    b[w] = _mm512_unpackhi_epi16(v0, v1);
                }
                for (int64_t h = 0; h < G; h++) {
                    float pp;
                    memcpy(&pp, pr + 2 * h * Lw + o, 4);
                    const __m512bh pv = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(pp));
                    for (int64_t w = 0; w < NW; w++) {
                        lo[h][w] = _mm512_dpbf16_ps(lo[h][w], (__m512bh)a[w], pv);
                        hi[h][w] = _mm512_dpbf16_ps(hi[h][w], (__m512bh)b[w], pv);
                    }
                }
            }
            if (n & 1) { /* the last key of an odd run, paired with zeros (the word after its
                          * probability may be the next block's or not a probability at all) */
                const int64_t o = n - 1;
                __m512i a[8], b[8];
                for (int64_t w = 0; w < NW; w++) {
                    const __m512i v0 = _mm512_loadu_si512(vb + o * rs + w * 32);
                    a[w] = _mm512_unpacklo_epi16(v0, _mm512_setzero_si512());
                    b[w] = _mm512_unpackhi_epi16(v0, _mm512_setzero_si512());
                }
                for (int64_t h = 0; h < G; h++) {
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32(pr[2 * h * Lw + o]);
                    for (int64_t w = 0; w < NW; w++) {
                        lo[h][w] = _mm512_dpbf16_ps(lo[h][w], (__m512bh)a[w], pv);
                        hi[h][w] = _mm512_dpbf16_ps(hi[h][w], (__m512bh)b[w], pv);
                    }
                }
            }
            if (ng > 1)
                for (int64_t h = 0; h < G; h++)
                    for (int64_t w = 0; w < NW; w++) {
                        _mm512_storeu_ps(ai + h * hd + w * 32, lo[h][w]);
                        _mm512_storeu_ps(ai + h * hd + w * 32 + 16, hi[h][w]);
                    }
        }
        j0 += n;
    }
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < ng; i++)
        for (int64_t h = 0; h < G; h++) {
            const __m512 is = _mm512_set1_ps(inv_sum[i * G + h]);
            uint16_t* oh = out + ((g0 + i) * G + h) * hd;
            float* ph = part ? part + i * ps + h * hd : NULL;
            for (int64_t w = 0; w < NW; w++) {
                const __m512 l = ng > 1 ? _mm512_loadu_ps(acc + (i * G + h) * hd + w * 32) : lo[h][w];
                const __m512 u = ng > 1 ? _mm512_loadu_ps(acc + (i * G + h) * hd + w * 32 + 16) : hi[h][w];
                const __m512 o0 = _mm512_mul_ps(_mm512_permutex2var_ps(l, i0, u), is);
                const __m512 o1 = _mm512_mul_ps(_mm512_permutex2var_ps(l, i1, u), is);
                if (ph) {
                    _mm512_storeu_ps(ph + w * 32, o0);
                    _mm512_storeu_ps(ph + w * 32 + 16, o1);
                } else {
                    _mm256_storeu_si256((__m256i*)(oh + w * 32), ps_to_bf16x16(o0));
                    _mm256_storeu_si256((__m256i*)(oh + w * 32 + 16), ps_to_bf16x16(o1));
                }
            }
        }
}

/* Set once at load time from Python: 1 when the CPU has AVX512_BF16. */
static int kv_bf16_dot = 0;
void kv_set_bf16_dot(int on) { kv_bf16_dot = on; }

static __attribute__((noinline)) TGT_DP void attn_one_dp(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                                         const int64_t* bt, int64_t J, int64_t L, uint16_t* out, int64_t G,
                                                         int64_t KVH, int64_t g0, int64_t ng, int64_t hd, int64_t bs,
                                                         float scale, float* sc, float* acc, float* part) {
    const int64_t nw = hd / 32;
#define KV_DP_CASE(GC, NC)                                                                                         \
    if (G == GC && nw == NC) {                                                                                     \
        attn_core_dp(GC, NC, q, kc, vc, bt, J, L, out, KVH, g0, ng, hd, bs, scale, sc, acc, part);                 \
        return;                                                                                                    \
    }
    KV_DP_CASE(1, 2) KV_DP_CASE(2, 2) KV_DP_CASE(3, 2) KV_DP_CASE(4, 2) KV_DP_CASE(5, 2) KV_DP_CASE(6, 2)
    KV_DP_CASE(8, 2) KV_DP_CASE(1, 4) KV_DP_CASE(2, 4) KV_DP_CASE(3, 4) KV_DP_CASE(4, 4) KV_DP_CASE(1, 8)
    KV_DP_CASE(2, 8)
#undef KV_DP_CASE
    attn_core_dp(G, nw, q, kc, vc, bt, J, L, out, KVH, g0, ng, hd, bs, scale, sc, acc, part);
}

/* Keys [J, L) of the sequence (block table bt): J > 0 skips the first J keys (a sliding window
 * starting inside bt's first block); the scratch sc holds G * (L - J) scores. part: as attn_core. */
INLINE TGT void attn_one(const void* q, const void* kc, const void* vc, const int64_t* bt, int64_t J, int64_t L,
                         void* out,
                         int64_t G, int64_t KVH, int64_t g, int64_t hd, int64_t bs, float scale, float* sc,
                         float* qf, float* kt, int bf, float* part) {
    const int64_t nv = (hd + 15) / 16;
    if (bf && kv_bf16_dot && hd % 32 == 0) {
        attn_one_dp((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, bt, J, L, (uint16_t*)out, G, KVH, g,
                    1, hd, bs, scale, sc, NULL, part);
        return;
    }
#define KV_ATTN_CASE(GC, NC) \
    if (G == GC && nv == NC) { attn_core(GC, NC, q, kc, vc, bt, J, L, out, KVH, g, hd, bs, scale, sc, qf, kt, bf, part); return; }
    KV_ATTN_CASE(1, 4) KV_ATTN_CASE(2, 4) KV_ATTN_CASE(3, 4) KV_ATTN_CASE(4, 4) KV_ATTN_CASE(5, 4) KV_ATTN_CASE(6, 4)
    KV_ATTN_CASE(1, 8) KV_ATTN_CASE(2, 8) KV_ATTN_CASE(3, 8) KV_ATTN_CASE(4, 8)
    KV_ATTN_CASE(1, 2) KV_ATTN_CASE(2, 2) KV_ATTN_CASE(4, 2) KV_ATTN_CASE(8, 2)
#undef KV_ATTN_CASE
    attn_core(G, nv, q, kc, vc, bt, J, L, out, KVH, g, hd, bs, scale, sc, qf, kt, bf, part);
}

/* Sliding windows (Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023): a query at position
 * p = L - 1 of a context of L tokens sees keys (p - window, p], i.e. [L - window, L) (window 0:
 * all). The block-table walk starts at the first block overlapping that range, so a windowed
 * layer reads at most window + bs - 1 keys whatever the context length; blocks before it are
 * never read (an all-windowed model frees them: their table entries are not valid blocks). */
static inline int64_t kv_window_first_block(int64_t L, int64_t window, int64_t bs) {
    return window > 0 && L > window ? (L - window) / bs : 0;
}

/* ---- Paged decode attention on AMX tiles (bf16 caches, CPUs with AMX-BF16) ----------------
 * The vector kernels above are compute-bound at ~15-20 GB/s of KV on the development CPU (a
 * dot product per head per key, horizontal sums, scalar probability conversions). Here one
 * work item is a sequence and a set of `ns` KV heads whose query heads fit one tile's 16
 * columns (ns * G <= 16), and both products run as TDPBF16PS:
 *   scores^T [16 keys x 16 cols] += K rows [16 keys x 32 dims] * Qbd [32 dims x 16 cols],
 *     Qbd block-diagonal (column n = query head n of the set, zero outside its KV head's dims),
 *     so one pass over the set's K row slices scores every head (K read as stored, 16 rows
 *     of a block per tile);
 *   out [16 heads x 16 dims] += P [16 heads x 32 keys] * V [32 keys x 16 dims] (V repacked to
 *     pairs of keys; lanes come out in unpacklo/unpackhi order and are put back at the end).
 * Softmax runs key-major (one vector per key holds all heads of the set), exact float32 with
 * probabilities rounded to bf16 for the P @ V product, as the VDPBF16PS kernel does.
 * Needs block_size % 16 == 0 and head_dim % 32 == 0. */
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16,amx-tile,amx-bf16")))
#include "amx.h"
static int kv_amx = 0;

/* Enable the AMX path if Linux grants the tile state (on = 1); on = 0 disables it. Returns
 * whether it is enabled. */
int kv_set_amx(int on) {
    kv_amx = on && kv_amx_request();
    return kv_amx;
}
int kv_amx_enabled(void) { return kv_amx; }

/* r[i] <- column i of the 16 x 16 matrix with rows r[0..15]. */
INLINE TGT void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512 a = t[4 * i], b = t[4 * i + 1], c = t[4 * i + 2], d = t[4 * i + 3];
        r[4 * i] = _mm512_shuffle_ps(a, c, 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(a, c, 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(b, d, 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(b, d, 0xee);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            __m512 a = r[8 * i + j], b = r[8 * i + 4 + j];
            t[8 * i + j] = _mm512_shuffle_f32x4(a, b, 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(a, b, 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
}

/* Prefetch to L2 the K and V row slices [off, off + bytes) of a sequence's first L keys (block
 * table bt), four blocks side by side: line l of blocks b..b+3 (K and V), then line l + 1, so
 * that the L2 streamer runs several sequential streams at once. Reading 6 KiB blocks one after
 * another reaches ~18-20 GB/s on the development machine, this ~28-34 GB/s; decode attention
 * over DRAM-resident caches got ~15% faster (64 sequences x 500 tokens, 30 layers). */
INLINE TGT void prefetch_kv_l2(const void* kc, const void* vc, const int64_t* bt, int64_t L, int64_t bs,
                               int64_t rsb, int64_t off, int64_t bytes) { /* rsb, off: bytes */
    const int64_t nb = (L + bs - 1) / bs;
    for (int64_t g = 0; g < nb; g += 4) {
        const int64_t nt = nb - g < 4 ? nb - g : 4;
        const char *k[4], *v[4];
        int64_t rows[4];
        for (int64_t t = 0; t < nt; t++) {
            k[t] = (const char*)kc + bt[g + t] * bs * rsb + off;
            v[t] = (const char*)vc + bt[g + t] * bs * rsb + off;
            rows[t] = L - (g + t) * bs < bs ? L - (g + t) * bs : bs;
        }
        for (int64_t r = 0; r < bs; r++)
            for (int64_t c = 0; c < bytes; c += 64)
                for (int64_t t = 0; t < nt; t++)
                    if (r < rows[t]) {
                        _mm_prefetch(k[t] + r * rsb + c, _MM_HINT_T1);
                        _mm_prefetch(v[t] + r * rsb + c, _MM_HINT_T1);
                    }
    }
}

/* scores^T [L keys][16 columns] f32 into sc: per 16 keys (one tile of a block) the K rows'
 * slices [off, off + 32 NC) of the cache (row stride rs) times the query tiles qt (NC tiles
 * of [16 dim pairs x 16 columns] u16). prefetch: bytes of each K row slice to pull into L1
 * two tiles ahead (0: none). */
INLINE TGT_AMX void scores_t_amx(const uint16_t* kc, const int64_t* bt, int64_t L, int64_t bs, int64_t rs,
                                 int64_t off, int64_t NC, const uint16_t* qt, float* sc, int64_t prefetch) {
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const uint16_t* kb = kc + (bt[j0 / bs] * bs + j0 % bs) * rs + off;
        if (prefetch && j0 + 32 < L) {
            const char* nx = (const char*)(kc + (bt[(j0 + 32) / bs] * bs + (j0 + 32) % bs) * rs + off);
            for (int64_t r = 0; r < 16; r++)
                for (int64_t b = 0; b < prefetch; b += 64) _mm_prefetch(nx + r * rs * 2 + b, _MM_HINT_T0);
        }
        _tile_zero(0);
        for (int64_t c = 0; c < NC; c++) {
            _tile_loadd(1, kb + c * 32, rs * 2);
            _tile_loadd(2, qt + c * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + j0 * 16, 64);
    }
}

/* 32 values [i, i + 32) of a cache row as bf16: loaded as stored (fmt 0, bf16 row), or
 * dequantized from an 8-bit pool row (codes * scale rounded to bf16; row = the row's start). */
INLINE TGT_AMX __m512i ld_bf16x32(const char* row, int64_t i, int64_t hd, int fmt) {
    if (!fmt) return _mm512_loadu_si512(row + i * 2);
    float s;
    memcpy(&s, row + hd, 4);
    const __m512 vs = _mm512_set1_ps(s);
    return (__m512i)_mm512_cvtne2ps_pbh(ldq8((const uint8_t*)row, i + 16, 0xffff, vs, fmt),
                                        ldq8((const uint8_t*)row, i, 0xffff, vs, fmt));
}

/* scores_t_amx over an 8-bit pool (fmt 1/2): per 16 keys, the K rows of KV heads [g0, g0 + ns)
 * are dequantized into kq [16][ns * hd] bf16 (in L1; keys >= L zero), which the tiles read. */
INLINE TGT_AMX void scores_t_amx_q(const uint8_t* kc, const int64_t* bt, int64_t L, int64_t bs, int64_t KVH,
                                   int64_t hd, int64_t g0, int64_t ns, int64_t NC, const uint16_t* qt, float* sc,
                                   uint16_t* kq, int fmt) {
    const int64_t rb = KV_QROW(hd), w = ns * hd;
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const char* kb = (const char*)kc + ((bt[j0 / bs] * bs + j0 % bs) * KVH + g0) * rb;
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        if (j0 + 32 < L) { /* the K rows two tiles ahead into L1 */
            const char* nx = (const char*)kc + ((bt[(j0 + 32) / bs] * bs + (j0 + 32) % bs) * KVH + g0) * rb;
            for (int64_t r = 0; r < 16; r++)
                for (int64_t b = 0; b < ns * rb; b += 64) _mm_prefetch(nx + r * KVH * rb + b, _MM_HINT_T0);
        }
        for (int64_t r = 0; r < 16; r++) {
            uint16_t* dst = kq + r * w;
            if (r >= n) {
                memset(dst, 0, (size_t)w * 2);
                continue;
            }
            for (int64_t h = 0; h < ns; h++)
                for (int64_t i = 0; i < hd; i += 32)
                    _mm512_storeu_si512(dst + h * hd + i, ld_bf16x32(kb + (r * KVH + h) * rb, i, hd, fmt));
        }
        _tile_zero(0);
        for (int64_t c = 0; c < NC; c++) {
            _tile_loadd(1, kq + c * 32, w * 2);
            _tile_loadd(2, qt + c * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + j0 * 16, 64);
    }
}

/* Up to 16 query columns over the KV heads [g0, g0 + ns) of one sequence (block table bt).
 * Column n: query qn[n] and output on[n] (hd values each), local KV head gl[n] in [0, ns),
 * attending to tokens [Sn[n], Ln[n]) (Sn NULL: from 0; Ln[n] = 0 for unused columns n >= nq;
 * keys before Sn[n] are read and get probability 0: a sliding window's start, always inside
 * bt's first block, which the caller starts at the window's first block); decode uses
 * one token's heads as columns. Scratch (per thread): qb [NC][16][32] u16, sc [Lp][16] f32,
 * p [16][Lp] u16, vb [4][16][32] u16, ct [4][16][16] f32, NC = ns * hd / 32, Lp = max(Ln)
 * rounded up to 32. The columns' K and V are first pulled into L2 (prefetch_kv_l2: in decode
 * they come from DRAM). */
static TGT_AMX void attn_amx_cols(const void* kc_, const void* vc_, const int64_t* bt, int64_t nq,
                                  const uint16_t* const* qn, uint16_t* const* on, const int64_t* gl_n,
                                  const int32_t* Ln, const int32_t* Sn, int64_t KVH, int64_t hd, int64_t bs,
                                  float scale, int64_t g0,
                                  int64_t ns, uint16_t* qb, float* sc, uint16_t* p, uint16_t* vb, float* ct, int fmt,
                                  uint16_t* kq) {
    const uint16_t *kc = (const uint16_t*)kc_, *vc = (const uint16_t*)vc_;
    const int64_t rs = KVH * hd, NC = ns * hd / 32;
    /* bytes of a token's row (all KV heads) and of one KV head's row in the cache */
    const int64_t rsb = fmt ? KVH * KV_QROW(hd) : rs * 2, hb = fmt ? KV_QROW(hd) : hd * 2;
    int64_t L = 0;
    for (int64_t n = 0; n < nq; n++) L = Ln[n] > L ? Ln[n] : L;
    const int64_t Lp = (L + 31) & ~(int64_t)31;
    prefetch_kv_l2(kc, vc, bt, L, bs, rsb, g0 * hb, ns * hb);
    /* Qbd: chunk c covers dims [32c, 32c + 32) of the set's row slice, i.e. local KV head
     * c * 32 / hd; row k of its tile holds dims (2k, 2k + 1) of every column of that head. */
    memset(qb, 0, (size_t)NC * 1024);
    for (int64_t c = 0; c < NC; c++) {
        const int64_t gl = c * 32 / hd, d0 = (c * 32) % hd;
        for (int64_t n = 0; n < nq; n++) {
            if (gl_n[n] != gl) continue;
            const uint32_t* qh = (const uint32_t*)(qn[n] + d0);
            uint32_t* col = (uint32_t*)(qb + c * 512) + n;
            for (int64_t k = 0; k < 16; k++) col[k * 16] = qh[k];
        }
    }
    if (fmt) scores_t_amx_q((const uint8_t*)kc, bt, L, bs, KVH, hd, g0, ns, NC, qb, sc, kq, fmt);
    else scores_t_amx(kc, bt, L, bs, rs, g0 * hd, NC, qb, sc, ns * hd * 2);
    /* softmax over keys, one lane per column; key j counts for column n iff Sn[n] <= j < Ln[n] */
    const __m512i lens = _mm512_loadu_si512(Ln);
    const __m512i starts = Sn ? _mm512_loadu_si512(Sn) : _mm512_setzero_si512();
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < L; j++) {
        const __mmask16 m = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)j), lens)
                            & _mm512_cmpge_epi32_mask(_mm512_set1_epi32((int)j), starts);
        const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), m, _mm512_loadu_ps(sc + j * 16), vs);
        _mm512_storeu_ps(sc + j * 16, s);
        mx = _mm512_max_ps(mx, s);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const __mmask16 m = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)j), lens)
                            & _mm512_cmpge_epi32_mask(_mm512_set1_epi32((int)j), starts);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + j * 16), mx)));
        _mm512_storeu_ps(sc + j * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    for (int64_t j = L; j < Lp; j++) _mm512_storeu_ps(sc + j * 16, _mm512_setzero_ps());
    float inv_sum[16];
    _mm512_storeu_ps(inv_sum, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    /* P [16 columns][Lp keys] in bf16 (rows >= nq zero) */
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(sc + (j0 + i) * 16);
        transpose16(r);
        for (int64_t n = 0; n < 16; n++)
            _mm256_storeu_si256((__m256i*)(p + n * Lp + j0),
                                n < nq ? (__m256i)_mm512_cvtneps_pbh(r[n]) : _mm256_setzero_si256());
    }
    /* P @ V per KV head of the set, 64 dims (4 tiles) at a time */
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t gl = 0; gl < ns; gl++)
        for (int64_t dc = 0; dc < hd; dc += 64) {
            const int64_t nw = hd - dc >= 64 ? 2 : 1; /* 32-dim words */
            const int64_t off = (g0 + gl) * hb; /* bytes: the KV head's row start in a token's row */
            const char* vcb = (const char*)vc;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t k0 = 0; k0 < Lp; k0 += 32) {
                /* rows of keys k0 .. k0 + 15 and k0 + 16 .. k0 + 31 (each half within one block) */
                const char* half[2] = {vcb + (bt[k0 / bs] * bs + k0 % bs) * rsb + off,
                                       k0 + 16 < L ? vcb + (bt[(k0 + 16) / bs] * bs + (k0 + 16) % bs) * rsb + off
                                                   : NULL};
                if (k0 + 32 + 16 < L) { /* prefetch V rows two tiles ahead */
                    const int64_t kn = k0 + 32 + 16;
                    const char* nx = vcb + (bt[kn / bs] * bs + kn % bs) * rsb + off + (fmt ? dc : dc * 2);
                    for (int64_t r = 0; r < 16; r++)
                        for (int64_t b = 0; b < nw * (fmt ? 32 : 64); b += 64) _mm_prefetch(nx + r * rsb + b, _MM_HINT_T0);
                }
                for (int64_t pp = 0; pp < 16; pp++) {
                    const int64_t ka = k0 + 2 * pp, kb = ka + 1;
                    const char* ra = ka < L ? half[pp >> 3] + (2 * pp & 15) * rsb : NULL;
                    const char* rb = kb < L ? half[pp >> 3] + ((2 * pp + 1) & 15) * rsb : NULL;
                    for (int64_t w = 0; w < nw; w++) {
                        const __m512i a = ra ? ld_bf16x32(ra, dc + w * 32, hd, fmt) : _mm512_setzero_si512();
                        const __m512i b = rb ? ld_bf16x32(rb, dc + w * 32, hd, fmt) : _mm512_setzero_si512();
                        _mm512_storeu_si512(vb + (2 * w) * 512 + pp * 32, _mm512_unpacklo_epi16(a, b));
                        _mm512_storeu_si512(vb + (2 * w + 1) * 512 + pp * 32, _mm512_unpackhi_epi16(a, b));
                    }
                }
                _tile_loadd(4, p + k0, Lp * 2);
                _tile_loadd(5, vb, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, vb + 512, 64);
                _tile_dpbf16ps(1, 4, 5);
                if (nw == 2) {
                    _tile_loadd(5, vb + 1024, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(5, vb + 1536, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, ct, 64); _tile_stored(1, ct + 256, 64);
            _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64);
            for (int64_t n = 0; n < nq; n++) {
                if (gl_n[n] != gl) continue;
                const __m512 is = _mm512_set1_ps(inv_sum[n]);
                uint16_t* oh = on[n] + dc;
                for (int64_t w = 0; w < nw; w++) {
                    const __m512 lo = _mm512_loadu_ps(ct + (2 * w) * 256 + n * 16);
                    const __m512 hi = _mm512_loadu_ps(ct + (2 * w + 1) * 256 + n * 16);
                    _mm256_storeu_si256((__m256i*)(oh + w * 32),
                                        ps_to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, i0, hi), is)));
                    _mm256_storeu_si256((__m256i*)(oh + w * 32 + 16),
                                        ps_to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, i1, hi), is)));
                }
            }
        }
}

/* Per-thread scratch of attn_amx_cols for NC chunks and contexts up to maxL tokens, with the
 * tile configuration loaded (all 8 tiles 16 rows x 64 bytes). NULL if allocation failed. */
static TGT_AMX char* amx_attn_begin(int64_t NC, int64_t maxL, uint16_t** qb, float** sc, uint16_t** p,
                                    uint16_t** vb, float** ct) {
    const int64_t Lp = (maxL + 31) & ~(int64_t)31;
    const size_t bytes = (size_t)NC * 1024 + (size_t)Lp * 96 + 8192;
    char* buf = (char*)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!buf) return NULL;
    kv_amx_config();
    *qb = (uint16_t*)buf;
    *sc = (float*)(buf + NC * 1024);
    *p = (uint16_t*)(buf + NC * 1024 + Lp * 64);
    *vb = (uint16_t*)(buf + NC * 1024 + Lp * 96);
    *ct = (float*)(buf + NC * 1024 + Lp * 96 + 4096);
    return buf;
}

/* AMX decode attention over D sequences; same contract as kv_paged_attention_decode (bf16).
 * ns: KV heads per work item (divides KVH, ns * G <= 16). fmt != 0 (8-bit pools): the K rows
 * of each 16-key tile are dequantized into a per-thread bf16 buffer in L1 before the tiles read
 * them (scores_t_amx_q), the V rows as they are repacked into key pairs (ld_bf16x32). */
static TGT_AMX int attention_amx(const uint16_t* q, int64_t ldq, const void* kc, const void* vc,
                                 const int64_t* block_tables, int64_t bt_stride, const int64_t* ctx, uint16_t* out,
                                 int64_t ldo, int64_t D, int64_t KVH, int64_t G, int64_t hd, int64_t bs,
                                 float scale, int64_t window, int64_t ns, int fmt, int nthreads) {
    int64_t maxL = 0; /* keys read by one sequence: from its window's first block (all if no window) */
    for (int64_t d = 0; d < D; d++) {
        const int64_t Ld = ctx[d] - kv_window_first_block(ctx[d], window, bs) * bs;
        maxL = Ld > maxL ? Ld : maxL;
    }
    const int64_t nsets = KVH / ns;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *qb, *p, *vb;
        float *sc, *ct;
        char* buf = amx_attn_begin(ns * hd / 32, maxL, &qb, &sc, &p, &vb, &ct);
        uint16_t* kd = NULL; /* 8-bit pools: 16 K rows of the set, [16][ns][hd] bf16 */
        if (buf && fmt) {
            kd = (uint16_t*)aligned_alloc(64, ((size_t)16 * ns * hd * 2 + 63) & ~(size_t)63);
            if (!kd) {
                _tile_release();
                free(buf);
                buf = NULL;
            }
        }
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < D * nsets; i++) {
            if (!buf) continue;
            const int64_t d = i / nsets, g0 = (i % nsets) * ns, nq = ns * G;
            const int64_t b0 = kv_window_first_block(ctx[d], window, bs); /* the walk starts at block b0 */
            const int64_t first = ctx[d] > window && window > 0 ? ctx[d] - window : 0;
            const int64_t* bt = block_tables + d * bt_stride + b0;
            const uint16_t* qn[16];
            uint16_t* on[16];
            int64_t gl[16];
            int32_t Ln[16] = {0}, Sn[16] = {0};
            for (int64_t n = 0; n < nq; n++) {
                qn[n] = q + d * ldq + (g0 * G + n) * hd;
                on[n] = out + d * ldo + (g0 * G + n) * hd;
                gl[n] = n / G;
                Ln[n] = (int32_t)(ctx[d] - b0 * bs);
                Sn[n] = (int32_t)(first - b0 * bs);
            }
            const int32_t* sn = first > b0 * bs ? Sn : NULL;
            if (fmt) /* (two calls: the compiler specialises the bf16 one for fmt = 0) */
                attn_amx_cols(kc, vc, bt, nq, qn, on, gl, Ln, sn, KVH, hd, bs, scale, g0, ns,
                              qb, sc, p, vb, ct, fmt, kd);
            else
                attn_amx_cols(kc, vc, bt, nq, qn, on, gl, Ln, sn, KVH, hd, bs, scale, g0, ns,
                              qb, sc, p, vb, ct, 0, NULL);
        }
        if (buf) _tile_release();
        free(buf);
        free(kd);
    }
    return failed ? -1 : 0;
}

/* ---- Causal prefill attention on AMX tiles ------------------------------------------------
 * A work item is 16 consecutive tokens of a chunk and one query head; the tokens are the tile
 * columns and the keys the rows, so the softmax runs key-major (one vector per key holds the
 * 16 tokens' scores: no horizontal sums, each lane with its own causal length) and
 *   scores^T [16 keys x 16 tokens] += K [16 keys x 32 dims] * Q^T [32 dims x 16 tokens]
 *     (K read from the cache as stored: 16 rows of a block per tile),
 *   out^T [16 dims x 16 tokens] += V^T [16 dims x 32 keys] * P^T [32 keys x 16 tokens]
 *     (V^T packed once per chunk and KV head by pack_vt_prefill, so the G query heads of a KV
 *     head and all token blocks read it as it is; P^T built in the tiles' key-pair layout).
 * Softmax as in the decode kernel: float32, exact two-pass, probabilities rounded to bf16 for
 * the product, 1 / sum applied to the float32 result. */

/* Keys [k0, k1) (multiples of 32) of KV head g of a sequence with L cached keys (block table
 * bt) as V^T tiles: per 32-key tile kt and 16-dim block b, 1 KiB whose row d holds dim
 * 16 b + d of keys 32 kt .. 32 kt + 31. Keys >= L are zero (never NaN from unwritten slots). */
static TGT_AMX void pack_vt_prefill(const uint16_t* vc, const int64_t* bt, int64_t L, int64_t KVH, int64_t g,
                                    int64_t hd, int64_t bs, int64_t k0, int64_t k1, uint16_t* vt) {
    const int64_t rs = KVH * hd, NB = hd / 16;
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t j0 = k0; j0 < k1; j0 += 32)
        for (int64_t w = 0; w < hd / 32; w++) {
            __m512 r0[16], r1[16]; /* row pp: (key 2pp, key 2pp + 1) pairs of dims 32w .. +15, +16 .. +31 */
            for (int64_t pp = 0; pp < 16; pp++) {
                const int64_t ja = j0 + 2 * pp, jb = ja + 1;
                const __m512i a = ja < L ? _mm512_loadu_si512(vc + (bt[ja / bs] * bs + ja % bs) * rs + g * hd + w * 32)
                                         : _mm512_setzero_si512();
                const __m512i b = jb < L ? _mm512_loadu_si512(vc + (bt[jb / bs] * bs + jb % bs) * rs + g * hd + w * 32)
                                         : _mm512_setzero_si512();
                /* unpack{lo,hi} pair dims {0-3, 8-11, 16-19, 24-27} and {4-7, ...}; put them in order */
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                r0[pp] = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, i0, hi));
                r1[pp] = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, i1, hi));
            }
            transpose16(r0); /* row d: the 16 key pairs of dim d (moves bits only) */
            transpose16(r1);
            uint16_t* t = vt + ((j0 / 32) * NB + 2 * w) * 512;
            for (int64_t d = 0; d < 16; d++) {
                _mm512_storeu_ps(t + d * 32, r0[d]);
                _mm512_storeu_ps(t + 512 + d * 32, r1[d]);
            }
        }
}

/* One work item: tokens n < nt (nt <= 16) with queries q + n * ldq (one head, hd dims), token
 * n attending to keys [0, past + n + 1) of its sequence (K in the cache through block table
 * bt, KV head g; V^T packed in vt); results to out + n * ldo. Scratch: qt [hd / 32][16][32]
 * u16, sc [Lp][16] f32, pt [Lp / 2][32] u16, ct [4][16][16] f32, Lp = past + nt rounded up
 * to 32. */
static TGT_AMX void prefill_cols(const uint16_t* q, int64_t ldq, uint16_t* out, int64_t ldo, int64_t nt,
                                 int64_t past, const uint16_t* kc, const int64_t* bt, int64_t KVH, int64_t g,
                                 const uint16_t* vt, int64_t hd, int64_t bs, float scale, uint16_t* qt, float* sc,
                                 uint16_t* pt, float* ct) {
    const int64_t NC = hd / 32, NB = hd / 16, rs = KVH * hd, L = past + nt;
    const int64_t Lp = (L + 31) & ~(int64_t)31;
    for (int64_t c = 0; c < NC; c++) { /* Q^T tiles: row r = dim pair (32c + 2r, +1) of every token */
        __m512 r[16];
        for (int64_t n = 0; n < 16; n++)
            r[n] = n < nt ? _mm512_loadu_ps(q + n * ldq + c * 32) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t d = 0; d < 16; d++) _mm512_storeu_ps(qt + c * 512 + d * 32, r[d]);
    }
    scores_t_amx(kc, bt, L, bs, rs, g * hd, NC, qt, sc, 0);
    /* softmax over keys, one lane per token; key j counts for token n iff j <= past + n */
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lens = _mm512_add_epi32(_mm512_set1_epi32((int)past + 1), iota);
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j <= past; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j * 16)); /* every token */
    for (int64_t j = past + 1; j < L; j++) {
        const __mmask16 m = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)j), lens);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(sc + j * 16));
    }
    const __m512 nms = _mm512_mul_ps(mx, _mm512_set1_ps(-scale)); /* -max(score) * scale (scale > 0) */
    /* word indices 0, 16, 1, 17, ..., 15, 31: dword k = k | (k + 16) << 16 */
    const __m512i pairs = _mm512_add_epi32(_mm512_mullo_epi32(iota, _mm512_set1_epi32(65537)),
                                           _mm512_set1_epi32(16 << 16));
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 1 <= past; j += 2) { /* P^T rows: (key j, key j + 1) pairs; keys every token sees */
        const __m512 e0 = exp_ps(_mm512_fmadd_ps(_mm512_loadu_ps(sc + j * 16), vs, nms));
        const __m512 e1 = exp_ps(_mm512_fmadd_ps(_mm512_loadu_ps(sc + (j + 1) * 16), vs, nms));
        sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
        _mm512_storeu_si512(pt + j * 16, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
    }
    for (; j < Lp; j += 2) { /* the rest, masked per token */
        __m512 e[2];
        for (int64_t i = 0; i < 2; i++) {
            const __mmask16 m = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)(j + i)), lens);
            e[i] = j + i < L ? _mm512_maskz_mov_ps(m, exp_ps(_mm512_fmadd_ps(_mm512_loadu_ps(sc + (j + i) * 16), vs, nms)))
                             : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, e[i]);
        }
        _mm512_storeu_si512(pt + j * 16, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0])));
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int64_t b0 = 0; b0 < NB; b0 += 4) { /* out^T, 64 dims (4 tiles) at a time */
        const int64_t nb = NB - b0 < 4 ? NB - b0 : 4;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k0 = 0; k0 < Lp; k0 += 32) {
            const uint16_t* vk = vt + ((k0 / 32) * NB + b0) * 512;
            _tile_loadd(4, pt + k0 * 16, 64);
            _tile_loadd(5, vk, 64);
            _tile_dpbf16ps(0, 5, 4);
            if (nb > 1) { _tile_loadd(6, vk + 512, 64); _tile_dpbf16ps(1, 6, 4); }
            if (nb > 2) { _tile_loadd(7, vk + 1024, 64); _tile_dpbf16ps(2, 7, 4); }
            if (nb > 3) { _tile_loadd(5, vk + 1536, 64); _tile_dpbf16ps(3, 5, 4); }
        }
        _tile_stored(0, ct, 64); _tile_stored(1, ct + 256, 64);
        _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64);
        for (int64_t b = 0; b < nb; b++) {
            __m512 r[16]; /* row d: dim 16 (b0 + b) + d of every token -> row n: token n's 16 dims */
            for (int64_t d = 0; d < 16; d++) r[d] = _mm512_mul_ps(_mm512_loadu_ps(ct + b * 256 + d * 16), inv);
            transpose16(r);
            for (int64_t n = 0; n < nt; n++)
                _mm256_storeu_si256((__m256i*)(out + n * ldo + (b0 + b) * 16), ps_to_bf16x16(r[n]));
        }
    }
}

/* Causal prefill attention on AMX tiles (bf16 caches, AMX enabled, hd % 32 == 0,
 * bs % 16 == 0, G <= 16): for each of P chunks, seg[3p .. 3p + 2] = (first row of the chunk
 * in q/out, its tokens n, tokens of the sequence already cached before it); the chunk's K/V
 * must already be in the cache. Token t of a chunk attends to the first num_past + t + 1
 * tokens of its sequence (block table row p). First each chunk's V per KV head is packed as
 * V^T tiles (pack_vt_prefill; work items of 128 keys), then the work items of prefill_cols
 * run (a chunk, 16 tokens and a query head; the last tokens, with the longest contexts,
 * first).
 * Returns 0, -1 when a work buffer could not be allocated, -2 when the AMX path is not
 * available for the shape. */
static TGT_AMX int prefill_amx(const void* q, int64_t ldq, const void* k_cache, const void* v_cache,
                               const int64_t* block_tables, int64_t bt_stride, const int64_t* seg, int64_t P,
                               void* out, int64_t ldo, int64_t H, int64_t KVH, int64_t hd, int64_t bs,
                               float scale, int nthreads) {
    const int64_t G = H / KVH;
    int64_t maxLp = 32, packed = 0, pack_items = 0, items = 0;
    int64_t* base = (int64_t*)malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));
    if (!base) return -1;
    for (int64_t c = 0; c < P; c++) {
        const int64_t Lp = (seg[3 * c + 2] + seg[3 * c + 1] + 31) & ~(int64_t)31;
        maxLp = Lp > maxLp ? Lp : maxLp;
        base[c] = packed;
        packed += KVH * Lp * hd; /* u16: V^T of each KV head */
        pack_items += KVH * ((Lp + 127) / 128);
        items += H * ((seg[3 * c + 1] + 15) / 16);
    }
    uint16_t* vtp = (uint16_t*)aligned_alloc(64, ((size_t)packed * 2 + 64 + 63) & ~(size_t)63); /* (> 0) */
    if (!vtp) {
        free(base);
        return -1;
    }
    const uint16_t* kc = (const uint16_t*)k_cache;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < pack_items; it++) { /* V^T, 128 keys of a KV head per item */
            int64_t rest = it, c = 0, Lp;
            for (;;) {
                Lp = (seg[3 * c + 2] + seg[3 * c + 1] + 31) & ~(int64_t)31;
                if (rest < KVH * ((Lp + 127) / 128)) break;
                rest -= KVH * ((Lp + 127) / 128);
                c++;
            }
            const int64_t ng = (Lp + 127) / 128, g = rest / ng, k0 = (rest % ng) * 128;
            pack_vt_prefill((const uint16_t*)v_cache, block_tables + c * bt_stride, seg[3 * c + 2] + seg[3 * c + 1],
                            KVH, g, hd, bs, k0, k0 + 128 < Lp ? k0 + 128 : Lp, vtp + base[c] + g * Lp * hd);
        }
        /* (the barrier at the end of the loop: every chunk is packed) */
        char* buf = (char*)aligned_alloc(64, ((size_t)hd * 32 + (size_t)maxLp * 96 + 4096 + 63) & ~(size_t)63);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            kv_amx_config();
        }
        uint16_t* qt = (uint16_t*)buf;
        float* ct = (float*)(buf + hd * 32);
        float* sc = ct + 1024;
        uint16_t* pt = (uint16_t*)(sc + maxLp * 16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!buf) continue;
            /* item -> (chunk, KV head, token block, query head of that KV head): the items of
             * a KV head run one after another (they read the same K and V^T, which then stay
             * in L2), later token blocks (longer contexts) first */
            int64_t rest = it, c = 0;
            while (rest >= H * ((seg[3 * c + 1] + 15) / 16)) rest -= H * ((seg[3 * c + 1] + 15) / 16), c++;
            const int64_t start = seg[3 * c], n_tok = seg[3 * c + 1], past = seg[3 * c + 2];
            const int64_t nblk = (n_tok + 15) / 16, g = rest / (nblk * G), r2 = rest % (nblk * G);
            const int64_t tb = nblk - 1 - r2 / G, h = g * G + r2 % G;
            const int64_t t0 = tb * 16, nt = t0 + 16 < n_tok ? 16 : n_tok - t0;
            const int64_t Lp = (past + n_tok + 31) & ~(int64_t)31;
            prefill_cols((const uint16_t*)q + (start + t0) * ldq + h * hd, ldq,
                         (uint16_t*)out + (start + t0) * ldo + h * hd, ldo, nt, past + t0, kc,
                         block_tables + c * bt_stride, KVH, h / G, vtp + base[c] + (h / G) * Lp * hd, hd, bs, scale,
                         qt, sc, pt, ct);
        }
        if (buf) _tile_release();
        free(buf);
    }
    free(vtp);
    free(base);
    return failed ? -1 : 0;
}

/* ---- Causal prefill attention on AVX512-BF16 dot products (CPUs without AMX) --------------
 * The counterpart of prefill_amx for CPUs with AVX512_BF16 but no AMX tiles (e.g. AMD Zen 4),
 * built in the cpu_ops_avx512bf16 variant only. Flash-attention style (Dao et al. 2022,
 * "FlashAttention"): a work item is a chunk, a KV head and up to PF_MQ consecutive tokens of
 * the chunk, whose G query heads each make a row (R = tokens * G <= 64 rows, token-major);
 * the item walks its keys in blocks of PF_KB = 64 with an online softmax (running max m and
 * sum l per row, the float32 output rescaled by exp(m_old - m_new) when the max grows), so
 * every K/V block loaded is used by all R rows (the G heads of the KV head share it: GQA
 * without repeating KV). Both products run on VDPBF16PS (pairs of bf16 multiplied exactly,
 * float32 accumulators):
 *   scores [row][16 keys] += Q[row][dims 2p, 2p+1] (broadcast) . K'[p][16 keys][2]
 *     (K' = K packed once per chunk and KV head by pack_kv_prefill_dp: the 16 x 16 dword
 *     transpose of 16 keys' rows);
 *   out [row][16 dims] += P[row][keys 2k, 2k+1] (broadcast) . V'[k][16 dims][2]
 *     (V' = V packed to pairs of consecutive keys, the layout pack_vt_prefill builds before
 *     its transpose; P = exp(s - m) rounded to bf16, as the AMX kernel and PyTorch's CPU flash
 *     attention do, while l sums the float32 values).
 * Softmax in float32 (exp_ps), 1 / l applied to the float32 result. Register blocking: 6 rows
 * x 64 keys (24 accumulators) for Q.K^T, 6 rows x 64 dims for P.V. */
#ifdef KV_AVX512BF16
#define PF_KB 64   /* keys per block */
#define PF_ROWS 64 /* most rows (tokens x G) of a work item */
#define PF_DIRECT_ROWS 16 /* probe_colsum: at most this many rows (tokens x G) read the keys unpacked */

/* Tokens per work item for GQA group G: 16, fewer when G > 4 so that tokens * G <= 64. */
static inline int64_t pf_tokens(int64_t G) {
    const int64_t t = PF_ROWS / G;
    return t > 16 ? 16 : (t < 1 ? 1 : t);
}

/* Lanes [0, n) of a 16-lane vector, none for n <= 0. */
INLINE TGT_DP __mmask16 pf_mask(int64_t n) { return n <= 0 ? (__mmask16)0 : tail_mask(n); }

/* Keys [k0, k1) (multiples of 32) of KV head g of a sequence with L cached keys (block table
 * bt) into kp and vp, the packed buffers of that chunk and KV head ([Lp / 16][hd / 2][16][2]
 * and [Lp / 2][hd / 16][16][2] u16, Lp = L rounded up to PF_KB); keys >= L are zero. vp NULL:
 * K only. */
static TGT_DP void pack_kv_prefill_dp(const uint16_t* kc, const uint16_t* vc, const int64_t* bt, int64_t L,
                                      int64_t KVH, int64_t g, int64_t hd, int64_t bs, int64_t k0, int64_t k1,
                                      uint16_t* kp, uint16_t* vp) {
    const int64_t rs = KVH * hd, NV = hd / 16;
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t j0 = k0; j0 < k1; j0 += 16) {
        const uint16_t* row[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t j = j0 + i;
            row[i] = j < L ? kc + (bt[j / bs] * bs + j % bs) * rs + g * hd : NULL;
        }
        uint16_t* kt = kp + j0 * hd; /* (j0 / 16) * (hd / 2) * 32 */
        for (int64_t w = 0; w < hd / 32; w++) { /* K: 16 keys x 16 dim pairs -> 16 dim pairs x 16 keys */
            __m512 r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = row[i] ? _mm512_loadu_ps(row[i] + w * 32) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t p = 0; p < 16; p++) _mm512_storeu_ps(kt + (16 * w + p) * 32, r[p]);
        }
        for (int64_t pp = 0; pp < 8 && vp; pp++) { /* V: keys (2pp, 2pp + 1) of the 16, dims interleaved */
            const int64_t ja = j0 + 2 * pp, jb = ja + 1;
            const uint16_t* va = ja < L ? vc + (bt[ja / bs] * bs + ja % bs) * rs + g * hd : NULL;
            const uint16_t* vb = jb < L ? vc + (bt[jb / bs] * bs + jb % bs) * rs + g * hd : NULL;
            uint16_t* vt = vp + (ja / 2) * NV * 32;
            for (int64_t w = 0; w < hd / 32; w++) {
                const __m512i a = va ? _mm512_loadu_si512(va + w * 32) : _mm512_setzero_si512();
                const __m512i b = vb ? _mm512_loadu_si512(vb + w * 32) : _mm512_setzero_si512();
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                _mm512_storeu_si512(vt + (2 * w) * 32, _mm512_permutex2var_epi32(lo, i0, hi));
                _mm512_storeu_si512(vt + (2 * w + 1) * 32, _mm512_permutex2var_epi32(lo, i1, hi));
            }
        }
    }
}

INLINE TGT_DP __m512bh pf_bcast(const uint16_t* p) { /* the bf16 pair at p in every dword */
    int32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* acc[r][i] lane j = q_r . k_(16i + j): the unscaled scores of rows qr[0 .. RB - 1] against the
 * 64 keys of the packed block kb (bf16 products, float32 sums). */
INLINE TGT_DP void pf_qk_acc(const int RB, const uint16_t* const* qr, const uint16_t* kb, int64_t hd,
                             __m512 acc[6][4]) {
#pragma GCC unroll 6
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    const int64_t gs = hd * 16; /* u16 between the packed 16-key groups */
    for (int64_t p = 0; p < hd / 2; p++) {
        __m512bh kv[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) kv[i] = (__m512bh)_mm512_loadu_si512(kb + i * gs + p * 32);
#pragma GCC unroll 6
        for (int r = 0; r < RB; r++) {
            const __m512bh b = pf_bcast(qr[r] + 2 * p);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], kv[i], b);
        }
    }
}

/* Scores of rows r0 .. r0 + RB - 1 (query rows qr[]) against the 64 keys of the packed block
 * kb, then their online-softmax step: keys [lo[r], lim[r]) of the block count for row r (lo
 * NULL: from 0; lim <= 0: none, >= 64: to the end); m, l, the float32 outputs o ([R][hd]) and
 * the bf16 probabilities pb ([R][64]). */
INLINE TGT_DP void pf_qk_rows(const int RB, const uint16_t* const* qr, const uint16_t* kb, int64_t hd, float scale,
                              const int64_t* lim, const int64_t* lo, float* m, float* l, float* o, uint16_t* pb) {
    __m512 acc[6][4]; /* (fixed sizes and full unrolling: the accumulators stay in registers) */
    pf_qk_acc(RB, qr, kb, hd, acc);
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < RB; r++) {
        uint16_t* pr = pb + r * PF_KB;
        const int64_t lr = lo ? lo[r] : 0;
        if (lim[r] <= 0 || lr >= lim[r] || lr >= PF_KB) { /* no key of this block for the row */
            _mm512_storeu_si512(pr, _mm512_setzero_si512());
            _mm512_storeu_si512(pr + 32, _mm512_setzero_si512());
            continue;
        }
        __mmask16 mk[4];
        __m512 s[4], bm = ninf;
        for (int i = 0; i < 4; i++) {
            mk[i] = pf_mask(lim[r] - 16 * i) & (__mmask16)~pf_mask(lr - 16 * i);
            s[i] = _mm512_mul_ps(acc[r][i], vs);
            bm = _mm512_mask_max_ps(bm, mk[i], bm, s[i]);
        }
        const float mo = m[r], mn = fmaxf(mo, _mm512_reduce_max_ps(bm));
        if (mn > mo) { /* the max grew: rescale the row's sum and output (first block: mo = -inf) */
            const float alpha = expf(mo - mn);
            l[r] *= alpha;
            const __m512 va = _mm512_set1_ps(alpha);
            float* orow = o + r * hd;
            for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
            m[r] = mn;
        }
        const __m512 vm = _mm512_set1_ps(mn);
        __m512 e[4];
        for (int i = 0; i < 4; i++) e[i] = _mm512_maskz_mov_ps(mk[i], exp_ps(_mm512_sub_ps(s[i], vm)));
        l[r] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
        _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_storeu_si512(pr + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
}

/* o[r][dims dc .. dc + 16 NC) += P[r] . V of the block, rows r0 .. r0 + RB - 1 (o, pb at r0),
 * over the block's first `pairs` key pairs (vb: the packed V of the block, [32][hd / 16][32]). */
INLINE TGT_DP void pf_pv_rows(const int RB, const int NC, const uint16_t* pb, const uint16_t* vb, int64_t pairs,
                              int64_t hd, int64_t dc, float* o) {
    __m512 acc[6][4]; /* (fixed sizes and full unrolling: the accumulators stay in registers) */
#pragma GCC unroll 6
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int i = 0; i < NC; i++) acc[r][i] = _mm512_loadu_ps(o + r * hd + dc + 16 * i);
    const int64_t ps = hd * 2; /* u16 per packed key pair */
    for (int64_t k = 0; k < pairs; k++) {
        __m512bh vv[4];
#pragma GCC unroll 4
        for (int i = 0; i < NC; i++) vv[i] = (__m512bh)_mm512_loadu_si512(vb + k * ps + (dc + 16 * i) * 2);
#pragma GCC unroll 6
        for (int r = 0; r < RB; r++) {
            const __m512bh b = pf_bcast(pb + r * PF_KB + 2 * k);
#pragma GCC unroll 4
            for (int i = 0; i < NC; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], vv[i], b);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int i = 0; i < NC; i++) _mm512_storeu_ps(o + r * hd + dc + 16 * i, acc[r][i]);
}

static TGT_DP void pf_qk_dispatch(int rb, const uint16_t* const* qr, const uint16_t* kb, int64_t hd, float scale,
                                  const int64_t* lim, const int64_t* lo, float* m, float* l, float* o, uint16_t* pb) {
    switch (rb) {
#define KV_PF_QK(N) case N: pf_qk_rows(N, qr, kb, hd, scale, lim, lo, m, l, o, pb); break;
        KV_PF_QK(1) KV_PF_QK(2) KV_PF_QK(3) KV_PF_QK(4) KV_PF_QK(5) default: KV_PF_QK(6)
#undef KV_PF_QK
    }
}

static TGT_DP void pf_pv_dispatch(int rb, int nc, const uint16_t* pb, const uint16_t* vb, int64_t pairs, int64_t hd,
                                  int64_t dc, float* o) {
#define KV_PF_PV(N, C) if (rb == N && nc == C) { pf_pv_rows(N, C, pb, vb, pairs, hd, dc, o); return; }
    KV_PF_PV(6, 4) KV_PF_PV(5, 4) KV_PF_PV(4, 4) KV_PF_PV(3, 4) KV_PF_PV(2, 4) KV_PF_PV(1, 4)
    KV_PF_PV(6, 2) KV_PF_PV(5, 2) KV_PF_PV(4, 2) KV_PF_PV(3, 2) KV_PF_PV(2, 2) KV_PF_PV(1, 2)
#undef KV_PF_PV
}

/* Rows 0 .. R - 1 (queries qr[]) against one packed 64-key block (kb, vb) of which the first
 * `keys` exist: the online-softmax step (row r counts keys [lo[r], lim[r]): pf_qk_rows), then
 * o += P . V over those keys. */
static TGT_DP void pf_block(int64_t R, const uint16_t* const* qr, const uint16_t* kb, const uint16_t* vb, int64_t keys,
                            int64_t hd, float scale, const int64_t* lim, const int64_t* lo, float* m, float* l,
                            float* o, uint16_t* pb) {
    for (int64_t r0 = 0; r0 < R; r0 += 6) {
        const int rb = R - r0 < 6 ? (int)(R - r0) : 6;
        pf_qk_dispatch(rb, qr + r0, kb, hd, scale, lim + r0, lo ? lo + r0 : NULL, m + r0, l + r0, o + r0 * hd,
                       pb + r0 * PF_KB);
    }
    const int64_t pairs = (keys + 1) / 2;
    for (int64_t dc = 0; dc < hd; dc += 64) {
        const int nc = hd - dc >= 64 ? 4 : 2;
        for (int64_t r0 = 0; r0 < R; r0 += 6) {
            const int rb = R - r0 < 6 ? (int)(R - r0) : 6;
            pf_pv_dispatch(rb, nc, pb + r0 * PF_KB, vb, pairs, hd, dc, o + r0 * hd);
        }
    }
}

/* Row r (token r / G, head r % G) of the item: o[r] / l[r] rounded to bf16 into out (zeros for a
 * row that saw no key). The outputs' dims come out as packed: lane i of dims [16c, 16c + 16) is
 * dim 16c + i. */
static TGT_DP void pf_store(int64_t R, int64_t G, uint16_t* out, int64_t ldo, int64_t hd, const float* o,
                            const float* l) {
    for (int64_t r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        uint16_t* orow = out + (r / G) * ldo + (r % G) * hd;
        for (int64_t d = 0; d < hd; d += 16)
            _mm256_storeu_si256((__m256i*)(orow + d), ps_to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(o + r * hd + d), inv)));
    }
}

/* A thread's scratch for R rows of a prefill work item: o [R][hd] f32, m, l [R], pb [R][PF_KB] u16
 * in one buffer (buf NULL: allocation failed). */
typedef struct {
    char* buf;
    float *o, *m, *l;
    uint16_t* pb;
} pf_scratch_t;

static inline int pf_scratch_alloc(pf_scratch_t* s, int64_t R, int64_t hd) {
    s->buf = (char*)aligned_alloc(64, ((size_t)R * (hd * 4 + 8 + PF_KB * 2) + 63) & ~(size_t)63);
    s->o = (float*)s->buf;
    s->m = s->o + R * hd;
    s->l = s->m + R;
    s->pb = (uint16_t*)(s->l + R);
    return s->buf != NULL;
}

/* One work item: tokens n < nt of a chunk (queries q + n * ldq, heads 0 .. G - 1 of the KV head
 * at q + h * hd), token n attending to keys [0, past + n + 1) (packed K/V of its chunk and KV
 * head in kp, vp); results to out + n * ldo + h * hd. Scratch: o [R][hd] f32, m, l [R],
 * pb [R][64] u16, R = nt * G <= PF_ROWS. */
static TGT_DP void prefill_dp_item(const uint16_t* q, int64_t ldq, uint16_t* out, int64_t ldo, int64_t nt, int64_t G,
                                   int64_t past, const uint16_t* kp, const uint16_t* vp, int64_t hd, float scale,
                                   float* o, float* m, float* l, uint16_t* pb) {
    const int64_t R = nt * G, L = past + nt;
    const uint16_t* qr[PF_ROWS];
    for (int64_t r = 0; r < R; r++) {
        qr[r] = q + (r / G) * ldq + (r % G) * hd;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(R * hd));
    int64_t lim[PF_ROWS];
    for (int64_t k0 = 0; k0 < L; k0 += PF_KB) {
        for (int64_t r = 0; r < R; r++) lim[r] = past + r / G + 1 - k0; /* keys of the block row r sees */
        pf_block(R, qr, kp + k0 * hd, vp + k0 * hd, L - k0 < PF_KB ? L - k0 : PF_KB, hd, scale, lim, NULL, m, l, o,
                 pb);
    }
    pf_store(R, G, out, ldo, hd, o, l);
}

/* Causal prefill attention on AVX512-BF16 (bf16 caches, hd % 32 == 0, hd <= 256, G <= 64; any
 * block size): same contract as prefill_amx. First each chunk's K and V per KV head are packed
 * (pack_kv_prefill_dp; work items of 128 keys), then the work items of prefill_dp_item run (a
 * chunk, a KV head and pf_tokens(G) tokens; the items of a KV head one after another, the last
 * tokens, with the longest contexts, first). Returns 0, or -1 when a work buffer could not be
 * allocated. */
static TGT_DP int prefill_dp(const void* q, int64_t ldq, const void* k_cache, const void* v_cache,
                             const int64_t* block_tables, int64_t bt_stride, const int64_t* seg, int64_t P, void* out,
                             int64_t ldo, int64_t H, int64_t KVH, int64_t hd, int64_t bs, float scale, int nthreads) {
    const int64_t G = H / KVH, MQ = pf_tokens(G);
    int64_t packed = 0, pack_items = 0, items = 0;
    int64_t* base = (int64_t*)malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));
    if (!base) return -1;
    for (int64_t c = 0; c < P; c++) {
        const int64_t Lp = (seg[3 * c + 2] + seg[3 * c + 1] + PF_KB - 1) / PF_KB * PF_KB;
        base[c] = packed;
        packed += 2 * KVH * Lp * hd; /* u16: K' then V' of each KV head */
        pack_items += KVH * ((Lp + 127) / 128);
        items += KVH * ((seg[3 * c + 1] + MQ - 1) / MQ);
    }
    uint16_t* kvp = (uint16_t*)aligned_alloc(64, ((size_t)packed * 2 + 64 + 63) & ~(size_t)63);
    if (!kvp) {
        free(base);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < pack_items; it++) { /* 128 keys of a KV head per item */
            int64_t rest = it, c = 0, Lp;
            for (;;) {
                Lp = (seg[3 * c + 2] + seg[3 * c + 1] + PF_KB - 1) / PF_KB * PF_KB;
                if (rest < KVH * ((Lp + 127) / 128)) break;
                rest -= KVH * ((Lp + 127) / 128);
                c++;
            }
            const int64_t ng = (Lp + 127) / 128, g = rest / ng, k0 = (rest % ng) * 128;
            uint16_t* kp = kvp + base[c] + 2 * g * Lp * hd;
            pack_kv_prefill_dp((const uint16_t*)k_cache, (const uint16_t*)v_cache, block_tables + c * bt_stride,
                               seg[3 * c + 2] + seg[3 * c + 1], KVH, g, hd, bs, k0, k0 + 128 < Lp ? k0 + 128 : Lp,
                               kp, kp + Lp * hd);
        }
        /* (the barrier at the end of the loop: every chunk is packed) */
        pf_scratch_t sc;
        if (!pf_scratch_alloc(&sc, MQ * G, hd)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!sc.buf) continue;
            int64_t rest = it, c = 0;
            while (rest >= KVH * ((seg[3 * c + 1] + MQ - 1) / MQ)) rest -= KVH * ((seg[3 * c + 1] + MQ - 1) / MQ), c++;
            const int64_t start = seg[3 * c], n_tok = seg[3 * c + 1], past = seg[3 * c + 2];
            const int64_t ntile = (n_tok + MQ - 1) / MQ, g = rest / ntile, tb = ntile - 1 - rest % ntile;
            const int64_t t0 = tb * MQ, nt = t0 + MQ < n_tok ? MQ : n_tok - t0;
            const int64_t Lp = (past + n_tok + PF_KB - 1) / PF_KB * PF_KB;
            const uint16_t* kp = kvp + base[c] + 2 * g * Lp * hd;
            prefill_dp_item((const uint16_t*)q + (start + t0) * ldq + g * G * hd, ldq,
                            (uint16_t*)out + (start + t0) * ldo + g * G * hd, ldo, nt, G, past + t0, kp, kp + Lp * hd,
                            hd, scale, sc.o, sc.m, sc.l, sc.pb);
        }
        free(sc.buf);
    }
    free(kvp);
    free(base);
    return failed ? -1 : 0;
}

/* One work item of prefill_ranges: tokens n < nt (queries q + n * ldq, heads 0 .. G - 1 of the
 * KV head), token n attending to keys [0, rg[3n]) of source D (packed kd, vd) and then to keys
 * [rg[3n + 1], rg[3n + 2]) of source F (packed kf, vf), one online softmax over both; results
 * to out + n * ldo. Scratch as prefill_dp_item. */
static TGT_DP void prefill_ranges_item(const uint16_t* q, int64_t ldq, uint16_t* out, int64_t ldo, int64_t nt,
                                       int64_t G, const int64_t* rg, const uint16_t* kd, const uint16_t* vd,
                                       int64_t Ld, const uint16_t* kf, const uint16_t* vf, int64_t Lf, int64_t hd,
                                       float scale, float* o, float* m, float* l, uint16_t* pb) {
    const int64_t R = nt * G;
    const uint16_t* qr[PF_ROWS];
    int64_t dmax = 0, fmin = Lf, fmax = 0;
    for (int64_t r = 0; r < R; r++) {
        qr[r] = q + (r / G) * ldq + (r % G) * hd;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t t = 0; t < nt; t++) {
        const int64_t d = rg[3 * t], f0 = rg[3 * t + 1], f1 = rg[3 * t + 2];
        dmax = d > dmax ? d : dmax;
        if (f1 > f0) {
            fmin = f0 < fmin ? f0 : fmin;
            fmax = f1 > fmax ? f1 : fmax;
        }
    }
    dmax = dmax < Ld ? dmax : Ld;
    fmax = fmax < Lf ? fmax : Lf;
    memset(o, 0, sizeof(float) * (size_t)(R * hd));
    int64_t lim[PF_ROWS], lo[PF_ROWS];
    for (int64_t k0 = 0; k0 < dmax; k0 += PF_KB) {
        for (int64_t r = 0; r < R; r++) lim[r] = (rg[3 * (r / G)] < Ld ? rg[3 * (r / G)] : Ld) - k0;
        pf_block(R, qr, kd + k0 * hd, vd + k0 * hd, Ld - k0 < PF_KB ? Ld - k0 : PF_KB, hd, scale, lim, NULL, m, l, o,
                 pb);
    }
    for (int64_t k0 = fmin / PF_KB * PF_KB; k0 < fmax; k0 += PF_KB) {
        for (int64_t r = 0; r < R; r++) {
            const int64_t f0 = rg[3 * (r / G) + 1], f1 = rg[3 * (r / G) + 2];
            lo[r] = f0 - k0;
            lim[r] = f1 > f0 ? (f1 < Lf ? f1 : Lf) - k0 : 0;
        }
        pf_block(R, qr, kf + k0 * hd, vf + k0 * hd, Lf - k0 < PF_KB ? Lf - k0 : PF_KB, hd, scale, lim, lo, m, l, o,
                 pb);
    }
    pf_store(R, G, out, ldo, hd, o, l);
}

/* Attention of n tokens over two bf16 key/value sources with a key range per token (see
 * kv_prefill_ranges), on AVX512-BF16: both sources packed once per KV head
 * (pack_kv_prefill_dp over contiguous rows), then work items of pf_tokens(G) tokens and one KV
 * head, the last tokens first. Returns 0, or -1 when a work buffer could not be allocated. */
static TGT_DP int prefill_ranges_dp(const void* q, int64_t ldq, const void* kd, const void* vd, int64_t Ld,
                                    const void* kf, const void* vf, int64_t Lf, const int64_t* rg, int64_t n,
                                    void* out, int64_t ldo, int64_t H, int64_t KVH, int64_t hd, float scale,
                                    int nthreads) {
    const int64_t G = H / KVH, MQ = pf_tokens(G);
    const int64_t Ldp = (Ld + PF_KB - 1) / PF_KB * PF_KB, Lfp = (Lf + PF_KB - 1) / PF_KB * PF_KB;
    const int64_t nd = (Ldp + 127) / 128, nf = (Lfp + 127) / 128, per = 2 * (Ldp + Lfp) * hd;
    const int64_t pack_items = KVH * (nd + nf), ntile = (n + MQ - 1) / MQ, items = KVH * ntile;
    const int64_t bt0 = 0;
    uint16_t* kvp = (uint16_t*)aligned_alloc(64, ((size_t)(KVH * per) * 2 + 64 + 63) & ~(size_t)63);
    if (!kvp) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < pack_items; it++) { /* 128 keys of one source and KV head per item */
            const int64_t g = it / (nd + nf), i = it % (nd + nf);
            uint16_t* base = kvp + g * per;
            if (i < nd) /* contiguous rows: one "block" of Ld keys */
                pack_kv_prefill_dp((const uint16_t*)kd, (const uint16_t*)vd, &bt0, Ld, KVH, g, hd, Ld, i * 128,
                                   i * 128 + 128 < Ldp ? i * 128 + 128 : Ldp, base, base + Ldp * hd);
            else
                pack_kv_prefill_dp((const uint16_t*)kf, (const uint16_t*)vf, &bt0, Lf, KVH, g, hd, Lf, (i - nd) * 128,
                                   (i - nd) * 128 + 128 < Lfp ? (i - nd) * 128 + 128 : Lfp, base + 2 * Ldp * hd,
                                   base + (2 * Ldp + Lfp) * hd);
        }
        pf_scratch_t sc;
        if (!pf_scratch_alloc(&sc, MQ * G, hd)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!sc.buf) continue;
            const int64_t g = it / ntile, tb = ntile - 1 - it % ntile;
            const int64_t t0 = tb * MQ, nt = t0 + MQ < n ? MQ : n - t0;
            const uint16_t* base = kvp + g * per;
            prefill_ranges_item((const uint16_t*)q + t0 * ldq + g * G * hd, ldq,
                                (uint16_t*)out + t0 * ldo + g * G * hd, ldo, nt, G, rg + 3 * t0, base,
                                base + Ldp * hd, Ld, base + 2 * Ldp * hd, base + (2 * Ldp + Lfp) * hd, Lf, hd, scale,
                                sc.o, sc.m, sc.l, sc.pb);
        }
        free(sc.buf);
    }
    free(kvp);
    return failed ? -1 : 0;
}

/* Masked max of s[a, b). */
INLINE TGT_DP float pc_max(const float* s, int64_t a, int64_t b, float m) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = _mm512_set1_ps(m);
    for (int64_t j = a; j < b; j += 16) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, pf_mask(b - j), s + j));
    return b > a ? _mm512_reduce_max_ps(vm) : m;
}

/* s[j] = exp(s[j] - m) for j in [a, b); returns their sum. */
INLINE TGT_DP float pc_exp(float* s, int64_t a, int64_t b, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = a; j < b; j += 16) {
        const __mmask16 k = pf_mask(b - j);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm)));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* cs[j] += s[j] * w for j in [a, b). */
INLINE TGT_DP void pc_add(float* cs, const float* s, int64_t a, int64_t b, float w) {
    const __m512 vw = _mm512_set1_ps(w);
    for (int64_t j = a; j < b; j += 16) {
        const __mmask16 k = pf_mask(b - j);
        _mm512_mask_storeu_ps(cs + j, k, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j), vw,
                                                         _mm512_maskz_loadu_ps(k, cs + j)));
    }
}

/* Scaled scores of rows qr[0 .. R - 1] against the packed keys kp, blocks [k0, k1) (multiples of
 * PF_KB), into s + r * ls + k (k = key index). */
static TGT_DP void pc_scores(int64_t R, const uint16_t* const* qr, const uint16_t* kp, int64_t k0, int64_t k1,
                             int64_t hd, float scale, float* s, int64_t ls) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t kb = k0; kb < k1; kb += PF_KB)
        for (int64_t r0 = 0; r0 < R; r0 += 6) {
            const int rb = R - r0 < 6 ? (int)(R - r0) : 6;
            __m512 acc[6][4];
            switch (rb) {
#define KV_PC_QK(N) case N: pf_qk_acc(N, qr + r0, kp + kb * hd, hd, acc); break;
                KV_PC_QK(1) KV_PC_QK(2) KV_PC_QK(3) KV_PC_QK(4) KV_PC_QK(5) default: KV_PC_QK(6)
#undef KV_PC_QK
            }
            for (int r = 0; r < rb; r++)
                for (int i = 0; i < 4; i++) _mm512_storeu_ps(s + (r0 + r) * ls + kb + 16 * i, _mm512_mul_ps(acc[r][i], vs));
        }
}

/* pc_scores for keys as stored (key j of the KV head at kr + j * rs, keys [k0, k1)), for a few rows:
 * per 16 keys and row, the dot products reduced across lanes (as the decode kernels do), no packing. */
static TGT_DP void pc_scores_rows(int64_t R, const uint16_t* const* qr, const uint16_t* kr, int64_t rs, int64_t k0,
                                  int64_t k1, int64_t hd, float scale, float* s, int64_t ls) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j0 = k0; j0 < k1; j0 += 16) {
        const int64_t n = k1 - j0 < 16 ? k1 - j0 : 16;
        for (int64_t r = 0; r < R; r++) {
            __m512 P[16];
            for (int jj = 0; jj < 16; jj++) P[jj] = _mm512_setzero_ps();
            for (int64_t jj = 0; jj < n; jj++)
                for (int64_t w = 0; w < hd / 32; w++)
                    P[jj] = _mm512_dpbf16_ps(P[jj], (__m512bh)_mm512_loadu_si512(qr[r] + w * 32),
                                             (__m512bh)_mm512_loadu_si512(kr + (j0 + jj) * rs + w * 32));
            _mm512_mask_storeu_ps(s + r * ls + j0, pf_mask(n), _mm512_mul_ps(hsum16(P), vs));
        }
    }
}

/* One work item of probe_colsum: tokens n < nt (queries q + n * ldq, heads 0 .. G - 1 of the KV
 * head), token n attending to keys [0, rg[3n]) of D (packed kd) and [rg[3n + 1], rg[3n + 2]) of F
 * (packed kf; rs > 0: kd, kf are the sources as stored, at the KV head, rows rs apart); each
 * row's softmax probabilities added to cs (D's key j at cs[j], F's key j at cs[fofs + j]).
 * Scratch s: [nt * G][Ldp + Lfp] float32. */
static TGT_DP void probe_colsum_item(const uint16_t* q, int64_t ldq, int64_t nt, int64_t G, const int64_t* rg,
                                     const uint16_t* kd, int64_t Ld, int64_t Ldp, const uint16_t* kf, int64_t Lf,
                                     int64_t Lfp, int64_t rs, int64_t fofs, int64_t hd, float scale, float* s,
                                     float* cs) {
    const int64_t R = nt * G, ls = Ldp + Lfp;
    const uint16_t* qr[PF_ROWS];
    int64_t dmax = 0, fmin = Lf, fmax = 0;
    for (int64_t r = 0; r < R; r++) qr[r] = q + (r / G) * ldq + (r % G) * hd;
    for (int64_t t = 0; t < nt; t++) {
        const int64_t d = rg[3 * t] < Ld ? rg[3 * t] : Ld, f0 = rg[3 * t + 1], f1 = rg[3 * t + 2] < Lf ? rg[3 * t + 2] : Lf;
        dmax = d > dmax ? d : dmax;
        if (f1 > f0) {
            fmin = f0 < fmin ? f0 : fmin;
            fmax = f1 > fmax ? f1 : fmax;
        }
    }
    if (rs) {
        pc_scores_rows(R, qr, kd, rs, 0, dmax, hd, scale, s, ls);
        if (fmax > fmin) pc_scores_rows(R, qr, kf, rs, fmin, fmax, hd, scale, s + Ldp, ls);
    } else {
        pc_scores(R, qr, kd, 0, (dmax + PF_KB - 1) / PF_KB * PF_KB, hd, scale, s, ls);
        if (fmax > fmin)
            pc_scores(R, qr, kf, fmin / PF_KB * PF_KB, (fmax + PF_KB - 1) / PF_KB * PF_KB, hd, scale, s + Ldp, ls);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = r / G, d = rg[3 * t] < Ld ? rg[3 * t] : Ld;
        const int64_t f0 = rg[3 * t + 1], f1 = rg[3 * t + 2] < Lf ? rg[3 * t + 2] : Lf;
        float* sr = s + r * ls;
        const float m = pc_max(sr + Ldp, f0, f1, pc_max(sr, 0, d, -INFINITY));
        if (m == -INFINITY) continue; /* no key (or every score -inf) */
        const float l = pc_exp(sr, 0, d, m) + (f1 > f0 ? pc_exp(sr + Ldp, f0, f1, m) : 0.0f);
        pc_add(cs, sr, 0, d, 1.0f / l);
        if (f1 > f0) pc_add(cs + fofs, sr + Ldp, f0, f1, 1.0f / l);
    }
}

/* Column sums of attention probabilities (see kv_probe_colsum), on AVX512-BF16: K of both
 * sources packed once per KV head (pack_kv_prefill_dp, K only; not for <= PF_DIRECT_ROWS rows,
 * a decode step's, which read the keys as stored), then work items of
 * pf_tokens(G) tokens and one KV head, each thread adding into its own [KVH][c] sums, added
 * into out at the end in thread order (the same result every call for a thread count). Returns
 * 0, or -1 when a work buffer could not be allocated. */
static TGT_DP int probe_colsum_dp(const void* q, int64_t ldq, const void* kd, int64_t Ld, const void* kf, int64_t Lf,
                                  const int64_t* rg, int64_t n, int64_t fofs, float* out, int64_t c, int64_t H,
                                  int64_t KVH, int64_t hd, float scale, int nthreads) {
    const int64_t G = H / KVH, MQ = pf_tokens(G);
    const int64_t Ldp = (Ld + PF_KB - 1) / PF_KB * PF_KB, Lfp = (Lf + PF_KB - 1) / PF_KB * PF_KB;
    const int64_t nd = (Ldp + 127) / 128, nf = (Lfp + 127) / 128, per = (Ldp + Lfp) * hd;
    const int direct = n * G <= PF_DIRECT_ROWS; /* a few rows (decode): keys read as stored */
    const int64_t pack_items = direct ? 0 : KVH * (nd + nf), ntile = (n + MQ - 1) / MQ, items = KVH * ntile;
    const int64_t bt0 = 0;
    uint16_t* kp = direct ? NULL : (uint16_t*)aligned_alloc(64, ((size_t)(KVH * per) * 2 + 64 + 63) & ~(size_t)63);
    float** sums = (float**)calloc((size_t)(nthreads > 0 ? nthreads : 1), sizeof(float*)); /* each thread's [KVH][c] */
    if ((!direct && !kp) || !sums) {
        free(kp);
        free(sums);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), T = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < pack_items; it++) { /* 128 keys of one source and KV head per item */
            const int64_t g = it / (nd + nf), i = it % (nd + nf);
            uint16_t* base = kp + g * per;
            if (i < nd)
                pack_kv_prefill_dp((const uint16_t*)kd, NULL, &bt0, Ld, KVH, g, hd, Ld, i * 128,
                                   i * 128 + 128 < Ldp ? i * 128 + 128 : Ldp, base, NULL);
            else
                pack_kv_prefill_dp((const uint16_t*)kf, NULL, &bt0, Lf, KVH, g, hd, Lf, (i - nd) * 128,
                                   (i - nd) * 128 + 128 < Lfp ? (i - nd) * 128 + 128 : Lfp, base + Ldp * hd, NULL);
        }
        const int64_t R = (n < MQ ? n : MQ) * G; /* (rows of the largest item) */
        float* s = (float*)aligned_alloc(64, ((size_t)(R * (Ldp + Lfp) + KVH * c) * 4 + 63) & ~(size_t)63);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        float* cs = s ? s + R * (Ldp + Lfp) : NULL;
        if (cs) memset(cs, 0, sizeof(float) * (size_t)(KVH * c));
        sums[tid] = cs;
        /* (round robin, the last tokens of each KV head first: the same items on the same thread
         * every call, so the sums below add in a fixed order: deterministic for a thread count) */
#pragma omp for schedule(static, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!s) continue;
            const int64_t g = it / ntile, tb = ntile - 1 - it % ntile;
            const int64_t t0 = tb * MQ, nt = t0 + MQ < n ? MQ : n - t0;
            const uint16_t* q0 = (const uint16_t*)q + t0 * ldq + g * G * hd;
            if (direct)
                probe_colsum_item(q0, ldq, nt, G, rg + 3 * t0, (const uint16_t*)kd + g * hd, Ld, Ldp,
                                  (const uint16_t*)kf + g * hd, Lf, Lfp, KVH * hd, fofs, hd, scale, s, cs + g * c);
            else
                probe_colsum_item(q0, ldq, nt, G, rg + 3 * t0, kp + g * per, Ld, Ldp, kp + g * per + Ldp * hd, Lf, Lfp,
                                  0, fofs, hd, scale, s, cs + g * c);
        }
        /* (the barrier at the end of the loop: every thread's sums are final) */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < KVH * c; j += 16) { /* out = the threads' sums, added in thread order */
            const __mmask16 k = pf_mask(KVH * c - j);
            __m512 acc = _mm512_setzero_ps();
            for (int t = 0; t < T; t++)
                if (sums[t]) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(k, sums[t] + j));
            _mm512_mask_storeu_ps(out + j, k, acc);
        }
        free(s);
    }
    free(kp);
    free(sums);
    return failed ? -1 : 0;
}
#endif /* KV_AVX512BF16 */

/* Whether this library has the AVX512-BF16 prefill kernel (the cpu_ops_avx512bf16 variant). */
int kv_prefill_dp_built(void) {
#ifdef KV_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

/* Whether kv_prefill_ranges runs here for this shape (the avx512bf16 variant with
 * kv_set_bf16_dot on, hd % 32 == 0, hd <= 256, GQA group <= 64). */
int kv_prefill_ranges_supported(int64_t H, int64_t KVH, int64_t hd) {
    if (KVH <= 0 || H % KVH || hd <= 0 || hd % 32 || hd > 256 || H / KVH > 64) return 0;
    return kv_prefill_dp_built() && kv_bf16_dot;
}

/* Attention of n query tokens (q: [n][H][hd] bf16, row stride ldq) over two key/value sources,
 * D (kd, vd: Ld contiguous rows [KVH][hd] bf16) and F (kf, vf: Lf rows): token t attends to D's
 * keys [0, rg[3t]) and F's keys [rg[3t + 1], rg[3t + 2]) (rg: [n][3] int64), one softmax over
 * both (float32, probabilities rounded to bf16 for P.V, as prefill_dp); a token that sees no
 * key gets zeros. Out: [n][H][hd] bf16, row stride ldo. The 2-/4-bit KV caches' prefill
 * (kvserve.worker.attention.prefill_lowbit) passes the dequantized context as D and the
 * model-dtype rows of the blocks its chunk touches as F. Returns 0, -1 when a work buffer could
 * not be allocated, -2 when !kv_prefill_ranges_supported. */
int kv_prefill_ranges(const void* q, int64_t ldq, const void* kd, const void* vd, int64_t Ld, const void* kf,
                      const void* vf, int64_t Lf, const int64_t* rg, int64_t n, void* out, int64_t ldo, int64_t H,
                      int64_t KVH, int64_t hd, float scale, int nthreads) {
    if (!kv_prefill_ranges_supported(H, KVH, hd)) return -2;
#ifdef KV_AVX512BF16
    return prefill_ranges_dp(q, ldq, kd, vd, Ld, kf, vf, Lf, rg, n, out, ldo, H, KVH, hd, scale, nthreads);
#else
    (void)q, (void)ldq, (void)kd, (void)vd, (void)Ld, (void)kf, (void)vf, (void)Lf, (void)rg, (void)n, (void)out;
    (void)ldo, (void)scale, (void)nthreads;
    return -2;
#endif
}

/* Column sums of softmax attention probabilities, the scores of H2O and SnapKV
 * (kvserve.worker.attention.record_kv_probes): n query tokens (q: [n][H][hd] bf16, row stride
 * ldq) over two key sources D (kd: Ld contiguous rows [KVH][hd] bf16) and F (kf: Lf rows), token
 * t attending to D's keys [0, rg[3t]) and F's keys [rg[3t + 1], rg[3t + 2]) (rg: [n][3] int64)
 * with one softmax(q.k * scale) over both (bf16 products, float32 sums, exp and softmax); out
 * ([KVH][c] float32, overwritten) gets, per KV head, the probabilities summed over the tokens and
 * the head's G = H / KVH query heads, D's key j in column j and F's key j in column fofs + j
 * (Ld <= c, fofs + Lf <= c; a token that sees no key adds nothing). Returns 0, -1 when a work
 * buffer could not be allocated, -2 when !kv_prefill_ranges_supported. */
int kv_probe_colsum(const void* q, int64_t ldq, const void* kd, int64_t Ld, const void* kf, int64_t Lf,
                    const int64_t* rg, int64_t n, int64_t fofs, float* out, int64_t c, int64_t H, int64_t KVH,
                    int64_t hd, float scale, int nthreads) {
    if (!kv_prefill_ranges_supported(H, KVH, hd)) return -2;
#ifdef KV_AVX512BF16
    return probe_colsum_dp(q, ldq, kd, Ld, kf, Lf, rg, n, fofs, out, c, H, KVH, hd, scale, nthreads);
#else
    (void)q, (void)ldq, (void)kd, (void)Ld, (void)kf, (void)Lf, (void)rg, (void)n, (void)fofs, (void)out, (void)c;
    (void)scale, (void)nthreads;
    return -2;
#endif
}

/* Whether kv_paged_attention_prefill runs for bf16 caches of this shape here, and on what:
 * 1 on AMX tiles (AMX enabled, hd % 32 == 0, bs % 16 == 0, G <= 16), 2 on AVX512-BF16 dot
 * products (the avx512bf16 variant with kv_set_bf16_dot on, hd % 32 == 0, hd <= 256,
 * G <= 64), 0 not at all. */
int kv_prefill_path(int64_t H, int64_t KVH, int64_t hd, int64_t bs) {
    if (KVH <= 0 || H % KVH || hd <= 0 || hd % 32) return 0;
    const int64_t G = H / KVH;
    if (kv_amx && bs % 16 == 0 && G <= 16) return 1;
    if (kv_prefill_dp_built() && kv_bf16_dot && hd <= 256 && G <= 64) return 2;
    return 0;
}

/* The bf16 prefill on the path kv_prefill_path picks (-2 if none). */
static TGT_AMX int prefill_bf16(const void* q, int64_t ldq, const void* k_cache, const void* v_cache,
                                const int64_t* block_tables, int64_t bt_stride, const int64_t* seg, int64_t P,
                                void* out, int64_t ldo, int64_t H, int64_t KVH, int64_t hd, int64_t bs, float scale,
                                int nthreads) {
    const int path = kv_prefill_path(H, KVH, hd, bs);
    if (path == 1)
        return prefill_amx(q, ldq, k_cache, v_cache, block_tables, bt_stride, seg, P, out, ldo, H, KVH, hd, bs, scale,
                           nthreads);
#ifdef KV_AVX512BF16
    if (path == 2)
        return prefill_dp(q, ldq, k_cache, v_cache, block_tables, bt_stride, seg, P, out, ldo, H, KVH, hd, bs, scale,
                          nthreads);
#endif
    return -2;
}

/* fmt != 0 (8-bit pools [.., KVH, hd + 4]): the chunks' contexts are first dequantized to bf16,
 * each into its own run of 32-key blocks of a work buffer ([keys][KVH][hd], block table row c
 * numbering chunk c's blocks), and the bf16 kernel runs on that copy. */
TGT_AMX int kv_paged_attention_prefill(const void* q, int64_t ldq, const void* k_cache, const void* v_cache,
                                       const int64_t* block_tables, int64_t bt_stride, const int64_t* seg, int64_t P,
                                       void* out, int64_t ldo, int64_t H, int64_t KVH, int64_t hd, int64_t bs,
                                       float scale, int fmt, int nthreads) {
    if (!kv_prefill_path(H, KVH, hd, bs)) return -2;
    if (!fmt)
        return prefill_bf16(q, ldq, k_cache, v_cache, block_tables, bt_stride, seg, P, out, ldo, H, KVH, hd, bs, scale,
                            nthreads);
    int64_t maxnb = 1, total = 0, items = 0;
    for (int64_t c = 0; c < P; c++) {
        const int64_t nb = (seg[3 * c + 2] + seg[3 * c + 1] + 31) / 32;
        maxnb = nb > maxnb ? nb : maxnb;
        total += nb;
        items += KVH * ((nb + 3) / 4);
    }
    int64_t* bt2 = (int64_t*)calloc((size_t)(P > 0 ? P : 1) * maxnb, sizeof(int64_t));
    uint16_t* kd = (uint16_t*)aligned_alloc(64, ((size_t)(total > 0 ? total : 1) * 32 * KVH * hd * 4 + 63) & ~(size_t)63);
    if (!bt2 || !kd) {
        free(bt2);
        free(kd);
        return -1;
    }
    uint16_t* vd = kd + total * 32 * KVH * hd;
    for (int64_t c = 0, b = 0; c < P; c++) {
        const int64_t nb = (seg[3 * c + 2] + seg[3 * c + 1] + 31) / 32;
        for (int64_t i = 0; i < nb; i++) bt2[c * maxnb + i] = b + i;
        b += nb;
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) { /* a KV head of 128 keys (4 blocks of 32) of a chunk */
        int64_t rest = it, c = 0, nb;
        for (;;) {
            nb = (seg[3 * c + 2] + seg[3 * c + 1] + 31) / 32;
            if (rest < KVH * ((nb + 3) / 4)) break;
            rest -= KVH * ((nb + 3) / 4);
            c++;
        }
        const int64_t ng = (nb + 3) / 4, g = rest / ng, b0 = (rest % ng) * 4, L = seg[3 * c + 2] + seg[3 * c + 1];
        const int64_t j0 = b0 * 32, j1 = (b0 + 4) * 32 < L ? (b0 + 4) * 32 : L;
        const int64_t* bt = block_tables + c * bt_stride;
        for (int64_t j = j0; j < j1; j++) { /* key j -> row bt2[c][j / 32] * 32 + j % 32 */
            const int64_t src = ((bt[j / bs] * bs + j % bs) * KVH + g) * KV_QROW(hd);
            const int64_t dst = ((bt2[c * maxnb + j / 32] * 32 + j % 32) * KVH + g) * hd;
            float sk, sv;
            memcpy(&sk, (const uint8_t*)k_cache + src + hd, 4);
            memcpy(&sv, (const uint8_t*)v_cache + src + hd, 4);
            const __m512 vk = _mm512_set1_ps(sk), vv = _mm512_set1_ps(sv);
            for (int64_t i = 0; i < hd; i += 16) {
                st(kd, dst + i, ldq8((const uint8_t*)k_cache + src, i, 0xffff, vk, fmt), 0xffff, 1);
                st(vd, dst + i, ldq8((const uint8_t*)v_cache + src, i, 0xffff, vv, fmt), 0xffff, 1);
            }
        }
    }
    const int rc = prefill_bf16(q, ldq, kd, vd, bt2, maxnb, seg, P, out, ldo, H, KVH, hd, 32, scale, nthreads);
    free(bt2);
    free(kd);
    return rc;
}

/* ---- 2-/4-bit KV cache (KIVI, kv_quant_lowbit.py) -------------------------------------------
 * A pool is one layer's K or V: data [num_blocks][KVH][block_bytes] of uint8 full blocks, and a
 * residual [R][bs][KVH][hd] in the model dtype for the blocks not full (res_map[block] = its slot,
 * -1: none; the step's read map, which already hides the blocks the step filled). A block of one
 * KV head: bs * hd * bits / 8 bytes of codes (token-major, 8 / bits channels a byte, the first in
 * the lowest bits), then float16 scales, then as many float16 zeros: per channel for K (hd each),
 * per token and group of 32 channels for V (bs * ceil(hd / 32) each). The value is
 * code * scale + zero in float32 (a multiply, then an add, as the PyTorch reference), rounded to
 * the model dtype. */
#define KV_VGROUP 32

/* Codes of channels [i, i + 16) of one token row (row = its first code byte) as float32. */
INLINE TGT __m512 ld_codes(const uint8_t* row, int64_t i, int64_t hd, int bits) {
    __m128i b;
    if (i + 16 <= hd) { /* (fixed-size copies: one load each) */
        if (bits == 4) {
            uint64_t w;
            memcpy(&w, row + i / 2, 8);
            b = _mm_cvtsi64_si128((long long)w);
        } else {
            uint32_t w;
            memcpy(&w, row + i / 4, 4);
            b = _mm_cvtsi32_si128((int)w);
        }
    } else {
        uint8_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tmp, row + i * bits / 8, (size_t)(((hd - i) * bits + 7) / 8));
        b = _mm_loadl_epi64((const __m128i*)tmp);
    }
    __m512i v;
    if (bits == 4) {
        b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        v = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(b), _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
        v = _mm512_and_si512(v, _mm512_set1_epi32(15));
    } else {
        b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
        v = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(b), _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6));
        v = _mm512_and_si512(v, _mm512_set1_epi32(3));
    }
    return _mm512_cvtepi32_ps(v);
}

INLINE TGT __m512 ld_half(const uint16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

/* One full block's rows [0, n) of one KV head: K (per-channel scale/zero, loaded once per 16
 * channels) or V (per token and 32-channel group), into dst rows (model dtype, ld elements
 * apart). */
INLINE TGT void dequant_block(const uint8_t* blk, int64_t n, int64_t bs, int64_t hd, int bits, int is_key, void* dst,
                              int64_t ld, int bf) {
    const int64_t cb = bs * hd * bits / 8, rowb = hd * bits / 8, ng = (hd + KV_VGROUP - 1) / KV_VGROUP;
    const uint16_t* sc = (const uint16_t*)(blk + cb);
    const uint16_t* zp = sc + (is_key ? hd : bs * ng);
    if (is_key) {
        for (int64_t i = 0; i < hd; i += 16) {
            const __mmask16 m = tail_mask(hd - i);
            const __m512 s = ld_half(sc + i, m), z = ld_half(zp + i, m);
            for (int64_t t = 0; t < n; t++)
                st(dst, t * ld + i, _mm512_add_ps(_mm512_mul_ps(ld_codes(blk + t * rowb, i, hd, bits), s), z), m, bf);
        }
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const uint8_t* row = blk + t * rowb;
        for (int64_t i = 0; i < hd; i += 16) {
            const __mmask16 m = tail_mask(hd - i);
            const int64_t gi = t * ng + i / KV_VGROUP;
            const __m512 s = _mm512_cvtph_ps(_mm256_set1_epi16((short)sc[gi]));
            const __m512 z = _mm512_cvtph_ps(_mm256_set1_epi16((short)zp[gi]));
            st(dst, t * ld + i, _mm512_add_ps(_mm512_mul_ps(ld_codes(row, i, hd, bits), s), z), m, bf);
        }
    }
}

/* Rows [0, L) of KV head g of one sequence (block table bt) of a 2-/4-bit pool into dst [Lpad][hd]
 * in the model dtype (rows L .. Lpad - 1 zero): full blocks dequantized, the others copied from
 * their residual slot. */
INLINE TGT void dequant_ctx_lowbit(const uint8_t* data, const void* res, const int64_t* res_map, const int64_t* bt,
                                   int64_t L, int64_t Lpad, int64_t bs, int64_t KVH, int64_t hd, int64_t g, int bits,
                                   int is_key, void* dst, int bf) {
    const int64_t es = bf ? 2 : 4, ng = (hd + KV_VGROUP - 1) / KV_VGROUP;
    const int64_t bb = bs * hd * bits / 8 + 4 * (is_key ? hd : bs * ng);
    for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const int64_t b = bt[j0 / bs], n = L - j0 < bs ? L - j0 : bs, r = res_map[b];
        if (r >= 0) {
            for (int64_t t = 0; t < n; t++)
                memcpy((char*)dst + (j0 + t) * hd * es, (const char*)res + ((r * bs + t) * KVH + g) * hd * es,
                       (size_t)(hd * es));
        } else {
            if (j0 + bs < L) _mm_prefetch((const char*)(data + (bt[j0 / bs + 1] * KVH + g) * bb), _MM_HINT_T0);
            dequant_block(data + (b * KVH + g) * bb, n, bs, hd, bits, is_key, (char*)dst + j0 * hd * es, hd, bf);
        }
    }
    if (Lpad > L) memset((char*)dst + L * hd * es, 0, (size_t)((Lpad - L) * hd * es));
}

/* Full blocks blocks[0 .. N) of a 2-/4-bit pool (data [num_blocks][KVH][block bytes]) dequantized
 * into out [N][bs][KVH][hd] in the model dtype (bf: bf16, else float32), the values of
 * kvserve.worker.kv_quant_lowbit.dequantize_blocks bit for bit (code * scale, then + zero, in
 * float32; one rounding). Work items: a block and a KV head. */
TGT void kv_lowbit_dequantize(const void* data, const int64_t* blocks, int64_t N, int64_t KVH, int64_t bs, int64_t hd,
                              int bits, int is_key, void* out, int bf, int nthreads) {
    const int64_t ng = (hd + KV_VGROUP - 1) / KV_VGROUP, es = bf ? 2 : 4;
    const int64_t bb = bs * hd * bits / 8 + 4 * (is_key ? hd : bs * ng);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < N * KVH; it++) {
        const int64_t n = it / KVH, g = it % KVH;
        dequant_block((const uint8_t*)data + (blocks[n] * KVH + g) * bb, bs, bs, hd, bits, is_key,
                      (char*)out + ((n * bs * KVH + g) * hd) * es, KVH * hd, bf);
    }
}

/* float32 -> float16 bits, round to nearest even (as torch's .to(float16)); and back. */
INLINE TGT uint16_t f32_to_h(float f) {
    return (uint16_t)_mm256_extract_epi16(_mm512_cvtps_ph(_mm512_set1_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                          0);
}
INLINE TGT float h_to_f32(uint16_t h) { return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)h))); }

/* torch.nextafter of a float16 toward -inf (up = 0) or +inf (up = 1), on its bits. */
static inline uint16_t h_next(uint16_t h, int up) {
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)(((h & 0x8000) == 0) == (up != 0) ? h + 1 : h - 1);
}

/* (scale, zero) of a group with float32 minimum mn and maximum mx, as qparams in
 * kv_quant_lowbit.py: zero = mn rounded down to float16, scale = (mx - zero) / qmax rounded up to
 * float16, scale 1 for a group whose range is 0. */
INLINE TGT void lowbit_qparams(float mn, float mx, float qmax, uint16_t* s, uint16_t* z) {
    uint16_t zh = f32_to_h(mn);
    if (h_to_f32(zh) > mn) zh = h_next(zh, 0);
    const float rng = mx - h_to_f32(zh);
    uint16_t sh = f32_to_h(rng / qmax);
    if (h_to_f32(sh) * qmax < rng) sh = h_next(sh, 1);
    *s = rng > 0.0f ? sh : (uint16_t)0x3c00;
    *z = zh;
}

/* A bf16 value (its bits) as float32, exactly. */
static inline float bf16_bits_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* clamp(round_half_even((x - z) / s), 0, qmax), as _codes. */
INLINE uint8_t lowbit_code(float x, float s, float z, float qmax) {
    float c = nearbyintf((x - z) / s);
    c = c < 0.0f ? 0.0f : (c > qmax ? qmax : c);
    return (uint8_t)c;
}

/* Blocks x [N][bs][KVH][hd] (model dtype: bf16 if bf, else float32) quantized into out
 * [N][KVH][block bytes], the bytes of kvserve.worker.kv_quant_lowbit.quantize_blocks bit for bit:
 * K per channel over the block's tokens, V per token and 32-channel group (the format above).
 * Work items: a block and a KV head. */
TGT void kv_lowbit_quantize(const void* x, int64_t N, int64_t KVH, int64_t bs, int64_t hd, int bits, int is_key,
                            int bf, uint8_t* out, int nthreads) {
    const int64_t ng = (hd + KV_VGROUP - 1) / KV_VGROUP, per = 8 / bits, rowb = hd * bits / 8;
    const int64_t np = is_key ? hd : bs * ng, cb = bs * rowb, bb = cb + 4 * np;
    const float qmax = (float)((1 << bits) - 1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < N * KVH; it++) {
        const int64_t n = it / KVH, g = it % KVH;
        uint8_t* blk = out + it * bb;
        uint16_t* sc = (uint16_t*)(blk + cb);
        uint16_t* zp = sc + np;
#define XV(t, c) (bf ? bf16_bits_f32(((const uint16_t*)x)[((n * bs + (t)) * KVH + g) * hd + (c)]) \
                     : ((const float*)x)[((n * bs + (t)) * KVH + g) * hd + (c)])
        memset(blk, 0, (size_t)cb);
        for (int64_t t = 0; t < bs; t++)
            for (int64_t c = 0; c < hd; c++) {
                const int64_t pi = is_key ? c : t * ng + c / KV_VGROUP;
                if (is_key ? t == 0 : c % KV_VGROUP == 0) { /* the parameter's group first seen */
                    float mn = INFINITY, mx = -INFINITY;
                    if (is_key)
                        for (int64_t u = 0; u < bs; u++) mn = fminf(mn, XV(u, c)), mx = fmaxf(mx, XV(u, c));
                    else
                        for (int64_t u = c; u < hd && u < c + KV_VGROUP; u++) mn = fminf(mn, XV(t, u)), mx = fmaxf(mx, XV(t, u));
                    lowbit_qparams(mn, mx, qmax, sc + pi, zp + pi);
                }
                const uint8_t code = lowbit_code(XV(t, c), h_to_f32(sc[pi]), h_to_f32(zp[pi]), qmax);
                blk[t * rowb + c / per] |= (uint8_t)(code << (bits * (c % per)));
            }
#undef XV
    }
}

/* Whether kv_paged_attention_decode runs the AMX kernel (bf16 pools on a CPU with AMX-BF16). */
static inline int decode_uses_amx(int bf, int64_t hd, int64_t bs, int64_t G) {
    return bf && kv_amx && hd % 32 == 0 && bs % 16 == 0 && G <= 16;
}

/* The keys the longest sequence of a decode batch reads: from its window's first block. */
static inline int64_t decode_max_keys(int64_t D, const int64_t* ctx, int64_t window, int64_t bs) {
    int64_t maxL = 0;
    for (int64_t d = 0; d < D; d++) {
        const int64_t Ld = ctx[d] - kv_window_first_block(ctx[d], window, bs) * bs;
        maxL = Ld > maxL ? Ld : maxL;
    }
    return maxL;
}

/* A thread's work buffers for decode_item: `sc` floats (scores, the query, a key tile) and, for
 * 8-bit and 2-/4-bit pools, `kd` bytes (one KV head's dequantized K, then V). */
typedef struct {
    float* sc;
    char* kd;
} decode_scratch_t;

static inline int decode_scratch_alloc(decode_scratch_t* s, int64_t G, int64_t hd, int64_t maxL, int bf, int fmt) {
    const int64_t nv = (hd + 15) / 16, maxLp = (maxL + 15) & ~(int64_t)15, es = bf ? 2 : 4;
    s->sc = (float*)malloc(sizeof(float) * (size_t)(G * maxL + G * nv * 16 + 16 * nv * 16 + 16));
    s->kd = fmt ? (char*)malloc((size_t)(2 * maxLp * hd * es + 64)) : NULL;
    return s->sc && (!fmt || s->kd);
}

static inline void decode_scratch_free(decode_scratch_t* s) {
    free(s->sc);
    free(s->kd);
    s->sc = NULL;
    s->kd = NULL;
}

/* ---- Split-K decode attention (flash-decoding: Dao, Haziza, Massa and Sizov, 2023) ----------
 * A work item is one (sequence, KV head): with a few sequences and KV heads (SmolLM2 decoding one
 * stream: 3 items on 2 threads) one thread attends twice the keys of the other. A sequence whose
 * attended keys span more than KV_SPLIT_KEYS is therefore cut along its keys into splits of
 * whole blocks, each an item of its own that leaves its G heads' outputs, normalized by the
 * split's softmax sum, and the split's maxima and sums (a part); the last split of a (sequence,
 * KV head) to finish merges the parts (merge_splits). How a sequence is split depends on its own
 * context length only, never on the batch or the thread count, so a sequence's output is the
 * same whatever it is batched with. Items run split by split with the KV heads innermost, so a
 * thread that takes consecutive items reads whole token rows. */
#define KV_SPLIT_KEYS 512

typedef struct {
    int64_t P;       /* (sequence, split) pairs; P == D: nothing split, the pair arrays unused */
    int32_t* pair_d; /* [P] the pair's sequence */
    int32_t* pair_s; /* [P] its split */
    int32_t* nsplit; /* [D] splits of sequence d */
    int32_t* sblk;   /* [D] blocks per split of sequence d (the last one may hold fewer) */
    int* pending;    /* [D * KVH] splits of (d, g) not finished (decode_plan_reset) */
    float* part;     /* [P][KVH][G * hd + 2 * G] the splits' parts */
} decode_plan_t;

/* Splits of a sequence whose attended keys start in block b0 of its table (the window's first
 * block) and end at key ctx: nb blocks cut into ceil(nb / (KV_SPLIT_KEYS / bs)) splits of
 * equal whole blocks but the last. */
static inline void decode_split(int64_t ctx, int64_t window, int64_t bs, int32_t* nsplit, int32_t* sblk) {
    const int64_t nb = (ctx - kv_window_first_block(ctx, window, bs) * bs + bs - 1) / bs;
    const int64_t cap = KV_SPLIT_KEYS / bs > 0 ? KV_SPLIT_KEYS / bs : 1;
    const int64_t S = (nb + cap - 1) / cap, per = S > 1 ? (nb + S - 1) / S : nb;
    *sblk = (int32_t)per;
    *nsplit = (int32_t)(per > 0 ? (nb + per - 1) / per : 1);
}

/* Returns 0, or -1 when its memory could not be allocated. */
static inline int decode_plan_init(decode_plan_t* p, int64_t D, const int64_t* ctx, int64_t window, int64_t bs,
                                   int64_t KVH, int64_t G, int64_t hd) {
    *p = (decode_plan_t){.P = 0};
    for (int64_t d = 0; d < D; d++) {
        int32_t n, per;
        decode_split(ctx[d], window, bs, &n, &per);
        p->P += n;
    }
    if (p->P == D) return 0;
    const int64_t ps = G * hd + 2 * G;
    p->pair_d = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * p->P + 2 * D));
    p->pending = (int*)malloc(sizeof(int) * (size_t)(D * KVH));
    p->part = (float*)malloc(sizeof(float) * (size_t)(p->P * KVH * ps));
    if (!p->pair_d || !p->pending || !p->part) return -1;
    p->pair_s = p->pair_d + p->P;
    p->nsplit = p->pair_s + p->P;
    p->sblk = p->nsplit + D;
    for (int64_t d = 0, i = 0; d < D; d++) {
        decode_split(ctx[d], window, bs, p->nsplit + d, p->sblk + d);
        for (int32_t k = 0; k < p->nsplit[d]; k++, i++) p->pair_d[i] = (int32_t)d, p->pair_s[i] = k;
    }
    return 0;
}

/* Before each attention over the plan's sequences (one call, or one layer of a decode step). */
static inline void decode_plan_reset(decode_plan_t* p, int64_t D, int64_t KVH) {
    if (p->P == D) return;
    for (int64_t d = 0; d < D; d++)
        for (int64_t g = 0; g < KVH; g++) p->pending[d * KVH + g] = p->nsplit[d];
}

static inline void decode_plan_free(decode_plan_t* p) {
    free(p->pair_d);
    free(p->pending);
    free(p->part);
    *p = (decode_plan_t){.P = 0};
}

/* out[h * hd + i] (the G heads of one KV head) from the S parts of its splits (`stride` floats
 * apart; a part as attn_core writes it): with the largest maximum m, weights
 * w_s = sum_s * exp(max_s - m) and out = sum_s w_s * o_s / sum_s w_s, rounded to the model dtype. */
INLINE TGT void merge_splits(const float* part, int64_t stride, int64_t S, int64_t G, int64_t hd, void* out, int bf) {
    for (int64_t h = 0; h < G; h++) {
        float m = -INFINITY, wsum = 0.0f;
        for (int64_t s = 0; s < S; s++) m = fmaxf(m, part[s * stride + G * hd + h]);
        for (int64_t s = 0; s < S; s++) wsum += part[s * stride + G * hd + G + h] * expf(part[s * stride + G * hd + h] - m);
        const __m512 inv = _mm512_set1_ps(1.0f / wsum);
        for (int64_t i = 0; i < hd; i += 16) {
            const __mmask16 k = tail_mask(hd - i);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t s = 0; s < S; s++) {
                const float* ps = part + s * stride;
                const float w = ps[G * hd + G + h] * expf(ps[G * hd + h] - m);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_maskz_loadu_ps(k, ps + h * hd + i), acc);
            }
            st(out, h * hd + i, _mm512_mul_ps(acc, inv), k, bf);
        }
    }
}

/* The arguments of a non-AMX decode attention (kv_paged_attention_decode, the lowbit variant and
 * the decode step's attention jobs), for its items. fmt: 0 caches in the model dtype, 1 / 2 8-bit
 * pools (int8 / fp8 e4m3, kv_reshape_and_cache_q), 3 2-/4-bit pools (`bits`, with their residual
 * slots k_res / v_res and the step's res_map). */
typedef struct {
    const void *q, *k_cache, *v_cache, *k_res, *v_res;
    const int64_t *block_tables, *ctx, *res_map;
    void* out;
    const decode_plan_t* plan;
    int64_t ldq, bt_stride, ldo, KVH, G, hd, bs, window, maxL;
    float scale;
    int bf, fmt, bits;
    int pf_rows; /* the first KV head's item prefetches the pair's rows (decode_item): set where a
                  * thread runs a pair's items one after the other (decode_attention_run) */
    int rows;    /* 1: item i is pair i with all its KV heads, each token row read once (decode_rows) */
} decode_attn_t;

/* Whether the items of a decode attention over P (sequence, split) pairs on nthreads threads are
 * whole pairs (all KV heads in one pass over the token rows, attn_core_dp with ng = KVH) rather
 * than (pair, KV head): bf16 caches on the VDPBF16PS kernel, with enough pairs that whole-pair
 * items still balance (KV_ROWS_PAIRS a thread). With an item per KV head, the item of KV head 0
 * pulls the rows from DRAM while the others find them in L2 (or, in the decode step's team,
 * on the other core), so memory is busy a third of the time with SmolLM2's 3 KV heads; whole
 * pairs read their rows evenly through the pass. */
#define KV_ROWS_PAIRS 4
static inline int decode_rows(int bf, int fmt, int64_t KVH, int64_t hd, int64_t P, int nthreads) {
    return bf && fmt == 0 && kv_bf16_dot && hd % 32 == 0 && KVH > 1 && P >= (int64_t)KV_ROWS_PAIRS * nthreads;
}

/* Query heads a thread's decode_scratch_t must hold scores for. */
static inline int64_t decode_scratch_heads(const decode_attn_t* a) { return a->rows ? a->G * a->KVH : a->G; }

/* Item i = (pair i / KVH, KV head i % KVH), the pair a (sequence d, split s) of a->plan: its G
 * query heads over the split's keys, on the calling thread with its buffers `s`; with a->rows,
 * item i = pair i, all its KV heads (the same results: decode_rows). An item's
 * output does not depend on which thread runs it or on the other items. Pools other than the
 * model dtype's are dequantized, the split's keys only, into the thread's buffer first. */
INLINE TGT void decode_item(const decode_attn_t* a, int64_t i, const decode_scratch_t* s) {
    const decode_plan_t* pl = a->plan;
    const int64_t KVH = a->KVH, G = a->G, hd = a->hd, bs = a->bs, nv = (hd + 15) / 16, es = a->bf ? 2 : 4;
    const int64_t nh = a->rows ? KVH : 1; /* KV heads of the item: g .. g + nh - 1 */
    const int64_t p = a->rows ? i : i / KVH, g = a->rows ? 0 : i % KVH, maxLp = (a->maxL + 15) & ~(int64_t)15;
    const int64_t split = pl->pair_d != NULL, d = split ? pl->pair_d[p] : p, k = split ? pl->pair_s[p] : 0;
    const int64_t S = split ? pl->nsplit[d] : 1;
    float* sc = s->sc;
    float* qf = sc + decode_scratch_heads(a) * a->maxL; /* (the P·V accumulators of a rows item) */
    float* kt = qf + decode_scratch_heads(a) * nv * 16;
    const int64_t zero_bt = 0;
    /* the walk starts at the window's first block b0; keys [J, L) of it on are attended; split k
     * of S takes the blocks [k * per, (k + 1) * per) of them */
    const int64_t b0 = kv_window_first_block(a->ctx[d], a->window, bs), per = S > 1 ? pl->sblk[d] : 0;
    const int64_t* bt = a->block_tables + d * a->bt_stride + b0 + k * per;
    int64_t L = a->ctx[d] - (b0 + k * per) * bs, J = k == 0 && a->window > 0 && a->ctx[d] > a->window ? a->ctx[d] - a->window - b0 * bs : 0;
    if (S > 1 && L > per * bs) L = per * bs;
    float* part = S > 1 ? pl->part + (p * KVH + g) * (G * hd + 2 * G) : NULL;
    void* out = atw(a->out, d * a->ldo + g * G * hd, a->bf);
    if (a->fmt) {
        const int64_t Lp = (L + 15) & ~(int64_t)15;
        char* kd = s->kd;
        char* vd = kd + maxLp * hd * es;
        if (a->fmt == 3) {
            dequant_ctx_lowbit((const uint8_t*)a->k_cache, a->k_res, a->res_map, bt, L, Lp, bs, KVH, hd, g, a->bits, 1,
                               kd, a->bf);
            dequant_ctx_lowbit((const uint8_t*)a->v_cache, a->v_res, a->res_map, bt, L, Lp, bs, KVH, hd, g, a->bits, 0,
                               vd, a->bf);
        } else {
            dequant_ctx((const uint8_t*)a->k_cache, bt, L, Lp, bs, KVH, hd, g, 1, kd, a->bf, a->fmt);
            dequant_ctx((const uint8_t*)a->v_cache, bt, L, Lp, bs, KVH, hd, g, 1, vd, a->bf, a->fmt);
        }
        if (a->bf)
            attn_one(at(a->q, d * a->ldq + g * G * hd, 1), kd, vd, &zero_bt, J, L, out, G, 1, 0, hd, Lp, a->scale, sc,
                     qf, kt, 1, part);
        else
            attn_one(at(a->q, d * a->ldq + g * G * hd, 0), kd, vd, &zero_bt, J, L, out, G, 1, 0, hd, Lp, a->scale, sc,
                     qf, kt, 0, part);
    } else if (a->rows) {
        if (a->pf_rows) prefetch_kv_l2(a->k_cache, a->v_cache, bt, L, bs, KVH * hd * 2, 0, KVH * hd * 2);
        attn_one_dp(at(a->q, d * a->ldq, 1), a->k_cache, a->v_cache, bt, J, L, atw(a->out, d * a->ldo, 1), G, KVH, 0,
                    KVH, hd, bs, a->scale, sc, qf, part);
    } else if (a->bf) {
        /* the item of the first KV head pulls the pair's whole rows into L2, four blocks side by
         * side, for its own loop (which prefetches KV_PFD keys ahead as well) and the other KV
         * heads' items (run next on this thread; not in the decode step's team, whose threads
         * take the items of a pair side by side). 64 sequences of 150-600 tokens, blocks in
         * random order, 30 layers from DRAM, 2-core AMD EPYC: 14.2-14.6 -> 16.8-17.8 GB/s of KV
         * (the first 64 or 128 keys only: 14.2-16.1; the next pair's keys too: no faster). */
        if (g == 0 && a->pf_rows) prefetch_kv_l2(a->k_cache, a->v_cache, bt, L, bs, KVH * hd * 2, 0, KVH * hd * 2);
        attn_one(at(a->q, d * a->ldq, 1), a->k_cache, a->v_cache, bt, J, L, atw(a->out, d * a->ldo, 1), G, KVH, g, hd,
                 bs, a->scale, sc, qf, kt, 1, part);
    }
    else
        attn_one(at(a->q, d * a->ldq, 0), a->k_cache, a->v_cache, bt, J, L, atw(a->out, d * a->ldo, 0), G, KVH, g, hd,
                 bs, a->scale, sc, qf, kt, 0, part);
    /* the last split of (d, g) to finish merges them (acquire-release: it sees the others' parts) */
    for (int64_t gg = g; part && gg < g + nh; gg++)
        if (__atomic_sub_fetch(pl->pending + d * KVH + gg, 1, __ATOMIC_ACQ_REL) == 0)
            merge_splits(pl->part + ((p - k) * KVH + gg) * (G * hd + 2 * G), KVH * (G * hd + 2 * G), S, G, hd,
                         atw(out, (gg - g) * G * hd, a->bf), a->bf);
}

/* The items of `a` on nthreads threads (static shares). Returns 0, or -1 when a buffer could not
 * be allocated (out is then incomplete). */
TGT static int decode_attention_run(decode_attn_t* a, int64_t D, int nthreads) {
    decode_plan_t plan;
    if (decode_plan_init(&plan, D, a->ctx, a->window, a->bs, a->KVH, a->G, a->hd)) {
        decode_plan_free(&plan);
        return -1;
    }
    decode_plan_reset(&plan, D, a->KVH);
    a->plan = &plan;
    a->pf_rows = 1; /* (static shares: a thread runs a pair's KV heads one after the other) */
    a->rows = decode_rows(a->bf, a->fmt, a->KVH, a->hd, plan.P, nthreads);
    const int64_t items = a->rows ? plan.P : plan.P * a->KVH;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        decode_scratch_t s;
        const int ok = decode_scratch_alloc(&s, decode_scratch_heads(a), a->hd, a->maxL, a->bf, a->fmt);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++)
            if (ok) decode_item(a, i, &s);
        decode_scratch_free(&s);
    }
    decode_plan_free(&plan);
    return failed ? -1 : 0;
}

/* Returns 0, or -1 when a work buffer could not be allocated (out is then incomplete).
 * fmt: 0 for caches in the model dtype, 1 / 2 for 8-bit pools [.., KVH, hd + 4] (int8 / fp8
 * e4m3 codes and a scale per row): each work item then dequantizes its keys to the model
 * dtype (dequant_ctx) and runs the same kernel on that copy. */
TGT int kv_paged_attention_decode(const void* q, int64_t ldq, const void* k_cache, const void* v_cache,
                                  const int64_t* block_tables, int64_t bt_stride, const int64_t* ctx, void* out,
                                  int64_t ldo, int64_t D, int64_t H, int64_t KVH, int64_t hd, int64_t bs, float scale,
                                  int64_t window, int bf, int fmt, int nthreads) {
    const int64_t G = H / KVH;
    if (decode_uses_amx(bf, hd, bs, G)) {
        /* the most KV heads per work item, fewer when that would leave threads idle */
        int64_t ns = 1;
        for (int64_t c = KVH; c > 1; c--)
            if (KVH % c == 0 && c * G <= 16 && D * (KVH / c) >= 2 * nthreads) { ns = c; break; }
        return attention_amx((const uint16_t*)q, ldq, k_cache, v_cache, block_tables, bt_stride, ctx, (uint16_t*)out,
                             ldo, D, KVH, G, hd, bs, scale, window, ns, fmt, nthreads);
    }
    decode_attn_t a = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables, .ctx = ctx,
                       .out = out, .ldq = ldq, .bt_stride = bt_stride, .ldo = ldo, .KVH = KVH, .G = G, .hd = hd,
                       .bs = bs, .window = window, .maxL = decode_max_keys(D, ctx, window, bs), .scale = scale,
                       .bf = bf, .fmt = fmt};
    return decode_attention_run(&a, D, nthreads);
}

/* Decode attention over 2-/4-bit pools: per item (sequence, split, KV head) the keys are
 * dequantized into a per-thread buffer (dequant_ctx_lowbit), then attended by the same kernel as
 * a model-dtype cache. Returns 0, or -1 when a work buffer could not be allocated. */
TGT int kv_paged_attention_decode_lowbit(const void* q, int64_t ldq, const void* k_data, const void* v_data,
                                         const void* k_res, const void* v_res, const int64_t* res_map,
                                         const int64_t* block_tables, int64_t bt_stride, const int64_t* ctx, void* out,
                                         int64_t ldo, int64_t D, int64_t H, int64_t KVH, int64_t hd, int64_t bs,
                                         float scale, int64_t window, int bits, int bf, int nthreads) {
    decode_attn_t a = {.q = q, .k_cache = k_data, .v_cache = v_data, .k_res = k_res, .v_res = v_res,
                       .block_tables = block_tables, .ctx = ctx, .res_map = res_map, .out = out, .ldq = ldq,
                       .bt_stride = bt_stride, .ldo = ldo, .KVH = KVH, .G = H / KVH, .hd = hd, .bs = bs,
                       .window = window, .maxL = decode_max_keys(D, ctx, window, bs), .scale = scale, .bf = bf,
                       .fmt = 3, .bits = bits};
    return decode_attention_run(&a, D, nthreads);
}

/* ---- A whole decode step of a Llama-family model ------------------------------------------
 * For a few tokens (M <= the gemv limit) the per-op cost of Python and PyTorch exceeds the
 * math, so the step runs here in one call: for every layer
 *   residual += delta; x = rms_norm(residual)          (layer 0: residual = hidden)
 *   qkv = x @ Wqkv^T (+ b); [Qwen3: per-head q/k RMSNorm]; RoPE(q, k); cache[slot] = k, v
 *   attn = paged_attention(q); delta = attn @ Wo^T
 *   residual += delta; x = rms_norm(residual); delta = down(silu(gate(x)) * up(x))
 * then residual += delta; x = rms_norm(residual); logits = x @ Wlm^T.
 * It calls exactly the kernels the PyTorch-level model calls for these shapes (the linear
 * layer's choice of the gemv kernel, `gemv`, or the AMX kernel, `amx`, and the functions
 * above), so its logits are bit-identical to it. */
typedef void (*gemv_fn)(const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t, int);
/* kv_amx_linear of the linear library: same arguments with the packed weight, returns 0 or -1. */
typedef int (*amx_fn)(const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t, int);

typedef struct {
    const void *ln1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *ln2, *gu_w, *down_w;
    void *k_cache, *v_cache;
    const void *qkv_p, *o_p, *gu_p, *down_p; /* weights packed for the tile kernel (NULL: none) */
} kv_layer_t;

/* The linear layer's choice for M rows: gemv up to gemv_max, else the tile kernel `amx` (AMX, or
 * AVX512-BF16 without it: kv_amx_linear / kv_bf16p_linear of gemv.c, same arguments). */
#define KV_LINEAR(X, LDX, W, WP, B, Y, LDY, N, K)                                         \
    do {                                                                                  \
        if (M <= gemv_max || !(WP)) gemv(X, LDX, W, B, Y, LDY, M, N, K, nthreads);        \
        else if (amx(X, LDX, WP, B, Y, LDY, M, N, K, nthreads)) return -1;               \
    } while (0)
/* The phases kv_decode_step times when given a `prof` array (ns added to prof[phase]); the
 * order of DecodeStep.PHASES in kvserve/kernels/cpu_ops.py. */
enum { KV_PH_NORM, KV_PH_QKV, KV_PH_ROPE, KV_PH_KV_WRITE, KV_PH_ATTENTION, KV_PH_O, KV_PH_GATE_UP, KV_PH_SILU,
       KV_PH_DOWN, KV_PH_LM_HEAD, KV_N_PHASES };
static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
#define PROF(ph)                                 \
    do {                                         \
        if (prof) {                              \
            const int64_t t_now_ = now_ns();     \
            prof[ph] += t_now_ - t_prev;         \
            t_prev = t_now_;                     \
        }                                        \
    } while (0)
int kv_decode_step_phases(void) { return KV_N_PHASES; }
/* Row-wise loops run on all threads once there is enough work (results do not depend on it). */
static inline int rows_nt(int64_t work, int nthreads) { return work >= (1 << 14) ? nthreads : 1; }

/* ---- The decode step on one team of threads ------------------------------------------------
 * For a few tokens a step is ~150 small GEMVs (0.6-4 MB of weights each) and as many short
 * serial pieces (norms, RoPE, the KV write, attention). Run as one OpenMP region per piece, the
 * team's threads fall asleep in libgomp whenever a serial piece or an imbalance outlasts
 * GOMP_SPINCOUNT (kvserve sets 1000, ~20 us, for shared machines), and waking one on a VM costs
 * tens of us, paid at every GEMV; each region also waits for its slowest thread, so a thread
 * that another process holds up stalls every one of them. Here the whole step is one region in
 * which thread 0 runs the step in order: it does the serial pieces, and for each GEMV it
 * publishes the GEMV, takes chunks of its rows from a counter like the other threads, and waits
 * until every chunk is done. The other threads only wait for the next GEMV to be published
 * (spinning, then yielding the CPU; never asleep) and take chunks of it; one that is held up
 * takes fewer chunks and delays nothing but a chunk it has started. Each output row is computed
 * by the same kernel code as on the per-piece path (a row's dot product does not depend on which
 * rows share a call), so the logits are bit-identical. */
typedef void (*gemv_rows_fn)(const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t);

typedef struct {
    const void *X, *W, *B;
    void* Y;
    int64_t LDX, LDY, N, K, chunk, nchunks;
    int64_t next, done;          /* chunks claimed, chunks finished (atomics) */
    const decode_attn_t* attn;   /* not NULL: a layer's decode attention, chunk i its item i (decode_item) */
} team_gemv_t;
#define KV_TEAM_SPINS 4096 /* pause instructions between sched_yield calls while waiting (~0.1 ms on Zen 4) */

static inline void team_pause(int* spins) {
    if (++*spins < KV_TEAM_SPINS) _mm_pause();
    else {
        sched_yield();
        *spins = 0;
    }
}

/* Take and compute chunks of g until none is left. A dense weight (row-major [N, K], es bytes a
 * value) is sliced here; a packed one by `rows`; an attention job's items run with the thread's
 * buffers `s` (a thread without them takes none: thread 0 always has them). */
TGT static inline void team_gemv_work(team_gemv_t* g, gemv_fn gemv, gemv_rows_fn rows, int64_t M, int64_t es,
                                      const decode_scratch_t* s) {
    if (g->attn && !s->sc) return;
    for (;;) {
        const int64_t c = __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED);
        if (c >= g->nchunks) return;
        const int64_t n0 = c * g->chunk, n1 = n0 + g->chunk < g->N ? n0 + g->chunk : g->N;
        if (g->attn) decode_item(g->attn, c, s);
        else if (rows) rows(g->X, g->LDX, g->W, g->B, g->Y, g->LDY, M, g->N, g->K, n0, n1);
        else gemv(g->X, g->LDX, (const char*)g->W + n0 * g->K * es, g->B ? (const char*)g->B + n0 * es : NULL,
                  (char*)g->Y + n0 * es, g->LDY, M, n1 - n0, g->K, 1);
        __atomic_add_fetch(&g->done, 1, __ATOMIC_RELEASE);
    }
}

/* Chunks a thread of a GEMV's rows: dense weights 8, packed GGUF weights 2. A packed chunk reads
 * three streams (the values, the scales, the offsets) that the hardware prefetchers must pick up
 * again at every chunk: a SmolLM2 Q4_1 decode step's GEMVs took 7.6-7.75 ms a step with 2 chunks
 * a thread against 8.1-8.45 with 8 (2-core AMD EPYC, interleaved runs), while dense bf16 ones
 * were 3-7% slower with 2. (Fewer, larger chunks also leave less room to a thread that another
 * process holds up.) */
#define KV_TEAM_CHUNKS 8
#define KV_TEAM_CHUNKS_PACKED 2

static inline void team_gemv_set(team_gemv_t* g, const void* X, int64_t LDX, const void* W, const void* B, void* Y,
                                 int64_t LDY, int64_t N, int64_t K, int nt, int per_thread) {
    int64_t c = (N + per_thread * nt - 1) / (per_thread * nt); /* whole groups of 4 rows, >= 16 rows */
    c = (c + 3) & ~(int64_t)3;
    c = c < 16 ? 16 : c;
    *g = (team_gemv_t){.X = X, .W = W, .B = B, .Y = Y, .LDX = LDX, .LDY = LDY, .N = N, .K = K, .chunk = c,
                       .nchunks = (N + c - 1) / c};
}

/* EXPR with BF the constant 1 (bf16) or 0 (float32), so the always-inline row helpers specialise as in
 * kv_decode_step. */
#define BFSPEC(EXPR)          \
    do {                      \
        if (bf) {             \
            const int BF = 1; \
            EXPR;             \
        } else {              \
            const int BF = 0; \
            EXPR;             \
        }                     \
    } while (0)

TGT static int decode_step_team(const kv_layer_t* layers, int64_t n_layers, gemv_fn gemv, gemv_rows_fn gemv_rows,
                                int64_t M, const void* hidden, void* residual, void* delta, void* x, void* qkv,
                                void* attn, void* gu, void* act, int64_t E, int64_t H, int64_t KVH, int64_t hd,
                                int64_t I, float eps, const int64_t* pos, const void* cos, const void* sin,
                                const int64_t* slots, const int64_t* bt, int64_t bt_stride, const int64_t* ctx,
                                int64_t bs, float scale, int64_t window, const void* final_norm, const void* lm_head,
                                int64_t V, void* logits, int bf, int kv_fmt, int nthreads, int64_t* prof) {
    /* jobs 5 l .. 5 l + 4: layer l's QKV GEMV, attention, O, gate-up and down GEMVs; 5 n_layers:
     * the LM head. Attention is a job of (sequence, KV head) items where it runs the vector
     * kernel; the AMX kernel runs on thread 0 alone (its job is then never published). */
    const int64_t NQKV = (H + 2 * KVH) * hd, es = bf ? 2 : 4, n_gemv = 5 * n_layers + 1, G = H / KVH;
    const int team_attn = !decode_uses_amx(bf, hd, bs, G);
    const int64_t maxL = decode_max_keys(M, ctx, window, bs);
    team_gemv_t* g = (team_gemv_t*)calloc((size_t)n_gemv, sizeof(team_gemv_t));
    decode_attn_t* A = (decode_attn_t*)malloc(sizeof(decode_attn_t) * (size_t)(n_layers > 0 ? n_layers : 1));
    decode_scratch_t s0 = {NULL, NULL}; /* thread 0's attention buffers */
    decode_plan_t plan;                 /* the attention items' splits, the same in every layer */
    const int plan_failed = team_attn ? decode_plan_init(&plan, M, ctx, window, bs, KVH, G, hd) : 0;
    if (!team_attn) plan = (decode_plan_t){.P = M};
    const int rows = team_attn && decode_rows(bf, kv_fmt, KVH, hd, plan.P, nthreads);
    const int64_t Gs = rows ? G * KVH : G; /* query heads of an item's scores (decode_scratch_heads) */
    if (!g || !A || plan_failed || (team_attn && !decode_scratch_alloc(&s0, Gs, hd, maxL, bf, kv_fmt))) {
        free(g);
        free(A);
        decode_scratch_free(&s0);
        decode_plan_free(&plan);
        return 1;
    }
    const int per_thread = gemv_rows ? KV_TEAM_CHUNKS_PACKED : KV_TEAM_CHUNKS;
    for (int64_t l = 0; l < n_layers; l++) {
        const kv_layer_t* L = layers + l;
        team_gemv_set(g + 5 * l, x, E, L->qkv_w, L->qkv_b, qkv, NQKV, NQKV, E, nthreads, per_thread);
        A[l] = (decode_attn_t){.q = qkv, .k_cache = L->k_cache, .v_cache = L->v_cache, .block_tables = bt, .ctx = ctx,
                               .out = attn, .ldq = NQKV, .bt_stride = bt_stride, .ldo = H * hd, .KVH = KVH, .G = G,
                               .hd = hd, .bs = bs, .window = window, .maxL = maxL, .scale = scale, .bf = bf,
                               .fmt = kv_fmt, .plan = &plan, .rows = rows};
        const int64_t items = rows ? plan.P : plan.P * KVH;
        g[5 * l + 1] = (team_gemv_t){.N = items, .chunk = 1, .nchunks = items, .attn = A + l};
        team_gemv_set(g + 5 * l + 2, attn, H * hd, L->o_w, NULL, delta, E, E, H * hd, nthreads, per_thread);
        team_gemv_set(g + 5 * l + 3, x, E, L->gu_w, NULL, gu, 2 * I, 2 * I, E, nthreads, per_thread);
        team_gemv_set(g + 5 * l + 4, act, I, L->down_w, NULL, delta, E, E, I, nthreads, per_thread);
    }
    team_gemv_set(g + 5 * n_layers, x, E, lm_head, NULL, logits, V, V, E, nthreads, per_thread);
    int64_t published = -1; /* the job the threads may work on; n_gemv: the step is over */
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    if (omp_get_thread_num() != 0) {
        decode_scratch_t s = {NULL, NULL};
        if (team_attn && !decode_scratch_alloc(&s, Gs, hd, maxL, bf, kv_fmt)) decode_scratch_free(&s); /* (takes no attention item) */
        int64_t seen = -1;
        for (int spins = 0;;) {
            const int64_t p = __atomic_load_n(&published, __ATOMIC_ACQUIRE);
            if (p >= n_gemv) break;
            if (p > seen) {
                team_gemv_work(g + p, gemv, gemv_rows, M, es, &s);
                seen = p;
                spins = 0;
            } else team_pause(&spins);
        }
        decode_scratch_free(&s);
    } else {
        int64_t t_prev = prof ? now_ns() : 0;
        /* publish job j, work on it, wait for its last chunk */
#define RUN_GEMV(j, ph)                                                              \
    do {                                                                             \
        team_gemv_t* g_ = g + (j);                                                   \
        __atomic_store_n(&published, (j), __ATOMIC_RELEASE);                         \
        team_gemv_work(g_, gemv, gemv_rows, M, es, &s0);                             \
        for (int spins = 0; __atomic_load_n(&g_->done, __ATOMIC_ACQUIRE) < g_->nchunks;) \
            team_pause(&spins);                                                      \
        PROF(ph);                                                                    \
    } while (0)
        memcpy(residual, hidden, (size_t)(M * E * es));
        for (int64_t l = 0; l < n_layers && !failed; l++) {
            const kv_layer_t* L = layers + l;
            for (int64_t m = 0; m < M; m++) /* layer 0 normalizes the embeddings themselves */
                BFSPEC(rms_norm_row(l ? at(delta, m * E, BF) : at(residual, m * E, BF),
                                    l ? atw(residual, m * E, BF) : NULL, L->ln1, atw(x, m * E, BF), E, eps, BF));
            PROF(KV_PH_NORM);
            RUN_GEMV(5 * l, KV_PH_QKV);
            for (int64_t m = 0; m < M; m++) {
                void* row = atw(qkv, m * NQKV, bf);
                if (L->q_norm)
                    for (int64_t h = 0; h < H + KVH; h++) {
                        void* hp = atw(row, h * hd, bf);
                        BFSPEC(rms_norm_row(hp, NULL, h < H ? L->q_norm : L->k_norm, hp, hd, eps, BF));
                    }
                BFSPEC(rope_row(row, H + KVH, hd, at(cos, pos[m] * hd, BF), at(sin, pos[m] * hd, BF), BF));
            }
            PROF(KV_PH_ROPE);
            if (kv_fmt)
                kv_reshape_and_cache_q(at(qkv, H * hd, bf), NQKV, at(qkv, (H + KVH) * hd, bf), NQKV, L->k_cache,
                                       L->v_cache, slots, M, KVH, hd, bf, kv_fmt);
            else
                kv_reshape_and_cache(at(qkv, H * hd, bf), NQKV, at(qkv, (H + KVH) * hd, bf), NQKV, L->k_cache,
                                     L->v_cache, slots, M, KVH * hd, es);
            PROF(KV_PH_KV_WRITE);
            if (team_attn) {
                decode_plan_reset(&plan, M, KVH);
                RUN_GEMV(5 * l + 1, KV_PH_ATTENTION);
            } else {
                if (kv_paged_attention_decode(qkv, NQKV, L->k_cache, L->v_cache, bt, bt_stride, ctx, attn, H * hd, M, H,
                                              KVH, hd, bs, scale, window, bf, kv_fmt, 1)) {
                    failed = 1;
                    break;
                }
                PROF(KV_PH_ATTENTION);
            }
            RUN_GEMV(5 * l + 2, KV_PH_O);
            for (int64_t m = 0; m < M; m++)
                BFSPEC(rms_norm_row(at(delta, m * E, BF), atw(residual, m * E, BF), L->ln2, atw(x, m * E, BF), E, eps,
                                    BF));
            PROF(KV_PH_NORM);
            RUN_GEMV(5 * l + 3, KV_PH_GATE_UP);
            for (int64_t m = 0; m < M; m++) BFSPEC(silu_mul_row(at(gu, m * 2 * I, BF), atw(act, m * I, BF), I, BF));
            PROF(KV_PH_SILU);
            RUN_GEMV(5 * l + 4, KV_PH_DOWN);
        }
        if (!failed) {
            for (int64_t m = 0; m < M; m++)
                BFSPEC(rms_norm_row(at(delta, m * E, BF), atw(residual, m * E, BF), final_norm, atw(x, m * E, BF), E,
                                    eps, BF));
            PROF(KV_PH_NORM);
            RUN_GEMV(5 * n_layers, KV_PH_LM_HEAD);
        }
        __atomic_store_n(&published, n_gemv, __ATOMIC_RELEASE); /* (also after a failure: the threads leave) */
#undef RUN_GEMV
    }
    free(g);
    free(A);
    decode_scratch_free(&s0);
    decode_plan_free(&plan);
    return failed ? -1 : 0;
}
#undef BFSPEC

TGT int kv_decode_step(const kv_layer_t* layers, int64_t n_layers, gemv_fn gemv, amx_fn amx, int64_t gemv_max,
                       int64_t M, const void* hidden,
                       void* residual, void* delta, void* x, void* qkv, void* attn, void* gu, void* act,
                       int64_t E, int64_t H, int64_t KVH, int64_t hd, int64_t I, float eps, const int64_t* pos,
                       const void* cos, const void* sin, const int64_t* slots, const int64_t* bt, int64_t bt_stride,
                       const int64_t* ctx, int64_t max_ctx, int64_t bs, float scale, int64_t window, const void* final_norm,
                       const void* lm_head, const void* lm_head_p, int64_t V, void* logits, int bf, int kv_fmt,
                       int nthreads, int attn_threads, int64_t* prof, int team, gemv_rows_fn gemv_rows) {
    const int64_t NQKV = (H + 2 * KVH) * hd, es = bf ? 2 : 4;
    /* (the team path runs the vector attention kernel's items on all its threads, the AMX one on
     * thread 0 alone: where that would take several threads, many sequences or long contexts,
     * the per-operation path below runs the step) */
    if (team && nthreads > 1 && M <= gemv_max && (attn_threads <= 1 || !decode_uses_amx(bf, hd, bs, H / KVH))) {
        const int rc = decode_step_team(layers, n_layers, gemv, gemv_rows, M, hidden, residual, delta, x, qkv, attn, gu,
                                        act, E, H, KVH, hd, I, eps, pos, cos, sin, slots, bt, bt_stride, ctx, bs, scale,
                                        window, final_norm, lm_head, V, logits, bf, kv_fmt, nthreads, prof);
        if (rc != 1) return rc; /* (1: its counters could not be allocated: the path below) */
    }
    int64_t t_prev = prof ? now_ns() : 0;
    memcpy(residual, hidden, (size_t)(M * E * es));
    for (int64_t l = 0; l < n_layers; l++) {
        const kv_layer_t* L = layers + l;
#pragma omp parallel for num_threads(rows_nt(M * E, nthreads)) schedule(static)
        for (int64_t m = 0; m < M; m++) { /* layer 0 normalizes the embeddings themselves */
            if (bf) rms_norm_row(l ? at(delta, m * E, 1) : at(residual, m * E, 1), l ? atw(residual, m * E, 1) : NULL,
                                 L->ln1, atw(x, m * E, 1), E, eps, 1);
            else rms_norm_row(l ? at(delta, m * E, 0) : at(residual, m * E, 0), l ? atw(residual, m * E, 0) : NULL,
                              L->ln1, atw(x, m * E, 0), E, eps, 0);
        }
        PROF(KV_PH_NORM);
        KV_LINEAR(x, E, L->qkv_w, L->qkv_p, L->qkv_b, qkv, NQKV, NQKV, E);
        PROF(KV_PH_QKV);
#pragma omp parallel for num_threads(rows_nt(M * NQKV, nthreads)) schedule(static)
        for (int64_t m = 0; m < M; m++) {
            void* row = atw(qkv, m * NQKV, bf);
            if (L->q_norm) {
                for (int64_t h = 0; h < H + KVH; h++) {
                    void* hp = atw(row, h * hd, bf);
                    if (bf) rms_norm_row(hp, NULL, h < H ? L->q_norm : L->k_norm, hp, hd, eps, 1);
                    else rms_norm_row(hp, NULL, h < H ? L->q_norm : L->k_norm, hp, hd, eps, 0);
                }
            }
            if (bf) rope_row(row, H + KVH, hd, at(cos, pos[m] * hd, 1), at(sin, pos[m] * hd, 1), 1);
            else rope_row(row, H + KVH, hd, at(cos, pos[m] * hd, 0), at(sin, pos[m] * hd, 0), 0);
        }
        PROF(KV_PH_ROPE);
        if (kv_fmt)
            kv_reshape_and_cache_q(at(qkv, H * hd, bf), NQKV, at(qkv, (H + KVH) * hd, bf), NQKV, L->k_cache,
                                   L->v_cache, slots, M, KVH, hd, bf, kv_fmt);
        else
            kv_reshape_and_cache(at(qkv, H * hd, bf), NQKV, at(qkv, (H + KVH) * hd, bf), NQKV, L->k_cache, L->v_cache,
                                 slots, M, KVH * hd, es);
        PROF(KV_PH_KV_WRITE);
        if (kv_paged_attention_decode(qkv, NQKV, L->k_cache, L->v_cache, bt, bt_stride, ctx, attn, H * hd, M, H, KVH,
                                      hd, bs, scale, window, bf, kv_fmt, attn_threads))
            return -1;
        PROF(KV_PH_ATTENTION);
        KV_LINEAR(attn, H * hd, L->o_w, L->o_p, NULL, delta, E, E, H * hd);
        PROF(KV_PH_O);
#pragma omp parallel for num_threads(rows_nt(M * E, nthreads)) schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (bf) rms_norm_row(at(delta, m * E, 1), atw(residual, m * E, 1), L->ln2, atw(x, m * E, 1), E, eps, 1);
            else rms_norm_row(at(delta, m * E, 0), atw(residual, m * E, 0), L->ln2, atw(x, m * E, 0), E, eps, 0);
        }
        PROF(KV_PH_NORM);
        KV_LINEAR(x, E, L->gu_w, L->gu_p, NULL, gu, 2 * I, 2 * I, E);
        PROF(KV_PH_GATE_UP);
#pragma omp parallel for num_threads(rows_nt(M * I, nthreads)) schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (bf) silu_mul_row(at(gu, m * 2 * I, 1), atw(act, m * I, 1), I, 1);
            else silu_mul_row(at(gu, m * 2 * I, 0), atw(act, m * I, 0), I, 0);
        }
        PROF(KV_PH_SILU);
        KV_LINEAR(act, I, L->down_w, L->down_p, NULL, delta, E, E, I);
        PROF(KV_PH_DOWN);
    }
#pragma omp parallel for num_threads(rows_nt(M * E, nthreads)) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (bf) rms_norm_row(at(delta, m * E, 1), atw(residual, m * E, 1), final_norm, atw(x, m * E, 1), E, eps, 1);
        else rms_norm_row(at(delta, m * E, 0), atw(residual, m * E, 0), final_norm, atw(x, m * E, 0), E, eps, 0);
    }
    PROF(KV_PH_NORM);
    KV_LINEAR(x, E, lm_head, lm_head_p, NULL, logits, V, V, E);
    PROF(KV_PH_LM_HEAD);
    return 0;
}
