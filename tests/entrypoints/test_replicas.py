"""Engine replicas on Ray Serve behind the OpenAI server: 2 replicas under each routing
policy, and 1 prefill + 1 decode replica, give SmolLM2's float32 greedy outputs token for
token as ``LLM.generate()``, through the openai client, streamed and not; prefix routing
computes at most 0.6x the prompt tokens of round robin on groups sharing a 1,000-token prefix;
the decode replica computes one prompt token per request; a killed prefill replica leaks no
decode block and no request hangs.

The replicas run on a Ray instance this module starts (8 logical CPUs on this 2-core machine, 1 per
replica:
slow, but they prove correctness); the server runs in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.router import Router
from server_helpers import ServerThread, pid_gone, request_counts

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")

ARGS = dict(dtype="float32", kv_cache_memory=0.25, max_model_len=2048)
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ray_instance():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, object_store_memory=512 << 20, include_dashboard=False,
                 logging_level="WARNING", log_to_driver=False)
    yield
    if started:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(model=str(smollm2_path), **ARGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = llm.generate(PROMPTS, params)
    texts = [o.outputs[0].text for o in outs]
    ids = [list(o.outputs[0].token_ids) for o in outs]
    sampled = llm.generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, n=2, seed=7))
    REFERENCE_SAMPLED[:] = [o.text for o in sampled[0].outputs]
    llm.shutdown()
    return texts, ids


REFERENCE_SAMPLED: list[str] = []


def _server(smollm2_path, specs_kwargs, prefix, routing="prefix"):
    from kvserve.engine.ray_serve import ReplicaDeployment, replica_specs
    from kvserve.engine.replica_client import ReplicaPool

    args = EngineArgs(model=str(smollm2_path), **ARGS)
    deployment = ReplicaDeployment(args, replica_specs(**specs_kwargs, app_prefix=prefix), replica_cpus=1)
    pool = ReplicaPool(deployment, routing)
    return ServerThread(pool, names=["smol"])


@pytest.fixture(scope="module")
def replicas(ray_instance, smollm2_path):
    with _server(smollm2_path, dict(data_parallel_size=2), "test-dp") as s:
        yield s
        # (leaving: the lifespan stops the engines; the deployment's apps are deleted)


@pytest.fixture(scope="module")
def tiny_replicas(ray_instance, tiny_model_dir):
    """2 replicas of a tiny random model with a 4,096-token context (long prompts, quickly)."""
    from kvserve.engine.ray_serve import ReplicaDeployment, replica_specs
    from kvserve.engine.replica_client import ReplicaPool

    args = EngineArgs(model=str(tiny_model_dir("llama_long")[0]), dtype="float32", max_model_len=2048,
                      num_blocks=2048, block_size=16)
    deployment = ReplicaDeployment(args, replica_specs(data_parallel_size=2, app_prefix="test-tiny"), replica_cpus=1)
    with ServerThread(ReplicaPool(deployment, "prefix"), names=["smol"]) as s:
        yield s


@pytest.fixture(scope="module")
def disaggregated(ray_instance, smollm2_path, replicas):
    with _server(smollm2_path, dict(prefill_replicas=1, decode_replicas=1), "test-pd") as s:
        yield s


def _check_outputs(base_url, reference):
    texts, ids = reference
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(p):
            r = await aclient.completions.create(model="smol", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text

        async def streamed(p):
            parts = []
            stream = await aclient.completions.create(model="smol", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True)
            async for chunk in stream:
                parts.extend(c.text for c in chunk.choices)
            return "".join(parts)

        got = await asyncio.gather(*(one(p) for p in PROMPTS), *(streamed(p) for p in PROMPTS))
        await aclient.close()
        return got

    got = asyncio.run(run_all())
    assert got[: len(PROMPTS)] == texts
    assert got[len(PROMPTS):] == texts
    # a batch of prompts in one request (each routed on its own), with the tokens back
    r = client.completions.create(model="smol", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=0)
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == texts


def _stats(server) -> dict:
    return server.api.async_engine.call_sync("stats")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix"])
def test_two_replicas_equal_offline_under_each_routing(replicas, reference, policy):
    engine = replicas.api.async_engine
    engine.router = Router(engine.decode_names, policy, block_size=16)
    _check_outputs(replicas.base_url, reference)
    routed = engine.router.routed
    assert sum(routed.values()) == 3 * len(PROMPTS)
    if policy != "prefix":  # (prefix may keep short prompts together)
        assert min(routed.values()) >= len(PROMPTS) // 2
    assert engine.router.load == {"replica-0": 0, "replica-1": 0}
    health = replicas.api.async_engine.replica_states()
    assert {n: h["state"] for n, h in health.items()} == {"replica-0": "healthy", "replica-1": "healthy"}


def _computed(server) -> dict:
    return {n: s["prompt_tokens_computed"] for n, s in _stats(server).items()}


def _run_groups(server, seed: int) -> tuple[int, dict]:
    """8 groups of 8 requests, each group sharing a 1,000-token prefix (the group's first
    request alone, then the other 7 at once); returns the prompt tokens the replicas computed
    and the requests per replica."""
    rng = random.Random(seed)
    engine = server.api.async_engine
    before = _computed(server)
    routed_before = dict(engine.router.routed)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(ids):
            r = await aclient.completions.create(model="smol", prompt=ids, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens == len(ids)

        for g in range(8):
            prefix = [rng.randrange(3, 384) for _ in range(1000)]
            prompts = [prefix + [rng.randrange(3, 384) for _ in range(8)] for _ in range(8)]
            await one(prompts[0])
            await asyncio.gather(*(one(p) for p in prompts[1:]))
        await aclient.close()

    asyncio.run(run())
    after = _computed(server)
    routed = {n: engine.router.routed[n] - routed_before.get(n, 0) for n in engine.router.routed}
    return sum(after[n] - before[n] for n in after), routed


def test_prefix_routing_computes_at_most_0_6x_of_round_robin(tiny_replicas):
    """(A tiny random model: the routing and the caches are the same as SmolLM2's, the
    prefills of 130,000 prompt tokens take seconds instead of minutes.)"""
    engine = tiny_replicas.api.async_engine
    engine.router = Router(engine.decode_names, "round_robin", block_size=16)
    rr, _ = _run_groups(tiny_replicas, seed=1)
    engine.router = Router(engine.decode_names, "prefix", block_size=16)
    px, routed = _run_groups(tiny_replicas, seed=2)  # (other prefixes: nothing of them is cached)
    print(f"prompt tokens computed: round_robin {rr}, prefix {px} ({px / rr:.2f}x); prefix routing: {routed}")
    assert px <= 0.6 * rr, (px, rr)
    assert max(routed.values()) <= 0.7 * 64, routed
    assert px >= 8 * 1000  # each prefix computed once at least (the measure is real)


def test_metrics_and_health_per_replica(replicas):
    engine = replicas.api.async_engine
    engine.router = Router(engine.decode_names, "round_robin", block_size=16)
    client = openai.OpenAI(base_url=replicas.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    for _ in range(2):  # one on each
        client.completions.create(model="smol", prompt="hi", max_tokens=2)
    text = replicas.api.metrics.render().decode()
    for name in ("replica-0", "replica-1"):
        assert f'kvserve:num_requests_running{{model_name="smol",replica="{name}"}}' in text
        line = next(ln for ln in text.splitlines()
                    if ln.startswith(f'kvserve:time_to_first_token_seconds_count{{model_name="smol",replica="{name}"}}'))
        assert float(line.split()[-1]) > 0
    import httpx

    r = httpx.get(replicas.base_url + "/health", timeout=10)
    assert r.status_code == 200
    states = r.json()["replicas"]
    assert set(states) == {"replica-0", "replica-1"} and all(s["state"] == "healthy" for s in states.values())
    # the step heartbeat per replica: a paused replica with a request pending is 'stalled'
    engine.engines["replica-1"].pause()
    engine.router = Router(engine.decode_names, "round_robin", block_size=16)
    client.completions.create(model="smol", prompt="hi", max_tokens=2)  # -> replica-0
    import threading

    pending = threading.Thread(target=lambda: client.completions.create(model="smol", prompt="hi", max_tokens=2))
    pending.start()  # -> replica-1, paused
    saved, replicas.api.health_timeout = replicas.api.health_timeout, 0.5
    try:
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(replicas.base_url + "/health", timeout=10)
            if r.json()["replicas"]["replica-1"]["state"] == "stalled":
                break
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["replicas"]["replica-0"]["state"] == "healthy"  # one still serves
    finally:
        replicas.api.health_timeout = saved
        engine.engines["replica-1"].resume()
        pending.join(60)
    assert not pending.is_alive()
    # the web dashboard's feed sums the replicas
    stats = httpx.get(replicas.base_url + "/dashboard/stats", timeout=10).json()
    text = replicas.api.metrics.render().decode()
    ttft_counts = sum(float(ln.split()[-1]) for ln in text.splitlines()
                      if ln.startswith("kvserve:time_to_first_token_seconds_count"))
    assert stats["totals"]["time_to_first_token_seconds_count"] == ttft_counts
    assert len(stats["requests"]) >= 4  # (the 4 requests of this test at least)


def _samples(server) -> dict[str, float]:
    """``/metrics``' samples: ``{'name{model_name="smol",replica="..."}': value}``."""
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in server.api.metrics.render().decode().splitlines()
            if ln and not ln.startswith("#")}


