"""Paged decode attention on bf16 against 8-bit (int8, fp8 e4m3) KV pools: the C kernel alone.

Workload: SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, block size
16), 30 layers each with its own K and V pools (so that, as in a real decode step, the K/V come
from DRAM rather than cache), 64 sequences of 440-500 tokens (mean ~470) on shuffled blocks.
One measurement is a decode step's attention: the kernel called once per layer. The settings
run in alternation, ``--rounds`` times; the script prints the median per step of each, the KV
bytes it reads and the resulting rate.

Usage:
    python benchmarks/kv_cache_dtype.py [--rounds 7] [--seqs 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import torch

from kvserve.worker import kv_quant
from kvserve.kernels import cpu_ops

H, KVH, HD, BS, LAYERS = 9, 3, 64, 16, 30


def build(dtype: torch.dtype, ctx: list[int], g: torch.Generator):
    nblk = sum((n + BS - 1) // BS for n in ctx)
    perm = torch.randperm(nblk, generator=g).tolist()
    tables, i = [], 0
    for n in ctx:
        k = (n + BS - 1) // BS
        tables.append(perm[i : i + k])
        i += k
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    pools = []
    for _ in range(LAYERS):
        x = torch.randn(nblk * BS, KVH, HD, generator=g)
        if kv_quant.is_quantized(dtype):
            pair = [kv_quant.quantize(x, dtype).view(nblk, BS, KVH, HD + 4) for _ in range(2)]
        else:
            pair = [x.to(dtype).view(nblk, BS, KVH, HD) for _ in range(2)]
        pools.append(pair)
    return pools, bt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(440, 501, (a.seqs,), generator=g).tolist()
    cl = torch.tensor(ctx)
    q = torch.randn(a.seqs, H, HD, generator=g).bfloat16()
    settings = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
    data = {name: build(dt, ctx, g) for name, dt in settings.items()}
    times = {name: [] for name in settings}
    for _ in range(a.rounds):
        for name, (pools, bt) in data.items():
            t0 = time.perf_counter()
            for kc, vc in pools:
                cpu_ops.paged_attention_decode(q, kc, vc, bt, cl, HD**-0.5, max_context_len=max(ctx))
            times[name].append(time.perf_counter() - t0)
    tokens = sum(ctx)
    print(f"{a.seqs} sequences, mean context {tokens / a.seqs:.0f}, {LAYERS} layers, {a.threads} threads, "
          f"{a.rounds} alternated rounds (medians)")
    print("| KV cache | attention per decode step (ms) | KV read per step (MB) | GB/s | vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(times["bf16"])
    for name, dt in settings.items():
        med = statistics.median(times[name])
        nbytes = tokens * 2 * LAYERS * KVH * kv_quant.bytes_per_head_token(HD, dt)
        print(f"| {name} | {med * 1e3:.1f} | {nbytes / 1e6:.0f} | {nbytes / med / 1e9:.1f} | {base / med:.2f}x |")
    print("all rounds (ms):", {k: [round(t * 1e3, 1) for t in v] for k, v in times.items()})


if __name__ == "__main__":
    main()
