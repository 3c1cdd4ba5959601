#!/usr/bin/env bash
# Print the environment vLLM's CPU backend runs with here, as `export` lines to eval:
#   eval "$(benchmarks/peers/vllm_env.sh)"
# - LD_PRELOAD: tcmalloc (Debian's libgoogle-perftools4) and the venv's libiomp5.so (Intel
#   OpenMP), as vLLM's CPU docs ask;
# - VLLM_CPU_OMP_THREADS_BIND=0-(N-1) and VLLM_CPU_NUM_OF_RESERVED_CPU=0: its OpenMP threads on
#   all N cores (by default it reserves one of them for the frontend, half of a 2-core machine);
# - VLLM_CPU_KVCACHE_SPACE: the KV cache in GiB (default 1, to fit the memory shared here).
# Env: VLLM_VENV (default /work/vllm-venv), VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND,
#      VLLM_CPU_NUM_OF_RESERVED_CPU (default 0) override the values above.
set -euo pipefail
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !f {print $NF; f = 1}')"
IOMP="$VLLM_VENV/lib/libiomp5.so"
[ -n "$TCMALLOC" ] || { echo "tcmalloc not found: run benchmarks/peers/install_vllm_cpu.sh" >&2; exit 1; }
[ -f "$IOMP" ] || { echo "$IOMP not found: run benchmarks/peers/install_vllm_cpu.sh" >&2; exit 1; }
echo "export LD_PRELOAD=$TCMALLOC:$IOMP"
echo "export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
echo "export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
echo "export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}"
