"""Prefill/decode disaggregation with a 2-/4-bit KV cache (``kv_cache_dtype`` int4 / int2 with
``kv_connector="local"``) on the tiny random Llama in float32: the prefill engine saves the
prompt's full blocks as their packed codes and scales, the decode engine loads them and computes
the tokens of the prompt's last partial block itself (at most ``block_size - 1``, plus the last
token): outputs equal one engine's with the same ``kv_cache_dtype``, token for token; the loaded
blocks and computed tokens are counted; a handle of another KV dtype is refused; every block and
residual slot is free at the end."""

import pytest

from kvserve import SamplingParams
from kvserve.distributed.kv_transfer import KVTransferHandle
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

from test_kv_transfer import _finish, _run

BS = 4
# prompt lengths 12, 13, 14, 15 and 2: P - 1 = 11, 12, 13, 14, 1 tokens, of which 8, 12, 12, 12, 0 in full blocks
PROMPTS = [list(range(5, 17)), list(range(20, 33)), list(range(40, 54)), list(range(60, 75)), [80, 81]]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _engine(folder, kv, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=64, block_size=BS, max_model_len=128,
                kv_connector="local", kv_cache_dtype=kv)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_lowbit_prefill_then_decode_equals_one_engine(folder, kv):
    one = _engine(folder, kv, kv_connector=None, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in _run(one, [(p, PARAMS, None) for p in PROMPTS])]
    prefill, decode = _engine(folder, kv), _engine(folder, kv)
    outs = _run(prefill, [(p, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
                          for p in PROMPTS])
    handles = [o.kv_transfer_params for o in outs]
    assert all(isinstance(h, KVTransferHandle) for h in handles)
    assert [h.num_tokens for h in handles] == [8, 12, 12, 12, 0]  # full blocks of the first P - 1 only
    bb = sum(c.data[0].numel() for pair in prefill.kv_caches for c in pair)  # a packed block, all layers, K and V
    assert [h.num_bytes for h in handles] == [n // BS * bb for n in (8, 12, 12, 12, 0)]
    got = _run(decode, [(p, PARAMS, h) for p, h in zip(PROMPTS, handles)])
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.kv_transfer_stats["blocks"] if o.kv_transfer_stats else 0 for o in got] == [2, 3, 3, 3, 0]
    s = decode.stats()
    # computed at the decode engine: each prompt's tokens after its loaded blocks (the partial block's and the last)
    assert s["prompt_tokens_computed"] == sum(len(p) - n for p, n in zip(PROMPTS, (8, 12, 12, 12, 0)))
    for eng in (prefill, decode):
        r = eng.kv.residual
        r.end_step()
        eng.kv.check_invariants()
        assert eng.kv.num_used_blocks == 0 and r.num_free == r.num_slots and bool((r.map == -1).all())


def test_a_handle_of_another_kv_dtype_is_refused(folder):
    prefill = _engine(folder, "int4")
    h = _run(prefill, [(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})])[0]
    h = h.kv_transfer_params
    assert h.layout == (2, 2, 16, "torch.uint4", 1)
    for kv, dt in (("int2", "torch.uint2"), ("auto", "torch.float32")):
        with pytest.raises(ValueError, match=rf"kv_transfer_params: blocks of 4 tokens laid out as \(2, 2, 16, "
                                             rf"'torch.uint4', 1\); this engine's are 4 tokens as \(2, 2, 16, '{dt}', 1\)"):
            _engine(folder, kv).add_request(PROMPTS[1], PARAMS, kv_transfer_params=h)
    # an int4 engine takes it (the handle is still loadable: the refusals loaded nothing)
    dec = _engine(folder, "int4")
    out = _finish(dec, [dec.add_request(PROMPTS[1], PARAMS, kv_transfer_params=h)])[0]
    assert out.kv_transfer_stats["blocks"] == 3 and not out.kv_transfer_stats["failed"]


@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_blocks_loaded_into_blocks_just_freed(folder, kv):
    """A decode engine of 8 blocks: before each transfer a 20-token prompt + 10 tokens (30 tokens:
    every block) runs and finishes; its full blocks stay in the prefix cache, its partial last
    block goes to the free queue with its residual slot still marked for release, and the
    transfer's first loaded block is that one: it must be read from its packed data, not the slot."""
    filler = list(range(100, 120))
    one = _engine(folder, kv, kv_connector=None, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in _run(one, [(p, PARAMS, None) for p in PROMPTS + [filler]])]
    prefill = _engine(folder, kv)
    handles = [o.kv_transfer_params for o in _run(prefill, [
        (p, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True}) for p in PROMPTS])]
    decode = _engine(folder, kv, num_blocks=8)
    for p, h, w in zip(PROMPTS, handles, want):
        assert _run(decode, [(filler, PARAMS, None)])[0].outputs[0].token_ids == want[-1]
        assert _run(decode, [(p, PARAMS, h)])[0].outputs[0].token_ids == w
    decode.kv.residual.end_step()
    decode.kv.check_invariants()
    assert decode.kv.residual.num_free == decode.kv.residual.num_slots


def test_ray_blocks_pack_and_unpack_packed_parts_of_two_sizes():
    """The Ray connector's per-block objects (no Ray needed): whole-row payloads stack into one
    tensor per block as before; 2-/4-bit payloads (K and V blocks of different byte sizes) go as a
    tuple of parts per block; unpacking any subset of blocks gives those blocks back exactly."""
    import torch

    from kvserve.distributed.kv_transfer.ray_connector import _pack_block, _unpack_blocks

    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(3, 4, 2, 16, generator=g), torch.randn(3, 4, 2, 16, generator=g)) for _ in range(2)]
    packed = [(torch.randint(0, 256, (3, 2, 96), dtype=torch.uint8, generator=g),
               torch.randint(0, 256, (3, 2, 72), dtype=torch.uint8, generator=g)) for _ in range(2)]
    for payload in (rows, packed):
        objs = [_pack_block(payload, b) for b in range(3)]
        assert isinstance(objs[0], torch.Tensor) == (payload is rows)
        got = _unpack_blocks([objs[2], objs[0]])
        for (k, v), (k0, v0) in zip(got, payload):
            assert torch.equal(k, k0[[2, 0]]) and torch.equal(v, v0[[2, 0]])
