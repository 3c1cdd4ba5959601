"""KV compression policies on SmolLM2-135M-Instruct (the default model): single-stream greedy decode
of ``--tokens`` tokens after a ``--prompt``-token prompt, with no compression, StreamingLLM
(4 sinks + ``--window``), H2O (budget ``--budget``, recent ``--budget // 4``) and SnapKV (budget
``--budget``, observation window 32), one engine, the runs one after the other.

For each: decode tokens/s (output tokens after the first / time after the first token, from the
request's metrics), the most KV blocks the request held after any step and at the end, the
compactions, and how many of its tokens equal the uncompressed run's before the first that
differs. StreamingLLM decodes on the one-call C decode step; SnapKV's prompt step and every H2O step
run the layers' PyTorch path, which also computes the attention probabilities (so H2O is slower
per token here, while its context stays short).

``--kv-cache-dtype`` (``auto``, ``int8``, ``fp8``, ``int4``, ``int2``) runs the same table over that KV
format (int4 / int2: KIVI's 2-/4-bit blocks, the kept tokens requantized at each compaction); the
"KV MiB" column is the most blocks held times the bytes of a block in that format.

Usage:
    python benchmarks/kv_compression.py [--prompt 512] [--tokens 1024] [--window 252] [--budget 256]
        [--dtype bfloat16] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import os
import time

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)

from kvserve import LLM, SamplingParams


def run(llm: LLM, prompt: list[int], n: int, comp) -> dict:
    eng = llm.engine
    core = eng.core
    c0 = core.num_kv_compactions
    eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, kv_compression=comp))
    most, out, t0 = 0, None, time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        for r in core.scheduler.running:
            most = max(most, core.kv.num_held_blocks(r))
    wall = time.perf_counter() - t0
    m = out.metrics
    return {"tokens": out.outputs[0].token_ids, "tok_s": m.decode_tokens_per_s, "ttft": m.ttft, "wall": wall,
            "most_blocks": most, "compactions": core.num_kv_compactions - c0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "int4", "int2"])
    a = ap.parse_args()
    llm = LLM(dtype=a.dtype, max_model_len=a.prompt + a.tokens + 8, kv_cache_memory=0.5,
              enable_prefix_caching=False, kv_cache_dtype=a.kv_cache_dtype)
    spec = llm.engine.core.kv_spec
    block_mib = spec.bytes_per_token * spec.block_size / 2**20
    text = "The history of the city is long and full of stories about its people, rivers and roads. " * 200
    prompt = llm.engine.encode(text)[: a.prompt]
    runs = [("none", None),
            (f"streaming_llm 4+{a.window}", {"method": "streaming_llm", "sink_tokens": 4, "window": a.window}),
            (f"h2o {a.budget}/{a.budget // 4}", {"method": "h2o", "budget": a.budget, "recent": a.budget // 4}),
            (f"snapkv {a.budget}", {"method": "snapkv", "budget": a.budget})]
    run(llm, prompt[:32], 8, None)  # warm-up
    ref = None
    print(f"SmolLM2-135M {a.dtype}, KV {a.kv_cache_dtype}, prompt {len(prompt)} tokens, {a.tokens} generated, "
          f"block 16, load average {os.getloadavg()[0]:.2f}")
    print("| policy | decode tok/s | TTFT s | most blocks held | KV MiB | compactions | tokens equal to none's |")
    print("|---|---|---|---|---|---|---|")
    for name, comp in runs:
        r = run(llm, prompt, a.tokens, comp)
        if ref is None:
            ref = r["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(ref, r["tokens"])) if x != y), len(ref))
        print(f"| {name} | {r['tok_s']:.1f} | {r['ttft']:.2f} | {r['most_blocks']} | "
              f"{r['most_blocks'] * block_mib:.2f} | {r['compactions']} | {same} |")
    print(f"(load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
