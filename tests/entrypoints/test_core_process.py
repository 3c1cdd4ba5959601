"""The server with the engine core in its own process (``build_app(EngineArgs)``, ``kvserve serve``'s
default): greedy outputs equal the offline ``LLM``'s, aborts and errors cross the process
boundary, metrics move, and a core that dies fails every live request and ``/health`` at once.

Tiny random model for most; the real-model checks (SmolLM2, float32) are marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread, pid_gone

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.sampling_params import StructuredOutputsParams

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PROMPT = "The quick brown fox"
TINY = dict(dtype="float32", block_size=4, max_model_len=512)


def _metrics(server) -> dict:
    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "le" in s.labels:
                continue
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


def _events(r: httpx.Response) -> list:
    """The SSE payloads of a streamed response (parsed JSON, or the string ``[DONE]``)."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    with ServerThread(EngineArgs(model=str(tiny_folder), num_blocks=512, **TINY), names=["tiny"]) as s:
        s.api.tokenizer.chat_template = CHAT_TEMPLATE  # (templates are applied in the API process)
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_folder):
    llm = LLM(model=str(tiny_folder), num_blocks=512, **TINY)
    llm.engine.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


# ------------------------------------------------------------- the wire format
def test_core_outputs_are_deltas_that_do_not_grow_with_the_sequence(tiny_folder):
    """What a step sends to the API process (pickled EngineCoreOutputs) carries the step's new
    tokens and logprobs only: its size does not grow with the length of the output, and the
    front end rebuilds the whole output (tokens, text, logprobs) as the offline engine has it."""
    import pickle

    from kvserve.engine.llm_engine import EngineArgs, LLMEngine
    from kvserve.engine.output_processor import OutputProcessor

    eng = LLMEngine(EngineArgs(model=str(tiny_folder), num_blocks=512, **TINY))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=5)
    ref = None
    rid = eng.add_request([5, 6, 7], params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            ref = o
    front = OutputProcessor(eng.tokenizer)
    rid = eng.core.add_request(eng.input_processor.process([5, 6, 7], params))
    front.add_request(rid, [5, 6, 7], None, params)
    sizes, last = [], None
    while eng.core.has_unfinished_requests():
        outs = eng.core.step()
        wire = pickle.dumps(outs)
        sizes.append(len(wire))
        for o in front.process_outputs(pickle.loads(wire)).request_outputs:
            last = o
    assert len(sizes) == 200 and max(sizes[100:]) <= max(sizes[1:10]) * 1.1, (sizes[1:10], sizes[100:])
    assert last.finished and last.outputs[0].token_ids == ref.outputs[0].token_ids
    assert last.outputs[0].text == ref.outputs[0].text and len(last.outputs[0].token_logprobs) == 200
    got, want = last.outputs[0].token_logprobs, ref.outputs[0].token_logprobs  # (the second run hits the prefix cache)
    assert [(x.token_id, x.rank, [t for t, _ in x.top]) for x in got] == \
           [(x.token_id, x.rank, [t for t, _ in x.top]) for x in want]
    assert [v for x in got for _, v in x.top] == pytest.approx([v for x in want for _, v in x.top], abs=1e-4)
    assert last.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob)
    assert not front.requests


class _FakeEngine:
    """Just enough of EngineCore for the core loop: a step that raises once asked to (its
    all-or-nothing ``add_requests`` is the real one)."""

    def __init__(self) -> None:
        self.groups: dict = {}
        self.aborted: list = []
        self.fail = False

    def validate_request(self, ids, params):
        if not ids:
            raise ValueError("prompt is empty")

    def add_request(self, request):
        self.validate_request(request.prompt_token_ids, request.sampling_params)
        if request.request_id == "full":
            raise ValueError("the waiting queue is full")  # (passes validation, fails when added)
        self.groups[request.request_id] = request.prompt_token_ids
        return request.request_id

    def add_requests(self, requests):
        from kvserve.engine.core import EngineCore

        return EngineCore.add_requests(self, requests)

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.groups.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.groups)

    def is_healthy(self):
        return True

    def shutdown(self):
        pass

    def stats(self):
        return {"num_running": len(self.groups)}

    def lock(self):
        return threading.Lock()  # (does not pickle)

    def step(self):
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(0.01)
        return []


