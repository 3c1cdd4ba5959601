"""Speculative decoding (n-gram proposer) against plain decoding, single stream, one run.

SmolLM2-135M-Instruct (bfloat16 by default), greedy, one request at a time, on three chat
prompts: one that invites repetition (rewrite a list, whose items the reply copies), a
plain question, and ``json``: an extraction under a JSON schema (structured output, compact
JSON; the reply copies values from the prompt, and the grammar cuts the drafts it rejects;
the output is checked against the schema). For each prompt and each configuration (no speculation, n-gram with
k = 2 and 4) it prints decode tokens/s (output tokens after the first, per second after
the first token), the acceptance rate (accepted / proposed drafts), the mean acceptance
length (tokens per verification step) and whether the output equals plain decoding's.
Configurations are alternated ``--repeats`` times and the median is reported.

Usage:
    python benchmarks/spec_decode.py [--dtype bfloat16] [--max-tokens 256] [--repeats 3] [--k 2 4]
                                     [--cases repetitive plain json] [--kv-cache-dtype auto|int8|int4|int2]
                                     [--kv-cache-memory GIB]

kvserve is imported first so OpenMP does not busy-wait next to other processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import kvserve  # noqa: F401  (before torch: GOMP_SPINCOUNT)
from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.tokenizer import apply_chat_template

PROMPTS = {
    "repetitive": [{"role": "user", "content": (
        "Rewrite this list as a numbered list, one item per line, keeping every word:\n"
        "apples from the market, bread from the bakery, milk from the farm, eggs from the farm, "
        "cheese from the market, butter from the farm, tomatoes from the garden, onions from the garden, "
        "rice from the store, beans from the store, pasta from the store, coffee from the store")}],
    "plain": [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    "json": [{"role": "user", "content": (
        "Extract the people in this text as JSON with their name, city, email and job:\n"
        "Alice Johnson lives in Springfield and works as a software engineer (alice.johnson@example.com). "
        "Bob Smith, a teacher from Riverside, can be reached at bob.smith@example.org. "
        "Carol White is a nurse in Lakeside; her email is carol.white@example.net. "
        "David Brown, chef, Hillview, david.brown@example.com.")}],
}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "email": {"type": "string"}, "job": {"type": "string"}},
    "required": ["name", "city", "email", "job"], "additionalProperties": False}
SCHEMAS = {"json": {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 1}},
                    "required": ["people"], "additionalProperties": False}}


def run(llm: LLM, ids: list[int], max_tokens: int, schema: Optional[dict] = None) -> tuple[float, list[int], dict]:
    eng = llm.engine
    before = eng.spec_stats()
    so = None if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so))[0]
    dt = time.perf_counter() - t0
    m = out.metrics
    after = eng.spec_stats()
    d = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                            "spec_decode_num_accepted_tokens", "spec_decode_num_grammar_cut_tokens")}
    if schema is not None and out.outputs[0].finish_reason == "stop":
        import jsonschema

        jsonschema.validate(json.loads(out.outputs[0].text), schema)  # (raises if the grammar let it stray)
        d["valid"] = True
    rate = m.decode_tokens_per_s or (len(out.token_ids) / dt)
    return rate, out.token_ids, d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cases", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--kv-cache-dtype", default="auto", help="every configuration's KV cache dtype")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="each engine's KV budget (GiB)")
    a = ap.parse_args()
    configs = {"off": None}
    for k in a.k:
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 1}
    llms = {name: LLM(dtype=a.dtype, max_model_len=2048, speculative_config=cfg, kv_cache_dtype=a.kv_cache_dtype,
                      kv_cache_memory=a.kv_cache_memory) for name, cfg in configs.items()}
    tok = next(iter(llms.values())).tokenizer
    rows = []
    for pname in a.cases:
        ids = apply_chat_template(tok, PROMPTS[pname])
        schema = SCHEMAS.get(pname)
        for llm in llms.values():  # warm-up (kernels, caches, the grammar's compilation)
            run(llm, ids, 16, schema)
        rates = {name: [] for name in configs}
        res = {}
        for _ in range(a.repeats):  # alternate the configurations
            for name, llm in llms.items():
                r, toks, d = run(llm, ids, a.max_tokens, schema)
                rates[name].append(r)
                res[name] = (toks, d)
        base = res["off"][0]
        for name in configs:
            toks, d = res[name]
            acc = d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_draft_tokens"] if d["spec_decode_num_draft_tokens"] else 0.0
            mal = 1 + d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_drafts"] if d["spec_decode_num_drafts"] else 1.0
            med = statistics.median(rates[name])
            cut = d["spec_decode_num_grammar_cut_tokens"]
            rows.append((pname, name, len(toks), med, med / statistics.median(rates["off"]),
                         acc if name != "off" else None, mal if name != "off" else None, toks == base,
                         " ".join(f"{x:.1f}" for x in rates[name]), cut if schema and name != "off" else None,
                         d.get("valid", False) if schema else None))
    print(f"\nSmolLM2-135M-Instruct {a.dtype}, kv_cache_dtype {a.kv_cache_dtype}, greedy, single stream, "
          f"{a.max_tokens} max tokens, "
          f"median of {a.repeats} alternated runs\n")
    print("| prompt | speculation | output tokens | decode tok/s | speed-up | acceptance rate | mean acceptance length "
          "| drafts cut by the grammar | same output | valid JSON | runs (tok/s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for p, name, n, med, sp, acc, mal, same, runs, cut, valid in rows:
        print(f"| {p} | {name} | {n} | {med:.1f} | {sp:.2f}x | {'' if acc is None else f'{acc:.1%}'} | "
              f"{'' if mal is None else f'{mal:.2f}'} | {'' if cut is None else cut} | {same} | "
              f"{'' if valid is None else valid} | {runs} |")


if __name__ == "__main__":
    main()
