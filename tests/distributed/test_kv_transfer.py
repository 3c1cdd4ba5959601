"""Prefill/decode disaggregation through a KV connector (``kv_connector="local"``): a prefill
engine computes the prompt and saves its K/V, a decode engine loads only the blocks its prefix
cache does not hold (the bytes of those blocks, counted in the stats and the request's
``kv_transfer_stats``), computes the one prompt token it owes and decodes: the outputs equal one
engine's, token for token; bad handles are refused naming ``kv_transfer_params``; a load that
fails (the blocks went between the request's arrival and its admission) recomputes that prompt,
token for token as one engine, while the other requests go on, and leaks no block."""

import pytest
import torch

from kvserve import SamplingParams
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.distributed.kv_transfer import (KV_TRANSFER_TIMEOUT_S, KVTransferError, KVTransferHandle, get_connector,
                                             kv_transfer_timeout_s)
from kvserve.distributed.kv_transfer.base import token_digest
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34],
           [40, 41], [7]]
SHARED = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]  # 3 blocks of 4


def _engine(folder, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
                kv_connector="local")
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _run(engine: LLMEngine, requests) -> list:
    return _finish(engine, [engine.add_request(p, params, kv_transfer_params=kv) for p, params, kv in requests])


def _finish(engine: LLMEngine, rids) -> list:
    """Step until every request is done; their final outputs, each with the first output's
    ``kv_transfer_stats`` checked against the final one's (attribute ``first_stats``)."""
    final, first = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out.kv_transfer_stats)
            if out.finished:
                final[out.request_id] = out
    for r in rids:
        assert final[r].kv_transfer_stats == first[r]  # on the first output already, the same on the last
    return [final[r] for r in rids]


def _block_bytes(engine: LLMEngine) -> int:
    """Bytes of one KV block of the engine's pools, all layers, K and V."""
    return sum(c[0].numel() * c.element_size() for pair in engine.kv_caches for c in pair)


def _check_no_leak(engine: LLMEngine, free_before: int) -> None:
    kv = engine.kv
    assert not engine.has_unfinished_requests()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == free_before  # (cached blocks count as free)
    kv.check_invariants()


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def engines(folder):
    return _engine(folder), _engine(folder), _engine(folder, kv_connector=None)


