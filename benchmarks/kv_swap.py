"""Swap vs recompute preemption (``preemption_mode``, ``swap_space``; kvserve.core.kv_swap).

The same memory-pressured workload runs on a fresh engine per mode, in one process (the weights
are read once): N requests of random prompt tokens, all arriving at once, each generating a fixed
number of tokens (greedy, ``ignore_eos``), on a KV pool that holds the full contexts of only a
few of them, so the scheduler keeps preempting. ``recompute`` frees a victim's blocks and
recomputes its prompt + output when it comes back (hitting the prefix cache where its blocks are
still there); ``swap`` copies them to the host pool and back.

Reported per mode: wall time of the whole workload, output tokens/s, preemptions, swap-outs and
swap-ins (requests and blocks), recompute fallbacks, the prompt tokens and all tokens run through
the model (recomputation shows there), and whether the outputs equal the other mode's.

Usage::

    python benchmarks/kv_swap.py                         # SmolLM2-135M-Instruct, bfloat16
    python benchmarks/kv_swap.py --requests 32 --fit 6 --model path/to/model --dtype float32
"""

from __future__ import annotations

import argparse
import functools
import random
import time

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import kvserve.worker.worker as worker_mod
from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine


def run(args: argparse.Namespace, mode: str, prompts: list[list[int]]) -> dict:
    ctx = max(map(len, prompts)) + args.output_len
    blocks_per_request = -(-ctx // args.block_size)
    engine = LLMEngine(EngineArgs(
        model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size,
        num_blocks=args.fit * blocks_per_request, max_model_len=ctx,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=mode, swap_space=args.swap_space if mode == "swap" else 0))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    tokens = 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal tokens
        out = schedule()
        tokens += out.num_batched_tokens
        return out

    engine.scheduler.schedule = counting_schedule
    copy_s = 0.0  # time inside the swap copies
    if engine.swap is not None:
        def timed(fn):
            def wrapper(*a):
                nonlocal copy_s
                t = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    copy_s += time.perf_counter() - t
            return wrapper
        engine.swap.swap_out, engine.swap.swap_in = timed(engine.swap.swap_out), timed(engine.swap.swap_in)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    dt = time.perf_counter() - t0
    s = engine.stats()
    return dict(mode=mode, seconds=dt, out_tok_s=len(prompts) * args.output_len / dt, outs=outs,
                blocks=engine.kv.num_blocks, tokens=tokens, copy_s=copy_s,
                block_bytes=engine.swap.block_bytes if engine.swap is not None else 0, **s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--fit", type=int, default=3, help="the pool holds this many full contexts")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--swap-space", type=float, default=1.0, help="GiB (swap mode)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cached = functools.lru_cache(maxsize=1)(worker_mod.load_weights)  # read the weights once
    worker_mod.load_weights = lambda path: (cached(path)[0], dict(cached(path)[1]))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    # warm-up (kernel compilation, allocator)
    run(argparse.Namespace(**{**vars(args), "output_len": 4, "fit": 2}), "recompute", prompts[:2])
    results = [run(args, mode, prompts) for mode in ("recompute", "swap")]
    ref = results[0]["outs"]
    r0 = results[0]
    print(f"{args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, {args.output_len} output "
          f"tokens each (greedy), {args.dtype}, pool of {r0['blocks']} blocks x {args.block_size} tokens "
          f"(~{args.fit} full contexts), prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print("| mode | wall s | out tok/s | preemptions | swap-outs | swap-ins | blocks out / in | recompute fallbacks "
          "| prompt tokens computed | tokens computed | same tokens as recompute |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in results:
        same = sum(r["outs"][k] == v for k, v in ref.items())
        print(f"| {r['mode']} | {r['seconds']:.1f} | {r['out_tok_s']:.1f} | {r['num_preemptions']} | "
              f"{r['swap_num_swap_outs']} | {r['swap_num_swap_ins']} | {r['swap_num_swapped_out_blocks']} / "
              f"{r['swap_num_swapped_in_blocks']} | {r['swap_num_recompute_fallbacks']} | "
              f"{r['prompt_tokens_computed']} | {r['tokens']} | {same}/{len(ref)} |")
    sw = results[1]
    moved = sw["swap_num_swapped_out_blocks"] + sw["swap_num_swapped_in_blocks"]
    print(f"swap / recompute wall time: {sw['seconds'] / r0['seconds']:.2f}x; swap copies took {sw['copy_s'] * 1e3:.1f} ms "
          f"in all ({moved} blocks of {sw['block_bytes'] / 1024:.0f} KiB moved, "
          f"{sw['copy_s'] * 1e3 / max(moved, 1):.3f} ms per block)")


if __name__ == "__main__":
    main()
