"""Sampler cost per decode step: greedy vs the throughput benchmark's sampling params.

The workload of ``benchmarks/throughput.py --sampling`` at its busiest: 64 rows over the
SmolLM2 vocabulary (49152), token histories of prompt 64-512 + output 64-256 tokens, and
either greedy decoding or temperature=0.8, top_p=0.95, top_k=50,
repetition_penalty=1.1. For each, it times building the :class:`SamplingMetadata`
(including the rows, as the model runner makes them, one new output token per row per
step, so the per-request token histories are in their steady state) and the sampler
call, and prints ms per step (min and median over the repetitions) of process CPU
time (``--clock wall`` for wall time; with several threads CPU time adds theirs up).

Logits are Zipf-like by default (per row: ``-1.1 · ln(rank)`` plus N(0, 0.3) noise over
a random permutation of the vocabulary, shifted to a maximum of about 25) or a [B, V]
tensor saved with ``torch.save`` (``--logits-file``, e.g. real SmolLM2 logits of one
decode step; rows are repeated to fill the batch).

``--impl`` takes one or more sampler module files (default: the installed
``kvserve.sample.sampler``) and times them interleaved, so a before/after comparison sees the
same machine load, e.g.::

    git show 00a02ae~1:src/kvserve/sampler.py > /tmp/sampler_before.py  # before the speed-ups
    python benchmarks/sampler_speed.py --impl /tmp/sampler_before.py src/kvserve/sampler.py

Usage:
    python benchmarks/sampler_speed.py [--rows 64] [--vocab 49152] [--threads 1 2]
        [--repeat 20] [--logits-file PATH] [--impl FILE ...] [--extra] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time

import torch

from kvserve.sampling_params import SamplingParams

BENCH = dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)
EXTRA = {  # --extra: other common settings
    "top_p 0.95 only (T=0.8)": dict(temperature=0.8, top_p=0.95),
    "top_k 50 + freq/presence": dict(temperature=0.8, top_k=50, frequency_penalty=0.5, presence_penalty=0.5),
    "greedy + logprobs=5": dict(temperature=0.0, logprobs=5),
}


def load_impl(path: str):
    spec = importlib.util.spec_from_file_location(f"sampler_impl_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def zipf_logits(B: int, V: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = -1.1 * torch.log(torch.arange(1, V + 1, dtype=torch.float32)) + 25.0
    rows = []
    for _ in range(B):
        perm = torch.randperm(V, generator=g)
        rows.append((base + 0.3 * torch.randn(V, generator=g))[perm])
    return torch.stack(rows)


class FakeRequest:
    """What the model runner reads from a Request to build a SamplingRow."""

    def __init__(self, params, prompt, output, seed):
        self.sampling_params = params
        self.prompt_token_ids = prompt
        self.output_token_ids = output
        self.seed = seed
        self.eos_token_ids = (0,)
        self.token_history = None


def make_rows(mod, reqs):
    """As ModelRunner.execute does (with the token history when the module has one)."""
    attach = getattr(getattr(mod, "TokenHistory", None), "attach", None)
    rows = []
    for r in reqs:
        kw = {"history": attach(r)} if attach is not None else {}
        rows.append(mod.SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.seed,
                                    list(r.eos_token_ids), **kw))
    return rows


def make_requests(B: int, V: int, params: SamplingParams, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for i in range(B):
        prompt = [rng.randrange(100, V) for _ in range(rng.randint(64, 512))]
        output = [rng.randrange(100, V) for _ in range(rng.randint(64, 256))]
        reqs.append(FakeRequest(params, prompt, output, seed * 1000 + i))
    return reqs


def bench(mods, logits, params: SamplingParams, repeat: int, clock, seed: int = 0):
    """Per module: (build times, call times) in seconds of ``clock``."""
    B, V = logits.shape
    rng = random.Random(seed + 1)
    state = []
    for mod in mods:
        reqs = make_requests(B, V, params, seed)
        state.append((mod, reqs, mod.Sampler()))
    times = [([], []) for _ in mods]
    for it in range(repeat + 2):  # 2 warm-up steps
        for (mod, reqs, sampler), (tb, tc) in zip(state, times):
            for r in reqs:  # one new token per row per step, as in decoding
                r.output_token_ids.append(rng.randrange(100, V))
            t0 = clock()
            meta = mod.SamplingMetadata.build(make_rows(mod, reqs), V, logits.device)
            t1 = clock()
            out = sampler(logits, meta)
            out.sampled_token_ids.tolist()  # what the engine does next
            t2 = clock()
            if it >= 2:
                tb.append(t1 - t0)
                tc.append(t2 - t1)
    return times


def fmt(ts) -> str:
    return f"{min(ts) * 1e3:7.2f} / {statistics.median(ts) * 1e3:7.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--logits-file", default=None)
    ap.add_argument("--impl", nargs="+", default=None, help="sampler module files (default: kvserve.sample.sampler)")
    ap.add_argument("--extra", action="store_true", help="also time a few other common settings")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU time (all threads; not inflated when other processes "
                         "take the cores, the default on shared machines); wall: perf_counter")
    args = ap.parse_args()

    if args.impl:
        mods = [load_impl(p) for p in args.impl]
        names = list(args.impl)
    else:
        import kvserve.sample.sampler as mod

        mods, names = [mod], ["kvserve.sample.sampler"]
    if args.logits_file:
        x = torch.load(args.logits_file).float()
        logits = x[torch.arange(args.rows) % x.shape[0]].contiguous()
        src = f"{args.logits_file} ({x.shape[0]} distinct rows)"
    else:
        logits = zipf_logits(args.rows, args.vocab)
        src = "Zipf-like"
    B, V = logits.shape
    configs = {"greedy": dict(temperature=0.0), "sampling (bench params)": BENCH}
    if args.extra:
        configs.update(EXTRA)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{B} rows x {V} vocab, {src} logits; {args.clock} ms per step, min / median of {args.repeat}")
    before = torch.get_num_threads()
    try:
        for nt in args.threads:
            torch.set_num_threads(nt)
            print(f"\n## {nt} thread(s)\n")
            print(f"| impl | config | build | call | build + call |")
            print(f"|---|---|---|---|---|")
            for cname, kw in configs.items():
                params = SamplingParams(seed=0, **kw) if kw.get("temperature", 1.0) != 0 else SamplingParams(**kw)
                res = bench(mods, logits, params, args.repeat, clock)
                for name, (tb, tc) in zip(names, res):
                    tot = [b + c for b, c in zip(tb, tc)]
                    print(f"| {name} | {cname} | {fmt(tb)} | {fmt(tc)} | {fmt(tot)} |")
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
