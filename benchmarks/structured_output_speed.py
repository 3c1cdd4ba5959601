"""Per-decode-step cost of structured output: the grammar's token mask and its application.

Part 1 (components, no model): B sequences follow a JSON schema through a valid document
(each sequence its own matcher, fed the document's tokens one by one, as in decoding). Every
step times, for the whole batch,

* ``fill``: :func:`kvserve.structured_output.manager.grammar_bitmask` (llguidance computes the B
  token bitmasks, in its thread pool when B > 1);
* ``accept``: advancing the B matchers by their sampled token;
* ``sampler``: the sampler call on random [B, V] logits with the bitmask minus the same call
  without it (greedy, and temperature 1), i.e. unpacking the bits and the masked_fill, plus
  losing the fused greedy pass (``cpu_ops.greedy``) that an edit-free greedy batch takes.

for the tiny test tokenizer (384 tokens) and SmolLM2's (49,152), and prints ms per step
(median over the steps, after a warm-up pass).

Part 2 (``--e2e``, SmolLM2): the engine's decode steps with B sequences under the schema
against B free sequences (greedy, ``ignore_eos``, the same number of steps), ms per decode
step, runs alternated ``--rounds`` times; medians.

Usage:
    python benchmarks/structured_output_speed.py [--batch 1 16] [--e2e] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import kvserve  # noqa: F401  (first: sets GOMP_SPINCOUNT before torch loads)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.sample.sampler import Sampler, SamplingMetadata, SamplingRow
from kvserve.structured_output.manager import StructuredOutputManager, grammar_bitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org",
       "tags": ["mathematician", "writer", "engine"], "address": {"city": "London", "zip": "W1 1AA"}}


def _tokenizers():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tokenizer
    from transformers import AutoTokenizer

    from kvserve.worker.default_model import default_model_path

    tiny = make_tokenizer(Path(tempfile.mkdtemp()))
    path = default_model_path()
    smol = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return {"tiny (384)": (tiny, 384, [2]), "SmolLM2 (49152)": (smol, 49152, [2])}


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def components(batch_sizes: list[int]) -> None:
    sampler = Sampler()
    cpu = torch.device("cpu")
    text = json.dumps(DOC)
    print(f"{'tokenizer':<17} {'B':>3} {'steps':>5} {'fill ms':>8} {'accept ms':>9} "
          f"{'sampler +ms greedy':>18} {'sampler +ms T=1':>15} {'total ms/step':>13}")
    for name, (tok, V, eos) in _tokenizers().items():
        mgr = StructuredOutputManager(tok, V, eos)
        so = StructuredOutputsParams(json=SCHEMA)
        ids = tok.encode(text, add_special_tokens=False)
        for B in batch_sizes:
            rows_greedy = [SamplingRow(SamplingParams(temperature=0), [1], [], seed=i, eos_token_id=eos) for i in range(B)]
            rows_t1 = [SamplingRow(SamplingParams(temperature=1.0), [1], [], seed=i, eos_token_id=eos) for i in range(B)]
            logits = torch.randn(B, V) * 4
            res = {"fill": [], "accept": [], "greedy": [], "t1": []}
            for rep in range(2):  # the first pass warms up (lexer states are built lazily)
                grammars = [mgr.new_grammar(so) for _ in range(B)]
                for tid in ids:
                    t0 = time.perf_counter()
                    mask = grammar_bitmask(grammars)
                    t1 = time.perf_counter()
                    for g in grammars:
                        g.accept_token(tid)
                    t2 = time.perf_counter()
                    deltas = []
                    for rows in (rows_greedy, rows_t1):
                        a = time.perf_counter()
                        sampler(logits, SamplingMetadata.build(rows, V, cpu))
                        b = time.perf_counter()
                        sampler(logits, SamplingMetadata.build(rows, V, cpu, list(range(B)), mask))
                        c = time.perf_counter()
                        deltas.append((c - b) - (b - a))
                    if rep:
                        res["fill"].append(t1 - t0)
                        res["accept"].append(t2 - t1)
                        res["greedy"].append(deltas[0])
                        res["t1"].append(deltas[1])
                assert all(g.is_terminated() or g.matcher.is_accepting() for g in grammars)
            fill, acc, gr, t1m = (_median_ms(res[k]) for k in ("fill", "accept", "greedy", "t1"))
            print(f"{name:<17} {B:>3} {len(ids):>5} {fill:>8.3f} {acc:>9.3f} {gr:>18.3f} {t1m:>15.3f} "
                  f"{fill + acc + gr:>13.3f}")


def e2e(batch_sizes: list[int], rounds: int, dtype: str) -> None:
    from kvserve import LLM

    llm = LLM(dtype=dtype, max_model_len=1024)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe Ada Lovelace as JSON."}], tokenize=False, add_generation_prompt=True)
    ids = llm.engine.tokenizer.encode(prompt, add_special_tokens=False)
    so = StructuredOutputsParams(json=SCHEMA)

    def run(B: int, constrained: bool, max_tokens: int) -> tuple[float, int]:
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not constrained,
                           structured_outputs=so if constrained else None)
        for i in range(B):
            llm.engine.add_request(ids, p)
        times, steps = [], 0
        while llm.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            llm.engine.step()
            times.append(time.perf_counter() - t0)
            steps += 1
        return statistics.median(times[2:]) * 1e3, steps  # (the first steps are the prefill)

    print(f"\nend to end, SmolLM2 {dtype}, greedy, ms per engine step (median of steps, median of {rounds} rounds)")
    print(f"{'B':>3} {'constrained':>12} {'free':>8} {'overhead':>9}")
    llm.engine.structured_output.compile(so)
    for B in batch_sizes:
        con, free = [], []
        _, steps = run(B, True, 200)  # warm-up, and the number of steps the schema takes
        for _ in range(rounds):
            con.append(run(B, True, 200)[0])
            free.append(run(B, False, steps - 1)[0])
        c, f = statistics.median(con), statistics.median(free)
        print(f"{B:>3} {c:>12.2f} {f:>8.2f} {c - f:>+9.2f}   (constrained {min(con):.2f}-{max(con):.2f}, "
              f"free {min(free):.2f}-{max(free):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    components(args.batch)
    if args.e2e:
        e2e(args.batch, args.rounds, args.dtype)


if __name__ == "__main__":
    main()
