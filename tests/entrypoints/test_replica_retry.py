"""The replica front end's retries (:class:`~kvserve.entrypoints.openai.replica_engine.ReplicatedAsyncEngine`)
on fake replica engines: a request whose replica dies before it accepted the request (the
add was in flight, the router had chosen it while it was still up) goes to another replica,
as one whose replica dies mid-run before it showed anything does; requests that showed
something, or have no replica left, end with the death error; the router's load counts
stay exact through it all, and each request counts once in ``request_success_total`` (where it
finished, or as an error where it was lost), a retry as one ``request_retries_total`` of the
replica that lost it; with prefill/decode disaggregation too. The replicas' engines are real
:class:`MPAsyncEngine` s over fake clients (their metrics and failure paths run as in the
server). No Ray, no model: the real thing is tests/entrypoints/test_replicas_cli.py and
tests/entrypoints/test_replicas.py (slow)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvserve.entrypoints.openai.async_engine import EngineStoppedError, MPAsyncEngine, _track
from kvserve.entrypoints.openai.metrics import ServerMetrics
from kvserve.entrypoints.openai.replica_engine import MAX_RETRIES, ReplicatedAsyncEngine
from kvserve.sampling_params import SamplingParams


class FakeClient:
    """A :class:`ReplicaClient` stand-in that goes nowhere."""

    tokenizer = None

    def __init__(self, name: str) -> None:
        self.name = name

    def send(self, msg) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def start_io(self, on_message, on_exit) -> None:
        pass

    def death_message(self, exitcode) -> str:
        return f"the engine replica {self.name} died or became unreachable"


class FakeEngine(MPAsyncEngine):
    """A replica's :class:`MPAsyncEngine` over a :class:`FakeClient`: an add makes the request's
    track at once (as the core's ``added`` does), :meth:`die` is the replica's death as the
    front end sees it (its live requests fail, counted as the engine counts them), and
    ``die_on_add`` makes the next ``add_requests`` fail so (the pending add gets the error)."""

    def __init__(self, name: str, die_on_add: bool = False) -> None:
        super().__init__(FakeClient(name))
        self.name, self.die_on_add = name, die_on_add
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def add_requests(self, requests, params, out_queue, priority=0, cache_salt=None, arrival=None,
                           prompt_only=False, **kwargs) -> None:
        await asyncio.sleep(0)
        if self.is_running and self.die_on_add:
            self.die()
        if not self.is_running:
            raise EngineStoppedError(self._stop_message())
        for rid, _, tag in requests:
            self._tracks[rid] = _track(out_queue, tag, arrival, params, prompt_only)
        self.added += [rid for rid, _, _ in requests]

    async def call(self, fn, *args):
        return None

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        super().abort(rid)

    def die(self) -> None:
        self._on_exit(-9)


def _engine(*fakes: FakeEngine, roles=None) -> ReplicatedAsyncEngine:
    """The front end over ``fakes`` (``roles``: ``{name: "prefill" | "decode"}`` for disaggregation),
    with its metrics (``eng.metrics``)."""
    names = [f.name for f in fakes]
    pool = SimpleNamespace(disaggregated=roles is not None, names=names,
                           role=lambda n: "replica" if roles is None else roles[n],
                           args=SimpleNamespace(block_size=4), routing="round_robin", clients={})
    eng = ReplicatedAsyncEngine(pool, ServerMetrics("m", replicas=names))
    eng._loop = asyncio.get_running_loop()
    for f in fakes:  # (as ReplicatedAsyncEngine._attach)
        f.metrics = eng.metrics.for_replica(f.name)
        f.record_requests = pool.role(f.name) != "prefill"
        f.start(eng._loop)
    eng.engines = {f.name: f for f in fakes}
    eng.states = {n: "healthy" for n in names}
    return eng


def _counts(eng) -> dict[str, float]:
    """The non-zero request counters: ``{"<replica> <finished_reason>" | "<replica> retries": value}``."""
    out = {}
    for family in eng.metrics.registry.collect():
        for smp in family.samples:
            if smp.value and smp.name == "kvserve:request_success_total":
                out[f"{smp.labels['replica']} {smp.labels['finished_reason']}"] = smp.value
            elif smp.value and smp.name == "kvserve:request_retries_total":
                out[f"{smp.labels['replica']} retries"] = smp.value
    return out


def _output(rid: str, finished: bool = True, tokens: int = 2, handle=None, scheduled=None, transfer_stats=None):
    """A :class:`RequestOutput` of one sample (``finished``: with finish reason ``length``)."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5], num_cached_tokens=0, finished=finished,
                           error=None, kv_transfer_params=handle, kv_transfer_stats=transfer_stats,
                           metrics=SimpleNamespace(first_scheduled_time=scheduled, first_token_time=None),
                           outputs=[SimpleNamespace(index=0, token_ids=list(range(tokens)),
                                                    finish_reason="length" if finished else None)])


