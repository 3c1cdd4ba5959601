"""Prefill with 2-/4-bit KV caches (KIVI, ``--kv-cache-dtype int4|int2``): the C path against the
PyTorch path, and against the bf16 cache.

What runs where, per layer and prefill chunk: the K/V write quantizes the blocks the chunk fills
(C: ``kv_lowbit_quantize``; PyTorch: ``kv_quant_lowbit.quantize_blocks``), the context is read
with full blocks dequantized (C: ``kv_lowbit_dequantize``; PyTorch: ``dequantize_blocks``), and the
chunk attends with each query seeing its own block in the model dtype (C: ``kv_prefill_ranges``,
per-query key ranges over the two copies; PyTorch: SDPA with a boolean mask over both copies).
The PyTorch path is what runs where the kernels do not (another CPU, float16, CUDA); here it is
selected by turning the three kernels' ``*_supported`` checks off in this process.

Workload: SmolLM2-135M-Instruct in bfloat16 (the GGUF's weights dequantized), prompts of random
token ids of each ``--lengths`` (a new prompt per measurement, prefix caching off), prefilled in
the engine's default chunks (``max_num_batched_tokens``), one generated token: the time of
``LLM.generate`` is the prompt's time to first token. The paths run in alternation, ``--rounds``
times each (the bf16 cache first, on its own); the script prints the median per path and the
ratios.

Usage:
    python benchmarks/lowbit_prefill.py [--lengths 2048 8000] [--kv-cache-dtypes int4 int2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops


def _paths(on: bool) -> None:
    """C kernels on (the default) or off (the PyTorch path) for the 2-/4-bit caches."""
    for name in ("prefill_ranges_supported", "lowbit_dequantize_supported"):
        real = _REAL[name]
        setattr(cpu_ops, name, real if on else (lambda *a, **k: False))


_REAL = {n: getattr(cpu_ops, n) for n in ("prefill_ranges_supported", "lowbit_dequantize_supported")}


def _ttft(llm: LLM, length: int, rng: random.Random) -> float:
    ids = [rng.randrange(100, 40000) for _ in range(length)]
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["int4", "int2"])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rng = random.Random(0)
    max_len = max(a.lengths) + 1
    print(f"# lowbit_prefill: SmolLM2-135M bfloat16, {torch.get_num_threads()} threads, "
          f"kernels {'on' if cpu_ops.prefill_ranges_supported(torch.bfloat16, 9, 3, 64) else 'NOT available'}")
    print("| KV dtype | prompt tokens | C path s | PyTorch path s | C speed-up | bf16 cache s | C path / bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = LLM(dtype="bfloat16", max_model_len=max_len, kv_cache_memory=0.5, enable_prefix_caching=False)
    _ttft(base, 256, rng)  # warm-up
    auto = {L: statistics.median([_ttft(base, L, rng) for _ in range(a.rounds)]) for L in a.lengths}
    del base
    for kv in a.kv_cache_dtypes:
        llm = LLM(dtype="bfloat16", max_model_len=max_len, kv_cache_memory=0.5, kv_cache_dtype=kv,
                  enable_prefix_caching=False)
        _ttft(llm, 256, rng)  # warm-up
        for L in a.lengths:
            t = {True: [], False: []}
            for _ in range(a.rounds):
                for on in (True, False):
                    _paths(on)
                    t[on].append(_ttft(llm, L, rng))
            _paths(True)
            c, p = statistics.median(t[True]), statistics.median(t[False])
            print(f"| {kv} | {L} | {c:.2f} | {p:.2f} | {p / c:.2f}x | {auto[L]:.2f} | {c / auto[L]:.2f}x |", flush=True)
        del llm


if __name__ == "__main__":
    main()
