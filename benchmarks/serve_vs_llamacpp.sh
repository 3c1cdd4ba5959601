#!/usr/bin/env bash
# kvserve serve vs llama.cpp's llama-server, measured with `kvserve bench serve` in one run.
#
# Everything of the peer lives OUTSIDE the repository (default /work/peers); no binary is
# ever committed. Steps (each skipped when its output already exists):
#   1. download the llama-cpp-python sdist from PyPI and build the vendored llama.cpp's
#      llama-server and llama-quantize targets with cmake (CPU, -DGGML_NATIVE=ON, -j2);
#   2. turn the default model (SmolLM2-135M-Instruct, shipped as Q4_1 GGUF) into a BF16 GGUF
#      with `llama-quantize --allow-requantize IN OUT BF16`;
#   3. start both servers on 127.0.0.1 (kvserve in bfloat16, llama-server with -np 32), wait
#      for /health, and for each concurrency 1, 8 and 32 run `kvserve bench serve` against
#      llama-server and then kvserve (random 256-token prompts, 128 output tokens, streaming,
#      ignore_eos; max(MIN_PROMPTS, 2 x concurrency) requests); only one server is ever
#      under load. Then print the markdown table with the ratios.
#
# Usage: benchmarks/serve_vs_llamacpp.sh [build|convert|bench|all]   (default: all)
# Env:   PEERS (default /work/peers), PY (default python), MIN_PROMPTS (default 8),
#        OUT (default $PEERS/results), CONCURRENCIES (default "1 8 32"), LLAMA_EXTRA_ARGS.
# Run it on a quiet machine: both servers use 2 threads on a 2-core machine, and llama.cpp's
# busy-waiting threads are hurt far more than PyTorch's by any other load.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${PEERS:-/work/peers}"
PY="${PY:-python}"
OUT="${OUT:-$PEERS/results}"
MIN_PROMPTS="${MIN_PROMPTS:-8}"  # each level sends max(MIN_PROMPTS, 2 x concurrency) requests
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
# Extra llama-server flags, e.g. "--poll 0": its threads busy-wait between steps by default,
# which collapses its throughput when anything else (even the load generator) needs a core.
LLAMA_EXTRA_ARGS="${LLAMA_EXTRA_ARGS:-}"
LLAMA_PORT=8091
KV_PORT=8092
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$SRC/build"
BF16="$PEERS/SmolLM2-135M-Instruct.BF16.gguf"

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

wait_health() {  # url
  for _ in $(seq 1 240); do
    if "$PY" -c "import httpx,sys; sys.exit(0 if httpx.get('$1', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "server at $1 did not become healthy" >&2
  return 1
}

bench_level() {  # name base_url model concurrency
  local c=$4
  local n=$(( 2 * c > MIN_PROMPTS ? 2 * c : MIN_PROMPTS ))
  "$PY" -m kvserve.entrypoints.cli bench serve --base-url "$2" --model "$3" --endpoint completions \
    --dataset random --random-input-len 256 --random-output-len 128 \
    --num-prompts "$n" --max-concurrency "$c" --seed 0 --label "$1 c=$c" \
    --save-json "$OUT/$1_c$c.json"
}

bench() {
  mkdir -p "$OUT"
  # Both servers are up at once (an idle server uses no CPU) and each concurrency level is
  # measured on one and then the other, so that the two numbers of a level are taken minutes
  # apart at most, under the same conditions.
  # kvserve: the same model (its Q4_1 file dequantized to bf16 on load), bfloat16.
  "$PY" -m kvserve.entrypoints.cli serve --host 127.0.0.1 --port "$KV_PORT" --dtype bfloat16 \
    --served-model-name smollm2 --no-access-log >"$OUT/kvserve.log" 2>&1 &
  local kpid=$!
  trap 'kill $kpid 2>/dev/null || true' EXIT
  wait_health "http://127.0.0.1:$KV_PORT/health"  # loaded before the peer starts
  # llama-server: BF16 GGUF, 32 parallel slots (-np 32), context for 32 x 512 tokens, 2 threads.
  "$BUILD/bin/llama-server" -m "$BF16" --host 127.0.0.1 --port "$LLAMA_PORT" -np 32 -c $((32 * 512)) \
    -t 2 --alias smollm2 $LLAMA_EXTRA_ARGS >"$OUT/llama-server.log" 2>&1 &
  local lpid=$!
  trap 'kill $lpid $kpid 2>/dev/null || true' EXIT
  wait_health "http://127.0.0.1:$LLAMA_PORT/health"
  for c in $CONCURRENCIES; do
    echo "load before c=$c: $(cut -d' ' -f1-3 /proc/loadavg)"
    bench_level llama-server "http://127.0.0.1:$LLAMA_PORT" smollm2 "$c"
    bench_level kvserve "http://127.0.0.1:$KV_PORT" smollm2 "$c"
  done
  kill "$lpid" "$kpid"; wait "$lpid" "$kpid" 2>/dev/null || true
  trap - EXIT
  "$PY" -m kvserve.bench.report "$OUT"/llama-server_c*.json "$OUT"/kvserve_c*.json
}

case "${1:-all}" in
  build) build ;;
  convert) convert ;;
  bench) bench ;;
  all) build; convert; bench ;;
  *) echo "usage: $0 [build|convert|bench|all]" >&2; exit 2 ;;
esac