def test_core_loop_step_failure_and_commands():
    import multiprocessing

    from kvserve.engine.core_proc import _CoreLoop

    engine = _FakeEngine()
    cmd_recv, cmd = multiprocessing.Pipe(duplex=False)
    out, out_send = multiprocessing.Pipe(duplex=False)
    loop = threading.Thread(target=_CoreLoop(engine, cmd_recv, out_send, os.getppid()).run, daemon=True)
    loop.start()

    def next_msg(kind):
        deadline = time.monotonic() + 10
        while True:
            assert out.poll(max(0.0, deadline - time.monotonic())), f"no {kind!r} message"
            msg = out.recv()
            if msg[0] == kind:
                return msg

    from kvserve.engine.input_processor import EngineCoreRequest

    params = SamplingParams(max_tokens=2)

    def reqs(*items):
        return [EngineCoreRequest(rid, ids, None, params) for rid, ids in items]

    cmd.send(("add", 1, reqs(("a", [1, 2]), ("b", []))))  # all or nothing: checked first
    err = next_msg("added")[2]
    assert isinstance(err, ValueError) and err.request_index == 1 and not engine.aborted and not engine.groups
    cmd.send(("add", 5, reqs(("a", [1, 2]), ("full", [3]))))  # ... or taken back
    err = next_msg("added")[2]
    assert isinstance(err, ValueError) and err.request_index == 1 and engine.aborted == ["a"] and not engine.groups
    cmd.send(("add", 2, reqs(("a", [1]), ("b", [2]))))
    assert next_msg("added") == ("added", 2, None)
    cmd.send(("call", 3, "stats", ()))
    assert next_msg("reply") == ("reply", 3, True, {"num_running": 2})
    cmd.send(("call", 4, "_private", ()))
    assert isinstance(next_msg("reply")[3], ValueError)
    cmd.send(("call", 6, "lock", ()))
    reply = next_msg("reply")
    assert reply[:3] == ("reply", 6, False) and "cannot cross" in str(reply[3])
    engine.fail = True
    kind, message, stats = next_msg("step_failed")
    assert message == "boom" and sorted(engine.aborted[1:]) == ["a", "b"] and stats == {"num_running": 0}
    cmd.send(("stop",))
    next_msg("stopped")
    loop.join(5)
    assert not loop.is_alive()


def test_core_loop_exits_when_the_api_side_closes():
    import multiprocessing

    from kvserve.engine.core_proc import _CoreLoop

    cmd_recv, cmd = multiprocessing.Pipe(duplex=False)
    out, out_send = multiprocessing.Pipe(duplex=False)
    errors = []

    def run():
        try:
            _CoreLoop(_FakeEngine(), cmd_recv, out_send, os.getppid()).run()
        except EOFError as e:  # (run_engine_core turns this into a quiet exit)
            errors.append(e)

    loop = threading.Thread(target=run, daemon=True)
    loop.start()
    cmd.close()  # the API process is gone
    loop.join(5)
    assert not loop.is_alive() and errors


def test_ctrl_c_and_sigterm_while_the_core_process_boots_do_not_reach_it(tiny_folder, monkeypatch, capfd):
    """The core process starts with SIGINT and SIGTERM ignored (inherited from the spawn), not
    only once its main function runs: a Ctrl-C to the process group while it still imported
    kvserve and torch printed a KeyboardInterrupt traceback and killed it (a fresh user's report).
    The signals go to the child right after its start, while it boots; it starts and serves."""
    from multiprocessing.context import SpawnProcess

    from kvserve.engine.core_client import CoreClient

    start = SpawnProcess.start

    def start_then_signal(self):
        start(self)
        os.kill(self.pid, signal.SIGINT)
        os.kill(self.pid, signal.SIGTERM)

    monkeypatch.setattr(SpawnProcess, "start", start_then_signal)
    # (the parent's own handlers come back; under a shell's `&` SIGINT was SIG_IGN to begin with)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    client = CoreClient(EngineArgs(model=str(tiny_folder), num_blocks=64, **TINY))
    try:
        assert client.is_alive
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    finally:
        client.shutdown(timeout=10.0)
    assert client.exitcode == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_a_core_whose_api_process_went_away_while_loading_exits_quietly(tiny_folder, capfd):
    """SIGTERM to the API process alone while the model loads: the core (which ignores it) found
    the pipe closed when it sent "ready" and printed a BrokenPipeError traceback. It now exits 0
    without one."""
    import multiprocessing

    from kvserve.engine.core_proc import run_engine_core

    ctx = multiprocessing.get_context("spawn")
    cmd_recv, cmd = ctx.Pipe(duplex=False)
    out, out_send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=run_engine_core, args=(EngineArgs(model=str(tiny_folder), num_blocks=64, **TINY),
                                                  cmd_recv, out_send, os.getpid()))
    p.start()
    cmd_recv.close(), out_send.close()
    out.close(), cmd.close()  # the API side is gone before "ready"
    p.join(60)
    assert p.exitcode == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err