def _prefill(prefill, prompts) -> list[KVTransferHandle]:
    outs = _run(prefill, [(p, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
                          for p in prompts])
    handles = [o.kv_transfer_params for o in outs]
    assert all(isinstance(h, KVTransferHandle) for h in handles)
    return handles


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=9, ignore_eos=True, logprobs=2),
])
def test_prefill_then_decode_equals_one_engine(engines, params):
    prefill, decode, alone = engines
    ref = _run(alone, [(p, params, None) for p in PROMPTS])
    handles = _prefill(prefill, PROMPTS)
    assert [h.num_tokens for h in handles] == [len(p) - 1 for p in PROMPTS]
    assert handles[3].key is None and handles[3].num_bytes == 0  # a one-token prompt: nothing to move
    before = decode.stats()
    got = _run(decode, [(p, params, h) for p, h in zip(PROMPTS, handles)])
    after = decode.stats()
    for a, b in zip(got, ref):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
    # the decode engine computed one prompt token per sequence: the one owed after the transfer
    # (each further sample of n = 2 shares the prompt's blocks and computes that token too)
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(PROMPTS) * params.n
    loaded = after["kv_transfer_loaded_blocks"] - before["kv_transfer_loaded_blocks"]
    # only the blocks the decode engine's prefix cache lacked (all of them the first time)
    assert loaded == sum(h.num_blocks - o.num_cached_tokens // 4 for h, o in zip(handles, got) if h.key is not None)
    assert loaded > 0
    assert not any(get_connector("local").has(h.key) for h in handles if h.key is not None)  # loaded once


def test_only_blocks_the_decode_cache_lacks_are_loaded(engines):
    prefill, decode, alone = engines
    connector = get_connector("local")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    _run(decode, [(SHARED + [90, 91], greedy, None)])  # the decode engine caches SHARED's 3 blocks
    prompt = SHARED + [80, 81, 82, 83, 84, 85]  # 18 tokens: 17 transferred = 5 blocks, 3 of them cached
    ref = _run(alone, [(prompt, greedy, None)])[0]
    handle = _prefill(prefill, [prompt])[0]
    assert handle.num_blocks == 5 and handle.block_bytes == _block_bytes(decode)
    assert handle.num_bytes == 5 * _block_bytes(decode)
    before, loaded_bytes = decode.stats(), connector.num_loaded_bytes
    out = _run(decode, [(prompt, greedy, handle)])[0]
    after = decode.stats()
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_cached_tokens == len(SHARED)
    assert after["kv_transfer_loaded_blocks"] - before["kv_transfer_loaded_blocks"] == 2
    # the 2 blocks moved, no more: in the engine's stats, the connector's and the request's own
    assert after["kv_transfer_loaded_bytes"] - before["kv_transfer_loaded_bytes"] == 2 * _block_bytes(decode)
    assert connector.num_loaded_bytes - loaded_bytes == 2 * _block_bytes(decode)
    assert after["kv_transfer_load_seconds"] > before["kv_transfer_load_seconds"]
    assert after["kv_transfer_failed"] == before["kv_transfer_failed"]
    stats = out.kv_transfer_stats
    assert stats == {"blocks": 2, "bytes": 2 * _block_bytes(decode), "seconds": stats["seconds"], "cached_blocks": 3,
                     "failed": False}
    assert 0 < stats["seconds"] < 10
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 1
    assert ref.kv_transfer_stats is None  # (a request without a handle)
    saved = prefill.stats()
    assert saved["kv_transfer_saved_bytes"] >= handle.num_bytes and saved["kv_transfer_saved"] >= 1


def test_a_failed_load_recomputes_the_prompt_and_leaks_nothing(engines):
    """A handle good when the request arrives whose blocks are gone when the decode engine admits
    it: that request computes its whole prompt (token for token as one engine); a transferred
    request and a plain one in the same steps finish normally; no block is leaked."""
    prefill, decode, alone = engines
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lost, good, plain = list(range(100, 118)), list(range(130, 145)), list(range(160, 170))
    ref = _run(alone, [(p, greedy, None) for p in (lost, good, plain)])
    h_lost, h_good = _prefill(prefill, [lost, good])
    free, before = decode.kv.num_free_blocks, decode.stats()
    rids = [decode.add_request(lost, greedy, kv_transfer_params=h_lost),
            decode.add_request(good, greedy, kv_transfer_params=h_good), decode.add_request(plain, greedy)]
    get_connector("local").release(h_lost.key)  # gone between the request's arrival and its admission
    outs = _finish(decode, rids)
    after = decode.stats()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    assert after["kv_transfer_failed"] - before["kv_transfer_failed"] == 1
    assert after["kv_transfer_loaded_blocks"] - before["kv_transfer_loaded_blocks"] == h_good.num_blocks
    # the lost prompt computed whole, the good one its last token, the plain one whole
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(lost) + 1 + len(plain)
    assert outs[0].kv_transfer_stats == {"blocks": 0, "bytes": 0, "seconds": outs[0].kv_transfer_stats["seconds"],
                                         "cached_blocks": 0, "failed": True}
    assert outs[1].kv_transfer_stats["blocks"] == h_good.num_blocks and not outs[1].kv_transfer_stats["failed"]
    assert outs[2].kv_transfer_stats is None
    _check_no_leak(decode, free)


def _pools(num_blocks: int, layers: int = 2) -> list:
    return [(torch.zeros(num_blocks, 4, 1, 2), torch.zeros(num_blocks, 4, 1, 2)) for _ in range(layers)]


def _save(prompt, payload=None):
    """A handle of the local connector for ``prompt``'s first ``len - 1`` tokens (random K/V)."""
    n = len(prompt) - 1
    blocks = -(-n // 4)
    payload = payload or [(torch.randn(blocks, 4, 1, 2), torch.randn(blocks, 4, 1, 2)) for _ in range(2)]
    key = get_connector("local").save([payload])
    nbytes = sum(t.numel() * t.element_size() for pair in payload for t in pair)
    layout = (2, 1, 2, "torch.float32", 1)
    return KVTransferHandle("local", key, n, token_digest(prompt[:n]), 4, layout, nbytes), payload


def _req(rid: str, prompt, handle) -> Request:
    req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=4), seed=0)
    req.kv_transfer = handle
    return req


def test_the_manager_loads_at_once_and_recomputes_when_the_load_fails():
    """KVCacheManager with pools in this process (its mover applies the load at admission): the
    transferred blocks land in the request's blocks; a load that fails leaves the request its
    cached blocks and a first chunk within the token budget (the blocks allocated for the load
    beyond that chunk go back), counted and reported on the request."""
    pools = _pools(16)
    kv = KVCacheManager(16, 4, True, pools)
    prompt = list(range(12))
    handle, payload = _save(prompt)
    req = _req("a", prompt, handle)
    assert kv.admit(req, 64) == 1 and req.num_computed_tokens == 11 and not kv.ops
    table = kv.block_tables["a"]
    for (k, v), (pk, pv) in zip(pools, payload):
        assert torch.equal(k[table[:3]], pk) and torch.equal(v[table[:3]], pv)
    assert req.kv_transfer is None and req.kv_transfer_stats["blocks"] == 3 and not req.kv_transfer_stats["failed"]
    assert kv.stats()["kv_transfer_loaded_bytes"] == handle.num_bytes

    lost, _ = _save(list(range(50, 70)))  # 19 tokens: 5 blocks
    get_connector("local").release(lost.key)
    req = _req("b", list(range(50, 70)), lost)
    free = kv.num_free_blocks
    assert kv.admit(req, 6) == 6  # a token budget of 6: the first chunk of the recomputed prompt
    assert req.num_computed_tokens == 0 and len(kv.block_tables["b"]) == 2 and kv.num_free_blocks == free - 2
    assert kv.num_transfer_failed == 1 and kv.stats()["kv_transfer_failed"] == 1
    assert req.kv_transfer_stats["failed"] and req.kv_transfer_stats["blocks"] == 0
    kv.check_invariants()
    for r in ("a", "b"):
        kv.free(_req(r, [0], None), cache=False)
    assert kv.num_free_blocks == 16 and kv.num_used_blocks == 0
    kv.check_invariants()


