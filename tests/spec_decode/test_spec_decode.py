"""Speculative decoding (n-gram proposer): greedy outputs token for token those of plain
decoding, under preemption, chunking, prefix caching and n > 1; sampled outputs distributed
exactly as the target's (chi-square against the distribution enumerated from the model's
logits); stop conditions inside an accepted run; rejected drafts never reach the prefix
cache; configuration errors name the field."""


import numpy as np
import pytest
import torch
from scipy import stats

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from workload import run_workload
from kvserve.spec_decode import NgramProposer, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# repetitive prompts (drafts get proposed and some accepted) and a plain one
PROMPTS = [
    [5, 6, 7, 8, 9] * 3 + [5, 6],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [100, 101, 100, 101, 100, 101, 100],
    [20, 21, 22, 23, 24, 25],
    [7, 7, 7, 7, 7, 7, 7, 7],
]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return {arch: str(tiny_model_dir(arch)[0]) for arch in ("llama", "qwen3", "gemma3")}


def _engine(folder, arch="llama", spec=NGRAM, **kw):
    args = dict(model=folder[arch], dtype="float32", device="cpu", num_blocks=512, block_size=4, max_model_len=128)
    args.update(kw)
    return LLMEngine(EngineArgs(speculative_config=spec, **args))


def _run(engine, prompts, params, check=True):
    """Run every prompt to the end, checking the KV invariants after each step; outputs in order."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert o.request_id not in final
            if o.finished:
                final[o.request_id] = o
        if check:
            engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    return [final[i] for i in ids]


def _summary(out):
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in out.outputs]


def _check_cached_kv(engine, scratch):
    """Every block in the prefix cache holds the K/V of the tokens its tree path names (a
    block with a rejected draft's K/V would differ), against a clean prefill on ``scratch``."""
    from tiny_models import prefill_logits

    cache = engine.kv.cache
    bs = engine.kv.block_size
    checked = 0
    for node in cache.iter_nodes():
        if not node.blocks:
            continue
        path, n = [], node
        while n is not None and n.tokens:
            path[:0] = list(n.tokens)
            n = n.parent
        prefill_logits(scratch, path)  # writes the path's K/V to slots 0..len-1 of scratch's pool
        first = len(path) // bs - len(node.blocks)
        for (k, v), (rk, rv) in zip(engine.kv_caches, scratch.engine.kv_caches):
            for i, b in enumerate(node.blocks):
                torch.testing.assert_close(k[b], rk[first + i], atol=2e-4, rtol=1e-3)
                torch.testing.assert_close(v[b], rv[first + i], atol=2e-4, rtol=1e-3)
        checked += 1
    return checked


# ------------------------------------------------------------------------ config
@pytest.mark.parametrize("cfg, msg", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"speculative_config\.method must be one of"),
    ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     r"speculative_config\.prompt_lookup_min \(3\) must be ≤ speculative_config\.prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     r"speculative_config\.prompt_lookup_max must be an integer in \[1, 64\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"unknown field\(s\) \['model'\]"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config\.model must be the draft model"),
    ('{"method": "ngram", ', r"speculative_config must be a JSON object"),
    ([1, 2], r"speculative_config must be an object"),
])
def test_bad_config_is_refused_naming_the_field(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        EngineArgs(speculative_config=cfg).check()


def test_config_accepts_dicts_and_json():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 1)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(NGRAM).prompt_lookup_max == 3


def test_cli_refuses_bad_config_naming_the_option(capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    err = capsys.readouterr().err
    assert rc != 0 and "--speculative-config.num_speculative_tokens must be an integer in [1, 16]" in err


# ---------------------------------------------------------------------- proposer
def _brute_force(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    L = len(seq)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for j in range(L - n - 1, -1, -1):  # most recent start first; a token must follow it
            if seq[j : j + n] == seq[L - n :]:
                return seq[j + n : j + n + k]
    return []


def test_ngram_proposer_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(400):
        L = int(rng.integers(1, 40))
        seq = rng.integers(0, int(rng.integers(2, 6)), size=L).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        prop = NgramProposer(k, lo, hi)
        got = prop.propose(np.array(seq, dtype=np.int64), max_drafts=k)
        assert got == _brute_force(seq, k, lo, hi), (seq, k, lo, hi)
    p = NgramProposer(4, 1, 3)
    assert p.propose(np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]), 4) == [7, 8, 1, 2]  # the most recent
    assert p.propose(np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]), 2) == [7, 8]  # capped
    assert p.propose(np.array([5, 6, 1, 9, 2, 1]), 4) == [9, 2, 1]  # longest n = 1 match, to the end
    assert p.propose(np.array([1, 2, 3]), 4) == []


# ------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_is_token_identical_and_drafts_are_accepted(folder, arch):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    base = _run(_engine(folder, arch, spec=None), PROMPTS, params)
    eng = _engine(folder, arch)
    outs = _run(eng, PROMPTS, params)
    for b, o in zip(base, outs):
        assert _summary(o) == _summary(b)
        for lb, lo in zip(b.outputs[0].token_logprobs, o.outputs[0].token_logprobs):
            assert lb.token_id == lo.token_id and lb.rank == lo.rank
            assert lo.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in lo.top] == [t for t, _ in lb.top]
        assert o.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
    s = eng.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0  # drafts were accepted ...
    assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]  # ... and some rejected
    assert s["spec_decode_acceptance_rate"] == s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"]
    assert s["spec_decode_mean_acceptance_length"] == 1 + s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_drafts"]
    assert s["generated_tokens"] == 40 * len(PROMPTS)
    # fewer steps than tokens: accepted drafts came for free
    assert s["spec_decode_num_drafts"] < s["generated_tokens"]