def test_disaggregated_equals_offline_and_the_decode_replica_computes_one_prompt_token(disaggregated, reference):
    before = _stats(disaggregated)
    samples_before = _samples(disaggregated)
    _check_outputs(disaggregated.base_url, reference)
    after = _stats(disaggregated)
    samples = _samples(disaggregated)
    n = 3 * len(PROMPTS)
    computed = {k: after[k]["prompt_tokens_computed"] - before[k]["prompt_tokens_computed"] for k in after}
    assert computed["decode-0"] == n  # the one prompt token owed per request, nothing more
    assert computed["prefill-0"] >= sum(len(disaggregated.api.engine.encode(p)) - 1 for p in PROMPTS)
    assert after["prefill-0"]["kv_transfer_saved"] - before["prefill-0"]["kv_transfer_saved"] == n
    assert after["prefill-0"]["generated_tokens"] - before["prefill-0"]["generated_tokens"] == n  # (1 each, dropped)

    def delta(name, replica):
        key = f'kvserve:{name}{{model_name="smol",replica="{replica}"}}'
        return samples[key] - samples_before[key]

    # each series carries the replica that measured it: the decode replica's transfer and TTFT
    # part, the prefill replica's queue time (the decode replica's would include the prefill)
    for name, on_prefill in (("ttft_queue_seconds", True), ("ttft_prefill_seconds", True),
                             ("request_queue_time_seconds", True), ("ttft_transfer_seconds", False),
                             ("kv_transfer_blocks", False), ("kv_transfer_bytes", False),
                             ("kv_transfer_seconds", False)):
        assert (delta(f"{name}_count", "prefill-0"), delta(f"{name}_count", "decode-0")) == \
            ((n, 0) if on_prefill else (0, n)), name
    loaded = after["decode-0"]["kv_transfer_loaded_bytes"] - before["decode-0"]["kv_transfer_loaded_bytes"]
    assert loaded > 0 and delta("kv_transfer_bytes_sum", "decode-0") == loaded
    assert after["decode-0"]["kv_transfer_failed"] == before["decode-0"]["kv_transfer_failed"]
    engine = disaggregated.api.async_engine
    assert engine.num_transfers >= n


