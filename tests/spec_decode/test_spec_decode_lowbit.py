"""Speculative decoding over a 2-/4-bit KV cache (``kv_cache_dtype`` int4 / int2 with n-gram and
draft-model speculation; issue #23) on the tiny random Llama in float32, greedy, ``ignore_eos``.

A verification step writes the K/V of its draft rows and may fill (quantize) blocks with rows of
drafts that are then rejected. The tests hold the invariant of the 2-/4-bit cache: a token's stored
K/V and what each query attends to do not depend on how its block was filled, so speculation gives
exactly the tokens of the same engine and KV dtype without it:

* a batch of requests of different lengths, a few hundred tokens, block size 4 with k = 3 (most
  verifications cross a block end) and block size 8 with k = 5: token-exact; drafts were accepted
  and rejected, blocks were sealed in verification steps (full of accepted tokens) and blocks filled
  by a verification that rejected drafts kept their residual slot (the KV manager's counters);
* the same under recompute preemption in a small pool with a small token budget;
* the books after every step (``check_invariants``), every block and residual slot free at the end;
* decode rows on the C kernel and on SDPA alike, and a model with sliding-window layers;
* the draft model's own pool is 8-bit (``int8``) under a 2-/4-bit target;
* the KV manager's books for each accepted count, and a verification short of residual slots.

(The refused combinations: tests/worker/test_kv_quant_lowbit.py.) About 25 s.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

from test_spec_decode import _run, _summary, drafts  # noqa: F401  (drafts: the draft-model fixture)

LOWBIT = ("int4", "int2")
# repetitive prompts (the n-gram proposer finds drafts, the model copies some) and plain ones
PROMPTS = [
    [5, 6, 7, 8, 9] * 3 + [5, 6],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 44, 45, 46],
    [100, 101, 100, 101, 100, 101, 100],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 60, 61, 62],
    [7, 7, 7, 7, 7, 7, 7, 7, 9],
    [300, 12, 250, 13, 200],
]
MAX_TOKENS = [70, 52, 61, 45, 66, 58]  # 352 output tokens


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _engine(folder, kv, spec=None, **kw):
    args = dict(model=folder, dtype="float32", device="cpu", num_blocks=512, block_size=4, max_model_len=128,
                kv_cache_dtype=kv, enable_prefix_caching=False)
    args.update(kw)
    return LLMEngine(EngineArgs(speculative_config=spec, **args))


def _params():
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]


def _all_free(engine: LLMEngine) -> None:
    """Every block and every residual slot free once nothing runs (after the end of the step that
    follows the last, which gives back the slots the last one released)."""
    kv = engine.kv
    kv.end_step()
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    r = kv.residual
    assert r.num_free == r.num_slots and bool((r.map == -1).all())


def _spec_ran(engine: LLMEngine) -> None:
    """Drafts were accepted and rejected, and verification steps sealed blocks of accepted tokens and
    kept the residual slots of blocks they filled with rows of rejected drafts."""
    s = engine.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert s["kv_verify_sealed_blocks"] > 0 and s["kv_verify_unsealed_blocks"] > 0


_BASE: dict = {}


def _base(folder, kv, **kw):
    """The same engine and KV dtype without speculation (cached per configuration)."""
    key = (kv, tuple(sorted(kw.items())))
    if key not in _BASE:
        eng = _engine(folder, kv, **kw)
        _BASE[key] = [_summary(o) for o in _run(eng, PROMPTS, _params())]
        _all_free(eng)
    return _BASE[key]


@pytest.mark.parametrize("kv", LOWBIT)
@pytest.mark.parametrize("block_size, k", [(4, 3), (8, 5)])
def test_ngram_greedy_is_token_identical(llama, kv, block_size, k):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    base = _base(llama, kv, block_size=block_size)
    eng = _engine(llama, kv, spec, block_size=block_size)
    assert [_summary(o) for o in _run(eng, PROMPTS, _params())] == base
    _spec_ran(eng)
    _all_free(eng)


def test_sdpa_decode_rows_give_the_same_tokens(llama, monkeypatch):
    """The verifications that run as decode rows on SDPA over the PyTorch gather (what runs without
    the C kernels, and on CUDA) instead of the C decode kernel: the same tokens."""
    from kvserve.kernels import cpu_ops

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    base = _base(llama, "int2")
    monkeypatch.setattr(cpu_ops, "lowbit_available", lambda: False)
    calls = []
    real = cpu_ops.paged_attention_decode_pools
    monkeypatch.setattr(cpu_ops, "paged_attention_decode_pools", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = _engine(llama, "int2", spec)
    assert [_summary(o) for o in _run(eng, PROMPTS, _params())] == base
    _spec_ran(eng)
    assert not calls


def test_sliding_window_model_is_token_identical(tiny_model_dir):
    """A model whose every layer has a 16-token window (blocks before it freed while the request
    runs; masked chunks and the C kernel read the window only): the same tokens with drafts."""
    folder = str(tiny_model_dir("mistral_window")[0])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    base = [_summary(o) for o in _run(_engine(folder, "int2"), PROMPTS, _params())]
    eng = _engine(folder, "int2", spec, max_num_batched_tokens=6)
    assert [_summary(o) for o in _run(eng, PROMPTS, _params())] == base
    _spec_ran(eng)
    _all_free(eng)


@pytest.mark.parametrize("kv", LOWBIT)
def test_draft_model_greedy_is_token_identical(llama, drafts, kv):  # noqa: F811
    spec = {"method": "draft_model", "model": drafts["noisy"], "num_speculative_tokens": 3}
    base = _base(llama, kv)
    eng = _engine(llama, kv, spec)
    assert [_summary(o) for o in _run(eng, PROMPTS, _params())] == base
    _spec_ran(eng)
    _all_free(eng)
    prop = eng.proposer
    k, _ = prop.kv_caches[0]
    assert k.dtype == torch.int8  # (the draft's pool: 8-bit, per token, not the target's 2-/4-bit format)
    assert not prop._shadows and prop.kv.num_free_blocks == prop.kv.num_blocks


@pytest.mark.parametrize("kv, mode", [("int4", "recompute"), ("int2", "recompute"), ("int4", "swap")])
def test_greedy_is_token_identical_under_preemption(llama, kv, mode):
    """A pool of 40 blocks of 4 for six requests of up to 93 tokens and a budget of 6 tokens a
    step: prompts chunked, drafts trimmed, requests preempted and recomputed (with the prefix cache
    on: a resumed request hits the blocks its verifications sealed) or swapped out and in (full
    blocks packed, the partial last block's accepted rows through a host residual slot)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    base = _base(llama, kv)
    kw = dict(enable_prefix_caching=True) if mode == "recompute" else dict(preemption_mode="swap", swap_space=1e-4)
    eng = _engine(llama, kv, spec, num_blocks=40, max_num_batched_tokens=6, **kw)
    assert [_summary(o) for o in _run(eng, PROMPTS, _params())] == base
    _spec_ran(eng)
    s = eng.stats()
    assert s["num_preemptions"] > 0 and s["num_chunked_prefills"] > 0
    if mode == "recompute":
        assert s["prefix_cache_resumed_hits"] > 0
    else:
        assert s["swap_num_swap_ins"] > 0 and s["swap_num_swapped_residuals"] > 0
        assert s["swap_num_recompute_fallbacks"] == 0
    _all_free(eng)


# ------------------------------------------------------------ the KV manager's books
def _verifying(bs=4, slots=4):
    """A manager with a request of 6 computed tokens (blocks 0 and 1, block 1 partial) and 1 more
    owed, about to verify 4 drafts (KV indices 6..10: block 1 filled, block 2 partial)."""
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.request import Request

    kv = KVCacheManager(16, bs, residual_blocks=slots)
    req = Request(request_id="r", prompt_token_ids=list(range(10, 16)), sampling_params=SamplingParams(max_tokens=20),
                  seed=0)
    assert kv.allocate_slots(req, 6)
    kv.end_step()
    req.num_computed_tokens = 6
    req.output_token_ids.append(99)
    req.spec_token_ids = [1, 2, 3, 4]
    return kv, req


@pytest.mark.parametrize("accepted, sealed, kept", [(0, [], 1), (1, [1], None), (2, [1], 2), (3, [1], 2), (4, [1], 2)])
def test_end_verification_seals_only_blocks_of_accepted_tokens(accepted, sealed, kept):
    """Blocks the verification wrote: full of accepted tokens → unmapped (the packed block is read
    from now on), the slot back after the next forward; the block of the first rejected draft keeps
    its slot (its accepted rows); the blocks after it release theirs."""
    kv, req = _verifying()
    assert kv.allocate_slots(req, 5)
    table, r = kv.block_tables["r"], kv.residual
    assert len(table) == 3 and all(r.has(b) for b in table[1:])  # every block the step writes
    kv.end_step()  # (the forward: nothing of a verification is released by it)
    assert all(r.has(b) for b in table[1:])
    req.num_computed_tokens += 5 - (4 - accepted)  # (the rollback)
    kv.end_verification(req, 6, 11)
    for i in (1, 2):  # (a block past the accepted ones keeps its slot until the next forward ends)
        assert r.has(table[i]) == (int(r.map[table[i]]) >= 0) == (i not in sealed)
    kv.end_step()  # (the next forward)
    assert [i for i in (1, 2) if r.has(table[i])] == ([kept] if kept else [])
    assert r.num_free == r.num_slots - (1 if kept else 0)
    assert kv.num_verify_sealed == len(sealed) and kv.num_verify_unsealed == (1 if kept == 1 else 0)
    kv.check_invariants()


def test_a_verification_short_of_residual_slots_is_refused():
    """One residual slot (block 1's): the verification needs block 2's too, so allocate_slots refuses
    it and takes nothing (the scheduler then decodes the request without drafts)."""
    kv, req = _verifying(slots=1)
    assert not kv.allocate_slots(req, 5)
    assert len(kv.block_tables["r"]) == 2 and kv.residual.num_short == 1
    req.spec_token_ids = []
    assert kv.allocate_slots(req, 1)  # (its last token alone: block 1 keeps its slot)
    kv.check_invariants()
