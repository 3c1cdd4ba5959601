"""The KV block ops reach the workers with the steps (kvserve.core.kv_ops): an executor over two
workers (rank 1 a shadow that holds the whole pools, as a tensor-parallel rank holds its shard)
sees every copy and swap arrive with ``execute_model``, and after a workload of forks (n,
best_of), beam search, swap and recompute preemption and partial prefix-cache hits the shadow's
KV pools and host pool equal the driver's, bit for bit, after every step: nothing touches a
worker's pools but the ops it is sent. Ordering: the ops recorded after a step (forks, beam
clones) go first in the next step, also across an abort and an idle engine; a first scheduling
pass that only preempted keeps its ops; the per-group rerun of a failed forward carries none
(they were applied); a failure to apply them is the engine's, not a request's."""

from __future__ import annotations

import pickle

import pytest
import torch

import kvserve.engine.core as core_mod
from kvserve import SamplingParams
from kvserve.core.kv_ops import COPY, SWAP_IN, SWAP_OUT, KVCacheOps, KVCacheOpsError
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.executor import Executor
from kvserve.worker.worker import Worker

GiB = 1 << 30
BLOCK = 4


class MirrorExecutor(Executor):
    """Two workers fed the same calls, as tensor-parallel ranks are: rank 0 drives, rank 1 (the
    shadow) gets every ``collective_rpc`` and every step, its ``kv_ops`` through pickle (as to
    another process). Records each step's ops (``steps``)."""

    world_size = 2

    def __init__(self, driver: Worker) -> None:
        self.driver_worker = driver
        self.workers = [driver, Worker(driver.dtype, driver.device)]  # (a whole model: a world of its own)
        self.steps: list[KVCacheOps] = []

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def execute_model(self, scheduler_output: SchedulerOutput):
        self.steps.append(scheduler_output.kv_ops)
        shadow = SchedulerOutput(scheduled=list(scheduler_output.scheduled), preempted=list(scheduler_output.preempted),
                                 kv_ops=pickle.loads(pickle.dumps(scheduler_output.kv_ops)))
        error = None
        try:
            out = self.workers[0].execute_model(scheduler_output)
        except Exception as e:  # every rank runs the step, then the driver's error is raised
            error = e
        self.workers[1].execute_model(shadow)
        if error is not None:
            raise error
        return out

    def in_sync(self) -> bool:
        a, b = self.workers
        pools = [(a.kv_caches, b.kv_caches)] + ([(a.host_caches, b.host_caches)] if a.host_caches is not None else [])
        return all(torch.equal(x, y) for pa, pb in pools for la, lb in zip(pa, pb) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


@pytest.fixture
def mirrored(monkeypatch):
    """Engines built in the test get a :class:`MirrorExecutor`."""
    monkeypatch.setattr(core_mod, "UniProcExecutor", MirrorExecutor)


def _engine(folder: str, **kw) -> LLMEngine:
    args = dict(model=folder, dtype="float32", device="cpu", block_size=BLOCK, max_model_len=128,
                enable_prefix_caching=False)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


SHARED = list(range(40, 54))  # 14 tokens: shared by the prompts below, partial hits at block 4
# (prompt lengths of the forked groups are not 1 + a multiple of the block size: their forks copy)
PROMPTS = [SHARED + [3, 4], SHARED + [6, 7], list(range(100, 121)), SHARED[:9] + [8, 9, 10, 11],
           list(range(200, 213)), SHARED + [12]]
PARAMS = [SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=3, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=10, use_beam_search=True, beam_width=3, n=2, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=1, best_of=3, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=0.8, seed=5, n=2, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]


def _summary(out) -> list:
    return sorted((c.index, c.token_ids, round(c.cumulative_logprob or 0.0, 4)) for c in out.outputs)


def _run(engine: LLMEngine, on_step=None, prompts=PROMPTS, params=PARAMS, late: int = 3) -> dict:
    """Add the first ``late`` requests, the others after 4 steps (prefix-cache hits on the
    blocks of the first ones), step to the end; request id → summary."""
    reqs = [(f"r{i}", list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for rid, p, sp in reqs[:late]:
        engine.add_request(p, sp, request_id=rid)
    final = {}
    for step in range(3000):
        if step == 4:
            for rid, p, sp in reqs[late:]:
                engine.add_request(p, sp, request_id=rid)
        if step > 4 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = _summary(out)
        if on_step is not None:
            on_step(engine)
    assert not engine.has_unfinished_requests()
    return final


@pytest.fixture(scope="module")
def reference(folder):
    """The workload's outputs with a pool that never preempts, one worker."""
    return _run(_engine(folder, num_blocks=512))


def _kinds(ex: MirrorExecutor) -> dict[str, int]:
    n = {COPY: 0, SWAP_OUT: 0, SWAP_IN: 0}
    for ops in ex.steps:
        for b in ops.batches:
            n[b.kind] += len(b)
    return n


@pytest.mark.parametrize("mode", ["swap+prefix", "recompute+prefix", "swap"])
def test_shadow_worker_stays_in_sync_through_forks_beams_and_swaps(folder, mirrored, reference, mode):
    kw = dict(num_blocks=32, enable_prefix_caching="prefix" in mode)
    if mode.startswith("swap"):
        kw["swap_space"] = 64.5 * 512 * BLOCK / GiB  # 64 host blocks
    engine = _engine(folder, **kw)
    ex = engine.executor
    assert isinstance(ex, MirrorExecutor) and ex.workers[1].kv_caches is not engine.kv_caches
    assert (ex.workers[1].host_caches is not None) == mode.startswith("swap")
    checks = []

    def check(eng):
        checks.append(ex.in_sync())
        eng.kv.check_invariants()

    assert _run(engine, check) == reference
    assert checks and all(checks), f"the shadow's pools diverged at step {checks.index(False)}"
    s = engine.stats()
    assert s["num_preemptions"] > 0
    kinds = _kinds(ex)
    assert kinds[COPY] > 0  # forks, beam clones (and partial prefix hits)
    if mode.startswith("swap"):
        assert s["swap_num_swap_outs"] > 0 and s["swap_num_swap_ins"] > 0
        assert kinds[SWAP_OUT] == s["swap_num_swapped_out_blocks"] and kinds[SWAP_IN] == s["swap_num_swapped_in_blocks"]
    else:
        assert kinds[SWAP_OUT] == kinds[SWAP_IN] == 0
    if "prefix" in mode:
        assert s["prefix_cache_hits"] > 0
    assert not engine.kv.ops  # nothing left behind


def test_ops_recorded_after_a_step_go_first_in_the_next(folder, mirrored, reference):
    """Forks (n, best_of) and beam clones are recorded after a step's forward: they are the first
    ops of the next step's SchedulerOutput, in the order recorded, followed by that step's own."""
    engine = _engine(folder, num_blocks=32, enable_prefix_caching=True, swap_space=64.5 * 512 * BLOCK / GiB)
    ex = engine.executor
    pending: list[list] = []  # per step: the ops recorded after its forward

    def check(eng):
        pending.append(eng.kv.ops.moves())
        assert ex.in_sync()

    assert _run(engine, check) == reference
    assert len(ex.steps) == len(pending)
    carried = 0
    for i in range(len(pending) - 1):
        nxt = ex.steps[i + 1].moves()
        assert nxt[: len(pending[i])] == pending[i], f"step {i + 1} does not start with the ops recorded after step {i}"
        carried += len(pending[i])
    assert carried > 0 and all(m[0] == COPY for p in pending for m in p)
    assert pending[-1] == []


def test_abort_and_idle_keep_pending_ops_in_order(folder, mirrored, reference):
    """Ops recorded for a group that is aborted before the next forward are not dropped (a block
    they write may be reused, or enter the prefix cache): they go, in order, before the next
    forward, also when the engine was idle in between; the other requests are unaffected."""
    engine = _engine(folder, num_blocks=64, enable_prefix_caching=True)
    ex = engine.executor
    engine.add_request(PROMPTS[0], PARAMS[0], request_id="forked")
    for _ in range(20):  # the step that computes the prompt forks its other samples after it
        engine.step()
        if engine.kv.ops:
            break
    pending = engine.kv.ops.moves()
    assert pending and all(m[0] == COPY for m in pending)
    engine.abort_request("forked")
    assert not engine.has_unfinished_requests()
    assert engine.step() == [] and engine.kv.ops.moves() == pending  # idle: nothing runs, nothing is lost
    n = len(ex.steps)
    final = _run(engine, lambda eng: (eng.kv.check_invariants(), ex.in_sync() or pytest.fail("out of sync")),
                 prompts=PROMPTS[1:3], params=PARAMS[1:3])
    assert ex.steps[n].moves()[: len(pending)] == pending
    assert final == {f"r{i}": reference[f"r{i + 1}"] for i in range(2)}
    assert ex.in_sync() and not engine.kv.ops


def test_a_scheduling_pass_that_only_preempted_keeps_its_ops(folder, mirrored):
    """When the first scheduling pass only makes room (preemptions, no tokens), the core schedules
    again: the step carries the ops of both passes, first pass first."""
    engine = _engine(folder, num_blocks=32)
    ex = engine.executor
    sched = engine.scheduler
    real = sched.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 1:  # a pass that swapped a block out, say, and scheduled nothing
            engine.kv.ops.copy(30, 31, 2)
            return SchedulerOutput(preempted=[object()])
        out = real()
        engine.kv.ops.copy(29, 28, 1)
        return out

    sched.schedule = schedule
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    assert len(calls) == 2 and ex.steps[0].moves() == [(COPY, 30, 31, 2), (COPY, 29, 28, 1)]
    assert ex.in_sync()


def test_rerun_after_a_failed_forward_carries_no_ops(folder, mirrored, reference):
    """The ops of a step whose batched forward raises were applied before it: the per-group reruns
    carry none, and the shadow stays in sync."""
    engine = _engine(folder, num_blocks=32, enable_prefix_caching=True, swap_space=64.5 * 512 * BLOCK / GiB)
    ex = engine.executor
    raised: list[int] = []  # indices in ex.steps of the calls whose forward raised
    for w in ex.workers:
        orig = w.runner.execute

        def execute(so, w=w, orig=orig):
            if len(raised) < 2 and so.kv_ops and len({r.parent_id for r, _ in so.scheduled}) > 1:
                raised.append(len(ex.steps) - 1)  # (every rank fails the same step, once)
                raise RuntimeError("injected forward fault")
            return orig(so)

        w.runner.execute = execute
    ends: list[int] = []  # after each engine step: the calls so far

    def check(eng):
        ends.append(len(ex.steps))
        assert ex.in_sync()

    final = _run(engine, check)
    assert len(raised) == 2 and raised[0] == raised[1]
    f = raised[0]
    end = next(e for e in ends if e > f)
    assert ex.steps[f] and end - f - 1 >= 2  # the failed call carried ops; then one rerun per group
    assert all(not ops for ops in ex.steps[f + 1 : end])
    assert set(final) == set(reference) and ex.in_sync()


def test_a_failure_to_apply_the_ops_is_the_engines(folder):
    """A worker that cannot apply a step's ops raises KVCacheOpsError out of step(): the requests
    are not rerun without them (the pools would no longer match the books)."""
    engine = _engine(folder, num_blocks=32)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.kv.ops.copy(0, 10 ** 6, 1)  # a block beyond the pool
    # (checked on the host before anything is applied: on CUDA a bad index_copy_ would only be
    # a device-side assert at a later call)
    with pytest.raises(KVCacheOpsError, match="applying 1 KV block moves failed: IndexError: copy: dst block "
                                              "1000000 is out of range of the device pool of 32 blocks"):
        engine.step()