@pytest.mark.parametrize("case", ["preemption", "chunked_prefill", "prefix_cache", "n2"])
def test_greedy_identical_under_pressure(folder, case, tiny_model_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = PROMPTS
    kw = {}
    if case == "preemption":
        kw = dict(num_blocks=22, block_size=4, max_model_len=64)  # 5 x ~11 blocks: must preempt
    elif case == "chunked_prefill":
        kw = dict(max_num_batched_tokens=5)  # prompts chunked, drafts trimmed to the budget
    elif case == "n2":
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2)
    base_eng, eng = _engine(folder, spec=None), _engine(folder, **kw)
    rounds = [prompts]
    if case == "prefix_cache":  # then prompts that hit the blocks (prompt and output) the first left
        rounds.append([p + o.token_ids[:13] for p, o in zip(prompts, _run(base_eng, prompts, params))])
    for ps in rounds:
        base = _run(base_eng, ps, params)
        outs = _run(eng, ps, params)
        for b, o in zip(base, outs):
            assert _summary(o) == _summary(b)
    s = eng.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    if case == "preemption":
        assert s["num_preemptions"] > 0
    if case == "chunked_prefill":
        assert s["num_chunked_prefills"] > 0
    if case == "prefix_cache":
        assert s["prefix_cache_hits"] > 0
    scratch = LLM(str(tiny_model_dir("llama")[0]), dtype="float32", device="cpu", num_blocks=64, block_size=4,
                  max_model_len=128)
    assert _check_cached_kv(eng, scratch) > 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_rejected_drafts_never_reach_the_prefix_cache(folder, tiny_model_dir):
    """Blocks are cached after every step: a draft rejected in a block that the accepted
    tokens then fill must have been overwritten before the block is cached."""
    eng = _engine(folder, block_size=2, spec={**NGRAM, "num_speculative_tokens": 5})
    _run(eng, PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"] > 0
    scratch = LLM(str(tiny_model_dir("llama")[0]), dtype="float32", device="cpu", num_blocks=64, block_size=2,
                  max_model_len=128)
    assert _check_cached_kv(eng, scratch) > 10


def test_stop_conditions_inside_an_accepted_run(folder):
    """EOS, stop token ids, stop strings, max_tokens and min_tokens end a multi-token run
    exactly where decoding one token at a time ends."""
    base_eng, eng = _engine(folder, spec=None), _engine(folder)
    free = _run(base_eng, PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    cases = []
    for p, f in zip(PROMPTS, free):
        toks, text = f.token_ids, f.text
        cases += [
            (p, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[toks[9]])),
            (p, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[toks[9]], min_tokens=12)),
            (p, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[toks[9]],
                               include_stop_str_in_output=True)),
            (p, SamplingParams(max_tokens=40, temperature=0, stop=[text[len(text) // 3: len(text) // 3 + 2]])),
            (p, SamplingParams(max_tokens=40, temperature=0, stop=[text[len(text) // 3: len(text) // 3 + 2]],
                               include_stop_str_in_output=True, min_tokens=5)),
            (p, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)),
            (p, SamplingParams(max_tokens=40, temperature=0, min_tokens=30, stop=[text[-4:-2]])),
        ]
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    base = _run(base_eng, prompts, params)
    outs = _run(eng, prompts, params)
    reasons = set()
    for b, o in zip(base, outs):
        assert _summary(o) == _summary(b)
        reasons.add((b.finish_reason, type(b.outputs[0].stop_reason).__name__))
    assert {("stop", "int"), ("stop", "str"), ("length", "NoneType")} <= reasons
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_run_appended_at_once_ends_where_one_at_a_time_does(folder):
    """The engine's multi-token append (a verified run: the core's token checks, then the
    front end's detokenization and stop strings) against appending the same tokens one by
    one: same kept tokens, text, finish reason and stop reason, for stop strings (cut inside
    the run: the detokenizer's num_new_tokens_kept), stop token ids, EOS, min_tokens and
    max_tokens drawn at random."""
    from kvserve.core.request import TokenLogprob
    from kvserve.engine.core_output import EngineCoreOutput
    from kvserve.engine.output_processor import OutputProcessor

    eng = _engine(folder)
    core = eng.core
    rng = np.random.default_rng(0)
    tok = eng.tokenizer
    front = OutputProcessor(tok)
    cut = 0

    def lp(t):
        return TokenLogprob(t, -1.0, 1)

    def append(req, toks, last):
        """One step's append for ``req`` through the core and the front end (as LLMEngine.step)."""
        core._append_tokens(req, toks, [lp(t) for t in toks], 0.0)
        out = EngineCoreOutput(req.parent_id, [core._deltas.pop(req.request_id)], req.is_finished, req.metrics)
        processed = front.process_outputs([out])
        core.finish_samples(processed.finished_samples)
        last[req.request_id] = processed.request_outputs[0]

    for trial in range(300):
        run = rng.integers(3, 384, size=int(rng.integers(2, 7))).tolist()
        text = tok.decode(run)
        kw = dict(max_tokens=int(rng.integers(1, 12)), temperature=0)
        kw["min_tokens"] = int(rng.integers(0, kw["max_tokens"] + 1))
        if rng.random() < 0.7 and len(text) > 1:
            a = int(rng.integers(0, len(text) - 1))
            kw["stop"] = [text[a : a + int(rng.integers(1, 4))]]
            kw["include_stop_str_in_output"] = bool(rng.random() < 0.3)
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [int(rng.choice(run))]
        if rng.random() < 0.2:
            run[int(rng.integers(0, len(run)))] = 2  # EOS
        prefix = rng.integers(3, 384, size=int(rng.integers(0, 3))).tolist()  # tokens before the run
        reqs = []
        for _ in range(2):
            rid = core.add_request(eng.input_processor.process([5, 6, 7], SamplingParams(**kw)))
            front.add_request(rid, [5, 6, 7], None, core.groups[rid].params)
            reqs.append(core.groups[rid].seqs[0])
        a, b = reqs
        last: dict = {}
        for t in prefix:
            for r in (a, b):
                if not r.is_finished:
                    append(r, [t], last)
        if not a.is_finished:
            append(a, run, last)
        for t in run:
            if not b.is_finished:
                append(b, [t], last)
        assert a.is_finished == b.is_finished, (run, kw)
        oa, ob = last[a.request_id].outputs[0], last[b.request_id].outputs[0]
        assert (oa.token_ids, oa.text, oa.finish_reason, oa.stop_reason, oa.cumulative_logprob) == \
               (ob.token_ids, ob.text, ob.finish_reason, ob.stop_reason, ob.cumulative_logprob), (run, kw)
        cut += len(oa.token_ids) < len(prefix) + len(run) and isinstance(oa.stop_reason, str)
        for r in (a, b):
            core.abort_request(r.parent_id)
            front.abort_request(r.parent_id)
    assert cut > 20  # stop strings ended many runs early


def test_eos_inside_an_accepted_run(folder, tiny_model_dir):
    """A model whose greedy continuation of a repeated pattern is EOS (token 2 here, via a
    logit bias that makes EOS the argmax after token 9): the run stops at it."""
    params = [SamplingParams(max_tokens=40, temperature=0, logit_bias={2: 4.0}),
              SamplingParams(max_tokens=40, temperature=0, logit_bias={2: 3.0}, min_tokens=6)]
    base = _run(_engine(folder, spec=None), PROMPTS * 2, params * len(PROMPTS))
    outs = _run(_engine(folder), PROMPTS * 2, params * len(PROMPTS))
    assert any(b.finish_reason == "stop" for b in base)
    for b, o in zip(base, outs):
        assert _summary(o) == _summary(b)


def test_penalties_bans_and_bias_see_the_accepted_drafts(folder):
    """Row i of a verification applies penalties, bad words and min_tokens over the output
    followed by the first i drafts: greedy outputs stay identical."""
    ps = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=0.8),
        SamplingParams(max_tokens=30, temperature=0, min_tokens=20, logit_bias={2: 5.0}),
    ]
    base_eng = _engine(folder, spec=None)
    free = _run(base_eng, PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for p, f in zip(PROMPTS, free):  # ban a two-token phrase the model would otherwise emit
        ps.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, bad_words=[f.token_ids[5:7]]))
    prompts = [p for p in PROMPTS for _ in ps]
    params = [sp for _ in PROMPTS for sp in ps]
    base = _run(base_eng, prompts, params)
    eng = _engine(folder)
    outs = _run(eng, prompts, params)
    for b, o in zip(base, outs):
        assert _summary(o) == _summary(b)
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0


def test_beam_search_decodes_without_drafts(folder):
    params = SamplingParams(max_tokens=10, use_beam_search=True, beam_width=2, n=2, ignore_eos=True)
    base = _run(_engine(folder, spec=None), PROMPTS[:2], params)
    eng = _engine(folder)
    outs = _run(eng, PROMPTS[:2], params)
    assert [_summary(o) for o in outs] == [_summary(b) for b in base]
    assert eng.stats()["spec_decode_num_drafts"] == 0


# -------------------------------------------------------------- structured output
# (each has free text where a draft model that knows nothing of the grammar can be right, and
# fixed parts where its drafts are cut)
JSON_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"type": "string", "maxLength": 24},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"], "additionalProperties": False}
REGEX = r"[a-z ]{2,24}=(ab|cd){1,4}x"
CHOICE = ["the lazy dog", "the little girl", "the capital of France"]
LARK = r"""
start: "let " NAME " = " NUMBER ";"
NAME: /[a-z ]{1,16}/
NUMBER: /[0-9]{1,3}/
"""
LARK_RE = r"let [a-z ]{1,16} = [0-9]{1,3};"
# (spec, prompt text): prompts that hold text the outputs share, so n-gram drafts exist
GRAMMAR_CASES = {
    "json": (dict(json=JSON_SCHEMA, disable_any_whitespace=True),
             '{"id":12,"tag":"the fox","ok":true} {"id":7,"tag":"a dog","ok":false} {"id":'),
    "regex": (dict(regex=REGEX), "the fox=abcdx a dog=cdx the lazy dog=abab"),
    "choice": (dict(choice=CHOICE), "the lazy dog saw the little girl in the capital of France; the"),
    "grammar": (dict(grammar=LARK), "let a = 1; let the fox = 22; let x = 3; let"),
}


