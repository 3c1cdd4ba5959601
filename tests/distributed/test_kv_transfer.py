"""Prefill/decode disaggregation through a KV connector (``kv_connector="local"``): a prefill
engine computes the prompt and saves its K/V, a decode engine loads only the blocks its prefix
cache does not hold, computes the one prompt token it owes and decodes: the outputs equal one
engine's, token for token; bad handles are refused naming ``kv_transfer_params``."""

import pytest

from kvserve import SamplingParams
from kvserve.distributed.kv_transfer import KVTransferHandle, get_connector
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
    rids = [engine.add_request(p, params, kv_transfer_params=kv) for p, params, kv in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in rids]


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
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    _run(decode, [(SHARED + [90, 91], greedy, None)])  # the decode engine caches SHARED's 3 blocks
    prompt = SHARED + [80, 81, 82, 83, 84, 85]  # 18 tokens: 17 transferred = 5 blocks, 3 of them cached
    ref = _run(alone, [(prompt, greedy, None)])[0]
    handle = _prefill(prefill, [prompt])[0]
    assert handle.num_blocks == 5
    before = decode.stats()
    out = _run(decode, [(prompt, greedy, handle)])[0]
    after = decode.stats()
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_cached_tokens == len(SHARED)
    assert after["kv_transfer_loaded_blocks"] - before["kv_transfer_loaded_blocks"] == 2
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 1


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
