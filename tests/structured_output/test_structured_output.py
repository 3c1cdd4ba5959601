"""Structured output (JSON schema, regex, choice, grammar) on a tiny random-weight model, whose
unconstrained output is garbage: every constrained output must still be valid. Also the
sampler's bitmask step, the exactness of the masked distribution (chi-square against the
renormalized softmax of the model's own logits), batches mixing constrained and free
requests, preemption, and every bad input. The SmolLM2 case is at the end (slow)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from scipy import stats
from tiny_models import VOCAB, make_tokenizer, prefill_logits

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.entrypoints.llm import GenerationError
from kvserve.sample.sampler import Sampler, SamplingMetadata, SamplingRow, unpack_bitmask
from kvserve.structured_output.manager import StructuredOutputManager

PROMPT = "The quick brown fox"
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")[0]), dtype="float32", num_blocks=1024, block_size=4,
               max_model_len=512)


def _params(so: StructuredOutputsParams, **kw) -> list[SamplingParams]:
    """Greedy, then temperature 1 with each of SEEDS."""
    kw.setdefault("max_tokens", 256)
    return [SamplingParams(temperature=0, structured_outputs=so, **kw)] + [
        SamplingParams(temperature=1.0, seed=s, structured_outputs=so, **kw) for s in SEEDS]


def _texts(llm, so, **kw) -> list[str]:
    params = _params(so, **kw)
    outs = llm.generate([PROMPT] * len(params), params)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", (o.outputs[0].text, o.outputs[0].finish_reason)
    return [o.outputs[0].text for o in outs]


# ------------------------------------------------------------------- JSON schema
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "name": {"type": "string", "maxLength": 6}},
            "required": ["id", "name"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "int_ranges": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "y": {"type": "integer", "minimum": 1000, "maximum": 1010},
        "z": {"type": "integer", "exclusiveMinimum": 0, "maximum": 3}},
        "required": ["x", "y", "z"], "additionalProperties": False},
    "optional_and_null": {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 5},
        "level": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["ok", "note"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"enum": [1, 2, "three", None]}, "minItems": 1, "maxItems": 4},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    for text in _texts(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True)):
        value = json.loads(text)
        jsonschema.validate(value, schema)
        # compact: exactly the JSON text with no whitespace between tokens
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_json_schema_as_text_and_flexible_whitespace(llm):
    """By default whitespace is free between JSON tokens (this model pads with it, sometimes up to
    max_tokens); the outputs that end validate."""
    schema = SCHEMAS["enums"]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, _params(StructuredOutputsParams(json=json.dumps(schema)),
                                                                     max_tokens=100))]
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert done and all(o.finish_reason in ("stop", "length") for o in outs)
    for text in done:
        jsonschema.validate(json.loads(text), schema)
    assert any(re.search(r"\s", o.text) for o in outs)


def test_json_object_mode(llm):
    outs = llm.generate([PROMPT] * 4, _params(StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                                                max_tokens=100))
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done  # (long random strings can run to max_tokens)
    for text in done:
        assert isinstance(json.loads(text), dict)


def test_unconstrained_output_is_not_json(llm):
    """The premise: without the constraint this model writes garbage."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]
    with pytest.raises(ValueError):
        json.loads(out.outputs[0].text)


# ------------------------------------------------------------ regex, choice, grammar
@pytest.mark.parametrize("pattern", [
    r"[a-z]{2,5}-[0-9]{3}",
    r"(yes|no), because [a-z ]{1,10}\.",
    r"[A-Z][a-z]{0,6}@[a-z]{1,5}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
])
def test_regex_outputs_fullmatch(llm, pattern):
    for text in _texts(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_members(llm):
    choices = ["Paris", "Berlin", "the lazy dog", "42", "é"]
    texts = _texts(llm, StructuredOutputsParams(choice=choices))
    assert all(t in choices for t in texts), texts


LARK = r"""
start: "let " NAME " = " value ";"
value: NUMBER | "[" NUMBER ("," NUMBER)? "]"
NAME: /[a-z]{1,6}/
NUMBER: /[0-9]{1,3}/
"""
LARK_RE = r"let [a-z]{1,6} = ([0-9]{1,3}|\[[0-9]{1,3}(,[0-9]{1,3})?\]);"


def test_lark_grammar_outputs_parse(llm):
    for text in _texts(llm, StructuredOutputsParams(grammar=LARK)):
        assert re.fullmatch(LARK_RE, text), text


def test_gbnf_grammar_is_accepted(llm):
    for text in _texts(llm, StructuredOutputsParams(grammar='root ::= "id-" [0-9] [0-9] ("!" | "?")')):
        assert re.fullmatch(r"id-[0-9]{2}[!?]", text), text


def test_bfloat16_greedy_skips_the_fused_greedy_path(tiny_model_dir):
    """bf16 greedy batches without edits take the fused argmax (cpu_ops.greedy_sample); a grammar must
    keep them off it."""
    llm = LLM(model=str(tiny_model_dir("llama")[0]), dtype="bfloat16", num_blocks=256, block_size=4)
    pattern = r"[0-9]{3}\.[a-z]{2}"
    outs = llm.generate([PROMPT, "Once upon"], SamplingParams(temperature=0, max_tokens=40,
                                                              structured_outputs=StructuredOutputsParams(regex=pattern)))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, o.outputs[0].text)