def _request_counts(server) -> dict[str, float]:
    return request_counts(server.api.metrics.registry.collect())


def test_a_killed_prefill_replica_leaks_no_decode_block_and_no_request_hangs(disaggregated, reference):
    """... and each request counts once: finished on the decode replica, or an error of the
    prefill replica (the only one: nothing to retry on); these changed no counter."""
    engine = disaggregated.api.async_engine
    start_free = _stats(disaggregated)["decode-0"]["kv_blocks_free"] + _stats(disaggregated)["decode-0"]["kv_blocks_cached"]
    states = engine.replica_states()
    prefill_pid = states["prefill-0"]["pid"]
    before = _request_counts(disaggregated)
    routed = engine.prefill_router.routed["prefill-0"]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=disaggregated.base_url + "/v1", api_key="none", max_retries=0,
                                     timeout=180)

        async def one(i):
            ids = [random.Random(i).randrange(100, 40_000) for _ in range(600)]
            try:
                r = await aclient.completions.create(model="smol", prompt=ids, max_tokens=4, temperature=0)
                return r.choices[0].finish_reason
            except openai.APIStatusError as e:
                return e.status_code

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        deadline = time.monotonic() + 60  # until the 6 are routed to the prefill replica
        while engine.prefill_router.routed["prefill-0"] < routed + 6:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        os.kill(prefill_pid, signal.SIGKILL)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 150)
        await aclient.close()
        return got

    t0 = time.monotonic()
    got = asyncio.run(run())
    assert time.monotonic() - t0 < 150
    assert all(g in ("length", 503) for g in got), got  # finished (retried) or a clean error, never a hang
    after = _request_counts(disaggregated)
    d = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    print(f"outcomes {got}; request counters' changes: {d}")
    assert d == {k: v for k, v in (("decode-0 length", got.count("length")), ("prefill-0 error", got.count(503)))
                 if v}, (got, d)
    assert pid_gone(prefill_pid)
    deadline = time.monotonic() + 90
    while engine.replica_states()["prefill-0"]["state"] != "healthy":
        assert time.monotonic() < deadline, engine.replica_states()
        time.sleep(0.5)
    assert engine.replica_states()["prefill-0"]["pid"] != prefill_pid
    assert engine.replica_states()["prefill-0"]["restarts"] == 1
    # the decode replica holds no block of the dead replica's requests
    deadline = time.monotonic() + 30
    while True:
        s = _stats(disaggregated)["decode-0"]
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_in_use"] == 0:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    assert s["kv_blocks_free"] + s["kv_blocks_cached"] == start_free
    # and it serves again, token for token
    _check_outputs(disaggregated.base_url, reference)


