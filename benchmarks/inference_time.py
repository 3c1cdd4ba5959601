"""Inference-time compute on SmolLM2: accuracy on simple arithmetic word problems for greedy
decoding, self-consistency@N, best-of-N with the model's mean logprob and with the model as a
judge, and pass@N (an oracle verifier: the ceiling of any reranking), with the generated
tokens and wall time of each. Prints a table; not a test.

    python benchmarks/inference_time.py [--problems 40] [--n 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve import LLM, SamplingParams
from kvserve.inference_time import LLMJudge, MeanLogprobVerifier, best_of_n, last_number, self_consistency
from kvserve.engine.tokenizer import apply_chat_template

TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} stickers and gave away {b}. How many stickers are left?", lambda a, b: a - b),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b),
    ("{name} reads {a} pages a day for {b} days. How many pages is that in total?", lambda a, b: a * b),
]
NAMES = ["Tom", "Anna", "Sam", "Lena", "Omar", "Mia"]


def problems(k: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(k):
        text, fn = TEMPLATES[i % len(TEMPLATES)]
        a, b = rng.randint(2, 20), rng.randint(2, 9)
        if fn(5, 3) == 2:  # subtraction: keep it non-negative
            a = max(a, b + 1)
        out.append((text.format(name=rng.choice(NAMES), a=a, b=b), str(fn(a, b))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024)
    probs = problems(args.problems)
    prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": q + " Answer with the number."}],
                                   add_generation_prompt=True) for q, _ in probs]
    gold = [a for _, a in probs]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    rows = []

    def acc(answers) -> float:
        return sum(a == g for a, g in zip(answers, gold)) / len(gold)

    t = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    rows.append(("greedy", acc([last_number(o.text) for o in greedy]), sum(len(o.token_ids) for o in greedy),
                 time.perf_counter() - t))

    t = time.perf_counter()
    sc = self_consistency(llm, prompts, args.n, sampling_params=sp)
    sc_tokens = sum(len(c.token_ids) for r in sc for c in r.candidates)
    rows.append((f"self-consistency@{args.n}", acc([r.answer for r in sc]), sc_tokens, time.perf_counter() - t))
    # the same samples, reranked (the engine draws them identically from the same seed)
    samples = [[c.answer for c in r.candidates] for r in sc]
    rows.append((f"one sample (mean of {args.n})",
                 sum(acc([s[j] for s in samples]) for j in range(args.n)) / args.n, sc_tokens / args.n, float("nan")))
    rows.append((f"pass@{args.n} (oracle verifier)", sum(g in s for s, g in zip(samples, gold)) / len(gold),
                 sc_tokens, float("nan")))

    t = time.perf_counter()
    bl = best_of_n(llm, prompts, args.n, MeanLogprobVerifier(), sp)
    rows.append((f"best-of-{args.n}, mean logprob", acc([last_number(r.text) for r in bl]),
                 sum(len(c.token_ids) for r in bl for c in r.candidates), time.perf_counter() - t))

    t = time.perf_counter()
    bj = best_of_n(llm, prompts, args.n, LLMJudge(llm), sp, verifier_prompts=[q for q, _ in probs])
    rows.append((f"best-of-{args.n}, LLM judge (same model)", acc([last_number(r.text) for r in bj]),
                 sum(len(c.token_ids) for r in bj for c in r.candidates), time.perf_counter() - t))

    print(f"{args.problems} arithmetic word problems, SmolLM2-135M-Instruct {args.dtype}, temperature "
          f"{args.temperature}, at most {args.max_tokens} tokens per sample")
    print("| method | accuracy | generated tokens | wall s |")
    print("|---|---|---|---|")
    for name, a, toks, sec in rows:
        print(f"| {name} | {a:.1%} | {toks:.0f} | {'' if sec != sec else f'{sec:.1f}'} |")


if __name__ == "__main__":
    main()