class _FakeCoreClient:
    """Just enough of CoreClient for MPAsyncEngine: messages are fed to it by hand."""

    args = EngineArgs()
    tokenizer = None

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg):
        self.sent.append(msg)

    def is_alive(self):
        return True

    def start_io(self, on_message, on_exit):
        pass


def test_mp_async_engine_fails_live_requests_when_a_step_fails():
    import asyncio

    from kvserve.entrypoints.openai.async_engine import EngineStoppedError, MPAsyncEngine, _Track

    async def main():
        eng = MPAsyncEngine(_FakeCoreClient())
        eng.start()
        q: asyncio.Queue = asyncio.Queue()
        eng._tracks["r"] = _Track(q, 7, time.perf_counter(), 1)
        eng._on_message(("step_failed", "boom", {}))
        tag, err = await asyncio.wait_for(q.get(), 5)
        assert tag == 7 and isinstance(err, EngineStoppedError) and str(err) == "the engine failed: boom"
        assert eng.is_running  # the core goes on serving new requests
        eng._on_exit(-9)
        assert not eng.is_running and "SIGKILL" in str(eng.fatal_error)
        with pytest.raises(EngineStoppedError, match="died"):
            await eng.add_request("s", [1], SamplingParams(), q)

    asyncio.run(main())



def test_mp_async_engine_stops_running_when_the_core_says_its_engine_is_dead():
    """``("dead", message)`` (a rank died; the core exits next, slowly with Ray): not running
    at once (``/health`` 503), before the step's ``step_failed``; the live requests and new
    ones get the message, which the core's exit does not replace."""
    import asyncio

    from kvserve.entrypoints.openai.async_engine import EngineStoppedError, MPAsyncEngine, _Track

    async def main():
        eng = MPAsyncEngine(_FakeCoreClient())
        eng.start()
        q: asyncio.Queue = asyncio.Queue()
        eng._tracks["r"] = _Track(q, 7, time.perf_counter(), 1)
        msg = "the engine cannot run steps any more: tensor-parallel rank 1 died (exit code -9)"
        eng._on_message(("dead", msg))
        assert not eng.is_running  # (on the reader thread's call: no event-loop turn needed)
        eng._on_message(("step_failed", "tensor-parallel rank 1 died (exit code -9)", {}))
        tag, err = await asyncio.wait_for(q.get(), 5)
        assert tag == 7 and isinstance(err, EngineStoppedError) and str(err) == msg
        eng._on_exit(1)
        assert str(eng.fatal_error) == msg
        with pytest.raises(EngineStoppedError, match="rank 1 died"):
            await eng.add_request("s", [1], SamplingParams(), q)

    asyncio.run(main())

# ------------------------------------------------------------- same outputs
def test_core_runs_in_another_process(server):
    pid = server.api.async_engine.core_pid
    assert pid != os.getpid() and not pid_gone(pid, timeout=0.1)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert not hasattr(server.api.engine, "model")  # the API process holds no weights
    assert server.engine_call("stats")["kv_blocks_total"] == 512


