"""The ``"ray"`` KV connector across processes: the prefill engine in the test process puts a
request's prompt K/V into Ray's object store, one object per block, a decode engine in a Ray
actor (another process) loads it from the handle and decodes: the same tokens as one engine; the
decode engine computed one prompt token per request. The other way round, a prefill engine in an
actor and the decode engine here: a decode engine whose prefix cache holds the first blocks gets
only the others (their bytes, no more); once the prefill actor is killed, its objects are gone:
a request that arrived before recomputes its prompt (token for token as one engine, the other
requests unaffected, no block leaked) and one that arrives after is refused. A fetch that waits
past the timeout fails as a KVTransferError. Actors on 2 cores: slow, but they prove the transfer."""

import time

import pytest
import torch

from kvserve import SamplingParams
from kvserve.distributed.kv_transfer import KVTransferError, get_connector
from kvserve.distributed.kv_transfer.ray_connector import RayKVKey
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

ray = pytest.importorskip("ray")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]]
ARGS = dict(dtype="float32", num_blocks=64, block_size=4, max_model_len=128)


def _run(engine, requests) -> list:
    return _finish(engine, [engine.add_request(p, params, kv_transfer_params=kv) for p, params, kv in requests])


def _finish(engine, rids) -> list:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in rids]


def _decode_engine_class():
    """A decode engine for a Ray actor: defined here, self-contained, so that Ray ships it by
    value (the test module is not importable in the actor's process)."""

    class DecodeEngine:
        def __init__(self, model: str, args: dict) -> None:
            from kvserve.engine.llm_engine import EngineArgs, LLMEngine

            self.engine = LLMEngine(EngineArgs(model=model, kv_connector="ray", **args))

        def decode(self, prompts, handles, max_tokens: int):
            from kvserve import SamplingParams

            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            rids = [self.engine.add_request(p, params, kv_transfer_params=h) for p, h in zip(prompts, handles)]
            final = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out.outputs[0].token_ids
            return [final[r] for r in rids], self.engine.stats()

    return DecodeEngine


def _prefill_engine_class():
    """A prefill engine for a Ray actor (shipped by value, as :func:`_decode_engine_class`): the
    objects of the K/V it saves are this actor's, and go with it."""

    class PrefillEngine:
        def __init__(self, model: str, args: dict) -> None:
            from kvserve.engine.llm_engine import EngineArgs, LLMEngine

            self.engine = LLMEngine(EngineArgs(model=model, kv_connector="ray", **args))

        def prefill(self, prompts):
            from kvserve import SamplingParams

            params = SamplingParams(max_tokens=1, temperature=0)
            rids = [self.engine.add_request(p, params, kv_transfer_params={"do_remote_decode": True})
                    for p in prompts]
            final = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out.kv_transfer_params
            return [final[r] for r in rids]

        def ping(self) -> bool:
            return True

    return PrefillEngine


@pytest.fixture(scope="module")
def ray_cluster():
    from kvserve.executor.ray_executor import connect_ray

    started = connect_ray(2, torch.device("cpu"))
    yield
    if started:
        ray.shutdown()


def test_prefill_here_decode_in_another_process(tiny_model_dir, ray_cluster):
    folder = str(tiny_model_dir("llama")[0])
    prefill = LLMEngine(EngineArgs(model=folder, kv_connector="ray", **ARGS))
    alone = LLMEngine(EngineArgs(model=folder, **ARGS))
    ref = _run(alone, [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), None) for p in PROMPTS])
    outs = _run(prefill, [(p, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
                          for p in PROMPTS])
    handles = [o.kv_transfer_params for o in outs]
    assert all(h.connector == "ray" and h.num_bytes > 0 for h in handles)
    actor = ray.remote(num_cpus=0)(_decode_engine_class()).remote(folder, ARGS)
    try:
        tokens, stats = ray.get(actor.decode.remote(PROMPTS, handles, 12), timeout=300)
    finally:
        ray.kill(actor)
    assert tokens == [o.outputs[0].token_ids for o in ref]
    assert stats["prompt_tokens_computed"] == len(PROMPTS)  # the one owed per request
    assert stats["kv_transfer_loaded_blocks"] == sum(h.num_blocks for h in handles)
    assert stats["kv_transfer_loaded_bytes"] == sum(h.num_bytes for h in handles) and stats["kv_transfer_failed"] == 0


SHARED = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]  # 3 blocks of 4


