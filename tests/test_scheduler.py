"""Scheduler unit tests on bare requests (no model): budget, chunking, preemption, admission."""

import random

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler


def _req(i, n_prompt, max_tokens=8, priority=0):
    return Request(request_id=f"r{i}", prompt_token_ids=[1] * n_prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens), seed=i,
                   arrival_index=i, priority=priority)


def _run_step(sched: Scheduler):
    """Pretend to run the model: advance computed tokens, append one token where sampled."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                from kvserve.request import RequestStatus
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    return out


def test_token_budget_and_chunking():
    kv = KVCacheManager(num_blocks=100, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=200), kv)
    long, short = _req(0, 25), _req(1, 3)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 10)]
    assert s.num_chunked_prefills == 1


def test_decodes_run_beside_a_chunked_prefill():
    kv = KVCacheManager(num_blocks=100, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, max_model_len=200), kv)
    a = _req(0, 4)
    s.add_request(a)
    _run_step(s)  # a prefilled, has 1 output token
    b = _req(1, 40)
    s.add_request(b)
    for _ in range(4):
        out = s.schedule()
        plan = {r.request_id: n for r, n in out.scheduled}
        assert plan["r0"] == 1 and plan.get("r1", 0) == 7  # decode first, then a chunk
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(7)


def test_preempts_most_recent_and_resumes():
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 24 tokens
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), kv)
    reqs = [_req(i, 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    finished = set()
    for _ in range(200):
        out = _run_step(s)
        for r in reqs:
            if r.is_finished:
                finished.add(r.request_id)
        for v in out.preempted:
            assert v.num_computed_tokens == 0 and v.request_id not in kv.block_tables
        if len(finished) == 3:
            break
    assert len(finished) == 3
    assert s.num_preemptions > 0
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert kv.num_free_blocks == 6


def test_max_num_seqs():
    kv = KVCacheManager(num_blocks=100, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1000, max_num_seqs=2, max_model_len=64), kv)
    for i in range(5):
        s.add_request(_req(i, 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 3


def test_random_workloads_never_hang_and_free_everything():
    rng = random.Random(0)
    for trial in range(30):
        nb = rng.randint(8, 40)
        kv = KVCacheManager(num_blocks=nb, block_size=4)
        cfg = SchedulerConfig(max_num_batched_tokens=rng.randint(1, 64), max_num_seqs=rng.randint(1, 16), max_model_len=nb * 4)
        s = Scheduler(cfg, kv)
        reqs = []
        for i in range(rng.randint(1, 20)):
            p = rng.randint(1, 20)
            m = rng.randint(1, 12)
            if -(-(p + m) // 4) <= nb:  # the engine rejects requests larger than the pool
                reqs.append(_req(i, p, m))
                s.add_request(reqs[-1])
        steps = 0
        while s.has_unfinished():
            out = _run_step(s)
            assert not out.is_empty
            assert out.num_batched_tokens <= cfg.max_num_batched_tokens
            steps += 1
            assert steps < 5000
        assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)
        assert kv.num_free_blocks == nb