@pytest.mark.parametrize("which", ["replicas", "disaggregated"])
def test_sampling_errors_and_options_as_one_engine(which, request, reference):
    """Seeded n=2 sampling gives the offline samples; bad input gets the same 400 naming the
    field; JSON-schema output and beam search run (beam search on a decode replica alone)."""
    server = request.getfixturevalue(which)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.8, n=2,
                                  seed=7)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == REFERENCE_SAMPLED
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="hi", max_tokens=4000)
    assert e.value.body["param"] == "max_tokens" and "2048" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="hi", max_tokens=4, logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:  # one bad prompt of a batch: none runs
        client.completions.create(model="smol", prompt=["hi", [1, 2, 10**9]], max_tokens=4)
    assert "prompt[1]" in e.value.body["message"] or e.value.body["param"] == "prompt"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Give me a number"}],
                                       max_tokens=30, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": schema}})
    import json

    assert set(json.loads(r.choices[0].message.content)) == {"a"}
    r = client.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True})
    assert len(r.choices) == 2
    engine = server.api.async_engine
    assert all(v == 0 for v in engine.router.load.values())


def test_replicas_that_cannot_fit_the_cluster_fail_at_once(ray_instance, smollm2_path):
    from kvserve.engine.ray_serve import ReplicaDeployment, replica_specs

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^2 replicas of --replica-cpus 100 need 200 Ray CPUs, but the Ray cluster "
                                         r"has 8 CPUs"):
        ReplicaDeployment(EngineArgs(model=str(smollm2_path)), replica_specs(2, app_prefix="test-big"),
                          replica_cpus=100)
    assert time.monotonic() - t0 < 10