# ---------------------------------------------------------- termination and EOS
def test_eos_only_where_the_grammar_may_end(llm):
    """EOS pushed to +100 by logit_bias: it is sampled at the first place the grammar allows an
    end (after two digits), never before; a free request ends at once."""
    eos = llm.engine.eos_token_ids[0]
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}))[0]
    assert free.outputs[0].token_ids == [eos]
    so = StructuredOutputsParams(regex=r"[0-9]{2,4}")
    for p in _params(so, max_tokens=20, logit_bias={eos: 100}):
        o = llm.generate([PROMPT], p)[0].outputs[0]
        assert o.finish_reason == "stop" and o.token_ids[-1] == eos
        assert re.fullmatch(r"[0-9]{2}", o.text), o.text  # the EOS text is not in the output


def test_complete_grammar_stops_without_eos(llm):
    """A grammar that allows nothing after its last token ends the request there ("stop"),
    with no EOS step; the last token's text is in the output."""
    eos = set(llm.engine.eos_token_ids)
    for p in _params(StructuredOutputsParams(regex="abc[0-9]")):
        o = llm.generate([PROMPT], p)[0].outputs[0]
        assert o.finish_reason == "stop" and re.fullmatch("abc[0-9]", o.text)
        assert not eos & set(o.token_ids) and o.stop_reason is None


def test_max_tokens_before_the_grammar_completes_gives_length(llm):
    p = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"))
    o = llm.generate([PROMPT], p)[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3 and re.fullmatch("[a-z]{1,40}", o.text)


def test_min_tokens_and_ignore_eos_do_not_extend_a_complete_grammar(llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    for kw in ({"min_tokens": 10}, {"ignore_eos": True}):
        o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, structured_outputs=so, **kw))[0]
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("yes", "no")


def test_stop_string_inside_the_grammar_still_stops(llm):
    so = StructuredOutputsParams(regex="abc-[0-9]{2}")
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, structured_outputs=so, stop=["-"]))[0]
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text == "abc" and o.outputs[0].stop_reason == "-"


# ------------------------------------------------------------------ n, batches
def test_n_samples_follow_the_grammar_each(llm):
    pattern = r"[a-z]{3,8}"
    out = llm.generate([PROMPT], SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=30,
                                                structured_outputs=StructuredOutputsParams(regex=pattern)))[0]
    texts = [o.text for o in out.outputs]
    assert len(texts) == 6 and all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1  # each sample its own draw and its own grammar state
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=30,
                                                 structured_outputs=StructuredOutputsParams(regex=pattern)))[0]
    assert all(re.fullmatch(pattern, o.text) for o in best.outputs)


def test_free_requests_are_unchanged_by_constrained_batch_mates(llm):
    prompts = [PROMPT, "Once upon a time", "Paris is", "1, 2, 3"]
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, top_k=20, logprobs=2)]
    alone = [o.outputs[0] for o in llm.generate(prompts[:2], free)]
    so = [StructuredOutputsParams(json=SCHEMAS["nested"], disable_any_whitespace=True),
          StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}")]
    mixed = llm.generate([prompts[2], prompts[0], prompts[3], prompts[1]],
                         [SamplingParams(temperature=1.0, seed=3, max_tokens=64, structured_outputs=so[0]), free[0],
                          SamplingParams(temperature=0, max_tokens=24, structured_outputs=so[1]), free[1]])
    assert mixed[1].outputs[0].token_ids == alone[0].token_ids
    assert mixed[3].outputs[0].token_ids == alone[1].token_ids
    # (the logits can differ in their last bits with the batch's shape)
    assert [lp.logprob for lp in mixed[3].outputs[0].token_logprobs] == pytest.approx(
        [lp.logprob for lp in alone[1].token_logprobs], abs=1e-5)
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), SCHEMAS["nested"])
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", mixed[2].outputs[0].text)


