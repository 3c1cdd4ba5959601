"""KV quality report (issue #23, point 4): what KV compression (StreamingLLM, SnapKV, H2O) and the
KV cache dtypes cost in answer quality, on SmolLM2-135M-Instruct (the default model, context 8,192),
with long inputs this script builds itself. One row per (KV dtype, method, budget).

Columns:

* **passkey**: retrieval accuracy. A 5-digit key ("The pass key is 12345. Remember it. 12345 is
  the pass key.") hidden at ``--depths`` evenly spaced depths (0 = right after the instruction,
  1 = right before the question) in ``--lengths`` tokens of the classic filler ("The grass is green.
  The sky is blue. The sun is yellow. Here we go. There and back again."), the prompt ending in
  "What is the pass key? The pass key is"; greedy, ``--answer-tokens`` tokens; a hit when the
  key's 5 digits appear in the answer (Mohtashami & Jaggi 2023, "Landmark Attention", as used by
  LongLoRA and the KV compression papers). The prompt is built in token space
  (:func:`passkey_prompt`): exactly ``length`` tokens, the key's sentence starting at
  ``header + round(depth * filler)``. Each key is drawn from a seeded generator (same keys for
  every row).
* **Δppl** and **top-1 agree**: teacher-forced perplexity on long natural text found on the
  machine (:func:`natural_text`: the files of ``/usr/share/common-licenses``, then the
  ``LICENSE*``/``COPYING*``/``README*`` files of the venv's site-packages, then
  ``/usr/share/doc/*/copyright``, in sorted path order, concatenated until long enough; the same
  text every run on one machine). Method (:func:`forced_logprobs`): the text's first
  ``L - M`` tokens are the prompt (so SnapKV compresses them after prefill, StreamingLLM and H2O
  compact between prefill chunks and decode steps, as for any request), and its last ``M``
  (``--ppl-tokens``) tokens are *forced* one decode step at a time: before each engine step the
  request's ``allowed_token_ids`` is set to the text's next token, and ``logprobs=1`` returns the
  raw (pre-mask) log-probability of that token and the raw top-1 token. So every scored token is
  predicted from the compressed cache exactly as a generated token would be, compaction happening
  between steps as in serving. ``ppl = exp(-mean logprob)`` over the ``M`` tokens; Δppl is the
  row's ppl minus the full cache's (method none, KV dtype ``auto``); top-1 agree is the share of
  the ``M`` positions whose raw argmax equals the full cache's. For method none this equals plain
  ``prompt_logprobs`` perplexity of the same tokens (the report prints both; the test checks it).
  Budgets are a fraction (``--budgets``) of the text's length ``L``.
* **KV bytes/seq**: the most KV blocks the request held after any step of the perplexity run at
  the longest ``--ppl-lengths`` context, times the bytes of one block for that KV dtype (int4 / int2:
  a full block's codes, float16 scales and zeros; the one partial block a sequence holds also has a
  model-dtype residual slot, ``block_size`` tokens in the model dtype, not counted here).
* **decode tok/s @L**: decode tokens/s (from the request's metrics: tokens after the first / time
  after the first) of the same teacher-forced run at context ``L`` (``--ppl-lengths``; default 4,096
  and 8,192). The forced mask and logprobs add a little per step, the same for every row.

Budgets: StreamingLLM keeps 4 sinks + ``B - 4`` recent; SnapKV keeps ``B`` (observation window
32, kernel 7); H2O keeps ``B`` with ``B // 2`` recent (the paper's half heavy hitters, half recent).
A KV dtype the engine refuses is skipped with the reason printed. KV dtypes: ``auto``, ``int8``, ``fp8``,
and KIVI's ``int4`` / ``int2`` (``--kv-cache-dtypes auto int8 int4 int2``; the default grid runs
``auto int8 fp8 int4 int2``).

kvpress: ``--kvpress-python PATH`` runs NVIDIA's kvpress (``benchmarks/kv_quality.py --kvpress-worker``
under that interpreter, a venv holding kvpress and its transformers) on the same passkey prompts with
``SnapKVPress`` and ``StreamingLLMPress`` at the same budgets, and prints its answers and
accuracy beside kvserve's.

The passkey prompts of a row are submitted together (the engine batches them). ``--json FILE``
keeps the rows, with each row's answers and the full cache's teacher-forced logprobs and top-1
tokens; ``--reference FILE`` reads those back, so a grid can run in parts (one KV dtype at a
time) against one reference.

Usage (the issue's full grid; hours on the 2-core machine):
    python benchmarks/kv_quality.py --json grid.json
    python benchmarks/kv_quality.py --kv-cache-dtypes int4 int2 --reference grid.json  # a part
Reduced:
    python benchmarks/kv_quality.py --lengths 1024 2048 --depths 3 --ppl-lengths 2048 \\
        --methods none streaming_llm snapkv h2o --budgets 0.25 --kv-cache-dtypes auto int8 int4 int2
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
          "I will quiz you about the important information there.\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
METHODS = ("none", "streaming_llm", "snapkv", "h2o")


# ------------------------------------------------------------------------------------ inputs
def depths_grid(n: int) -> list[float]:
    """``n`` evenly spaced depths in [0, 1] (n = 1: [0.5]). Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"--depths must be ≥ 1, got {n}")
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def passkey_prompt(encode: Callable[[str], list[int]], length: int, depth: float, key: int
                   ) -> tuple[list[int], int, int]:
    """A passkey-retrieval prompt of exactly ``length`` tokens.

    Args:
        encode: text -> token ids (no special tokens added).
        length: total tokens (header + filler + needle + filler + question).
        depth: in [0, 1]: the share of the filler placed before the needle.
        key: the 5-digit pass key (10000..99999).
    Returns:
        (ids, needle_start, needle_len): the prompt's ids, the index of the needle sentence's first
        token and its token count.
    Raises:
        ValueError: ``depth`` outside [0, 1], ``key`` not 5 digits, or ``length`` too short to
        hold the header, needle and question.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if not 10000 <= key <= 99999:
        raise ValueError(f"key must be 5 digits (10000..99999), got {key}")
    head, needle, question = encode(HEADER), encode(NEEDLE.format(key=key)), encode(QUESTION)
    n_fill = length - len(head) - len(needle) - len(question)
    if n_fill < 0:
        raise ValueError(f"length must be ≥ {length - n_fill} tokens for the passkey prompt, got {length}")
    unit = encode(FILLER * 8)
    filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
    before = round(depth * n_fill)
    ids = head + filler[:before] + needle + filler[before:] + question
    return ids, len(head) + before, len(needle)


def natural_text(min_chars: int, site_packages: Optional[str] = None) -> str:
    """Deterministic natural text of at least ``min_chars`` characters from files on the machine:
    ``/usr/share/common-licenses/*``, then ``LICENSE*``/``COPYING*``/``README*`` under the venv's
    ``site-packages``, then ``/usr/share/doc/*/copyright``, each group in sorted path order,
    concatenated (blank line between files; files that are not UTF-8 text are skipped).
    Raises RuntimeError when the machine has less text than asked."""
    sp = site_packages or next(p for p in sys.path if p.endswith("site-packages"))
    groups = [sorted(glob.glob("/usr/share/common-licenses/*")),
              sorted(glob.glob(os.path.join(sp, "*", "LICENSE*")) + glob.glob(os.path.join(sp, "*", "COPYING*"))
                     + glob.glob(os.path.join(sp, "*", "README*"))),
              sorted(glob.glob("/usr/share/doc/*/copyright"))]
    parts, n = [], 0
    for group in groups:
        for path in group:
            if n >= min_chars:
                break
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    t = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            parts.append(t.strip())
            n += len(parts[-1]) + 2
    text = "\n\n".join(parts)
    if len(text) < min_chars:
        raise RuntimeError(f"only {len(text)} characters of natural text found, {min_chars} needed")
    return text


def policy(method: str, budget: int) -> Optional[dict]:
    """The ``kv_compression`` dict of ``method`` at ``budget`` kept tokens (None for none)."""
    if method == "none":
        return None
    if method == "streaming_llm":
        return {"method": "streaming_llm", "sink_tokens": 4, "window": budget - 4}
    if method == "snapkv":
        return {"method": "snapkv", "budget": budget, "observation_window": 32, "kernel_size": 7}
    if method == "h2o":
        return {"method": "h2o", "budget": budget, "recent": budget // 2}
    raise ValueError(f"--methods: unknown method {method!r}, allowed: {', '.join(METHODS)}")


# ------------------------------------------------------------------------------------ measures
def forced_logprobs(llm, ids: Sequence[int], num_forced: int, comp=None) -> dict:
    """Teacher-forced log-probabilities of the last ``num_forced`` tokens of ``ids`` under the
    KV compression policy ``comp`` (module docstring: the rest is the prompt; the forced tokens are
    decode steps, each pinned by ``allowed_token_ids``; the logprobs are the raw pre-mask ones).

    Returns: {"logprobs": [num_forced] floats (natural log), "top1": [num_forced] raw argmax token
    ids, "most_blocks": the most KV blocks the request held after a step, "tok_s": decode tokens/s,
    "ttft": s}. Raises ValueError unless 1 ≤ num_forced < len(ids).
    """
    from kvserve import SamplingParams

    ids = list(ids)
    if not 1 <= num_forced < len(ids):
        raise ValueError(f"num_forced must be in [1, {len(ids) - 1}], got {num_forced}")
    p = len(ids) - num_forced
    eng = llm.engine
    core = eng.core
    sp = SamplingParams(max_tokens=num_forced, temperature=0, ignore_eos=True, logprobs=1,
                        allowed_token_ids=[ids[p]], kv_compression=comp)
    eng.add_request(ids[:p], sp)
    out, most = None, 0
    while eng.has_unfinished_requests():
        for r in core.scheduler.running:
            k = len(r.output_token_ids)
            if k < num_forced:  # the token this step samples is ids[p + k]
                r.sampling_params.allowed_token_ids = [ids[p + k]]
        for o in eng.step():
            out = o
        for r in core.scheduler.running:
            most = max(most, core.kv.num_held_blocks(r))
    c = out.outputs[0]
    if list(c.token_ids) != ids[p:]:
        raise RuntimeError("forced decoding did not follow the text (allowed_token_ids not applied)")
    lps, top1 = [], []
    for tok, d in zip(c.token_ids, c.logprobs):
        lps.append(d[tok].logprob)
        top1.append(next(t for t, lp in d.items() if lp.rank == 1))
    m = out.metrics
    return {"logprobs": lps, "top1": top1, "most_blocks": most, "tok_s": m.decode_tokens_per_s,
            "ttft": m.ttft}


def prompt_logprobs(llm, ids: Sequence[int], num_scored: int) -> list[float]:
    """Plain ``prompt_logprobs`` of the last ``num_scored`` tokens of ``ids`` (no compression)."""
    from kvserve import SamplingParams

    o = llm.generate([list(ids)], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    plp = o.prompt_logprobs
    return [plp[i][ids[i]].logprob for i in range(len(ids) - num_scored, len(ids))]


def ppl(logprobs: Sequence[float]) -> float:
    """exp(-mean(logprobs))."""
    return math.exp(-sum(logprobs) / len(logprobs))


def passkey_answers(llm, prompts: Sequence[list[int]], comps: Sequence[Optional[dict]], answer_tokens: int
                    ) -> list[str]:
    """Greedy answers to the passkey prompts, all submitted at once (each with its own KV
    compression policy ``comps[i]``; the engine batches them as it batches any requests)."""
    from kvserve import SamplingParams

    params = [SamplingParams(max_tokens=answer_tokens, temperature=0, kv_compression=c) for c in comps]
    return [o.outputs[0].text for o in llm.generate([list(p) for p in prompts], params)]


# ------------------------------------------------------------------------------------ kvpress
def kvpress_worker(spec_path: str) -> None:
    """Run in the kvpress interpreter: read the cases, answer them with kvpress presses, print JSON."""
    import torch
    from kvpress import SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM

    spec = json.load(open(spec_path))
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], gguf_file=spec["gguf"], dtype=torch.float32).eval()
    res = []
    for case in spec["cases"]:
        ctx = torch.tensor([case["context"]])
        q = case["question"]
        ratio = 1.0 - max(1, case["budget"] - len(q)) / len(case["context"])  # kept = budget, question included
        if case["method"] == "none":
            with torch.no_grad():
                outp = model(ctx, use_cache=True)
        else:
            press = {"snapkv": SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7),
                     "streaming_llm": StreamingLLMPress(compression_ratio=ratio, n_sink=4)}[case["method"]]
            with torch.no_grad(), press(model):
                outp = model(ctx, use_cache=True)
        cache = outp.past_key_values
        kept = int(cache.get_seq_length())  # context tokens kept after the press
        toks, nxt = [], torch.tensor([q])
        pos = len(case["context"])
        with torch.no_grad():
            for _ in range(spec["answer_tokens"]):
                o = model(nxt, past_key_values=cache, use_cache=True,
                          position_ids=torch.arange(pos, pos + nxt.shape[1])[None])
                pos += nxt.shape[1]
                t = int(o.logits[0, -1].argmax())
                toks.append(t)
                nxt = torch.tensor([[t]])
        res.append({"tokens": toks, "kept": kept})
    print("KVPRESS_JSON " + json.dumps(res))


# ------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--depths", type=int, default=10, help="number of evenly spaced depths in [0, 1]")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5], help="fractions of the context")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int8", "fp8", "int4", "int2"])
    ap.add_argument("--ppl-lengths", type=int, nargs="+", default=[4096, 8192],
                    help="contexts of the perplexity / decode-speed runs")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="forced (scored) tokens at the end of each text")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--reference", help="an earlier run's --json: take the full cache's teacher-forced logprobs "
                                        "(Δppl, top-1) from it instead of the first KV dtype's method-none row")
    ap.add_argument("--kvpress-python", help="interpreter of a venv with kvpress (compare SnapKV/StreamingLLM)")
    ap.add_argument("--kvpress-cases", type=int, default=4, help="passkey cases per method for kvpress")
    ap.add_argument("--kvpress-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.kvpress_worker:
        return kvpress_worker(a.kvpress_worker)
    for m in a.methods:
        policy(m, 64)
    for b in a.budgets:
        if not 0.0 < b <= 1.0:
            raise SystemExit(f"--budgets: each must be in (0, 1], got {b}")
    for n in a.lengths + a.ppl_lengths:
        if not 64 <= n <= a.max_model_len:
            raise SystemExit(f"--lengths/--ppl-lengths: each must be in [64, {a.max_model_len}], got {n}")
    if not 1 <= a.ppl_tokens < min(a.ppl_lengths):
        raise SystemExit(f"--ppl-tokens must be in [1, {min(a.ppl_lengths) - 1}], got {a.ppl_tokens}")
    depths = depths_grid(a.depths)

    import random

    import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
    from kvserve import LLM

    rng = random.Random(a.seed)
    cases = [(L, d, rng.randint(10000, 99999)) for L in a.lengths for d in depths]
    rows, full = [], {}
    t_start = time.time()
    print(f"# kv_quality: SmolLM2-135M {a.dtype}, lengths {a.lengths}, {len(depths)} depths, budgets {a.budgets}, "
          f"ppl contexts {a.ppl_lengths} ({a.ppl_tokens} forced tokens), load average {os.getloadavg()[0]:.2f}",
          flush=True)
    texts = None
    kvserve_answers: dict = {}
    if a.reference:
        with open(a.reference) as f:
            for r in json.load(f):
                for L in a.ppl_lengths:
                    if f"ref@{L}" in r:
                        full[("auto", L)] = r[f"ref@{L}"]
        missing = [L for L in a.ppl_lengths if ("auto", L) not in full]
        if missing:
            raise SystemExit(f"--reference {a.reference}: no full-cache reference for --ppl-lengths {missing}")
    for kvd in a.kv_cache_dtypes:
        try:
            llm = LLM(dtype=a.dtype, kv_cache_dtype=kvd, max_model_len=a.max_model_len,
                      kv_cache_memory=a.kv_cache_memory, enable_prefix_caching=False)
        except (ValueError, NotImplementedError) as e:
            if "kv_cache_dtype" not in str(e):
                raise
            print(f"# kv dtype {kvd}: skipped, the engine refuses it: {e}", flush=True)
            continue
        eng = llm.engine
        block_bytes = eng.core.kv_spec.bytes_per_token * eng.core.kv_spec.block_size
        if texts is None:
            tok_text = eng.encode(natural_text(4 * max(a.ppl_lengths) + 4096))
            if len(tok_text) < max(a.ppl_lengths):
                raise SystemExit("natural text too short for --ppl-lengths")
            texts = {L: tok_text[:L] for L in a.ppl_lengths}
        # an L-token case is L tokens with its answer (the longest fits the model's context)
        prompts = [passkey_prompt(eng.encode, min(L, a.max_model_len - a.answer_tokens), d, key) for L, d, key in cases]
        from kvserve import SamplingParams
        llm.generate([prompts[0][0][:32]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        for method in a.methods:
            for frac in ([1.0] if method == "none" else a.budgets):
                row = {"kv_dtype": kvd, "method": method, "budget": frac}
                answers = passkey_answers(llm, [ids for ids, _, _ in prompts],
                                          [policy(method, max(64, int(frac * L))) for L, _, _ in cases],
                                          a.answer_tokens)
                hits = [str(key) in ans for (_, _, key), ans in zip(cases, answers)]
                for (L, d, _), ans in zip(cases, answers):
                    kvserve_answers[(kvd, method, frac, L, d)] = ans
                row["answers"] = answers
                row["passkey"] = sum(hits) / len(hits)
                row["passkey_by_length"] = {L: sum(h for h, c in zip(hits, cases) if c[0] == L) / len(depths)
                                            for L in a.lengths}
                for L in a.ppl_lengths:
                    comp = policy(method, max(64, int(frac * L)))
                    r = forced_logprobs(llm, texts[L], a.ppl_tokens, comp)
                    row[f"ppl@{L}"] = ppl(r["logprobs"])
                    row[f"tok_s@{L}"] = r["tok_s"]
                    row[f"kv_bytes@{L}"] = r["most_blocks"] * block_bytes
                    key_full = ("auto", L)
                    if method == "none" and kvd == a.kv_cache_dtypes[0] and not a.reference:
                        full[key_full] = r
                        row[f"ref@{L}"] = {"logprobs": r["logprobs"], "top1": r["top1"]}
                        # (a prompt leaves room for one token: at L = max_model_len the check
                        # scores the text without its last token, and compares as many)
                        n = min(L, a.max_model_len - 1)
                        pl = prompt_logprobs(llm, texts[L][:n], a.ppl_tokens - (L - n))
                        row[f"prompt_logprobs_ppl@{L}"] = ppl(pl)
                        row[f"forced_ppl_same_tokens@{L}"] = ppl(r["logprobs"][:len(pl)])
                    ref = full.get(key_full)
                    if ref is not None:
                        row[f"dppl@{L}"] = row[f"ppl@{L}"] - ppl(ref["logprobs"])
                        row[f"top1@{L}"] = sum(x == y for x, y in zip(r["top1"], ref["top1"])) / len(r["top1"])
                rows.append(row)
                print("# row " + json.dumps({k: v for k, v in row.items() if k != "answers" and not k.startswith("ref@")}),
                      flush=True)
        llm.shutdown()
        del llm

    Ls = a.ppl_lengths
    print(f"\nSmolLM2-135M-Instruct {a.dtype} weights; passkey over lengths {a.lengths} x {len(depths)} depths; "
          f"perplexity on the last {a.ppl_tokens} tokens of {Ls}-token natural text; full cache = none / "
          f"{'auto, from ' + a.reference if a.reference else a.kv_cache_dtypes[0]}; {time.time() - t_start:.0f} s, load average {os.getloadavg()[0]:.2f}")
    head = ["KV dtype", "method", "budget", "passkey"] + [f"Δppl @{L}" for L in Ls] + [f"top-1 agree @{L}" for L in Ls] \
        + [f"KV bytes/seq @{L}" for L in Ls] + [f"decode tok/s @{L}" for L in Ls]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["kv_dtype"], r["method"], "full" if r["method"] == "none" else f"{r['budget']:.0%}",
                 f"{r['passkey']:.0%}"]
        cells += [f"{r[f'dppl@{L}']:+.3f}" if f"dppl@{L}" in r else "" for L in Ls]
        cells += [f"{r[f'top1@{L}']:.1%}" if f"top1@{L}" in r else "" for L in Ls]
        cells += [f"{r[f'kv_bytes@{L}'] / 2**20:.2f} MiB" for L in Ls]
        cells += [f"{r[f'tok_s@{L}']:.1f}" for L in Ls]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        for L in Ls:
            if f"prompt_logprobs_ppl@{L}" in r:
                print(f"full cache ppl @{L}: teacher-forced decode {r[f'forced_ppl_same_tokens@{L}']:.4f}, "
                      f"plain prompt_logprobs {r[f'prompt_logprobs_ppl@{L}']:.4f}")
    print("passkey by length: " + "; ".join(
        f"{r['kv_dtype']}/{r['method']}/{r['budget']:g}: " + ", ".join(f"{L}={v:.0%}" for L, v in r["passkey_by_length"].items())
        for r in rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.kvpress_python:
        compare_kvpress(a, cases, depths, kvserve_answers)


def compare_kvpress(a, cases, depths, kvserve_answers) -> None:
    """kvpress (its SnapKVPress / StreamingLLMPress on transformers' SmolLM2 from the same GGUF,
    float32) on the first ``--kvpress-cases`` passkey prompts of the shortest length: the context
    (everything before the question) is compressed at prefill to the same kept-token count as
    kvserve's budget (kvserve compresses the whole prompt, question included, so SnapKV's
    observation window differs: kvserve's last 32 prompt tokens are the question's, kvpress's are
    the context's last), then the question and answer are decoded on the compressed cache. The
    "none" rows (no press) show how far transformers-float32 and kvserve's own dtype already
    differ without compression."""
    import tempfile

    from transformers import AutoTokenizer

    from kvserve.worker.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    qlen = len(enc(QUESTION))
    L = min(a.lengths)
    chosen = [c for c in cases if c[0] == L][: a.kvpress_cases]
    spec = {"model_dir": str(path.parent), "gguf": path.name, "answer_tokens": a.answer_tokens, "cases": []}
    meta = []
    for method in ("none", "snapkv", "streaming_llm"):
        if method not in a.methods:
            continue
        for frac in ([1.0] if method == "none" else a.budgets):
            for (L_, d, key) in chosen:
                ids, _, _ = passkey_prompt(enc, min(L_, a.max_model_len - a.answer_tokens), d, key)
                spec["cases"].append({"method": method, "budget": max(64, int(frac * L_)),
                                      "context": ids[:-qlen], "question": ids[-qlen:]})
                meta.append((method, frac, L_, d, key))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    p = subprocess.run([a.kvpress_python, os.path.abspath(__file__), "--kvpress-worker", f.name],
                       capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("KVPRESS_JSON ")), None)
    if line is None:
        print(f"kvpress failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        return
    res = json.loads(line[len("KVPRESS_JSON "):])
    print("\nkvpress vs kvserve, passkey answers (kvserve auto KV dtype):")
    print("| method | budget | length | depth | key | kvpress answer | kvpress hit | kvpress context kept | kvserve answer | kvserve hit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (method, frac, L_, d, key), r in zip(meta, res):
        ans = tok.decode(r["tokens"])
        ks = kvserve_answers.get((a.kv_cache_dtypes[0], method, frac, L_, d), "")
        print(f"| {method} | {frac:.0%} | {L_} | {d:.2f} | {key} | {ans.strip()!r} | {str(key) in ans} | {r['kept']} | "
              f"{ks.strip()!r} | {str(key) in ks} |")


if __name__ == "__main__":
    main()