def _so(kind):
    from kvserve import StructuredOutputsParams

    return StructuredOutputsParams(**GRAMMAR_CASES[kind][0])


def _check_valid(kind, text):
    import json
    import re

    import jsonschema

    if kind == "json":
        jsonschema.validate(json.loads(text), JSON_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(LARK_RE, text), text


def _spy(eng):
    """Per request (group) id: [drafts verified, drafts accepted, drafts cut by the grammar]."""
    seen: dict = {}
    verify, fit = eng.core._apply_verification, eng.spec.fit_to_grammar

    def apply(req, res, now):
        c = seen.setdefault(eng._group_id(req), [0, 0, 0])
        c[0] += res.num_drafts
        c[1] += res.num_accepted
        return verify(req, res, now)

    def cut(req):
        before = len(req.spec_token_ids)
        fit(req)
        seen.setdefault(eng._group_id(req), [0, 0, 0])[2] += before - len(req.spec_token_ids)

    eng.core._apply_verification, eng.spec.fit_to_grammar = apply, cut
    return seen


SPEC_CASES = [("ngram", 2), ("ngram", 3), ("ngram", 4), ("same", 2), ("same", 4), ("noisy", 3)]


def _spec(method, k, drafts):
    if method == "ngram":
        return {**NGRAM, "num_speculative_tokens": k}
    return _draft(drafts[method], k)


@pytest.mark.parametrize("method, k", SPEC_CASES)
def test_structured_output_greedy_with_drafts_is_token_identical(folder, drafts, method, k):
    """Greedy float32 requests under a JSON schema, a regex, a choice and a Lark grammar, with
    drafts (n-gram or a draft model that knows nothing of the grammar): the tokens of plain
    grammar decoding; every request verified drafts, some were accepted, some rejected and
    some cut before verification because the grammar rejects them; the outputs are valid."""
    kinds = sorted(GRAMMAR_CASES)
    base_eng = _engine(folder, spec=None)
    prompts = [base_eng.encode(GRAMMAR_CASES[kind][1]) for kind in kinds]
    params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=_so(kind), logprobs=1) for kind in kinds]
    base = _run(base_eng, prompts, params)
    eng = _engine(folder, spec=_spec(method, k, drafts))
    seen = _spy(eng)
    outs = _run(eng, prompts, params)
    for kind, b, o in zip(kinds, base, outs):
        assert _summary(o) == _summary(b), kind
        assert o.outputs[0].finish_reason == "stop"
        _check_valid(kind, o.outputs[0].text)
        assert [lp.logprob for lp in o.outputs[0].token_logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].token_logprobs], abs=1e-4)
    counts = dict(zip(kinds, (seen.get(o.request_id, [0, 0, 0]) for o in outs)))
    s = eng.stats()
    assert s["spec_decode_num_grammar_cut_tokens"] == sum(c[2] for c in counts.values()) > 0
    assert s["spec_decode_num_draft_tokens"] == sum(c[0] for c in counts.values()) > 0
    if method == "ngram":  # every request verified drafts, had some accepted, some rejected
        assert all(c[0] > 0 for c in counts.values()), counts
        assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
        assert sum(c[1] > 0 for c in counts.values()) >= 3, counts
        # fewer verification steps than tokens: accepted drafts came for free
        assert s["spec_decode_num_drafts"] < s["generated_tokens"]
    elif method == "same":
        # the target as its own (unconstrained) draft: a draft the grammar allows is the masked
        # argmax too, so every draft left after the cut is accepted (the JSON string's free text)
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0
        assert counts["json"][1] > 0
        assert all(c[2] > 0 for c in counts.values()), counts  # its free argmax breaks every grammar somewhere


