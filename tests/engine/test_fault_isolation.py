"""A request whose bookkeeping raises inside the engine fails alone (finish_reason "error");
the other requests in its batch finish with exactly the output they have without it."""

import json

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread

MARK = [60, 61, 5]  # prompts that start with this fail after FAIL_AT tokens
FAIL_AT = 3
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], MARK + [6, 7], [8, 9, 11, 12, 14]]


def _inject_fault(engine: LLMEngine, where: str = "_append_token") -> None:
    """Make the engine core's ``<where>`` raise for the sequences of marked prompts."""
    orig = getattr(engine.core, where)

    def faulty(*args, **kw):
        req = args[0]
        seqs = req.seqs if hasattr(req, "seqs") else [req]
        if any(s.prompt_token_ids[:3] == MARK and len(s.output_token_ids) >= FAIL_AT for s in seqs):
            raise RuntimeError("injected fault")
        return orig(*args, **kw)

    setattr(engine.core, where, faulty)


def _engine(folder, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _run(engine: LLMEngine, prompts, params) -> dict[str, object]:
    rids = [engine.add_request(p, params) for p in prompts]
    final = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return [final[r] for r in rids]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def expected(folder):
    """The outputs without any fault (n = 2 samples with a seed, so they are reproducible)."""
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    return {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)],
        "n2": [[c.token_ids for c in o.outputs]
               for o in llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=3, ignore_eos=True))],
    }