async def _settle() -> None:
    """Let the event loop run what the engines and relays scheduled."""
    for _ in range(5):
        await asyncio.sleep(0)


async def _add(eng, rid, q):
    await eng.add_requests([(rid, [1, 2, 3, 4, 5], 0)], SamplingParams(max_tokens=4), q, streaming=False)


def test_a_replica_dying_during_the_add_sends_the_request_to_another():
    async def main():
        a, b = FakeEngine("replica-0", die_on_add=True), FakeEngine("replica-1")
        eng = _engine(a, b)
        q = asyncio.Queue()
        await _add(eng, "r0", q)  # round robin picks replica-0 first
        assert b.added == ["r0"] and a.added == []
        assert eng.num_retries == 1
        assert eng.router.load == {"replica-0": 0, "replica-1": 1}
        b._dispatch([_output("r0")])
        tag, out = await asyncio.wait_for(q.get(), 5)
        assert out.finished and eng.router.load == {"replica-0": 0, "replica-1": 0}
        assert eng._relays == {}
        assert _counts(eng) == {"replica-0 retries": 1, "replica-1 length": 1}

    asyncio.run(main())


def test_no_replica_left_ends_the_add_with_the_death_error_and_counts_nothing():
    async def main():
        a, b = FakeEngine("replica-0", die_on_add=True), FakeEngine("replica-1", die_on_add=True)
        eng = _engine(a, b)
        with pytest.raises(EngineStoppedError, match="replica-1 died"):
            await _add(eng, "r0", asyncio.Queue())
        assert eng.num_retries == 1
        assert eng.router.load == {"replica-0": 0, "replica-1": 0}
        assert eng._relays == {}
        assert _counts(eng) == {"replica-0 retries": 1, "replica-1 error": 1}  # lost with replica-1
        # now neither is up: the next request is refused at once (never routed: not counted)
        with pytest.raises(EngineStoppedError, match="no engine replica is available"):
            await _add(eng, "r1", asyncio.Queue())
        assert _counts(eng) == {"replica-0 retries": 1, "replica-1 error": 1}

    asyncio.run(main())


def test_retries_stop_after_max_retries():
    async def main():
        fakes = [FakeEngine(f"replica-{i}", die_on_add=True) for i in range(MAX_RETRIES + 2)]
        fakes[-1].die_on_add = False
        eng = _engine(*fakes)
        with pytest.raises(EngineStoppedError, match=f"replica-{MAX_RETRIES} died"):
            await _add(eng, "r0", asyncio.Queue())
        assert eng.num_retries == MAX_RETRIES and fakes[-1].added == []
        assert all(v == 0 for v in eng.router.load.values())
        assert _counts(eng) == {**{f"replica-{i} retries": 1 for i in range(MAX_RETRIES)},
                                f"replica-{MAX_RETRIES} error": 1}

    asyncio.run(main())


def test_a_rejection_by_a_live_replica_is_not_retried():
    async def main():
        a, b = FakeEngine("replica-0"), FakeEngine("replica-1")

        async def reject(*args, **kwargs):
            raise EngineStoppedError("the server is shutting down")  # the replica still runs

        a.add_requests = reject
        eng = _engine(a, b)
        with pytest.raises(EngineStoppedError, match="shutting down"):
            await _add(eng, "r0", asyncio.Queue())
        assert eng.num_retries == 0 and b.added == []
        assert eng.router.load == {"replica-0": 0, "replica-1": 0}
        assert _counts(eng) == {}  # refused, as one engine's full queue refuses a request

    asyncio.run(main())