def test_structured_output_mixed_batch_n_and_preemption(folder, drafts):
    """Constrained (greedy, n = 2) and free requests in one batch, some speculating, in a pool
    that preempts: every output is that of plain decoding, and the constrained ones are valid."""
    kinds = sorted(GRAMMAR_CASES)
    base_eng = _engine(folder, spec=None)
    prompts, params = [], []
    for kind in kinds:
        prompts.append(base_eng.encode(GRAMMAR_CASES[kind][1]))
        params.append(SamplingParams(max_tokens=60, temperature=0, n=2, structured_outputs=_so(kind)))
    for p in PROMPTS[:3]:
        prompts.append(p)
        params.append(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    base = _run(base_eng, prompts, params)
    for spec in (_spec("ngram", 3, drafts), _spec("noisy", 3, drafts)):
        eng = _engine(folder, spec=spec, num_blocks=40)  # tight: preempts
        seen = _spy(eng)
        outs = _run(eng, prompts, params)
        assert [_summary(o) for o in outs] == [_summary(b) for b in base]
        for kind, o in zip(kinds, outs):
            assert len(o.outputs) == 2
            for c in o.outputs:
                _check_valid(kind, c.text)
        assert eng.scheduler.num_preemptions > 0
        assert eng.stats()["spec_decode_num_accepted_tokens"] > 0
        assert sum(c[0] for c in seen.values()) > 0


def test_grammar_completing_inside_accepted_drafts_stops_there(folder):
    """A grammar completed by an accepted draft ends the request at that token ("stop", no EOS),
    with the verification's later tokens dropped, as in plain decoding."""
    from kvserve import StructuredOutputsParams

    eng0 = _engine(folder, spec=None)
    # (the prompt repeats the grammar's only output: the drafts are its tokens and what follows)
    prompt = eng0.encode("pay the fox. pay the fox. pay the fox. pay")
    so = StructuredOutputsParams(regex="pay the fox")
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=so)
    base = _run(eng0, [prompt], params)[0]
    eng = _engine(folder, spec={**NGRAM, "num_speculative_tokens": 4})
    ended_inside = []
    apply = eng._apply_verification

    def spy(req, res, now):
        n0 = len(req.output_token_ids)
        apply(req, res, now)
        ended_inside.append(req.is_finished and len(req.output_token_ids) - n0 < len(res.token_ids))

    eng.core._apply_verification = spy
    out = _run(eng, [prompt], params)[0]
    assert _summary(out) == _summary(base)
    assert out.outputs[0].text == "pay the fox" and out.outputs[0].finish_reason == "stop"
    assert not set(eng.eos_token_ids) & set(out.outputs[0].token_ids)
    assert ended_inside and ended_inside[-1]  # the last verification ran past the grammar's end


def test_speculative_bitmask_rows_are_the_states_after_each_draft(folder):
    """Row i of a request is the mask of a fresh matcher that consumed its first i drafts; rows
    after a draft the grammar rejects are all-ones; the matchers come back unchanged."""
    import torch

    from kvserve.structured_output.manager import grammar_bitmask, speculative_bitmask

    eng = _engine(folder, spec=None)
    so = eng.structured_output
    enc = lambda t: eng.encode(t)  # noqa: E731
    g1 = so.new_grammar(_so("regex"))
    g2 = so.new_grammar(_so("json"))
    g3 = so.new_grammar(_so("choice"))
    g2.accept_token(enc("{")[0])  # a grammar part-way through its output
    d1 = enc("abcdab")
    d2 = enc('"id":5')
    d3 = enc("the lazy") + enc("!")  # the last draft is rejected
    n3 = g3.valid_prefix(d3)
    assert g1.valid_prefix(d1) == len(d1) and g2.valid_prefix(d2) == len(d2) and n3 == len(d3) - 1
    before = grammar_bitmask([g1, g2, g3])
    mask = speculative_bitmask([g1, g2, g3], [d1, d2, d3], [len(d1), len(d2), n3])
    assert mask.shape == (len(d1) + len(d2) + len(d3) + 3, before.shape[1]) and mask.dtype == torch.int32
    assert torch.equal(grammar_bitmask([g1, g2, g3]), before)  # rolled back
    row = 0
    for g, d, n in ((g1, d1, len(d1)), (g2, d2, len(d2)), (g3, d3, n3)):
        for i in range(len(d) + 1):
            if i <= n:
                fresh = so.new_grammar(_so("regex" if g is g1 else "json" if g is g2 else "choice"))
                if g is g2:
                    fresh.accept_token(enc("{")[0])
                for t in d[:i]:
                    fresh.accept_token(t)
                assert torch.equal(mask[row], grammar_bitmask([fresh])[0]), (i, d)
            else:
                assert bool((mask[row] == -1).all())
            row += 1
    assert len({tuple(r) for r in mask.tolist()}) > 8  # (the states differ)


