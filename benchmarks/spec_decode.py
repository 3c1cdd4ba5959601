"""Speculative decoding (n-gram proposer) against plain decoding, single stream, one run.

SmolLM2-135M-Instruct (bfloat16 by default), greedy, one request at a time, on two chat
prompts: one that invites repetition (rewrite a list, whose items the reply copies) and a
plain question. For each prompt and each configuration (no speculation, n-gram with
k = 2 and 4) it prints decode tokens/s (output tokens after the first, per second after
the first token), the acceptance rate (accepted / proposed drafts), the mean acceptance
length (tokens per verification step) and whether the output equals plain decoding's.
Configurations are alternated ``--repeats`` times and the median is reported.

Usage:
    python benchmarks/spec_decode.py [--dtype bfloat16] [--max-tokens 256] [--repeats 3] [--k 2 4]

kvserve is imported first so OpenMP does not busy-wait next to other processes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvserve  # noqa: F401  (before torch: GOMP_SPINCOUNT)
from kvserve import LLM, SamplingParams
from kvserve.tokenizer import apply_chat_template

PROMPTS = {
    "repetitive": [{"role": "user", "content": (
        "Rewrite this list as a numbered list, one item per line, keeping every word:\n"
        "apples from the market, bread from the bakery, milk from the farm, eggs from the farm, "
        "cheese from the market, butter from the farm, tomatoes from the garden, onions from the garden, "
        "rice from the store, beans from the store, pasta from the store, coffee from the store")}],
    "plain": [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
}


def run(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, list[int], dict]:
    eng = llm.engine
    before = eng.spec_stats()
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    dt = time.perf_counter() - t0
    m = out.metrics
    after = eng.spec_stats()
    d = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                            "spec_decode_num_accepted_tokens")}
    rate = m.decode_tokens_per_s or (len(out.token_ids) / dt)
    return rate, out.token_ids, d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    configs = {"off": None}
    for k in a.k:
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 1}
    llms = {name: LLM(dtype=a.dtype, max_model_len=2048, speculative_config=cfg) for name, cfg in configs.items()}
    tok = next(iter(llms.values())).tokenizer
    rows = []
    for pname, messages in PROMPTS.items():
        ids = apply_chat_template(tok, messages)
        for llm in llms.values():  # warm-up (kernels, caches)
            run(llm, ids, 16)
        rates = {name: [] for name in configs}
        res = {}
        for _ in range(a.repeats):  # alternate the configurations
            for name, llm in llms.items():
                r, toks, d = run(llm, ids, a.max_tokens)
                rates[name].append(r)
                res[name] = (toks, d)
        base = res["off"][0]
        for name in configs:
            toks, d = res[name]
            acc = d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_draft_tokens"] if d["spec_decode_num_draft_tokens"] else 0.0
            mal = 1 + d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_drafts"] if d["spec_decode_num_drafts"] else 1.0
            med = statistics.median(rates[name])
            rows.append((pname, name, len(toks), med, med / statistics.median(rates["off"]),
                         acc if name != "off" else None, mal if name != "off" else None, toks == base,
                         " ".join(f"{x:.1f}" for x in rates[name])))
    print(f"\nSmolLM2-135M-Instruct {a.dtype}, greedy, single stream, {a.max_tokens} max tokens, "
          f"median of {a.repeats} alternated runs\n")
    print("| prompt | speculation | output tokens | decode tok/s | speed-up | acceptance rate | mean acceptance length | same output | runs (tok/s) |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for p, name, n, med, sp, acc, mal, same, runs in rows:
        print(f"| {p} | {name} | {n} | {med:.1f} | {sp:.2f}x | {'' if acc is None else f'{acc:.1%}'} | "
              f"{'' if mal is None else f'{mal:.2f}'} | {same} | {runs} |")


if __name__ == "__main__":
    main()
