"""H2O's and SnapKV's attention scores (column sums of softmax probabilities,
:func:`kvserve.worker.attention.record_kv_probes`) on the C kernel ``probe_colsum`` against the
PyTorch path (float32 einsum and softmax, 256 query rows at a time), in one process, alternated.

1. The kernel alone: SmolLM2's 9 query / 3 KV heads, head_dim 64, bf16; a decode row over 4,096 and
   8,192 keys, prefill chunks of 512 queries over 4,096 keys and 2,048 over 8,192; best of 3 each,
   with the largest relative difference between the two.
2. End to end: SmolLM2-135M-Instruct in bfloat16, H2O keeping 50% of a random ``--prompt-len``-token
   prompt (half heavy hitters, half recent), 64 greedy tokens: TTFT (the prompt's prefill, every
   query scored) and decode tokens/s, per ``--kv-cache-dtypes``, ``--rounds`` times per path.

The PyTorch path is what runs where the kernel does not (no AVX512-BF16, float32/float16, CUDA);
here it is selected by turning ``cpu_ops.probe_colsum_supported`` off.

Usage:
    python benchmarks/kv_scores.py [--prompt-len 4096] [--kv-cache-dtypes auto int4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import numpy as np
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops

H, KVH, HD = 9, 3, 64


def torch_scores(q: torch.Tensor, ks: torch.Tensor, qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """record_kv_probes' PyTorch path for one probe (no 2-/4-bit own-block copy)."""
    c, g = ks.shape[0], H // KVH
    ks = ks.float()
    sums = torch.zeros(KVH, c)
    cols = torch.arange(c)
    for r0 in range(0, q.shape[0], 256):
        qs = q[r0 : r0 + 256].float().view(-1, KVH, g, HD)
        logits = torch.einsum("mkgd,ckd->kgmc", qs, ks) * scale
        logits.masked_fill_((cols[None] > qkv[r0 : r0 + 256, None]).view(1, 1, -1, c), float("-inf"))
        sums += torch.softmax(logits, -1).sum(dim=(1, 2))
    return sums


def kernel_ab() -> None:
    torch.manual_seed(0)
    for m, c in [(1, 4096), (1, 8192), (512, 4096), (2048, 8192)]:
        q, ks = torch.randn(m, H, HD).bfloat16(), torch.randn(c, KVH, HD).bfloat16()
        qkv = torch.arange(c - m, c)
        ranges = torch.stack([qkv + 1, 0 * qkv, 0 * qkv], 1).contiguous()
        none = ks[:0]
        a, b = cpu_ops.probe_colsum(q, ks, none, ranges, 0.125, c), torch_scores(q, ks, qkv, 0.125)
        ta, tb = [], []
        for _ in range(3):
            t = time.perf_counter()
            cpu_ops.probe_colsum(q, ks, none, ranges, 0.125, c)
            ta.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch_scores(q, ks, qkv, 0.125)
            tb.append(time.perf_counter() - t)
        err = ((a - b).abs().max() / b.abs().max()).item()
        print(f"queries {m:5d} x keys {c:5d}: C {min(ta) * 1e3:8.2f} ms  PyTorch {min(tb) * 1e3:8.2f} ms  "
              f"{min(tb) / min(ta):5.1f}x  (max difference {err:.1e} of the largest score)", flush=True)


def engine_ab(kv: str, prompt_len: int, rounds: int) -> None:
    llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, max_model_len=max(8192, prompt_len + 64), kv_cache_memory=1,
              enable_prefix_caching=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 40000, prompt_len)]
    policy = {"method": "h2o", "budget": prompt_len // 2, "recent": prompt_len // 4}
    real = cpu_ops.probe_colsum_supported
    try:
        for rnd in range(rounds):
            for name, supported in (("C", real), ("PyTorch", lambda *a: False)):
                cpu_ops.probe_colsum_supported = supported
                params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, kv_compression=policy)
                m = llm.generate([prompt], params)[0].metrics
                print(f"{kv:5s} {name:8s} round {rnd}: TTFT {m.first_token_time - m.arrival_time:6.2f} s, "
                      f"decode {m.decode_tokens_per_s:5.1f} tok/s", flush=True)
    finally:
        cpu_ops.probe_colsum_supported = real
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int4"])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not cpu_ops.probe_colsum_supported(torch.bfloat16, H, KVH, HD):
        raise SystemExit("probe_colsum does not run here (needs AVX512-BF16)")
    kernel_ab()
    for kv in a.kv_cache_dtypes:
        engine_ab(kv, a.prompt_len, a.rounds)


if __name__ == "__main__":
    main()