def test_a_death_mid_run_retries_only_what_showed_nothing():
    """The adversarial tester's case: the requests retried after their replica's death count
    once, as finished on the replica that answered, plus a retry of the dead one; not as
    errors (they were: ``error`` +2 on replica-0 for 2 requests answered 200)."""
    async def main():
        a, b = FakeEngine("replica-0"), FakeEngine("replica-1")
        eng = _engine(a, b)
        q0, q1, q2 = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
        await _add(eng, "r0", q0)  # on replica-0
        await eng.add_requests([("s1", [1, 2], 0)], SamplingParams(max_tokens=4), q1, streaming=True)  # replica-1
        await _add(eng, "r2", q2)  # replica-0 again
        assert a.added == ["r0", "r2"] and b.added == ["s1"]
        a._dispatch([_output("r2", finished=False)])  # not streamed: not shown
        a.die()  # replica-0 dies: its engine fails its requests
        await _settle()
        assert b.added == ["s1", "r0", "r2"] and eng.num_retries == 2
        assert _counts(eng) == {"replica-0 retries": 2}
        b._dispatch([_output("r0"), _output("r2")])
        assert (await asyncio.wait_for(q0.get(), 5))[1].finished
        assert (await asyncio.wait_for(q2.get(), 5))[1].finished is False  # (replica-0's, not shown)
        assert (await asyncio.wait_for(q2.get(), 5))[1].finished
        assert _counts(eng) == {"replica-0 retries": 2, "replica-1 length": 2}
        # a stream that showed a token dies with its replica: it ends with the error, counted once
        b._dispatch([_output("s1", finished=False)])
        assert (await asyncio.wait_for(q1.get(), 5))[1].finished is False
        b.die()
        err = (await asyncio.wait_for(q1.get(), 5))[1]
        assert isinstance(err, EngineStoppedError) and "replica-1 died" in str(err)
        assert _counts(eng) == {"replica-0 retries": 2, "replica-1 length": 2, "replica-1 error": 1}
        assert eng._relays == {} and eng.router.load == {"replica-0": 0, "replica-1": 0}

    asyncio.run(main())


def _two_samples(rid: str, first_done: bool, second_done: bool):
    """A :class:`RequestOutput` of an ``n=2`` request (finish reason ``length`` where done)."""
    out = _output(rid, finished=first_done and second_done)
    out.outputs = [SimpleNamespace(index=i, token_ids=[0, 1], finish_reason="length" if done else None)
                   for i, done in enumerate((first_done, second_done))]
    return out


@pytest.mark.parametrize("retried", [True, False])
def test_a_sample_finished_on_a_replica_that_died_counts_once(retried):
    """A non-streamed ``n=2`` request whose first sample finished on replica-0 before it died
    shows the client nothing from there: sent again, it counts its 2 samples where it is
    answered (they were 1 ``length`` on replica-0 too); with no replica left both samples are
    errors of replica-0 (they were 1 ``length`` + 1 ``error`` for a request answered 503)."""
    async def main():
        fakes = [FakeEngine("replica-0")] + ([FakeEngine("replica-1")] if retried else [])
        eng = _engine(*fakes)
        q = asyncio.Queue()
        await eng.add_requests([("r", [1, 2, 3, 4, 5], 0)], SamplingParams(max_tokens=4, n=2), q, streaming=False)
        fakes[0]._dispatch([_two_samples("r", True, False)])
        assert _counts(eng) == {}  # (the request has not ended)
        fakes[0].die()
        await _settle()
        if retried:
            assert fakes[1].added == ["r"] and _counts(eng) == {"replica-0 retries": 1}
            fakes[1]._dispatch([_two_samples("r", True, False)])
            fakes[1]._dispatch([_two_samples("r", True, True)])
            assert _counts(eng) == {"replica-0 retries": 1, "replica-1 length": 2}
            def e2e(name):
                return eng.metrics.registry.get_sample_value("kvserve:e2e_request_latency_seconds_count",
                                                             {"model_name": "m", "replica": name})
            assert e2e("replica-1") == 2 and e2e("replica-0") == 0
        else:
            assert _counts(eng) == {"replica-0 error": 2}
        await _settle()
        assert eng._relays == {} and eng.router.load == {n: 0 for n in eng.router.load}

    asyncio.run(main())


def _disaggregated(prefills: int):
    fakes = [FakeEngine(f"prefill-{i}") for i in range(prefills)] + [FakeEngine("decode-0")]
    eng = _engine(*fakes, roles={f.name: f.name.split("-")[0] for f in fakes})
    return eng, fakes[:-1], fakes[-1]