def test_per_block_objects_and_the_timeout(ray_cluster, monkeypatch):
    """Each block of each rank is an object of its own holding that block alone (not the
    storage of the tensor it was a view of); a fetch gets the blocks asked for; a get that waits
    past $KVSERVE_KV_TRANSFER_TIMEOUT_S raises KVTransferError, and ``has`` says False."""
    connector = get_connector("ray")
    payload = [(torch.randn(5, 4, 2, 3), torch.randn(5, 4, 2, 3)) for _ in range(3)]
    key = connector.save([payload])
    assert isinstance(key, RayKVKey) and len(key.blocks) == 1 and len(key.blocks[0]) == 5
    obj = ray.get(key.blocks[0][2])
    assert obj.shape == (6, 4, 2, 3) and obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
    loaded = connector.num_loaded_bytes
    got = connector.fetch(key, 0, [1, 3, 4])
    for (k, v), (pk, pv) in zip(got, payload):
        assert torch.equal(k, pk[[1, 3, 4]]) and torch.equal(v, pv[[1, 3, 4]])
    assert connector.num_loaded_bytes - loaded == 3 * 3 * 2 * 4 * 2 * 3 * 4
    assert not connector.has(key)  # loaded once
    with pytest.raises(KVTransferError, match="already loaded"):
        connector.fetch(key, 0, [0])

    never = ray.remote(num_cpus=0, resources={"no-such-resource": 1})(lambda: 0).remote()  # pending forever
    monkeypatch.setenv("KVSERVE_KV_TRANSFER_TIMEOUT_S", "0.5")
    stuck = RayKVKey(never, ((never,),))
    t0 = time.perf_counter()
    assert not connector.has(stuck)
    with pytest.raises(KVTransferError, match="timeout 0.5 s.*GetTimeoutError"):
        connector.fetch(stuck, 0, [0])
    assert time.perf_counter() - t0 < 10
    ray.cancel(never, force=False)


def test_decode_here_takes_only_missing_blocks_and_survives_a_dead_prefill(tiny_model_dir, ray_cluster):
    folder = str(tiny_model_dir("llama")[0])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    shared = SHARED + [80, 81, 82, 83, 84, 85]  # 17 tokens transferred: 5 blocks, the first 3 cached here
    lost, late, plain = list(range(100, 118)), list(range(130, 145)), list(range(160, 170))
    alone = LLMEngine(EngineArgs(model=folder, **ARGS))
    ref = _run(alone, [(p, greedy, None) for p in (shared, lost, late, plain)])
    del alone
    actor = ray.remote(num_cpus=0)(_prefill_engine_class()).remote(folder, ARGS)
    try:
        h_shared, h_lost, h_late = ray.get(actor.prefill.remote([shared, lost, late]), timeout=300)
        decode = LLMEngine(EngineArgs(model=folder, kv_connector="ray", **ARGS))
        block = sum(c[0].numel() * c.element_size() for pair in decode.kv_caches for c in pair)
        _run(decode, [(SHARED + [90, 91], greedy, None)])  # the decode engine caches SHARED's 3 blocks

        out = _run(decode, [(shared, greedy, h_shared)])[0]
        stats = decode.stats()
        assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids and out.num_cached_tokens == len(SHARED)
        assert stats["kv_transfer_loaded_blocks"] == 2 and stats["kv_transfer_loaded_bytes"] == 2 * block
        assert out.kv_transfer_stats["blocks"] == 2 and out.kv_transfer_stats["cached_blocks"] == 3
        assert get_connector("ray").num_loaded_bytes >= 2 * block

        free = decode.kv.num_free_blocks
        rids = [decode.add_request(lost, greedy, kv_transfer_params=h_lost),  # accepted: its owner lives
                decode.add_request(plain, greedy)]
        ray.kill(actor)  # the prefill engine's process, and the objects it owns, go ...
        deadline = time.monotonic() + 60
        # ... once this process has heard of it (for a second or so after the actor is gone, Ray
        # still serves its objects from the local store)
        while get_connector("ray").has(h_late.key) and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(ValueError, match="kv_transfer_params: the handle's blocks can no longer be loaded"):
            decode.add_request(late, greedy, kv_transfer_params=h_late)
        before = decode.stats()
        outs = _finish(decode, rids)
        after = decode.stats()
    finally:
        ray.kill(actor)
    assert [o.outputs[0].token_ids for o in outs] == [ref[1].outputs[0].token_ids, ref[3].outputs[0].token_ids]
    assert outs[0].kv_transfer_stats["failed"] and outs[0].error is None
    assert after["kv_transfer_failed"] - before["kv_transfer_failed"] == 1
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(lost) + len(plain)
    assert after["kv_transfer_loaded_blocks"] == before["kv_transfer_loaded_blocks"]
    assert decode.kv.num_used_blocks == 0 and decode.kv.num_free_blocks == free
    decode.kv.check_invariants()