def test_structured_output_draft_model_keeps_a_rejected_sample_and_cuts_one_hot_drafts(folder, drafts):
    """The grammar cut: one-hot drafts (greedy draft model) stop before the first draft the grammar
    rejects; a sampled draft-model request keeps it as its last draft (rejected for sure)."""
    from kvserve import StructuredOutputsParams
    from kvserve.core.request import Request

    eng = _engine(folder)
    so = eng.structured_output
    ids = eng.encode("abcdab")
    for q, keep in ((None, 2), (torch.full((4, 384), 1 / 384), 3)):
        req = Request(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(), seed=0)
        req.grammar = so.new_grammar(StructuredOutputsParams(regex="(ab|cd){2,5}x"))
        req.spec_token_ids, req.spec_draft_probs = ids[:2] + [90, 90], q
        eng.spec.fit_to_grammar(req)  # after one "ab" the regex wants another pair, not "x"
        assert req.spec_token_ids == (ids[:2] + [90, 90])[:keep]
        assert (req.spec_draft_probs is None) == (q is None)
        if q is not None:
            assert tuple(req.spec_draft_probs.shape) == (keep, 384)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_greedy_identical_on_an_8bit_kv_cache(folder, kv_cache_dtype):
    """Verification reads drafts' K/V back from an 8-bit pool as decoding does: token-identical."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = _run(_engine(folder, spec=None, kv_cache_dtype=kv_cache_dtype), PROMPTS, params)
    eng = _engine(folder, kv_cache_dtype=kv_cache_dtype)
    outs = _run(eng, PROMPTS, params)
    assert [_summary(o) for o in outs] == [_summary(b) for b in base]
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_does_not_depend_on_batch_mates(folder):
    eng = _engine(folder)
    sp = SamplingParams(max_tokens=30, temperature=0.7, seed=5, allowed_token_ids=[5, 6, 7, 8, 9])
    alone = _run(eng, [PROMPTS[0]], sp)[0]
    mixed = _run(eng, PROMPTS, [sp] + [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(4)])[0]
    assert _summary(alone) == _summary(mixed)
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0


# ------------------------------------------------------------ sampling exactness
A, B, C, D = 40, 41, 42, 43
PROMPT = [A, B, C, A, B, C, A, B]  # n-gram drafts exist after A, B or C


def _exact_distribution(model, params, num_tokens, prompt=None):
    """P(first num_tokens tokens) enumerated from the transformers model's logits: allowed
    ids, temperature, top-k, as kvserve's sampler defines them."""
    prompt = PROMPT if prompt is None else prompt
    allowed = params.allowed_token_ids
    probs = {}

    def dist(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
        x = logits[allowed] / params.temperature
        p = torch.softmax(x, 0)
        if params.top_k > 0:
            kth = p.sort(descending=True).values[params.top_k - 1]
            p = torch.where(p >= kth, p, 0.0)
            p = p / p.sum()
        return p.tolist()

    def walk(prefix, prob):
        if len(prefix) == num_tokens:
            probs[tuple(prefix)] = prob
            return
        for t, q in zip(allowed, dist(prefix)):
            if q > 0:
                walk(prefix + [t], prob * q)

    walk([], 1.0)
    return probs


def _chi_square(counts: dict, probs: dict, n: int) -> float:
    cells = sorted(probs, key=probs.get, reverse=True)
    obs, exp = [], []
    rest_o = rest_e = 0.0
    for c in cells:
        if probs[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(probs[c] * n)
        else:
            rest_o += counts.get(c, 0)
            rest_e += probs[c] * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    assert sum(obs) == n  # nothing outside the support
    return stats.chisquare(obs, exp).pvalue


def _sample_counts(eng, base, n, prompt=None):
    """n samples of PROMPT (16 requests of n / 16 samples, one seed each) → token tuple → count."""
    outs = _run(eng, [PROMPT if prompt is None else prompt] * 16, [SamplingParams(**{**_fields(base), "seed": s, "n": n // 16}) for s in range(16)],
                check=False)
    counts: dict = {}
    for o in (c for out in outs for c in out.outputs):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.6, 3)])
def test_sampling_matches_the_exact_distribution(folder, tiny_model_dir, temperature, top_k):
    """The first 3 tokens of 2000 seeded samples with n-gram speculation (drafts proposed,
    accepted and rejected) against their exact distribution: chi-square p-value > 1e-3
    (deterministic: the seeds are fixed)."""
    n = 2000
    model = tiny_model_dir("llama")[1]
    base = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True,
                          allowed_token_ids=[A, B, C, D])
    probs = _exact_distribution(model, base, 3)
    eng = _engine(folder, num_blocks=4096, max_num_seqs=512, max_num_batched_tokens=8192,
                  spec={**NGRAM, "num_speculative_tokens": 2})
    # 16 requests of n = 125 samples: each prompt is computed once, each sample has its own seed
    counts = _sample_counts(eng, base, n)
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] > 0.5 * n  # most samples verified a draft
    assert 0.1 < s["spec_decode_acceptance_rate"] < 0.9  # both accepted and rejected often
    assert _chi_square(counts, probs, n) > 1e-3


