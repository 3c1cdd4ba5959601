"""The replica front end's retries (:class:`~kvserve.entrypoints.openai.replica_engine.ReplicatedAsyncEngine`)
on fake replica engines: a request whose replica dies before it accepted the request (the
add was in flight, the router had chosen it while it was still up) goes to another replica,
as one whose replica dies mid-run before it showed anything does; requests that showed
something, or have no replica left, end with the death error; the router's load counts
stay exact through it all. No Ray, no model: the real thing is
tests/entrypoints/test_replicas_cli.py (slow)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvserve.entrypoints.openai.async_engine import EngineStoppedError
from kvserve.entrypoints.openai.replica_engine import MAX_RETRIES, ReplicatedAsyncEngine
from kvserve.sampling_params import SamplingParams


class FakeEngine:
    """An :class:`MPAsyncEngine` stand-in: ``die_on_add`` makes the next ``add_requests`` fail
    as a replica's death does (the engine stops running, the pending add gets the error)."""

    def __init__(self, name: str, die_on_add: bool = False) -> None:
        self.name, self.die_on_add = name, die_on_add
        self.running = True
        self.added: list[str] = []
        self.aborted: list[str] = []
        self._tracks: dict = {}

    @property
    def is_running(self) -> bool:
        return self.running

    async def add_requests(self, requests, params, out_queue, *args, **kwargs) -> None:
        await asyncio.sleep(0)
        if not self.running or self.die_on_add:
            self.running = False
            raise EngineStoppedError(f"the engine replica {self.name} died or became unreachable")
        self.added += [rid for rid, _, _ in requests]

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _engine(*fakes: FakeEngine) -> ReplicatedAsyncEngine:
    names = [f.name for f in fakes]
    pool = SimpleNamespace(disaggregated=False, names=names, role=lambda n: "replica",
                           args=SimpleNamespace(block_size=4), routing="round_robin", clients={})
    eng = ReplicatedAsyncEngine(pool)
    eng.engines = {f.name: f for f in fakes}
    eng.states = {n: "healthy" for n in names}
    eng._loop = asyncio.get_running_loop()
    return eng


def _finished_output():
    return SimpleNamespace(finished=True, error=None)


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
        eng._relays["r0"].put_nowait((0, _finished_output()))
        tag, out = q.get_nowait()
        assert out.finished and eng.router.load == {"replica-0": 0, "replica-1": 0}
        assert eng._relays == {}

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
        # now neither is up: the next request is refused at once
        with pytest.raises(EngineStoppedError, match="no engine replica is available"):
            await _add(eng, "r1", asyncio.Queue())

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

    asyncio.run(main())


def test_a_death_mid_run_retries_only_what_showed_nothing():
    async def main():
        a, b = FakeEngine("replica-0"), FakeEngine("replica-1")
        eng = _engine(a, b)
        q0, q1 = asyncio.Queue(), asyncio.Queue()
        await _add(eng, "r0", q0)  # on replica-0
        await eng.add_requests([("s1", [1, 2], 0)], SamplingParams(max_tokens=4), q1, streaming=True)  # replica-1
        await _add(eng, "r2", asyncio.Queue())  # replica-0 again
        assert a.added == ["r0", "r2"] and b.added == ["s1"]
        eng._relays["r2"].put_nowait((0, SimpleNamespace(finished=False, error=None)))  # not streamed: not shown
        a.running = False  # replica-0 dies: its engine fails its requests
        err = EngineStoppedError("the engine replica replica-0 died or became unreachable")
        for rid in ("r0", "r2"):
            eng._relays[rid].put_nowait((0, err))
        await asyncio.sleep(0.01)
        assert b.added == ["s1", "r0", "r2"] and eng.num_retries == 2
        # a stream that showed a token dies with its replica: it ends with the error
        eng._relays["s1"].put_nowait((0, SimpleNamespace(finished=False, error=None)))
        assert q1.get_nowait()[1].finished is False
        b.running = False
        eng._relays["s1"].put_nowait((0, EngineStoppedError("the engine replica replica-1 died")))
        assert isinstance(q1.get_nowait()[1], EngineStoppedError)

    asyncio.run(main())