def test_greedy_completions_equal_offline(client, offline):
    prompts = [PROMPT, "Once upon a time"]
    refs = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [o.text for o in refs]
    assert [c.finish_reason for c in got] == ["length", "length"]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == 24
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == refs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_logprobs_equal_offline(client, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.text == ref.text
        assert c.logprobs.token_logprobs == pytest.approx([e.logprob for e in ref.outputs[0].token_logprobs], abs=1e-4)
        assert len(c.logprobs.top_logprobs) == 8 and all(len(t) >= 2 for t in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=8, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == ref.text
        lps = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert lps == pytest.approx([e.logprob for e in ref.outputs[0].token_logprobs], abs=1e-4)


def test_stop_strings_end_samples_in_the_api_process(client, server, offline):
    """Stop strings are found by the API process's output processor: the texts (streamed and
    not, n = 3 seeded samples) are the offline engine's, and the samples they end are finished
    in the core at once (it generates a few tokens past them, not up to max_tokens; nothing
    keeps running there, no KV block stays in use)."""
    free = offline.generate([PROMPT], SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=11,
                                                     ignore_eos=True))[0]
    stop = [o.text[8:10] for o in free.outputs]  # every sample meets one
    params = dict(n=3, max_tokens=400, temperature=1.0, seed=11)
    ref = offline.generate([PROMPT], SamplingParams(**params, ignore_eos=True, stop=stop))[0]
    assert all(o.finish_reason == "stop" and o.stop_reason in stop for o in ref.outputs)
    kept = sum(len(o.token_ids) for o in ref.outputs)
    body = dict(model="tiny", prompt=PROMPT, stop=stop, extra_body={"ignore_eos": True}, **params)
    generated = server.engine_call("stats")["generated_tokens"]
    r = client.completions.create(**body)
    got = sorted(r.choices, key=lambda c: c.index)
    assert [(c.text, c.finish_reason) for c in got] == [(o.text, o.finish_reason) for o in ref.outputs]
    assert r.usage.completion_tokens == kept
    chunks = list(client.completions.create(**body, stream=True))
    for o in ref.outputs:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == o.index]
        assert "".join(c.text for c in mine) == o.text and mine[-1].finish_reason == o.finish_reason
    deadline = time.monotonic() + 10
    while server.engine_call("has_unfinished_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = server.engine_call("stats")
    assert not server.engine_call("has_unfinished_requests") and stats["kv_blocks_in_use"] == 0
    # the two requests' samples ran a few steps past their stop strings at most (1,200 tokens each
    # had the core not been told)
    assert 2 * kept <= stats["generated_tokens"] - generated < 2 * kept + 600


def test_beam_search_and_prompt_logprobs_equal_offline(client, offline):
    ref = offline.generate([PROMPT], SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=6,
                                                    ignore_eos=True))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "beam_width": 3, "ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in ref.outputs]
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, tid, e in zip(got[1:], ref.prompt_token_ids[1:], ref.prompt_token_logprobs[1:]):
        assert entry[str(tid)]["logprob"] == pytest.approx(e.logprob, abs=1e-4)
    assert r.choices[0].logprobs.token_logprobs[1:len(got)] == pytest.approx(
        [e.logprob for e in ref.prompt_token_logprobs[1:]], abs=1e-4)


def test_greedy_chat_equals_offline(client, offline):
    msgs = [{"role": "user", "content": "The quick brown"}]
    ref = offline.chat(msgs, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


# ------------------------------------------------------- across the boundary
def test_structured_output_across_the_boundary(client, server, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, structured_outputs=
                                                    StructuredOutputsParams(choice=["red", "green", "blue"])))[0]
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.text  # the core followed the grammar, as offline
    bad = httpx.post(server.base_url + "/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_disconnects_abort_in_the_core_and_free_kv_blocks(server):
    server.wait_idle()
    before_stats = server.engine_call("stats")
    assert before_stats["kv_blocks_in_use"] == 0
    before = _metrics(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    seen_in_use = []

    def client_that_leaves(i):
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "seed": i}, timeout=60) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        seen_in_use.append(server.engine_call("stats")["kv_blocks_in_use"])
                        break  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=client_that_leaves, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert max(seen_in_use) > 0  # the requests held blocks while they ran
    server.wait_idle(timeout=30)
    stats = server.engine_call("stats")
    assert stats["kv_blocks_in_use"] == 0 and stats["num_running"] + stats["num_waiting"] == 0
    after = _metrics(server)
    aborted = after["kvserve:request_success_total{finished_reason=abort}"] - \
        before.get("kvserve:request_success_total{finished_reason=abort}", 0.0)
    assert aborted == 8
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert generated < 8 * 400 / 2  # cancelled long before the end
    assert after["kvserve:kv_cache_usage_perc"] == 0.0
    assert after["kvserve:kv_cache_used_blocks"] == 0
    assert after["kvserve:kv_cache_free_blocks"] + after["kvserve:kv_cache_cached_blocks"] == stats["kv_blocks_total"]
    assert after["kvserve:kv_cache_cached_blocks"] == stats["kv_blocks_cached"]