def test_without_pools_or_a_loader_the_load_is_recorded_for_the_caller():
    kv = KVCacheManager(16, 4, False, None)
    handle, _ = _save(list(range(9)))
    req = _req("a", list(range(9)), handle)
    assert kv.admit(req, 64) == 1 and req.num_computed_tokens == 8
    table = kv.block_tables["a"]
    assert kv.ops.moves() == [("load", 0, table[0]), ("load", 1, table[1])]
    get_connector("local").release(handle.key)


def test_a_loader_that_fails_is_one_requests_fault():
    """The engine core's path: no pools here, a loader that applies the ops (and raises
    KVTransferError for a failed load); the ops recorded before the load go along, in order."""
    calls = []

    def loader(ops):
        calls.append(ops.moves())
        raise KVTransferError("the owner died")

    kv = KVCacheManager(16, 4, False, None, kv_loader=loader)
    kv.ops.copy(3, 4, 2)  # (a move recorded earlier: it goes first)
    handle, _ = _save(list(range(9)))
    req = _req("a", list(range(9)), handle)
    assert kv.admit(req, 64) == 9 and req.num_computed_tokens == 0
    t = kv.block_tables["a"]
    assert calls == [[("copy", 3, 4, 2), ("load", 0, t[0]), ("load", 1, t[1])]] and not kv.ops
    assert len(t) == 3 and kv.num_transfer_failed == 1
    get_connector("local").release(handle.key)


def test_the_transfer_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVSERVE_KV_TRANSFER_TIMEOUT_S", raising=False)
    assert kv_transfer_timeout_s() == KV_TRANSFER_TIMEOUT_S == 30.0
    monkeypatch.setenv("KVSERVE_KV_TRANSFER_TIMEOUT_S", "2.5")
    assert kv_transfer_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("KVSERVE_KV_TRANSFER_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="KVSERVE_KV_TRANSFER_TIMEOUT_S must be a number of seconds > 0"):
            kv_transfer_timeout_s()


def test_bad_kv_transfer_params_are_refused(engines, folder):
    prefill, decode, alone = engines
    greedy = SamplingParams(max_tokens=4, temperature=0)
    handle = _prefill(prefill, [PROMPTS[0]])[0]
    with pytest.raises(ValueError, match="kv_transfer_params: this engine has no kv_connector"):
        alone.add_request(PROMPTS[0], greedy, kv_transfer_params=handle)
    with pytest.raises(ValueError, match="kv_transfer_params: the handle holds the K/V of 10 other tokens"):
        decode.add_request(PROMPTS[1], greedy, kv_transfer_params=handle)
    with pytest.raises(ValueError, match="kv_transfer_params must be"):
        decode.add_request(PROMPTS[0], greedy, kv_transfer_params={"do_remote_decode": "yes"})
    with pytest.raises(ValueError, match="beam search or prompt_logprobs"):
        decode.add_request(PROMPTS[0], SamplingParams(max_tokens=4, prompt_logprobs=1), kv_transfer_params=handle)
    other = _engine(folder, block_size=8)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        other.add_request(PROMPTS[0], greedy, kv_transfer_params=handle)
    assert not decode.has_unfinished_requests()  # nothing of the refused ones was queued
    _run(decode, [(PROMPTS[0], greedy, handle)])  # the handle is still good: loaded once ...
    with pytest.raises(ValueError, match="already loaded or released"):
        decode.add_request(PROMPTS[0], greedy, kv_transfer_params=handle)  # ... and only once
    with pytest.raises(ValueError, match="kv_connector must be .local., .ray. or None"):
        EngineArgs(kv_connector="nixl").check()


def test_the_local_store_is_bounded_and_a_dropped_handle_is_refused(engines):
    prefill, decode, _ = engines
    connector = get_connector("local")
    old = connector.max_bytes
    try:
        h0 = _prefill(prefill, [PROMPTS[0]])[0]
        connector.max_bytes = h0.num_bytes + 1  # room for one save: the next one drops h0's blocks
        h1 = _prefill(prefill, [PROMPTS[1]])[0]
        assert not connector.has(h0.key) and connector.has(h1.key) and connector.num_bytes == h1.num_bytes
        with pytest.raises(ValueError, match="already loaded or released"):
            decode.add_request(PROMPTS[0], SamplingParams(max_tokens=2), kv_transfer_params=h0)
        connector.release(h1.key)
        assert connector.num_bytes == 0
    finally:
        connector.max_bytes = old
