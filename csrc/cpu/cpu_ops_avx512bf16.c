/* The cpu_ops_avx512bf16 variant: cpu_ops.c with float32 -> bf16 rounding by VCVTNEPS2BF16 and
 * the AVX512-BF16 prefill attention kernel (prefill_dp), for CPUs with AVX512_BF16 (kvserve.kernels picks it from /proc/cpuinfo). A file of its own, not a
 * -D flag, so that the two variants get separate object files when built side by side. */
#define KV_AVX512BF16 1
#include "cpu_ops.c"