def test_bad_requests_get_400_and_a_concurrent_request_is_unaffected(server, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    result = {}

    def good():
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:
            result["events"] = _events(r)

    t = threading.Thread(target=good)
    t.start()
    vocab = server.api.vocab_size
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, vocab + 5], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert str(vocab) in r.json()["error"]["message"]
    # the batch is rejected as a whole, naming the prompt at fault (request_index crossed the pipe)
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [[1, 2], [3, vocab]], "max_tokens": 4})
    assert r.status_code == 400 and "(prompt 1 of the batch)" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "min_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    t.join(60)
    events = result["events"]
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == ref.text
    server.wait_idle()
    assert server.engine_call("stats")["kv_blocks_in_use"] == 0  # nothing of the rejected ones stayed


def test_metrics_move(server):
    server.wait_idle()
    before = _metrics(server)
    api = server.api.async_engine
    api.pause()  # the request waits in the core: the waiting gauge shows it
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
        server.base_url + "/v1/completions", timeout=60,
        json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True})))
    try:
        t.start()
        deadline = time.monotonic() + 10
        while _metrics(server)["kvserve:num_requests_waiting"] != 1:
            assert time.monotonic() < deadline, "the waiting gauge never showed the request"
            time.sleep(0.02)
    finally:
        api.resume()
    t.join(60)
    assert box["r"].status_code == 200
    server.wait_idle()
    after = _metrics(server)
    assert after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"] == 5
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 40
    assert after["kvserve:request_success_total{finished_reason=length}"] - \
        before.get("kvserve:request_success_total{finished_reason=length}", 0.0) == 1
    assert after["kvserve:time_to_first_token_seconds_count"] - before["kvserve:time_to_first_token_seconds_count"] == 1
    assert after["kvserve:request_queue_time_seconds_count"] - before["kvserve:request_queue_time_seconds_count"] == 1
    assert after["kvserve:num_requests_running"] == 0 and after["kvserve:num_requests_waiting"] == 0
    # n = 3: three sequences, each one observation in every histogram (as vLLM's child requests)
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": [5, 6, 7], "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 3,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 18
    server.wait_idle()
    d = {k: v - after.get(k, 0.0) for k, v in _metrics(server).items()}
    assert d["kvserve:request_success_total{finished_reason=length}"] == 3
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "time_per_output_token"):
        assert d[f"kvserve:{h}_seconds_count"] == 3, h
    assert d["kvserve:inter_token_latency_seconds_count"] == 3 * 5


def test_running_gauge_while_streaming(server):
    server.wait_idle()
    api = server.api.async_engine
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        api.pause()  # (the tiny model would finish before the gauge is read): it stays running, unstepped
        try:
            deadline = time.monotonic() + 10
            while _metrics(server)["kvserve:num_requests_running"] != 1:
                assert time.monotonic() < deadline, "the running gauge never showed the request"
                time.sleep(0.01)
            assert _metrics(server)["kvserve:kv_cache_usage_perc"] > 0
        finally:
            api.resume()
        assert [line for line in lines if line][-1] == "data: [DONE]"
    server.wait_idle()
    assert _metrics(server)["kvserve:num_requests_running"] == 0


def test_engine_calls_take_method_names(server):
    with pytest.raises(TypeError, match="method's name"):
        server.engine_call(lambda e: e.stats())
    with pytest.raises(ValueError, match="private"):
        server.engine_call("_seq_id", "x")
    assert server.engine_call("has_unfinished_requests") is False


