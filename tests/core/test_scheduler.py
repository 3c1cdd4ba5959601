"""Scheduler unit tests on bare requests (no model): budget, chunking, preemption, admission."""

import random

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler


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
                from kvserve.core.request import RequestStatus
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


# ----------------------------------------------------------------------------- prefix caching
import pytest
import torch

from kvserve.core.request import RequestStatus


def _value(req: Request, pos: int) -> float:
    """What the fake model writes as the K of ``pos``: it depends on the namespace and on
    every token up to ``pos`` (as real K/V do)."""
    key = (getattr(req, "adapter_id", None), req.cache_salt, tuple(int(t) for t in req.all_token_ids[: pos + 1]))
    return float(hash(key) % (1 << 40))


class FakeModel:
    """Stands in for the model runner: checks that every computed position of a request's
    block table holds the right K/V before a step, then writes the new positions."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        shape = (num_blocks, block_size, 1, 1)
        self.kv_caches = [(torch.full(shape, -1.0, dtype=torch.float64), torch.full(shape, -1.0, dtype=torch.float64))]
        self.computed = 0

    def slot(self, kv: KVCacheManager, req: Request, pos: int) -> tuple[int, int]:
        return kv.block_tables[req.request_id][pos // self.bs], pos % self.bs

    def run(self, kv: KVCacheManager, req: Request, n: int) -> None:
        k, v = self.kv_caches[0]
        for p in range(req.num_computed_tokens):
            b, o = self.slot(kv, req, p)
            assert k[b, o, 0, 0].item() == _value(req, p), f"{req.request_id}: wrong K at {p}"
            assert v[b, o, 0, 0].item() == -_value(req, p)
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            b, o = self.slot(kv, req, p)
            assert b not in kv.cache._cached if kv.cache is not None else True, "write into a cached block"
            k[b, o, 0, 0] = _value(req, p)
            v[b, o, 0, 0] = -_value(req, p)
        self.computed += n


def _caching(num_blocks: int, block_size: int, **kw) -> tuple[KVCacheManager, FakeModel]:
    model = FakeModel(num_blocks, block_size)
    return KVCacheManager(num_blocks, block_size, True, model.kv_caches, **kw), model


def _step(s: Scheduler, model: FakeModel, check: bool = True):
    """One engine step with the fake model: run, advance, cache, sample (next token is a
    function of the last tokens, so shared histories stay shared)."""
    out = s.schedule()
    for req, n in out.scheduled:
        model.run(s.kv, req, n)
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        s.kv.cache_computed(req)
    for req, n in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(sum(req.all_token_ids[-3:]) % 5)
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
    if check:
        s.kv.check_invariants()
    return out


def _run_all(s: Scheduler, model: FakeModel, limit: int = 2000) -> None:
    for _ in range(limit):
        if not s.has_unfinished():
            return
        assert not _step(s, model).is_empty
    raise AssertionError("did not finish")


def _preq(i, tokens, max_tokens=4, priority=0, salt=None, prompt_logprobs=None):
    return Request(request_id=f"r{i}", prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
                   seed=i, arrival_index=i, priority=priority, cache_salt=salt)


def _sched(kv, budget=64, seqs=8, **kw):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=512), kv, **kw)


@pytest.mark.parametrize("prompt_len", [20, 16])  # 16: an exact multiple of the block size
def test_cache_hit_leaves_last_token_and_copies_partial_block(prompt_len):
    kv, model = _caching(32, 4)
    s = _sched(kv)
    prompt = list(range(100, 100 + prompt_len))
    a = _preq(0, prompt)
    s.add_request(a)
    _run_all(s, model)
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == (prompt_len + 3) // 4
    b = _preq(1, prompt)
    s.add_request(b)
    out = _step(s, model)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r1", 1)]  # a one-token prefill
    assert b.num_cached_tokens == prompt_len - 1 and b.num_computed_tokens == prompt_len
    assert b.output_token_ids == a.output_token_ids[:1]
    _run_all(s, model)
    assert b.output_token_ids == a.output_token_ids
    st = kv.stats()
    assert st["prefix_cache_queries"] == 2 * prompt_len and st["prefix_cache_hits"] == prompt_len - 1
    assert st["kv_blocks_free"] + st["kv_blocks_cached"] + st["kv_blocks_in_use"] == 32


def test_partial_block_reuse_off_reuses_full_blocks_only():
    model = FakeModel(32, 4)
    kv = KVCacheManager(32, 4, True, model.kv_caches, partial_block_reuse=False)
    s = _sched(kv)
    prompt = list(range(18))
    s.add_request(_preq(0, prompt))
    _run_all(s, model)
    b = _preq(1, prompt[:14] + [99, 98])
    s.add_request(b)
    _step(s, model)
    assert b.num_cached_tokens == 12  # 3 full blocks; the 2 tokens inside block 4 are recomputed


def test_two_requests_in_one_step_sharing_an_uncomputed_prefix():
    kv, model = _caching(64, 4)
    s = _sched(kv, budget=20)  # chunked prefill
    shared = list(range(30))
    a, b = _preq(0, shared + [1, 2]), _preq(1, shared + [3, 4])
    s.add_request(a)
    _step(s, model)
    s.add_request(b)
    assert a.num_computed_tokens == 20
    out = _step(s, model)  # b hits a's first chunk, not the blocks a computes in this step
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 12), ("r1", 8)]
    assert b.num_cached_tokens == 20
    _run_all(s, model)
    assert a.is_finished and b.is_finished
    # Admitted together, nothing is computed yet: no hit, and both compute the shared part.
    c, d = _preq(2, list(range(200, 230)) + [1]), _preq(3, list(range(200, 230)) + [2])
    s.add_request(c)
    s.add_request(d)
    _step(s, model)
    assert c.num_cached_tokens == 0 and d.num_cached_tokens == 0
    _run_all(s, model)


class CollidingInt(int):
    """A token id whose hash collides with every other token id."""

    def __hash__(self) -> int:
        return 0


def test_forced_key_collision_is_told_apart_by_tokens():
    kv, model = _caching(64, 4)
    s = _sched(kv)
    x = [CollidingInt(t) for t in range(10, 30)]
    y = [CollidingInt(t) for t in range(50, 70)]
    assert hash(tuple(x[:4])) == hash(tuple(y[:4]))  # the radix children keys collide
    a, b = _preq(0, x), _preq(1, y)
    s.add_request(a)
    _run_all(s, model)
    s.add_request(b)
    _run_all(s, model)  # the fake model checks every K/V b relies on
    assert b.num_cached_tokens == 0
    c = _preq(2, y)
    s.add_request(c)
    _run_all(s, model)
    assert c.num_cached_tokens == 19 and c.output_token_ids == b.output_token_ids


def test_salts_and_adapters_isolate():
    kv, model = _caching(64, 4)
    s = _sched(kv)
    prompt = list(range(40))
    s.add_request(_preq(0, prompt, salt="a"))
    _run_all(s, model)
    reqs = [_preq(1, prompt, salt="b"), _preq(2, prompt), _preq(3, prompt, salt="a"), _preq(4, prompt, salt="x")]
    reqs[3].adapter_id = "x"  # same value, different kind: adapter "x" with salt "x"
    adapter = _preq(5, prompt)
    adapter.adapter_id = "x"
    salt_x = _preq(6, prompt, salt="x")
    for r in reqs:
        s.add_request(r)
        _run_all(s, model)
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 39, 0]
    s.add_request(adapter)  # adapter "x" without salt: not the (adapter x, salt x) cache
    _run_all(s, model)
    s.add_request(salt_x)  # salt "x" without adapter: not adapter x's cache
    _run_all(s, model)
    assert adapter.num_cached_tokens == 0 and salt_x.num_cached_tokens == 0


def test_eviction_before_preemption():
    kv, model = _caching(12, 4)
    s = _sched(kv)
    for i in range(4):  # fill the cache with 4 finished prompts of 2 blocks each
        s.add_request(_preq(i, [i * 50 + t for t in range(8)], max_tokens=1))
        _run_all(s, model)
    assert kv.num_cached_blocks == 8 and kv.num_empty_blocks == 4 and kv.num_free_blocks == 12
    big = _preq(9, list(range(500, 530)), max_tokens=10)  # needs 10 blocks in the end
    s.add_request(big)
    _run_all(s, model)
    assert s.num_preemptions == 0 and kv.metrics.evicted_blocks >= 6
    assert len(big.output_token_ids) == 10


def test_preempted_request_hits_its_own_cache_on_resumption():
    kv, model = _caching(10, 4)
    s = _sched(kv, budget=64)
    a = _preq(0, list(range(12)), max_tokens=12)  # 24 tokens = 6 blocks at the end
    b = _preq(1, list(range(100, 112)), max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    resumed_hits = []
    for _ in range(200):
        if not s.has_unfinished():
            break
        hits = kv.metrics.resumed_hit_tokens
        _step(s, model)
        if kv.metrics.resumed_hit_tokens > hits:
            resumed_hits.append(kv.metrics.resumed_hit_tokens - hits)
    assert s.num_preemptions > 0 and b.num_preemptions > 0 and a.num_preemptions == 0
    assert resumed_hits, "the preempted request should hit the blocks it left behind"
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12


def test_priority_preempts_lower_priority_only():
    kv, model = _caching(8, 4)
    s = _sched(kv)
    low = _preq(0, list(range(20)), max_tokens=8, priority=1)  # 7 blocks at the end
    s.add_request(low)
    for _ in range(3):
        _step(s, model)
    same = _preq(1, list(range(100, 116)), max_tokens=2, priority=1)
    s.add_request(same)
    _step(s, model)
    assert same.status is RequestStatus.WAITING and s.num_priority_preemptions == 0  # FCFS in a level
    high = _preq(2, list(range(200, 216)), max_tokens=2, priority=0)
    s.add_request(high)
    out = _step(s, model)
    assert low in out.preempted and s.num_priority_preemptions == 1
    assert [r.request_id for r, _ in out.scheduled] == ["r2"]
    assert s.waiting == [low, same]
    _run_all(s, model)
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in (low, same, high))


def test_priority_order_of_admission():
    kv, model = _caching(100, 4)
    s = _sched(kv, seqs=1)
    reqs = [_preq(0, [1, 2], priority=2), _preq(1, [3, 4], priority=0), _preq(2, [5, 6], priority=2),
            _preq(3, [7, 8], priority=0)]
    for r in reqs:
        s.add_request(r)
    order = []
    while s.has_unfinished():
        out = _step(s, model)
        for r, _ in out.scheduled:
            if not order or order[-1] != r.request_id:
                order.append(r.request_id)
    assert order == ["r1", "r3", "r0", "r2"]


def test_admission_watermark_keeps_blocks_for_running_decodes():
    kv, model = _caching(100, 4)
    s = _sched(kv, budget=1000, watermark=0.1)  # keep 10 blocks
    a = _preq(0, list(range(8)), max_tokens=50)
    s.add_request(a)
    _step(s, model)
    flood = _preq(1, list(range(300, 652)), max_tokens=1)  # 88 blocks: would leave 10 - 1
    s.add_request(flood)
    _step(s, model)
    assert flood.status is RequestStatus.WAITING  # 2 + 88 + 10 > 100
    fits = _preq(2, list(range(1000, 1344)), max_tokens=1)  # 86 blocks: 2 + 86 + 10 <= 100... behind flood
    s.add_request(fits)
    _step(s, model)
    assert fits.status is RequestStatus.WAITING  # FCFS: nothing overtakes the head
    with pytest.raises(ValueError):
        _sched(kv, watermark=1.0)
    # Alone, a request may use the whole pool.
    kv2, model2 = _caching(10, 4)
    s2 = _sched(kv2, watermark=0.5)
    r = _preq(0, list(range(36)), max_tokens=4)
    s2.add_request(r)
    _run_all(s2, model2)
    assert len(r.output_token_ids) == 4


def test_prompt_logprobs_requests_take_no_hits_but_insert():
    kv, model = _caching(64, 4)
    s = _sched(kv)
    prompt = list(range(30))
    s.add_request(_preq(0, prompt))
    _run_all(s, model)
    p = _preq(1, prompt, prompt_logprobs=0)
    s.add_request(p)
    _step(s, model)
    assert p.num_cached_tokens == 0 and p.num_computed_tokens == 30
    _run_all(s, model)
    assert kv.stats()["prefix_cache_requests"] == 1  # it did not query the cache


def test_fork_shares_cached_prompt():
    for caching in (True, False):
        model = FakeModel(32, 4)
        kv = KVCacheManager(32, 4, caching, model.kv_caches)
        s = _sched(kv)
        lead = _preq(0, list(range(14)), max_tokens=3)
        s.add_request(lead)
        _step(s, model)
        child = _preq(1, list(range(14)), max_tokens=3)
        child.arrival_index = 0
        assert kv.fork(lead, child)
        s.add_request(child)
        kv.check_invariants()
        out = _step(s, model)
        assert dict((r.request_id, n) for r, n in out.scheduled)["r1"] == 1
        assert child.num_cached_tokens == 13
        _run_all(s, model)
        assert child.output_token_ids == lead.output_token_ids
        assert kv.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_prefix_caching(seed):
    """Shared prefixes, salts, priorities, chunking, small pools, forks and aborts: every
    step the K/V a request relies on are right, and the pool's accounting holds."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    nb = rng.randint(12, 40)
    kv, model = _caching(nb, bs, partial_block_reuse=rng.random() < 0.8)
    s = _sched(kv, budget=rng.randint(1, 48), seqs=rng.randint(1, 8), watermark=rng.choice([0.0, 0.01, 0.1]))
    bases = [[rng.randint(0, 3) for _ in range(rng.randint(1, 24))] for _ in range(4)]
    reqs = []
    for i in range(rng.randint(8, 24)):
        tokens = rng.choice(bases)[: rng.randint(1, 24)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
        m = rng.randint(1, 8)
        if not tokens or -(-(len(tokens) + m) // bs) > nb:
            continue
        r = _preq(i, tokens, m, priority=rng.randint(0, 2), salt=rng.choice([None, None, "t"]),
                  prompt_logprobs=0 if rng.random() < 0.1 else None)
        reqs.append(r)
    pending = list(reqs)
    steps = 0
    while pending or s.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                s.add_request(pending.pop(0))
        if rng.random() < 0.05 and (s.running or s.waiting):
            victim = rng.choice(s.running + s.waiting)
            s.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            kv.check_invariants()
        if rng.random() < 0.2:  # fork a running request that computed its prompt
            src = next((r for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens), None)
            if src is not None:
                child = _preq(1000 + steps, src.prompt_token_ids, 2, priority=src.priority, salt=src.cache_salt)
                if kv.fork(src, child):
                    s.add_request(child)
                    reqs.append(child)
                kv.check_invariants()
        if not s.has_unfinished():
            continue
        out = _step(s, model)
        assert not out.is_empty
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        steps += 1
        assert steps < 5000
    for r in reqs:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.sampling_params.max_tokens
    assert kv.num_used_blocks == 0 and kv.num_empty_blocks + kv.num_cached_blocks == kv.num_free_blocks == nb
    assert model.computed >= 0


def test_flood_of_long_prompts_does_not_starve_running_decodes():
    kv, model = _caching(40, 4)
    s = _sched(kv, budget=64)
    dec = _preq(0, list(range(8)), max_tokens=30)  # grows to 10 blocks
    s.add_request(dec)
    _step(s, model)
    for i in range(1, 11):  # 10 long, distinct prompts of 100 tokens (25 blocks each)
        s.add_request(_preq(i, [1000 * i + t for t in range(100)], max_tokens=4))
    steps = 0
    while not dec.is_finished:
        out = _step(s, model)
        assert dec in [r for r, _ in out.scheduled]  # a token every step
        steps += 1
    assert steps == 29 and dec.num_preemptions == 0
    _run_all(s, model)


@pytest.mark.parametrize("caching", [True, False])
def test_beam_handles_clone_keeps_the_tree_rule(caching):
    """detach/clone/attach/release (beam search): a clone shares the full blocks and copies
    the partial one; every reference and lock is accounted for."""
    model = FakeModel(32, 4)
    kv = KVCacheManager(32, 4, caching, model.kv_caches)
    s = _sched(kv)
    a = _preq(0, list(range(10)), max_tokens=8)
    s.add_request(a)
    for _ in range(3):
        _step(s, model)
    n = a.num_computed_tokens  # 12: three full blocks (cached when caching), then a's next token
    assert n == 12 and a.num_tokens == 13
    h = kv.detach(a)
    h2 = kv.clone(h, n - 1)  # a clone that ends inside the third block
    kv.attach(a, h)
    b = _preq(1, a.all_token_ids[: n - 1] + [4], max_tokens=8)
    b.status = RequestStatus.RUNNING
    s.running.append(b)
    kv.attach(b, h2)
    b.num_computed_tokens = n - 1
    kv.check_invariants()
    _run_all(s, model)
    kv.check_invariants()
    h3 = kv.clone(([], None), 0)
    assert h3 == ([], None)
    kv.release(h3)
    assert kv.num_used_blocks == 0


def _user_req(i, user, n_prompt=4, max_tokens=100):
    r = _req(i, n_prompt, max_tokens)
    r.user = user
    return r


def test_one_users_burst_cannot_hold_every_slot():
    """User a fills all 8 slots; user b's request gets a slot at once (a's last sequence is
    preempted, recomputed later), and b's later requests take slots up to the fair share."""
    kv = KVCacheManager(num_blocks=400, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=400), kv)
    burst = [_user_req(i, "a") for i in range(12)]
    for r in burst:
        s.add_request(r)
    _run_step(s)
    assert len(s.running) == 8 and all(r.user == "a" for r in s.running)
    b = _user_req(100, "b", max_tokens=3)
    s.add_request(b)
    out = _run_step(s)
    assert b in [r for r, _ in out.scheduled]
    assert [r.request_id for r in out.preempted] == ["r7"]  # a's last admitted
    assert s.num_fair_preemptions == 1
    for _ in range(3):
        _run_step(s)
    assert b.is_finished
    # b sends 6 more: it gets up to its share (4 of 8 slots), no more
    more = [_user_req(200 + i, "b", max_tokens=50) for i in range(6)]
    for r in more:
        s.add_request(r)
    _run_step(s)
    counts = {u: sum(r.user == u for r in s.running) for u in ("a", "b")}
    assert counts == {"a": 4, "b": 4}, counts
    for _ in range(5):
        _run_step(s)
        assert sum(r.user == "b" for r in s.running) == 4  # no thrash: the shares hold
    assert s.num_fair_preemptions == 1 + 4  # (b finished; a had all 8 slots again)


def test_fair_share_keeps_priorities_and_changes_nothing_for_one_user():
    kv = KVCacheManager(num_blocks=400, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=400), kv)
    urgent = [_user_req(i, "a") for i in range(4)]
    for r in urgent:
        r.priority = -1
        s.add_request(r)
    _run_step(s)
    late = _user_req(50, "b")  # priority 0: below a's -1, never preempts it
    s.add_request(late)
    out = _run_step(s)
    assert not out.preempted and late.status.name == "WAITING"
    # one user: the FCFS order and the (priority, arrival) victim as before
    kv2 = KVCacheManager(num_blocks=400, block_size=4)
    s2 = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=400), kv2)
    reqs = [_user_req(i, "a") for i in range(6)]
    for r in reqs:
        s2.add_request(r)
    _run_step(s2)
    assert [r.request_id for r in s2.running] == ["r0", "r1", "r2", "r3"] and s2.num_fair_preemptions == 0


def test_waiting_order_prefers_the_user_running_fewest():
    kv = KVCacheManager(num_blocks=400, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=400, max_num_seqs=6, max_model_len=400), kv)
    for i in range(3):
        s.add_request(_user_req(i, "a"))
    _run_step(s)  # a runs 3
    for i in range(3):
        s.add_request(_user_req(10 + i, "a"))  # a waits with 3 more, first in line
    for i in range(2):
        s.add_request(_user_req(20 + i, "c"))
    _run_step(s)
    users = sorted(r.user for r in s.running)
    assert users == ["a", "a", "a", "a", "c", "c"], users  # c's two first, then a's fourth