def _fields(params):
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "extra"}


def test_rejection_sampler_against_exact_distribution_directly():
    """The verification step alone, vectorized over 4000 requests with one draft each (drawn
    from q, or fixed for a one-hot proposer), a known target p: the first emitted token is
    distributed as p, and after an accepted draft the bonus token as the next position's p."""
    from kvserve.sample.sampler import SamplingMetadata, SamplingRow
    from kvserve.spec_decode import DraftBatch, rejection_sample

    V, n = 6, 4000
    torch.manual_seed(0)
    logits = torch.randn(2, V)  # position 0 (verifies the draft), position 1 (bonus)
    p = torch.softmax(logits.double(), 1)
    q = torch.softmax(torch.randn(V).double() * 2, 0)
    sp = SamplingParams(temperature=1.0)
    for one_hot in (True, False):
        drafts = [3] * n if one_hot else torch.multinomial(q, n, replacement=True,
                                                           generator=torch.Generator().manual_seed(1)).tolist()
        rows = [SamplingRow(sp, [1], [] if i == 0 else [d], seed, None) for seed, d in enumerate(drafts) for i in range(2)]
        meta = SamplingMetadata.build(rows, V, "cpu")
        out = rejection_sample(logits.repeat(n, 1), meta, DraftBatch(
            [1] * n, [[d] for d in drafts], [None if one_hot else q.float().unsqueeze(0)] * n, list(range(n)), [0] * n))
        first = np.bincount([t[0] for t in out.token_ids], minlength=V)
        assert stats.chisquare(first, p[0].numpy() * n).pvalue > 1e-3, (one_hot, first, p[0] * n)
        bonus = np.bincount([t[1] for t in out.token_ids if len(t) == 2], minlength=V)
        assert 0 < bonus.sum() < n  # accepted and rejected drafts
        assert stats.chisquare(bonus, p[1].numpy() * bonus.sum()).pvalue > 1e-3
        assert out.num_accepted == [len(t) - 1 for t in out.token_ids]


def test_rejection_sampler_under_a_grammar_mask():
    """As above with a grammar bitmask per verified position (position 0 allows {0, 1, 2, 4},
    the bonus position {1, 3, 5}) and drafts drawn from a q that puts mass on forbidden tokens:
    a forbidden draft is never accepted, the first token follows p masked at position 0 and the
    bonus token p masked at position 1 (chi-square), nothing outside a mask is emitted."""
    from kvserve.sample.sampler import SamplingMetadata, SamplingRow
    from kvserve.spec_decode import DraftBatch, rejection_sample

    V, n = 6, 4000
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    allowed = [[0, 1, 2, 4], [1, 3, 5]]
    masked = torch.full((2, V), float("-inf"), dtype=torch.float64)
    for i, a in enumerate(allowed):
        masked[i, a] = logits[i, a].double()
    p = torch.softmax(masked, 1)
    q = torch.softmax(torch.randn(V).double() * 2, 0)
    bits = torch.tensor([sum(1 << t for t in a) for a in allowed], dtype=torch.int32).unsqueeze(1)  # [2, W = 1]
    sp = SamplingParams(temperature=1.0)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(3)).tolist()
    assert sum(d not in allowed[0] for d in drafts) > 0.1 * n  # (q often proposes what the grammar forbids)
    rows = [SamplingRow(sp, [1], [] if i == 0 else [d], seed, None) for seed, d in enumerate(drafts) for i in range(2)]
    meta = SamplingMetadata.build(rows, V, "cpu", list(range(2 * n)), bits.repeat(n, 1))
    out = rejection_sample(logits.repeat(n, 1), meta, DraftBatch(
        [1] * n, [[d] for d in drafts], [q.float().unsqueeze(0)] * n, list(range(n)), [0] * n))
    for d, t in zip(drafts, out.token_ids):
        assert t[0] in allowed[0] and (len(t) == 1 or t[1] in allowed[1])
        if d not in allowed[0]:
            assert len(t) == 1  # rejected
    first = np.bincount([t[0] for t in out.token_ids], minlength=V)
    keep = p[0].numpy() > 0
    assert stats.chisquare(first[keep], p[0].numpy()[keep] * n).pvalue > 1e-3, (first, p[0] * n)
    bonus = np.bincount([t[1] for t in out.token_ids if len(t) == 2], minlength=V)
    keep = p[1].numpy() > 0
    assert 0 < bonus.sum() < n
    assert stats.chisquare(bonus[keep], p[1].numpy()[keep] * bonus.sum()).pvalue > 1e-3