# --------------------------------------------------------------- the core dies
def test_core_killed_mid_stream(tiny_model_dir):
    # The tiny model with a 4,096-token context and a pool of 768 blocks (3,072 tokens): the two
    # requests killed below generate 1,200 tokens each, so both still run when the core dies.
    # (With 150 tokens each, on the 512-token model, the non-streamed one ended 0.10-0.16 s
    # after the stream's third event on a quiet machine: a test process held up that long before
    # its SIGKILL saw it answered 200 instead of 503.)
    args = EngineArgs(model=str(tiny_model_dir("llama_long")[0]), num_blocks=768, max_waiting=1,
                      **{**TINY, "max_model_len": 4096})
    with ServerThread(args, names=["tiny"]) as s:
        base = s.base_url
        # the waiting queue's limit is the core's: QueueFullError crosses the pipe as a 503
        s.api.async_engine.pause()
        try:
            first_waiting = threading.Thread(target=lambda: httpx.post(
                base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30))
            first_waiting.start()
            deadline = time.monotonic() + 10
            while s.engine_call("stats")["num_waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = httpx.post(base + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        finally:
            s.api.async_engine.resume()
        first_waiting.join(30)
        s.wait_idle()
        # the pool is smaller than max_model_len: a request that could never fit gets 400 at once
        r = httpx.post(base + "/v1/completions", json={"prompt": [3 + i % 380 for i in range(3000)],
                                                       "max_tokens": 100})
        assert r.status_code == 400 and "KV" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        pid = s.api.async_engine.core_pid
        before = _metrics(s)
        plain, streamed, first = {}, {}, threading.Event()

        def non_streaming():
            plain["r"] = httpx.post(base + "/v1/completions", timeout=30,
                                    json={"prompt": [1, 2, 3], "max_tokens": 1200, "ignore_eos": True})

        def streaming():
            events = []
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"prompt": [4, 5, 6], "max_tokens": 1200, "ignore_eos": True,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) == 3:
                            first.set()
            streamed["events"] = events

        threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
        threads[0].start()
        deadline = time.monotonic() + 20
        while s.engine_call("stats")["num_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        threads[1].start()
        assert first.wait(20)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() - killed < 5.0, "/health did not turn 503 within 5 s"
            time.sleep(0.02)
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), "a client hung after the core died"
        events = streamed["events"]
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] and events[-2]["error"]["code"] == "engine_unavailable"
        assert "died" in events[-2]["error"]["message"] and "SIGKILL" in events[-2]["error"]["message"]
        assert not any("error" in e for e in events[:-2])
        assert plain["r"].status_code == 503
        assert "died" in plain["r"].json()["error"]["message"]
        # a new request is refused at once
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(Exception, match="died"):
            s.engine_call("stats")
        after = _metrics(s)  # the API process still serves its metrics
        assert after["kvserve:request_success_total{finished_reason=error}"] - \
            before.get("kvserve:request_success_total{finished_reason=error}", 0.0) == 2
        assert pid_gone(pid, 1.0)
        stop = time.monotonic()
    assert time.monotonic() - stop < 15  # the server stops without waiting on the dead core


def test_server_stop_leaves_no_child_process(tiny_folder):
    with ServerThread(EngineArgs(model=str(tiny_folder), num_blocks=64, **TINY), names=["tiny"]) as s:
        pid = s.api.async_engine.core_pid
        with httpx.stream("POST", s.base_url + "/v1/completions", timeout=30,
                          json={"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # a request is live when the server stops
            s.server.should_exit = True
            s.thread.join(30)
    assert not s.thread.is_alive()
    assert pid_gone(pid, timeout=1.0)
    assert s.api.engine.exitcode == 0  # it stopped when told to (not terminated after a timeout)
    assert not s.api.async_engine.is_running


def test_core_that_fails_to_start_raises_its_error(tmp_path):
    from kvserve.engine.core_client import CoreClient
    from kvserve.worker.default_model import ModelNotFoundError
    from kvserve.worker.loader import ModelLoadError

    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}  # (the module's server's core)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        CoreClient(EngineArgs(model=str(tmp_path / "missing.gguf")))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF this is not a model")
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as err:  # raised in the core process, re-raised here
        CoreClient(EngineArgs(model=str(bad)))
    assert "broken.gguf" in str(err.value)
    assert time.monotonic() - t0 < 120
    assert {p.pid for p in multiprocessing.active_children()} == before  # the failed core was reaped


def _serve(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_cli_missing_model_errors_clearly(tmp_path):
    p = _serve(["--model", str(tmp_path / "missing.gguf"), "--port", "0"])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "missing.gguf" in err and "does not exist" in err and "Traceback" not in err


def _start_serving(folder) -> tuple[subprocess.Popen, int, int]:
    """``kvserve serve`` on the tiny model: (the process, its core's pid, the port), once /health is 200."""
    from server_helpers import free_port

    port = free_port()
    p = _serve(["--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "0.01", "--max-model-len", "256",
                "--port", str(port), "--no-access-log"])
    try:
        core_pid, lines = None, []
        deadline = time.monotonic() + 180
        while core_pid is None:
            line = p.stderr.readline()
            lines.append(line)
            assert line and time.monotonic() < deadline, f"the server did not start: {''.join(lines)}"
            if "engine core in process" in line:
                core_pid = int(line.split("engine core in process ")[1].split(")")[0])
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return p, core_pid, port
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.1)
    except BaseException:
        p.kill()
        p.wait(10)
        raise


def test_cli_core_exits_when_the_api_process_dies(tiny_folder):
    p, core_pid, port = _start_serving(tiny_folder)
    try:
        assert core_pid != p.pid
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200
        os.kill(p.pid, signal.SIGKILL)  # no shutdown: the core notices the closed pipe
        p.wait(10)
        assert pid_gone(core_pid, timeout=10.0), "the core outlived the API process"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_cli_sigterm_stops_the_core(tiny_folder):
    p, core_pid, port = _start_serving(tiny_folder)
    try:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal after its graceful shutdown)
        err = p.stderr.read()
        assert "Traceback" not in err and "did not stop" not in err, err
        assert pid_gone(core_pid, timeout=1.0)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


