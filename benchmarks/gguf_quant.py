"""GGUF weights kept quantized (``--quantization gguf``: weight-only, and ``gguf_int8``: int8
activations) against dequantized bf16 (``none``), in one run: single-stream decode tokens/s, the bandwidth roofline of each, resident weight
bytes, and the kernel crossover that sets ``linear.QGEMV_MAX_M`` (issue #22).

Decode: a 128-token random prompt, 128 output tokens (EOS ignored), greedy, after a warm-up
(``benchmarks/throughput.py``'s single-stream measurement); the three engines are loaded at
once and their runs interleaved (a shared machine's load moves single runs 2-5x); medians. Roofline: the weight bytes one
decode step reads (the linear layers and the LM head: for ``gguf`` the packed quantized bytes,
:attr:`Linear.weight_nbytes`; for ``none`` the bf16 bytes; norms and embedding rows are
negligible) at the memory bandwidth measured here (:func:`kvserve.roofline.measure_memory_bandwidth`).
The Q4_1 file roofline uses the file's own tensor bytes instead (what llama.cpp streams).

``--modes`` adds rows: ``int4`` (``int4_gN``: ``--quantization int4`` on the file's float
weights: the linears in group-wise int4, embedding and LM head bf16, so the one-call C decode
step is not used) and a GGUF type name (``Q6_K``, ``Q8_0`` ...: every quantized tensor of the
file re-quantized to that type at load, :func:`weight_quality.requantizing_loader`, then
``gguf``; a K-quant takes llama.cpp's fallback type for tensors whose rows are not a multiple
of 256 values: for SmolLM2 ``Q6_K`` is Q6_K in ``down_proj`` and Q8_0 elsewhere).

``--kernels``: the weight-only kernel alone per packed type (one token, bf16, a 8192 x 3072
weight: 25M values, larger than the caches), best and median of 20 calls, and the packed
bytes it streams per second, next to the bf16 gemv of the dequantized model on the same shape.

Crossover: for each shape of SmolLM2's linears and M tokens (bf16 activations), each kernel of
:func:`quant.qlinear` against :func:`linear.chunked_linear` (dequantized chunks + F.linear)
in the same mode; this sets ``linear.QGEMV_WO_MAX_M`` and ``linear.QGEMV_MAX_M``.

Usage:
    python benchmarks/gguf_quant.py [--model PATH.gguf] [--n-out 128] [--json out.json] [--skip-crossover]
        [--modes gguf gguf_int8 none Q6_K int4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve import LLM  # noqa: E402
from kvserve.roofline import measure_memory_bandwidth  # noqa: E402
from kvserve.worker.default_model import default_model_path  # noqa: E402
from kvserve.worker.layers import linear as L  # noqa: E402
from kvserve.worker.layers import quant as Q  # noqa: E402
from throughput import decode_weight_bytes, single_stream_kvserve  # noqa: E402


def best(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def crossover(ms=(1, 2, 4, 8, 16, 32, 64, 128)) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for n, k in ((3072, 576), (576, 1536), (49152, 576)):
        raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=g)
        raw[..., 0:2] = (torch.rand(n, k // 32, generator=g) * 0.02).half().view(torch.uint8).view(n, k // 32, 2)
        raw[..., 2:4] = 0
        p = Q.pack_gguf([Q.GGUFWeight("Q4_1", raw.reshape(n, -1), (n, k))])
        for M in ms:
            x = torch.randn(M, k, generator=g).bfloat16()
            r = {"N": n, "K": k, "M": M}
            for int8 in (False, True):
                tq = best(lambda: Q.qlinear(x, p, int8=int8))
                tc = best(lambda: L.chunked_linear(x, p, int8=int8))
                r["int8" if int8 else "weight_only"] = {"qlinear_ms": tq * 1e3, "chunked_ms": tc * 1e3}
            rows.append(r)
            print(f"  N={n} K={k} M={M}: weight-only qlinear {r['weight_only']['qlinear_ms']:.3f} ms, chunked "
                  f"{r['weight_only']['chunked_ms']:.3f} ms; int8 qlinear {r['int8']['qlinear_ms']:.3f} ms, chunked "
                  f"{r['int8']['chunked_ms']:.3f} ms", flush=True)
    return rows


def build(path: Path, mode: str) -> LLM:
    """The bf16 engine of one ``--modes`` entry (see the module docstring)."""
    import kvserve.worker.worker as worker_mod
    from weight_quality import GGUF_TYPES, requantizing_loader

    kw = dict(model=str(path), dtype="bfloat16", max_model_len=1024, kv_cache_memory=0.25, enable_prefix_caching=False)
    if mode not in GGUF_TYPES:
        return LLM(quantization=mode, **kw)
    orig = worker_mod.load_weights
    worker_mod.load_weights = requantizing_loader(orig, mode)
    try:
        return LLM(quantization="gguf", **kw)
    finally:
        worker_mod.load_weights = orig


#: byte offsets of the fp16 scales in each GGUF block (random blocks get sane ones there)
_SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
             "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def kernels(n: int = 8192, k: int = 3072, reps: int = 20) -> list[dict]:
    """The weight-only kernel per packed type, M = 1, bf16 (see the module docstring)."""
    import statistics

    g = torch.Generator().manual_seed(0)
    rows = []
    x = torch.randn(1, k, generator=g).bfloat16()
    for t in (*Q.KEPT_TYPES, "int4_g32", "int4_g16"):
        if t.startswith("int4"):
            p = Q.quantize_int4(torch.randn(n, k, generator=g) * 0.02, int(t[6:]))
        else:
            bs, bb = Q.BLOCK[t]
            raw = torch.randint(0, 256, (n, k // bs, bb), dtype=torch.uint8, generator=g)
            for at in _SCALE_AT[t]:
                raw[..., at:at + 2] = (torch.rand(n, k // bs, generator=g) * 0.01).half().view(torch.uint8).view(
                    n, k // bs, 2)
            p = Q.pack_gguf([Q.GGUFWeight(t, raw.reshape(n, -1), (n, k))])
        for _ in range(3):
            Q.qlinear(x, p, int8=False)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            Q.qlinear(x, p, int8=False)
            ts.append(time.perf_counter() - t0)
        r = {"type": t, "bytes": p.nbytes, "best_ms": min(ts) * 1e3, "median_ms": statistics.median(ts) * 1e3}
        r["GBps_best"] = p.nbytes / min(ts) / 1e9
        rows.append(r)
        print(f"  {t}: {p.nbytes / n / k:.3f} bytes/value, best {r['best_ms']:.2f} ms ({r['GBps_best']:.1f} GB/s), "
              f"median {r['median_ms']:.2f} ms", flush=True)
        del p
    w = torch.randn(n, k, generator=g).bfloat16()  # the dequantized model's layer: bf16 gemv (linear.gemv)
    if L.cpu_kernels() is not None and L.cpu_kernels().has_bf16:
        for _ in range(3):
            L.gemv(x, w)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            L.gemv(x, w)
            ts.append(time.perf_counter() - t0)
        nb = w.numel() * 2
        rows.append({"type": "bf16 (gemv)", "bytes": nb, "best_ms": min(ts) * 1e3,
                     "median_ms": statistics.median(ts) * 1e3, "GBps_best": nb / min(ts) / 1e9})
        print(f"  bf16 (gemv): 2.000 bytes/value, best {min(ts) * 1e3:.2f} ms ({nb / min(ts) / 1e9:.1f} GB/s), median "
              f"{statistics.median(ts) * 1e3:.2f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--n-out", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5, help="decode runs per mode, interleaved (best and median reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-crossover", action="store_true")
    ap.add_argument("--modes", nargs="+", default=["gguf", "gguf_int8", "none"],
                    help="gguf, gguf_int8, none (needed: the baseline), int4 / int4_gN, or a GGUF type to "
                         "re-quantize to")
    ap.add_argument("--kernels", action="store_true", help="only the per-type kernel timing (no engines)")
    a = ap.parse_args(argv)
    if a.kernels:
        print(f"weight-only kernel, M = 1, bf16, 8192 x 3072; load average {os.getloadavg()[0]:.2f}", flush=True)
        res = kernels()
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0
    if "none" not in a.modes or "gguf" not in a.modes:
        raise SystemExit("--modes must include none and gguf (the baselines)")
    path = Path(a.model) if a.model else default_model_path()
    file_bytes = path.stat().st_size
    bw = measure_memory_bandwidth()
    print(f"bandwidth {bw / 1e9:.1f} GB/s, load average {os.getloadavg()[0]:.2f}", flush=True)
    res = {"bandwidth_GBps": bw / 1e9, "file_bytes": file_bytes, "load_avg_start": os.getloadavg()[0], "modes": {}}
    # all three engines loaded at once and their runs interleaved, so that a shared machine's
    # load changes (which move single runs 2-5x here) hit every mode alike
    modes = tuple(a.modes)
    llms = {m: build(path, m) for m in modes}
    vocab = llms["gguf"].engine.model_config.vocab_size
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.runs):
        for mode in modes:
            runs[mode].append(single_stream_kvserve(llms[mode], vocab, a.n_out)["decode_tok_s"])
    for mode in modes:
        wb = decode_weight_bytes(llms[mode])
        rs = sorted(runs[mode])
        res["modes"][mode] = {"decode_tok_s_best": rs[-1], "decode_tok_s_median": rs[len(rs) // 2], "runs": runs[mode],
                              "weight_bytes": wb, "roofline_tok_s": bw / wb}
        print(f"{mode}: decode {[round(r, 1) for r in runs[mode]]} tok/s (in run order), weights read per token "
              f"{wb / 1e6:.1f} MB, roofline {bw / wb:.1f} tok/s", flush=True)
    del llms
    gc.collect()
    g, n = res["modes"]["gguf"], res["modes"]["none"]
    file_roofline = bw / file_bytes
    res["speedup_median"] = g["decode_tok_s_median"] / n["decode_tok_s_median"]
    if "gguf_int8" in res["modes"]:
        res["speedup_int8_median"] = res["modes"]["gguf_int8"]["decode_tok_s_median"] / n["decode_tok_s_median"]
    res["file_roofline_tok_s"] = file_roofline
    print()
    print("| mode | decode tok/s (median of runs) | best | vs none | weight bytes / token (MB) | roofline tok/s | "
          "share of roofline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in res["modes"].items():
        print(f"| {mode} | {r['decode_tok_s_median']:.1f} | {r['decode_tok_s_best']:.1f} | "
              f"{r['decode_tok_s_median'] / n['decode_tok_s_median']:.2f}x | {r['weight_bytes'] / 1e6:.1f} | "
              f"{r['roofline_tok_s']:.1f} | {r['decode_tok_s_median'] / r['roofline_tok_s']:.0%} |")
    print(f"\ngguf / none (bf16): {res['speedup_median']:.2f}x; Q4_1 file roofline ({file_bytes / 1e6:.1f} MB at "
          f"{bw / 1e9:.1f} GB/s): {file_roofline:.1f} tok/s, gguf at {g['decode_tok_s_median'] / file_roofline:.0%} of "
          f"it; load average at the end {os.getloadavg()[0]:.2f}")
    if not a.skip_crossover:
        print("\nqlinear vs chunked dequantization + F.linear (Q4_1, bf16 activations, best of 20):")
        res["crossover"] = crossover()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
