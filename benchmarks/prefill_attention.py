"""Per-layer prefill attention: the C prefill kernel (kvserve.kernels.cpu_ops.paged_attention_prefill:
AMX where the CPU has it, else AVX512-BF16) against the SDPA call of TorchSDPABackend.prefill, on
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, bf16, 16-token blocks).

For each chunk layout (tokens, cached tokens before it) both run ``--reps`` times, alternating
kernel and SDPA ``--rounds`` times (the machine may be shared: alternation spreads the other
load over both), and the median per-call time of each round is printed, then the medians over
rounds, the achieved GFLOP/s (causal: 2 · 2 · H · hd · sum over tokens of their context) and
the ratio, in wall-clock time and in process CPU time (on a shared machine the CPU time leaves
out the slices the scheduler gave other processes; the GFLOP/s are per second of CPU time, all
threads together). SDPA gets what the backend gives it: for a chunk without cached context the
chunk's own K/V as computed ([1, H, n, hd] views, ``is_causal``), else K/V gathered from the cache by
slot and a boolean causal mask (the gather counted, as in the backend).

Usage:
    python benchmarks/prefill_attention.py [--threads 1 2] [--layouts 256:0 1024:0 256:768]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops


def _median_ms(fn, reps: int) -> tuple[float, float]:
    """Median wall-clock and process CPU ms per call (CPU time: all threads together, so on a
    shared machine it leaves out the time the scheduler gave other processes)."""
    fn()
    ts, cs = [], []
    for _ in range(reps):
        c = time.process_time()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return statistics.median(ts) * 1e3, statistics.median(cs) * 1e3


def bench(n: int, past: int, threads: int, reps: int, rounds: int, H=9, KVH=3, hd=64, bs=16) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    L = n + past
    nb = (L + bs - 1) // bs
    perm = torch.randperm(nb, generator=g)
    kc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
    vc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
    slots = (perm.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb))[:L]
    q = torch.randn(n, H, hd, generator=g).bfloat16()
    k_new = kc.view(-1, KVH, hd)[slots[past:]].clone()
    v_new = vc.view(-1, KVH, hd)[slots[past:]].clone()
    bt = perm.unsqueeze(0)
    info = torch.tensor([[0, n, past]])
    out = torch.empty(n, H, hd, dtype=torch.bfloat16)
    mask = torch.arange(L).unsqueeze(0) <= (past + torch.arange(n)).unsqueeze(1)
    scale = hd**-0.5

    def kernel():
        cpu_ops.paged_attention_prefill(q, kc, vc, bt, info, scale, out)

    def sdpa():
        qs = q.transpose(0, 1).unsqueeze(0)
        if past == 0:
            ks, vs = k_new.transpose(0, 1).unsqueeze(0), v_new.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = kc.view(-1, KVH, hd)[slots].transpose(0, 1).unsqueeze(0)
            vs = vc.view(-1, KVH, hd)[slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out.copy_(o.squeeze(0).transpose(0, 1))

    kernel()
    a = out.float().clone()
    sdpa()
    err = (a - out.float()).abs().max().item()
    kms, sms, kcs, scs = [], [], [], []
    for _ in range(rounds):
        w, c = _median_ms(kernel, reps)
        kms.append(w)
        kcs.append(c)
        w, c = _median_ms(sdpa, reps)
        sms.append(w)
        scs.append(c)
    flop = 4 * H * hd * sum(past + t + 1 for t in range(n))
    k, s = statistics.median(kms), statistics.median(sms)
    kc, sc = statistics.median(kcs), statistics.median(scs)
    return {"tokens": n, "past": past, "threads": threads, "kernel_ms": k, "sdpa_ms": s,
            "kernel_cpu_ms": kc, "sdpa_cpu_ms": sc, "kernel_gflops_cpu": flop / kc / 1e6,
            "sdpa_gflops_cpu": flop / sc / 1e6, "speedup": s / k, "speedup_cpu": sc / kc,
            "kernel_rounds": kms, "sdpa_rounds": sms, "max_abs_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layouts", nargs="+", default=["256:0", "1024:0", "256:768"],
                    help="chunks as TOKENS:CACHED_BEFORE")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not cpu_ops.prefill_supported(torch.bfloat16, 9, 3, 64, 16):
        raise SystemExit("no C prefill kernel here (needs AMX or AVX512_BF16 and the built kernels)")
    path = "AMX" if cpu_ops.amx_prefill_supported(torch.bfloat16, 9, 3, 64, 16) else "AVX512-BF16"
    with open("/proc/loadavg") as f:
        print(f"kernel: {path}; load average before: {f.read().split()[:3]}")
    print("| tokens | cached | threads | kernel ms | SDPA ms | speedup | kernel CPU ms | SDPA CPU ms | speedup (CPU) "
          "| kernel GFLOP/s per thread (CPU) | SDPA GFLOP/s per thread (CPU) | max |diff| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for th in args.threads:
        for lay in args.layouts:
            n, past = map(int, lay.split(":"))
            r = bench(n, past, th, args.reps, args.rounds)
            print(f"| {n} | {past} | {th} | {r['kernel_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['speedup']:.2f}x | "
                  f"{r['kernel_cpu_ms']:.3f} | {r['sdpa_cpu_ms']:.3f} | {r['speedup_cpu']:.2f}x | "
                  f"{r['kernel_gflops_cpu']:.0f} | {r['sdpa_gflops_cpu']:.0f} | {r['max_abs_diff']:.4f} |",
                  flush=True)
            print(f"  rounds kernel {[round(x, 3) for x in r['kernel_rounds']]} sdpa "
                  f"{[round(x, 3) for x in r['sdpa_rounds']]}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