# ------------------------------------------------------------------ SmolLM2
def _rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / (1 << 20)


@pytest.mark.slow
def test_smollm2_api_process_holds_no_weights(smollm2_path):
    from server_helpers import free_port

    port = free_port()
    # (dequantized float32 weights, 0.54 GB: kept quantized they would be 0.12 GB, too close to
    # the API process's own size to tell where they live)
    p = _serve(["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5", "--port", str(port),
                "--no-access-log"])
    try:
        core_pid = None
        deadline = time.monotonic() + 300
        while core_pid is None:
            line = p.stderr.readline()
            assert line and time.monotonic() < deadline
            if "engine core in process" in line:
                core_pid = int(line.split("engine core in process ")[1].split(")")[0])
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        api, core = _rss_gb(p.pid), _rss_gb(core_pid)
        print(f"RSS after start (SmolLM2 float32, --kv-cache-memory 0.5): API {api:.2f} GB, core {core:.2f} GB")
        # the float32 weights (0.54 GB) live in the core only: the API process (torch, the
        # tokenizer: 0.30 GB) would pass 0.84 GB with them (the core's KV pool, 0.5 GiB, is
        # committed only as tokens are written: kv_cache_manager.allocate_kv_cache)
        assert api < 0.6 and core > 0.54
    finally:
        p.terminate()
        p.wait(30)
    assert pid_gone(core_pid, timeout=5.0)


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smol_server(smollm2_path):
    with ServerThread(EngineArgs(dtype="float32", max_model_len=1024, kv_cache_memory=0.5), names=["smollm2"]) as s:
        yield s


@pytest.mark.slow
def test_smollm2_greedy_equals_offline(smol_server, llm_fp32):
    c = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    refs = llm_fp32.generate(SMOL_PROMPTS, SamplingParams(max_tokens=16, temperature=0, logprobs=1))
    r = c.completions.create(model="smollm2", prompt=SMOL_PROMPTS, max_tokens=16, temperature=0, logprobs=1)
    got = sorted(r.choices, key=lambda ch: ch.index)
    assert [ch.text for ch in got] == [o.text for o in refs]
    assert [ch.finish_reason for ch in got] == [o.finish_reason for o in refs]
    for ch, o in zip(got, refs):
        assert ch.logprobs.token_logprobs == pytest.approx([e.logprob for e in o.outputs[0].token_logprobs], abs=1e-4)
    stream = c.completions.create(model="smollm2", prompt=SMOL_PROMPTS[0], max_tokens=16, temperature=0, stream=True,
                                  n=2)
    texts = {0: "", 1: ""}
    for ch in stream:
        for x in ch.choices:
            texts[x.index] += x.text
    assert texts == {0: refs[0].text, 1: refs[0].text}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm_fp32.chat(msgs, SamplingParams(max_tokens=24, temperature=0))
    r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    smol_server.wait_idle()
    assert smol_server.engine_call("stats")["kv_blocks_in_use"] == 0