@pytest.mark.parametrize("where", ["_append_token", "_make_output"])
def test_failing_request_fails_alone(folder, expected, caplog, where):
    engine = _engine(folder)
    _inject_fault(engine, where)
    outs = _run(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [expected["greedy"][0], expected["greedy"][2]]
    assert outs[0].error is None and outs[0].finish_reason == "length"
    bad = outs[1]
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error == "RuntimeError: injected fault"
    assert bad.outputs[0].token_ids == expected["greedy"][1][: len(bad.outputs[0].token_ids)]
    assert FAIL_AT <= len(bad.outputs[0].token_ids) < 8
    assert "injected fault" in caplog.text
    # its blocks are back in the pool and the engine goes on: the same prompt, fault removed
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    delattr(engine.core, where)  # (the instance attribute set by _inject_fault)
    again = _run(engine, [PROMPTS[1]], GREEDY)[0]
    assert again.error is None and again.outputs[0].token_ids == expected["greedy"][1]


def test_failing_output_processing_fails_its_request_alone(folder, expected):
    """A request whose detokenization raises in the front end (a tokenizer that chokes on its
    tokens) ends with an error output there and is aborted in the core; the others go on."""
    engine = _engine(folder)
    proc = engine.output_processor
    orig = proc._apply

    def faulty(state, out):
        if state.prompt_token_ids[:3] == MARK and len(state.samples[0].token_ids) >= FAIL_AT:
            raise RuntimeError("injected fault")
        return orig(state, out)

    proc._apply = faulty
    outs = _run(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [expected["greedy"][0], expected["greedy"][2]]
    bad = outs[1]
    assert bad.finished and bad.finish_reason == "error" and bad.error == "RuntimeError: injected fault"
    assert bad.outputs[0].token_ids == expected["greedy"][1][: len(bad.outputs[0].token_ids)]
    assert FAIL_AT <= len(bad.outputs[0].token_ids) < 8
    assert not engine.core.groups and not proc.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_failing_sample_fails_its_group_alone(folder, expected):
    engine = _engine(folder)
    _inject_fault(engine)
    outs = _run(engine, PROMPTS, SamplingParams(n=2, max_tokens=8, seed=3, ignore_eos=True))
    for i in (0, 2):
        assert [c.token_ids for c in outs[i].outputs] == expected["n2"][i]
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_failing_beam_search_fails_alone(folder):
    engine = _engine(folder)
    beams = SamplingParams(n=2, use_beam_search=True, beam_width=2, max_tokens=8, temperature=0, ignore_eos=True)
    alone = _run(engine, [PROMPTS[0]], beams)[0]
    _inject_fault(engine, "_advance_beams")
    outs = _run(engine, PROMPTS, beams)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in alone.outputs]
    assert outs[2].error is None and outs[1].error == "RuntimeError: injected fault"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_server_answers_500_for_the_failed_request_only(folder, expected):
    engine = _engine(folder)
    _inject_fault(engine)
    with ServerThread(engine, names=["tiny"]) as s:
        body = dict(model="tiny", max_tokens=8, temperature=0, ignore_eos=True)
        ok = httpx.post(s.base_url + "/v1/completions", json={**body, "prompt": PROMPTS[0]}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(s.base_url + "/v1/completions", json={**body, "prompt": PROMPTS[1]}, timeout=60)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"
        assert "failed inside the engine: RuntimeError: injected fault" in err["message"]
        with httpx.stream("POST", s.base_url + "/v1/completions",
                          json={**body, "prompt": PROMPTS[1], "stream": True}, timeout=60) as st:
            events = [line[6:] for line in st.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "internal_error"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        # the text before the fault was streamed (the engine failed the request at token FAIL_AT + 1)
        assert "".join(texts) == engine.tokenizer.decode(expected["greedy"][1][:FAIL_AT])
        after = httpx.post(s.base_url + "/v1/completions", json={**body, "prompt": PROMPTS[2]}, timeout=60)
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == engine.tokenizer.decode(expected["greedy"][2])
        finished = {smp.labels["finished_reason"]: smp.value
                    for fam in text_string_to_metric_families(httpx.get(s.base_url + "/metrics").text)
                    for smp in fam.samples if smp.name == "kvserve:request_success_total"}
        assert finished == {"stop": 0, "length": 2, "abort": 0, "error": 2}


def _inject_forward_fault(engine: LLMEngine, fail_at: int, after_forward: bool) -> None:
    """Make the model forward raise for any batch holding a marked prompt with at least
    ``fail_at`` output tokens: before it runs, or after it wrote the batch's K/V."""
    runner = engine.runner
    real_model, real_prepare = runner.model, runner.prepare_inputs
    marked = {}

    def prepare(sched):
        marked["now"] = any(r.prompt_token_ids[:3] == MARK and len(r.output_token_ids) >= fail_at
                            for r, _ in sched.scheduled)
        return real_prepare(sched)

    def model(*args, **kw):
        if marked["now"] and not after_forward:
            raise RuntimeError("injected forward fault")
        out = real_model(*args, **kw)
        if marked["now"]:
            raise RuntimeError("injected forward fault")
        return out

    runner.prepare_inputs, runner.model = prepare, model


@pytest.mark.parametrize("fail_at, after_forward", [(0, False), (FAIL_AT, False), (FAIL_AT, True)])
@pytest.mark.parametrize("params", ["greedy", "n2"])
def test_failing_forward_fails_its_request_alone(folder, expected, caplog, fail_at, after_forward, params):
    """The batched forward raises: each request's part is rerun alone; only the marked one
    fails, the others get their exact outputs, and nothing the failed step computed is cached."""
    engine = _engine(folder, enable_prefix_caching=True)
    _inject_forward_fault(engine, fail_at, after_forward)
    sp = GREEDY if params == "greedy" else SamplingParams(n=2, max_tokens=8, seed=3, ignore_eos=True)
    prompts = PROMPTS[:1] + [MARK + [6, 7, 8, 9, 10]] + PROMPTS[2:]  # 8 tokens: two full blocks of 4
    outs = _run(engine, prompts, sp)
    for i in (0, 2):
        assert outs[i].error is None
        assert [c.token_ids for c in outs[i].outputs] == (
            [expected["greedy"][i]] if params == "greedy" else expected["n2"][i])
    bad = outs[1]
    assert bad.error == "RuntimeError: injected forward fault"
    assert all(c.finish_reason == "error" for c in bad.outputs)
    assert max(len(c.token_ids) for c in bad.outputs) == fail_at  # (a forked sample may be a token behind)
    assert "running them one by one" in caplog.text
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # the engine goes on; had the failed prefill's blocks been cached, this would read them
    engine.runner.model, engine.runner.prepare_inputs = engine.model, type(engine.runner).prepare_inputs.__get__(
        engine.runner)
    again = _run(engine, [prompts[1]], GREEDY)[0]
    clean = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    assert again.error is None
    assert again.outputs[0].token_ids == clean.generate([prompts[1]], GREEDY)[0].outputs[0].token_ids


def test_forward_fault_of_a_lone_request_fails_it(folder):
    engine = _engine(folder)
    _inject_forward_fault(engine, 0, False)
    out = _run(engine, [PROMPTS[1]], GREEDY)[0]
    assert out.finished and out.error == "RuntimeError: injected forward fault"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
