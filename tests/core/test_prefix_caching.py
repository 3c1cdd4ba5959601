"""Prefix caching on SmolLM2 (float32, greedy): outputs never change, edge cases from other
engines' bug trackers, tenant isolation and metrics.

The workload: 24 prompts sharing long prefixes — 8 customer questions after a common
~300-token system prompt (chat template), 8 questions about one document, and two 4-turn
chats replayed turn by turn (each turn's prompt is the previous prompt + the model's reply +
a new user message).
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.engine.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are Atlas, the support assistant of Northwind Outfitters, a company that sells hiking, "
    "camping and climbing gear online and in twelve stores. Follow these rules in every answer. "
    "Be friendly, precise and brief: two or three sentences unless the customer asks for detail. "
    "Never invent order numbers, prices, delivery dates or stock levels; if you do not know, say so "
    "and offer to connect the customer with a human agent. Orders ship within two business days; "
    "standard delivery takes three to five days and express delivery one to two days. Returns are "
    "free within sixty days for unused items in their original packaging, and worn items can be "
    "returned within thirty days if they are defective. Refunds go back to the original payment "
    "method within ten days of the return being received. Gift cards never expire and cannot be "
    "exchanged for cash. Members of the Trailhead club get free express shipping, early access to "
    "sales and a ten percent discount on repairs. Tents, sleeping bags and backpacks have a lifetime "
    "warranty against manufacturing defects; footwear has a two year warranty. Do not give medical, "
    "legal or safety-critical climbing advice beyond pointing to the manufacturer's instructions and "
    "to certified guides. Do not discuss competitors. Answer in the language the customer writes in. "
    "When a customer is upset, acknowledge the problem first, then explain what you can do. Always end "
    "by asking whether there is anything else you can help with."
)
CUSTOMER = [
    "How long does express delivery take?", "Can I return boots I wore once?",
    "Do gift cards expire?", "My tent pole snapped on the first night. What now?",
    "What does the Trailhead club give me?", "When will I get my refund?",
    "Is my sleeping bag covered by a warranty?", "Where is my order 4471?",
]
DOC = (
    "The Lindqvist Glacier, in the northern Varden mountains, has retreated by about 1.8 kilometres "
    "since measurements began in 1921, when the geologist Marta Lindqvist placed the first stakes on "
    "its tongue. Retreat paused between 1965 and 1985, after several cool and snowy summers, and has "
    "accelerated since 1995, reaching a record 64 metres in 2022. The glacier feeds the Aska river, "
    "which supplies the town of Holmby with drinking water and a small power plant built in 1962. "
    "Researchers expect most of the lower tongue to be gone by 2060. A visitor centre opened in 2011 "
    "at the old survey hut."
)
QUESTIONS = [
    "When did measurements begin?", "Who led the first survey?", "What happened between 1965 and 1985?",
    "What was the record retreat?", "Which town depends on the river?", "When was the power plant built?",
    "What do researchers expect by 2060?", "Where is the visitor centre?",
]
CHATS = [
    ["Tell me a short fact about octopuses.", "Why is that?", "Name another animal like that.", "Thanks! Summarize."],
    ["Give me a tip for learning to cook.", "What should I cook first?", "How long does it take?", "Any other tip?"],
]

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BIG_POOL = 512  # blocks of 16 tokens: nothing is ever evicted


def _llm(**kw) -> LLM:
    kw.setdefault("num_blocks", BIG_POOL)
    kw.setdefault("max_num_batched_tokens", 512)  # a few prompts per step: later ones hit earlier ones
    return LLM(dtype="float32", max_model_len=1024, **kw)


def _run_workload(llm: LLM) -> list[list[int]]:
    """Run the 24 prompts; returns their output token ids in a fixed order."""
    tok = llm.tokenizer
    first = [apply_chat_template(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                 add_generation_prompt=True) for q in CUSTOMER]
    first += [tok.encode(f"Read the text and answer the question.\n\n{DOC}\n\nQuestion: {q}\nAnswer:") for q in QUESTIONS]
    histories = [[{"role": "user", "content": chat[0]}] for chat in CHATS]
    first += [apply_chat_template(tok, h, add_generation_prompt=True) for h in histories]
    outs = llm.generate(first, PARAMS)
    results = [o.token_ids for o in outs]
    replies = [o.text for o in outs[-len(CHATS):]]
    for turn in range(1, 4):
        for h, chat, reply in zip(histories, CHATS, replies):
            h += [{"role": "assistant", "content": reply}, {"role": "user", "content": chat[turn]}]
        outs = llm.generate([apply_chat_template(tok, h, add_generation_prompt=True) for h in histories], PARAMS)
        results += [o.token_ids for o in outs]
        replies = [o.text for o in outs]
    assert len(results) == 24
    return results


@pytest.fixture(scope="module")
def off_llm(smollm2_path):
    return _llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def on_llm(smollm2_path):
    return _llm()


@pytest.fixture(scope="module")
def reference_outputs(off_llm):
    """The workload with prefix caching off."""
    before = off_llm.engine.num_prompt_tokens_computed
    outs = _run_workload(off_llm)
    st = off_llm.engine.stats()
    assert st["prefix_cache_hits"] == 0 and st["prefix_cache_queries"] == 0
    return outs, st["prompt_tokens_computed"] - before


def test_outputs_identical_with_cache(reference_outputs, on_llm):
    expected, computed_off = reference_outputs
    eng = on_llm.engine
    before = eng.stats()
    assert _run_workload(on_llm) == expected
    st = eng.stats()
    queries = st["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = st["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queries > 4000 and hits > 0.5 * queries
    assert st["prompt_tokens_computed"] - before["prompt_tokens_computed"] < 0.5 * computed_off
    assert st["kv_blocks_in_use"] == 0 and st["kv_blocks_free"] + st["kv_blocks_cached"] == BIG_POOL
    eng.kv.check_invariants()


def test_outputs_identical_under_eviction_and_preemption(reference_outputs):
    expected, _ = reference_outputs
    llm = _llm(num_blocks=22)  # 352 tokens: one ~300-token request and a few that share its prefix
    assert _run_workload(llm) == expected
    st = llm.engine.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_evicted_blocks"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["kv_blocks_in_use"] == 0
    llm.engine.kv.check_invariants()


# ----------------------------------------------------------------------------- edge cases
def _run_to_end(eng) -> dict:
    """Step the engine until every request finished; request id -> final output."""
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _gen(llm: LLM, prompts, params: SamplingParams, salt=None, adapter_id=None):
    """Run prompts through the engine with a cache salt; returns outputs in order."""
    eng = llm.engine
    ids = []
    for p in prompts:
        ids.append(eng.add_request(p, params, cache_salt=salt))
        if adapter_id is not None:  # the adapter hook of the namespace (no adapters yet)
            for r in eng.groups[ids[-1]].seqs:
                r.adapter_id = adapter_id
    final = _run_to_end(eng)
    return [final[i] for i in ids]


def _text_ids(llm: LLM, n: int, seed: str) -> list[int]:
    ids = llm.engine.encode(f"{seed}: " + DOC + " " + SYSTEM)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("length", [64, 71])  # 64: a multiple of the block size (16)
def test_fully_cached_prompt_still_prefills_its_last_token(on_llm, off_llm, length):
    prompt = _text_ids(on_llm, length, f"full{length}")
    # 10 tokens: the first request fills the block holding the end of the prompt (71 + 9 =
    # 80), so the second one copies 6 tokens of that cached block (a token-granular hit).
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    (cold,) = _gen(off_llm, [prompt], params)
    eng = on_llm.engine
    salt = f"full-{length}"
    (first,) = _gen(on_llm, [prompt], params, salt=salt)
    before = eng.num_prompt_tokens_computed
    (hit,) = _gen(on_llm, [prompt], params, salt=salt)
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == length - 1
    assert eng.num_prompt_tokens_computed - before == 1  # a one-token prefill, with logits
    assert hit.token_ids == first.token_ids == cold.token_ids
    for a, b in zip(hit.outputs[0].token_logprobs, cold.outputs[0].token_logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    eng.kv.check_invariants()


def test_prompt_logprobs_identical_with_and_without_a_cache_hit(on_llm, off_llm):
    prompt = _text_ids(on_llm, 90, "plp")
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3, ignore_eos=True)
    (cold,) = _gen(off_llm, [prompt], params)
    salt = "plp"
    _gen(on_llm, [prompt], SamplingParams(max_tokens=2, temperature=0), salt=salt)  # warm the cache
    (warm,) = _gen(on_llm, [prompt], params, salt=salt)
    assert warm.num_cached_tokens == 0  # prompt logprobs need every position computed
    assert len(warm.prompt_token_logprobs) == len(prompt) and warm.prompt_token_logprobs[0] is None
    assert [(l.token_id, l.logprob, l.rank, l.top) for l in warm.prompt_token_logprobs[1:]] == [
        (l.token_id, l.logprob, l.rank, l.top) for l in cold.prompt_token_logprobs[1:]
    ]
    assert warm.token_ids == cold.token_ids
    (hit,) = _gen(on_llm, [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), salt=salt)
    assert hit.num_cached_tokens == 80 and hit.token_ids == cold.token_ids  # 5 full blocks cached


def test_preempted_request_hits_the_cache_on_resumption(off_llm):
    """Preempted requests come back through the cache they left behind, with the same
    outputs; one that asked for prompt logprobs still reports each position once."""
    prompts = [_text_ids(off_llm, 40, f"res{i}") for i in range(3)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=p) for p in (None, 1, 1)]
    expected = _gen_mixed(off_llm, prompts, params)
    llm = _llm(num_blocks=7)  # 112 tokens; each request grows to 64 (4 blocks)
    outs = _gen_mixed(llm, prompts, params)
    st = llm.engine.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_resumed_hits"] > 0
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    for o, e in zip(outs[1:], expected[1:]):
        assert len(o.prompt_token_logprobs) == len(e.prompt_token_logprobs) == 40
        for a, b in zip(o.prompt_token_logprobs[1:], e.prompt_token_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    llm.engine.kv.check_invariants()


def _gen_mixed(llm: LLM, prompts, params):
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = _run_to_end(eng)
    return [final[i] for i in ids]


def test_requests_in_one_step_sharing_an_uncomputed_prefix(off_llm):
    shared = _text_ids(off_llm, 150, "same-step")
    prompts = [shared + off_llm.engine.encode(" First question?"), shared + off_llm.engine.encode(" Second one?")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in _gen(off_llm, prompts, params)]
    llm = _llm()
    outs = _gen(llm, prompts, params)  # admitted together: nothing is computed yet, no hit
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.token_ids for o in outs] == expected
    # Chunked: the second arrives while the first is mid-prompt; it hits only the chunks
    # already computed, and both compute the rest of the shared prefix in the same steps.
    llm = _llm(max_num_batched_tokens=100)
    eng = llm.engine
    a = eng.add_request(prompts[0], params, cache_salt="chunk")
    eng.step()  # a computes 100 of its ~155 prompt tokens: 6 full blocks
    b = eng.add_request(prompts[1], params, cache_salt="chunk")  # next step: a 55 tokens, b 45
    final = _run_to_end(eng)
    assert final[b].num_cached_tokens == 96  # the block a is still filling is not shared
    assert [final[a].token_ids, final[b].token_ids] == expected
    eng.kv.check_invariants()


def test_salts_isolate_tenants(on_llm):
    eng = on_llm.engine
    prompt = _text_ids(on_llm, 80, "salt")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (a1,) = _gen(on_llm, [prompt], params, salt="tenant-a")
    hits = eng.stats()["prefix_cache_hits"]
    (b1,) = _gen(on_llm, [prompt], params, salt="tenant-b")
    assert b1.num_cached_tokens == 0 and eng.stats()["prefix_cache_hits"] == hits
    (a2,) = _gen(on_llm, [prompt], params, salt="tenant-a")
    assert a2.num_cached_tokens == len(prompt) - 1
    # A salt equal to an adapter id does not reach that adapter's cache, nor back.
    (ad,) = _gen(on_llm, [prompt], params, adapter_id="tenant-a")
    assert ad.num_cached_tokens == 0
    (sx,) = _gen(on_llm, [prompt], params, salt="lora-x")
    (ax,) = _gen(on_llm, [prompt], params, adapter_id="lora-x")
    assert sx.num_cached_tokens == 0 and ax.num_cached_tokens == 0
    assert a1.token_ids == b1.token_ids == a2.token_ids == ad.token_ids == ax.token_ids


def test_n_samples_compute_the_prompt_once(on_llm, off_llm):
    prompt = _text_ids(on_llm, 50, "fork")
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=11)
    results = []
    for llm in (off_llm, on_llm):
        before = llm.engine.num_prompt_tokens_computed
        (out,) = _gen(llm, [prompt], params, salt="fork" if llm is on_llm else None)
        assert llm.engine.num_prompt_tokens_computed - before == len(prompt) + 2
        results.append([o.token_ids for o in out.outputs])
        llm.engine.kv.check_invariants()
    assert results[0] == results[1]


def test_stats_report_prefix_cache_and_blocks(on_llm):
    st = on_llm.engine.stats()
    for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
                "prefix_cache_hit_rate_recent", "prefix_cache_evicted_blocks", "num_preemptions",
                "kv_blocks_free", "kv_blocks_cached", "kv_blocks_in_use"):
        assert key in st
    assert st["kv_blocks_free"] + st["kv_blocks_cached"] + st["kv_blocks_in_use"] == st["kv_blocks_total"]
    assert 0.0 <= st["prefix_cache_hit_rate_recent"] <= 1.0


@pytest.mark.parametrize("salt", ["", 7, b"tenant"])
def test_cache_salt_must_be_a_non_empty_string(salt, tiny_model_dir):
    eng = LLMEngine(EngineArgs(model=str(tiny_model_dir("llama")[0]), dtype="float32", num_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string or None"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), cache_salt=salt)
    assert not eng.has_unfinished_requests()