def test_preemption_does_not_change_constrained_outputs(tiny_model_dir, llm):
    folder = tiny_model_dir("llama")[0]
    so = [StructuredOutputsParams(json=SCHEMAS[k], disable_any_whitespace=True) for k in ("nested", "array", "int_ranges")]
    prompts = [PROMPT, "Once upon a time there was", "Paris is the capital of", "def fibonacci(n):"] * 2
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so[i % 3])
              for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(model=str(folder), dtype="float32", num_blocks=40, block_size=4, max_model_len=128)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o, p in zip(outs, params):
        jsonschema.validate(json.loads(o.outputs[0].text), json.loads(json.dumps(p.structured_outputs.json)))


# --------------------------------------------------------------- exactness
def test_masked_distribution_is_the_renormalized_softmax(llm):
    """choice over single-token options at temperature 1: the frequency of each option over
    many seeds must match softmax(logits) renormalized over the options, computed from the
    model's own logits (chi-square goodness of fit)."""
    tok = llm.engine.tokenizer
    ids = llm.engine.encode(PROMPT)
    logits = prefill_logits(llm, ids)[-1].double()
    # single-character letter tokens: no option is a prefix of another, each is one token
    letters = [t for t in range(len(tok)) if len(s := tok.decode([t])) == 1 and s.isalpha() and s.isascii()]
    ranked = sorted(letters, key=lambda t: -logits[t].item())
    options = [ranked[round(i * (len(ranked) - 1) / 4)] for i in range(5)]  # logits spread: a sensitive test
    choice = [tok.decode([t]) for t in options]
    probs = torch.softmax(logits[options], 0).numpy()
    n = 3000
    outs = llm.generate([ids] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=4,
                                                   structured_outputs=StructuredOutputsParams(choice=choice))
                                    for s in range(n)])
    counts = [0] * len(options)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) == 1
        counts[options.index(o.outputs[0].token_ids[0])] += 1
    assert min(probs) * n >= 5  # (the chi-square approximation holds)
    assert stats.chisquare(counts, probs * n).pvalue > 1e-3, (counts, list(probs * n))
    # and greedy takes the most likely option
    g = llm.generate([ids], SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=choice)))
    assert g[0].outputs[0].token_ids == [options[0]]


def test_logprobs_are_the_raw_model_logprobs(llm):
    """As for every other processor, logprobs are the model's raw distribution (before the
    grammar's mask): the first token's equals log_softmax of the prompt's last logits."""
    ids = llm.engine.encode(PROMPT)
    raw = torch.log_softmax(prefill_logits(llm, ids)[-1].float(), 0)
    o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                           structured_outputs=StructuredOutputsParams(regex="[0-9]{5}")))[0].outputs[0]
    first = o.token_logprobs[0]
    assert abs(first.logprob - raw[first.token_id].item()) < 1e-5
    assert first.rank == 1 + int((raw > raw[first.token_id]).sum())
    assert [t for t, _ in first.top] == torch.topk(raw, 3).indices.tolist()