# ------------------------------------------------------------------- randomized
def test_randomized_workloads_with_speculation(folder):
    """Hypothesis workloads (tight pools, small budgets, shared prefixes, aborts, n > 1,
    beams) with n-gram speculation: invariants after every step, every request finishes once,
    greedy ones with their output alone on a roomy engine without speculation."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    solo = _engine(folder, spec=None, max_model_len=64)
    cache = {}

    def alone(prompt, params):
        key = (prompt, repr(params))
        if key not in cache:
            cache[key] = _summary(_run(solo, [list(prompt)], params, check=False)[0])
        return cache[key]

    pattern = st.lists(st.integers(3, 12), min_size=2, max_size=4)

    @st.composite
    def workloads(draw):
        block_size = draw(st.sampled_from([1, 2, 4]))
        reqs = []
        for _ in range(draw(st.integers(1, 6))):
            prompt = draw(pattern) * draw(st.integers(1, 4)) + draw(st.lists(st.integers(3, 383), max_size=6))
            max_tokens = draw(st.integers(1, 20))
            kind = draw(st.sampled_from(["greedy", "greedy", "seeded", "samples", "beam"]))
            if kind == "greedy":
                sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=draw(st.booleans()))
            elif kind == "seeded":
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=draw(st.integers(0, 9)))
            elif kind == "samples":
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, n=2)
            else:
                sp = SamplingParams(max_tokens=max_tokens, use_beam_search=True, beam_width=2, ignore_eos=True)
            reqs.append(dict(prompt=tuple(prompt), params=sp, arrive=draw(st.integers(0, 6)),
                             abort=draw(st.sampled_from([None] * 4 + [2]))))
        need = max(-(-(len(r["prompt"]) + r["params"].max_tokens) // block_size)
                   * (2 if r["params"].use_beam_search else 1) for r in reqs)
        return dict(block_size=block_size, num_blocks=need + draw(st.sampled_from([0, 1, 3, 16])),
                    budget=draw(st.sampled_from([1, 3, 8, 64])), seqs=draw(st.sampled_from([2, 16])),
                    prefix=draw(st.booleans()), k=draw(st.integers(1, 5)), reqs=reqs)

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(w=workloads())
    def check(w):
        eng = _engine(folder, spec={**NGRAM, "num_speculative_tokens": w["k"]}, num_blocks=w["num_blocks"],
                      block_size=w["block_size"], max_model_len=64, max_num_batched_tokens=w["budget"],
                      max_num_seqs=w["seqs"], enable_prefix_caching=w["prefix"])
        ids, final = run_workload(eng, w["reqs"], 2000)
        for rid, out in final.items():
            if out == "aborted":
                continue
            r = ids[rid]
            assert out.error is None
            n_out = [len(o.token_ids) for o in out.outputs]
            assert all(1 <= m <= r["params"].max_tokens for m in n_out)
            if r["params"].temperature == 0 and not r["params"].use_beam_search:
                assert _summary(out) == alone(r["prompt"], r["params"]), rid
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        assert not eng.groups

    check()


# ------------------------------------------------------------------ draft model
@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """Draft models for the tiny llama target: its own weights with noise (agrees often, not
    always), a tiny qwen3 (same vocabulary, another model), and one with another vocabulary."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    target = tiny_model_dir("llama")[0]
    root = tmp_path_factory.mktemp("drafts")
    noisy = root / "noisy"
    shutil.copytree(target, noisy)
    w = load_file(str(noisy / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({k: (v + 0.04 * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v).contiguous()
               for k, v in w.items()}, str(noisy / "model.safetensors"), metadata={"format": "pt"})
    other_vocab = root / "vocab"
    shutil.copytree(target, other_vocab)
    cfg = json.loads((other_vocab / "config.json").read_text())
    cfg["vocab_size"] = 400
    (other_vocab / "config.json").write_text(json.dumps(cfg))
    short = root / "short"
    shutil.copytree(target, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    return dict(noisy=str(noisy), qwen3=str(tiny_model_dir("qwen3")[0]), vocab=str(other_vocab),
                short=str(short), same=str(target))


def _draft(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def test_draft_model_config_errors(folder, drafts, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft model path .* does not exist"):
        EngineArgs(speculative_config=_draft(str(tmp_path / "missing"))).check()
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft model's vocabulary has 400 tokens, "
                                         r"the target's 384"):
        _engine(folder, spec=_draft(drafts["vocab"]))
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft model's context \(64 tokens\) is "
                                         r"shorter than max_model_len \(128\)"):
        _engine(folder, spec=_draft(drafts["short"]))
    (tmp_path / "empty").mkdir()
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    for bad, why in ((tmp_path / "empty", "has no config.json"), (not_a_model, "is neither a .gguf file")):
        with pytest.raises(ValueError, match=rf"speculative_config\.model: .*{why}"):
            _engine(folder, spec=_draft(str(bad)))


@pytest.mark.parametrize("draft, k", [("noisy", 3), ("qwen3", 2), ("same", 4)])
def test_draft_model_greedy_is_token_identical(folder, drafts, draft, k):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [p + [3, 4] for p in PROMPTS]
    base = _run(_engine(folder, spec=None), prompts, params)
    eng = _engine(folder, spec=_draft(drafts[draft], k), num_blocks=60)  # tight: preempts
    outs = _run(eng, prompts, params)
    for b, o in zip(base, outs):
        assert _summary(o) == _summary(b)
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] > 0
    if draft == "same":  # the target as its own draft: every draft accepted
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    if draft == "noisy":
        assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    prop = eng.proposer
    assert not prop._shadows and prop.kv.num_free_blocks == prop.kv.num_blocks  # draft KV freed at the end


def test_draft_model_sampling_matches_the_exact_distribution(folder, drafts, tiny_model_dir):
    """As the n-gram test (1200 samples, temperature 0.8), with the noisy draft model: drafts
    drawn from its q, accepted with min(1, p/q), residual max(p - q, 0) on rejection."""
    n, temperature, top_k = 1200, 0.8, 0
    model = tiny_model_dir("llama")[1]
    base = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True,
                          allowed_token_ids=[A, B, C, D])
    probs = _exact_distribution(model, base, 3)
    eng = _engine(folder, num_blocks=4096, max_num_seqs=512, max_num_batched_tokens=8192,
                  spec=_draft(drafts["noisy"], 2))
    counts = _sample_counts(eng, base, n)
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] >= n  # (k = 2, max_tokens = 3: one draft after the first token)
    assert 0.1 < s["spec_decode_acceptance_rate"] < 0.95
    assert _chi_square(counts, probs, n) > 1e-3


LETTERS = [68, 77, 88, 92]  # "b", "k", "v", "z": one token each, no merged token of them in the vocabulary
# n-gram drafts after "b k" are digits (the grammar rejects them: cut), after one letter letters
LETTER_PROMPT = [68, 77, 19, 88, 92, 68, 77, 20, 92, 88, 68, 77]