async def _add_transfer(eng, rid, q):
    await eng.add_requests([(rid, [1, 2, 3, 4, 5], 0)], SamplingParams(max_tokens=4), q, streaming=False)
    assert eng._relays[rid].transfer


def test_a_request_lost_with_the_prefill_replica_counts_once():
    """Disaggregated: a request lost with its prefill replica is an error of that replica when
    no other prefill replica can take it, else a retry of it and a success of the decode
    replica that finished it; one aborted during its prefill counts as an abort there (the
    prefill replicas' engines record no request: these changed no counter)."""
    async def main():
        eng, (p0,), d = _disaggregated(1)
        q = asyncio.Queue()
        await _add_transfer(eng, "r0", q)
        assert p0.added == ["r0"] and d.added == []
        p0.die()
        err = (await asyncio.wait_for(q.get(), 5))[1]
        assert isinstance(err, EngineStoppedError) and "prefill-0 died" in str(err)
        assert eng.num_retries == 0 and _counts(eng) == {"prefill-0 error": 1}
        assert eng._relays == {} and eng.prefill_router.load == {"prefill-0": 0}

        eng, (p0, p1), d = _disaggregated(2)
        q = asyncio.Queue()
        await _add_transfer(eng, "r0", q)  # round robin: prefill-0
        p0.die()
        await _settle()
        assert p1.added == ["r0"] and _counts(eng) == {"prefill-0 retries": 1}
        p1._dispatch([_output("r0", tokens=1, handle="the handle")])  # the prefill's end: to the decode replica
        await _settle()
        assert d.added == ["r0"]
        d._dispatch([_output("r0")])
        assert (await asyncio.wait_for(q.get(), 5))[1].finished
        assert _counts(eng) == {"prefill-0 retries": 1, "decode-0 length": 1}
        await _add_transfer(eng, "r1", asyncio.Queue())  # on prefill-1, the one healthy
        eng.abort("r1")
        assert p1.aborted == ["r1"] and p1._tracks == {}
        assert _counts(eng) == {"prefill-0 retries": 1, "decode-0 length": 1, "prefill-1 abort": 1}
        assert eng._relays == {} and eng.prefill_router.load == {"prefill-0": 0, "prefill-1": 0}

    asyncio.run(main())


def test_the_disaggregation_histograms_carry_the_replica_label():
    """kv_transfer_* and ttft_transfer_seconds are the decode replica's, ttft_queue_seconds and
    ttft_prefill_seconds (and the request's queue time) the prefill replica's."""
    async def main():
        eng, (p0, p1), d = _disaggregated(2)
        q = asyncio.Queue()
        await _add_transfer(eng, "r0", q)
        await _add_transfer(eng, "r1", q)  # round robin: r0 on prefill-0, r1 on prefill-1
        for p, rid in ((p0, "r0"), (p1, "r1")):
            p._dispatch([_output(rid, tokens=1, handle="h", scheduled=time.perf_counter())])
        await _settle()
        stats = {"blocks": 3, "bytes": 3000, "seconds": 0.5}
        d._dispatch([_output("r0", transfer_stats=stats), _output("r1", transfer_stats=stats)])
        for _ in range(2):
            assert (await asyncio.wait_for(q.get(), 5))[1].finished

        def value(name, replica):
            return eng.metrics.registry.get_sample_value(f"kvserve:{name}", {"model_name": "m", "replica": replica})

        for name in ("kv_transfer_blocks", "kv_transfer_bytes", "kv_transfer_seconds", "ttft_transfer_seconds"):
            assert [value(f"{name}_count", r) for r in ("prefill-0", "prefill-1", "decode-0")] == [0, 0, 2], name
        assert value("kv_transfer_blocks_sum", "decode-0") == 6 and value("kv_transfer_bytes_sum", "decode-0") == 6000
        assert value("kv_transfer_seconds_sum", "decode-0") == 1.0
        for name in ("ttft_queue_seconds", "ttft_prefill_seconds", "request_queue_time_seconds"):
            assert [value(f"{name}_count", r) for r in ("prefill-0", "prefill-1", "decode-0")] == [1, 1, 0], name
        assert eng.metrics.registry.get_sample_value("kvserve:kv_transfer_blocks_count", {"model_name": "m"}) is None
        assert _counts(eng) == {"decode-0 length": 2}

    asyncio.run(main())