# ---------------------------------------------------------- padded vocabulary
@pytest.fixture(scope="module")
def padded_llm(tmp_path_factory):
    """A model whose LM head has 32 rows past the tokenizer's vocabulary, with huge logits."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-padded")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB + 32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tok = make_tokenizer(path)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
        # the padded rows: 3 x the row of the prompt's most likely token, so they win the first step
        top = model(torch.tensor([tok.encode(PROMPT)])).logits[0, -1, :VOCAB].argmax()
        model.lm_head.weight[VOCAB:] = 3 * model.lm_head.weight[top]
    model.save_pretrained(str(path))
    return LLM(model=str(path), dtype="float32", num_blocks=256, block_size=4)


def test_padded_vocabulary_rows_are_never_allowed(padded_llm):
    assert padded_llm.engine.model_config.vocab_size == VOCAB + 32 == len(padded_llm.engine.tokenizer) + 32
    free = padded_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert free.outputs[0].token_ids[0] >= VOCAB  # unconstrained, a padded row wins
    for p in _params(StructuredOutputsParams(regex=r"[a-z]{1,4}-[0-9]"), max_tokens=30):
        o = padded_llm.generate([PROMPT], p)[0].outputs[0]
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{1,4}-[0-9]", o.text)
        assert max(o.token_ids) < VOCAB


# -------------------------------------------------------------------- sampler
def test_sampler_applies_the_bitmask_to_its_rows_only():
    torch.manual_seed(0)
    B, V = 5, 100  # V not a multiple of 32: 4 words, the last one partly past V
    logits = torch.randn(B, V) * 3
    allowed = {1: [3, 64, 99], 3: [0, 31, 32, 33]}
    bitmask = torch.zeros(len(allowed), 4, dtype=torch.int32)
    for j, toks in enumerate(allowed.values()):
        for t in toks:
            bitmask[j, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)  # bit 31 wraps to a negative word
    unpacked = unpack_bitmask(bitmask, V)
    assert [unpacked[j].nonzero().flatten().tolist() for j in range(2)] == list(allowed.values())
    assert unpack_bitmask(bitmask, 160)[:, 128:].sum() == 0  # columns past 32·W are not allowed
    sampler = Sampler()
    for temp in (0.0, 1.0):
        rows = [SamplingRow(SamplingParams(temperature=temp, seed=s), [1], [], seed=s, eos_token_id=2) for s in range(B)]
        meta = SamplingMetadata.build(rows, V, torch.device("cpu"), list(allowed), bitmask)
        assert meta.edits_logits
        plain = sampler(logits.clone(), SamplingMetadata.build(rows, V, torch.device("cpu")))
        out = sampler(logits.clone(), meta)
        toks = out.sampled_token_ids.tolist()
        for i in range(B):
            if i in allowed:
                assert toks[i] in allowed[i]
                if temp == 0:
                    assert toks[i] == max(allowed[i], key=lambda t: logits[i, t].item())
            else:
                assert toks[i] == plain.sampled_token_ids[i].item()
        # logprobs stay raw
        assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0])


@pytest.mark.parametrize("V, W", [(100, 4), (49152 + 7, 49152 // 32), (33, 1)])
def test_bitmask_kernel_equals_the_torch_reference(V, W):
    """cpu_ops.apply_token_bitmask_ (the sampler's path on CPU) against unpack + masked_fill,
    on a row subset, with V not a multiple of 32 and masks narrower than V."""
    from kvserve.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the CPU kernels are not built on this machine")
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(7, V, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, W), dtype=torch.int32, generator=gen)
    bitmask[0] = 0
    bitmask[1] = -1
    rows = torch.tensor([0, 2, 3, 6])
    want = x.clone()
    want[rows] = want[rows].masked_fill_(~unpack_bitmask(bitmask, V), float("-inf"))
    got = x.clone()
    cpu_ops.apply_token_bitmask_(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.isneginf(got[0]).all() and torch.equal(got[2, : 32 * W], x[2, : 32 * W])
    got = x[:4].clone()
    cpu_ops.apply_token_bitmask_(got, bitmask)
    assert torch.equal(got, x[:4].clone().masked_fill_(~unpack_bitmask(bitmask, V), float("-inf")))


def test_sampler_without_the_cpu_kernels_masks_the_same(monkeypatch):
    """The PyTorch path (no C kernels, or CUDA) gives what the kernel path gives."""
    from kvserve.kernels import cpu_ops

    torch.manual_seed(1)
    B, V = 6, 200
    logits = torch.randn(B, V) * 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 7), dtype=torch.int32)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=i, logprobs=2), [1], [], seed=i, eos_token_id=2)
            for i, t in enumerate([0, 1.0, 0.7, 0, 1.0, 1.0])]
    meta = SamplingMetadata.build(rows, V, torch.device("cpu"), [0, 2, 4], bitmask)
    fast = Sampler()(logits.clone(), meta)
    monkeypatch.setattr(cpu_ops, "supports", lambda t: False)
    slow = Sampler()(logits.clone(), meta)
    assert torch.equal(fast.sampled_token_ids, slow.sampled_token_ids)
    assert torch.allclose(fast.logprobs, slow.logprobs)  # (the log partition has its own kernel too)
    allowed = unpack_bitmask(bitmask, V)
    for j, i in enumerate([0, 2, 4]):
        assert allowed[j, slow.sampled_token_ids[i]]


def test_grammar_wins_over_allowed_token_ids_and_bans():
    V = 64
    logits = torch.zeros(1, V)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # only token 5
    row = SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[7, 8], bad_words=[[5]]), [1], [], seed=0,
                      eos_token_id=2)
    meta = SamplingMetadata.build([row], V, torch.device("cpu"), [0], bitmask)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [5]


# -------------------------------------------------------------------- cache
def test_grammars_are_compiled_once_and_cached_lru(llm):
    tok = llm.engine.tokenizer
    m = StructuredOutputManager(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, cache_size=2)
    specs = [StructuredOutputsParams(regex=r"[0-9]+"), StructuredOutputsParams(json={"type": "integer"}),
             StructuredOutputsParams(choice=["a", "b"])]
    m.compile(specs[0])
    m.compile(StructuredOutputsParams(regex=specs[0].regex))
    assert m.num_compiled == 1
    m.compile(specs[1])
    m.compile(specs[2])  # evicts specs[0], the least recently used
    assert m.num_compiled == 3
    m.compile(specs[2])
    assert m.num_compiled == 3
    m.compile(specs[0])
    assert m.num_compiled == 4
    g1, g2 = m.new_grammar(specs[2]), m.new_grammar(specs[2])
    g1.accept_token(tok.encode("a")[0])
    assert g1.is_terminated() and not g2.is_terminated()  # each sequence owns its state


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, words", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of json, regex, choice, grammar, json_object; got 2: regex, choice"),
    ({"json_object": False}, "got none"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["yes", 3]}, "structured_outputs.choice[1] must be a string"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"grammar": "  "}, "structured_outputs.grammar must not be empty"),
    ({"json": 5}, "structured_outputs.json must be a JSON Schema"),
    ({"json": {"a": float("nan")}}, "structured_outputs.json: the schema is not JSON-serializable"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true or false"),
    ({"regex": "a\udc80"}, "structured_outputs.regex is not valid UTF-8"),
])
def test_bad_structured_outputs_params(kw, words):
    with pytest.raises(ValueError) as ei:
        StructuredOutputsParams(**kw)
    assert words in str(ei.value)


def test_bad_sampling_params_with_structured_outputs():
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, beam_width=2, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match=r"structured_outputs: unknown field\(s\) \['regexp'\]"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs == StructuredOutputsParams(regex="a")


@pytest.mark.parametrize("kw, words", [
    ({"json": {"type": "nope"}}, "structured_outputs.json: invalid JSON schema: Invalid type: nope"),
    ({"json": "{not json"}, "structured_outputs.json: the schema is not valid JSON"),
    ({"json": {"type": "string", "pattern": "a(("}}, "structured_outputs.json: invalid JSON schema: regex parse error"),
    ({"json": {"type": "object", "patternProperties": 5}}, "structured_outputs.json: invalid JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex: invalid regex"),
    ({"regex": "[z-a]"}, "structured_outputs.regex: invalid regex"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar: invalid grammar"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar: invalid grammar"),
])
def test_invalid_grammars_fail_their_request_alone(llm, kw, words):
    good = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    with pytest.raises(GenerationError) as ei:
        llm.generate([PROMPT, PROMPT], [SamplingParams(structured_outputs=StructuredOutputsParams(**kw)), good])
    assert list(ei.value.errors) == [0] and words in ei.value.errors[0]
    assert re.fullmatch("[0-9]{3}", ei.value.outputs[1].outputs[0].text)
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.engine.add_request(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_error_mid_way_fails_only_its_request(llm):
    """A grammar that rejects a sampled token (as llguidance's matcher does once it hits one of its
    limits) ends its own request with finish_reason "error"; a batch-mate is untouched."""
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate([PROMPT], free)[0].outputs[0].token_ids
    rid = llm.engine.add_request("Once upon", SamplingParams(temperature=0, max_tokens=20, structured_outputs=
                                                             StructuredOutputsParams(regex="[a-z]{10}")))
    seq = llm.engine.groups[rid].seqs[0]
    real = seq.grammar

    class Failing:  # the real grammar, rejecting the third token
        vocab_size, matcher, calls = real.vocab_size, real.matcher, 0

        def accept_token(self, token_id):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError(f"structured output: the grammar rejected token {token_id}: (test)")
            real.accept_token(token_id)

        def is_terminated(self):
            return real.is_terminated()

    seq.grammar = Failing()
    other = llm.engine.add_request(PROMPT, free)
    finals = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rid].outputs[0].finish_reason == "error" and "rejected token" in finals[rid].error
    assert finals[other].outputs[0].token_ids == expected


# ------------------------------------------------------------------ real model
@pytest.mark.slow
def test_smollm2_chat_returns_json_that_validates(llm_fp32):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 10000}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give the capital of France, its country and its population in "
                                            "millions as JSON."}]
    out = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=100,
                                                 structured_outputs=StructuredOutputsParams(json=schema)))
    o = out.outputs[0]
    assert o.finish_reason == "stop", o.text
    value = json.loads(o.text)
    jsonschema.validate(value, schema)
    assert value["city"] == "Paris"
    free = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=100)).outputs[0].text
    with pytest.raises(ValueError):  # left alone, the model writes a trailing comma and other keys
        json.loads(free)