@pytest.mark.parametrize("method", ["ngram", "noisy"])
def test_structured_output_sampling_matches_the_masked_distribution(folder, drafts, tiny_model_dir, method):
    """Seeded samples of regex [bkvz]{3} (temperature 0.8) with drafts, against the exact
    distribution: the model's softmax renormalized over the grammar's tokens at each position,
    enumerated from the transformers model. N-gram drafts the grammar rejects are cut; the
    noisy draft model's drafts, drawn from its q over the whole vocabulary, are mostly outside
    the grammar: each such draft is rejected and the correction drawn from max(p - q, 0)."""
    from kvserve import StructuredOutputsParams
    from kvserve.sample.sampler import unpack_bitmask
    from kvserve.structured_output.manager import grammar_bitmask

    n = 2000 if method == "ngram" else 1200
    model = tiny_model_dir("llama")[1]
    so = StructuredOutputsParams(regex="[bkvz]{3}")
    probs = _exact_distribution(model, SamplingParams(max_tokens=3, temperature=0.8, allowed_token_ids=LETTERS), 3,
                                LETTER_PROMPT)
    eng = _engine(folder, num_blocks=4096, max_num_seqs=512, max_num_batched_tokens=8192,
                  spec={**NGRAM, "num_speculative_tokens": 2} if method == "ngram" else _draft(drafts["noisy"], 2))
    g = eng.structured_output.new_grammar(so)
    for t in [None, 68, 92]:  # (the premise: the grammar allows exactly LETTERS until its third token)
        if t is not None:
            g.accept_token(t)
        assert unpack_bitmask(grammar_bitmask([g]), 384)[0].nonzero().squeeze(1).tolist() == LETTERS
    counts = _sample_counts(eng, SamplingParams(max_tokens=10, temperature=0.8, structured_outputs=so), n,
                            LETTER_PROMPT)
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] > 0.4 * n
    assert s["spec_decode_num_accepted_tokens"] > 0.02 * n
    assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    if method == "ngram":
        assert s["spec_decode_num_grammar_cut_tokens"] > 0.1 * n
    else:  # most draft-model samples fall outside the grammar: verified, and rejected
        assert s["spec_decode_acceptance_rate"] < 0.5
    assert _chi_square(counts, probs, n) > 1e-3


# ----------------------------------------------------------------------- server
def test_server_serves_speculative_greedy_and_exports_the_counters(folder):
    """Over HTTP with n-gram speculation: the greedy completion equals offline plain decoding,
    and /metrics has kvserve:spec_decode_num_draft_tokens / ..._num_accepted_tokens."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_helpers import ServerThread

    offline = _run(_engine(folder, spec=None), [PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0,
                                                                          ignore_eos=True))[0]
    with ServerThread(_engine(folder), names=["tiny"]) as server:
        r = httpx.post(server.base_url + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline.text
        text = httpx.get(server.base_url + "/metrics").text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["kvserve:spec_decode_num_draft_tokens_total"] > values["kvserve:spec_decode_num_accepted_tokens_total"] > 0
    assert values["kvserve:spec_decode_num_drafts_total"] > 0


def test_server_speculates_under_structured_outputs_and_exports_the_grammar_cuts(folder):
    """Over HTTP with n-gram speculation, vLLM's ``structured_outputs`` (JSON schema, regex,
    choice, Lark) give offline plain grammar decoding's text; /metrics counts the drafts the
    grammars cut (kvserve:spec_decode_num_grammar_cut_tokens), as the engine's stats do."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_helpers import ServerThread

    kinds = sorted(GRAMMAR_CASES)
    base_eng = _engine(folder, spec=None)
    prompts = [base_eng.encode(GRAMMAR_CASES[kind][1]) for kind in kinds]
    offline = _run(base_eng, prompts, [SamplingParams(max_tokens=60, temperature=0, structured_outputs=_so(kind))
                                       for kind in kinds])
    eng = _engine(folder)
    with ServerThread(eng, names=["tiny"]) as server:
        for kind, prompt, want in zip(kinds, prompts, offline):
            r = httpx.post(server.base_url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0,
                "structured_outputs": GRAMMAR_CASES[kind][0]}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.outputs[0].text, kind
            _check_valid(kind, want.outputs[0].text)
        text = httpx.get(server.base_url + "/metrics").text
        cuts = server.engine_call(lambda e: e.stats()["spec_decode_num_grammar_cut_tokens"])
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["kvserve:spec_decode_num_grammar_cut_tokens_total"] == cuts > 0
    assert values["kvserve:spec_decode_num_accepted_tokens_total"] > 0


# ---------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_fp32_greedy_with_ngram_speculation(llm_fp32, reference):
    """SmolLM2-135M float32 with n-gram speculation (k = 4): the reference cases give
    transformers' greedy tokens, and a chat prompt that invites repetition (rewrite a list)
    gives plain decoding's tokens, with many drafts accepted."""
    from reference_cases import reference_params as _params

    from kvserve.engine.tokenizer import apply_chat_template

    spec = LLM(dtype="float32", max_model_len=1024, kv_cache_memory=0.25,  # (5.8k tokens: the memory is shared)
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    cases = reference["cases"]
    outs = spec.generate([c["prompt_ids"] for c in cases], [_params(c) for c in cases])
    for c, o in zip(cases, outs):
        assert o.token_ids == c["greedy_ids"], c.get("prompt", c.get("messages"))
    msgs = [{"role": "user", "content": "Repeat this list exactly, one item per line: red apples, green pears, "
                                        "yellow bananas, red cherries, green grapes, yellow lemons"}]
    ids = apply_chat_template(spec.tokenizer, msgs)
    params = SamplingParams(max_tokens=96, temperature=0)
    want = llm_fp32.generate([ids], params)[0]
    before = spec.engine.stats()
    got = spec.generate([ids], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    s = {k: v - before[k] for k, v in spec.engine.stats().items() if k.endswith("_tokens") and k.startswith("spec")}
    assert s["spec_decode_num_accepted_tokens"] > 0.3 * s["spec_decode_num_draft_tokens"] > 0, s
