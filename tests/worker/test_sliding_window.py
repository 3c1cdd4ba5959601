"""Sliding-window attention that reads and keeps only the window.

Mistral v0.1-style tiny models (every layer windowed, a window of 16 tokens, block size 4) run
sequences 3-6x the window against transformers (float32: logits within 1e-4, greedy tokens
identical) on both CPU paths, while the KV manager frees every block before the window: the
blocks a request holds stay bounded however long it generates, and a pool too small for one
whole sequence (but big enough for the windows) runs batches that equal each request alone,
under chunking and preemption, with forks, beams and speculative decoding. Gemma 3 tiny
models (local and global layers) take the C kernel's window on their local layers and equal
the SDPA path and transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.worker.attention import TorchSDPABackend
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.kernels import cpu_ops
from kvserve.core.kv_cache_manager import FREED_BLOCK, KVCacheManager
from tiny_models import prefill_logits
from workload import run_workload

W = 16  # the tiny Mistral's sliding_window (tests/tiny_models.py)
BS = 4


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def _bound(chunk: int) -> int:
    """Most blocks one request may hold: the window's blocks plus a chunk's (blocks_to_run)."""
    return -(-(W - 1 + chunk) // BS) + 1


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    """Both CPU paths: the C decode kernel with its window, and plain PyTorch (SDPA, CUDA's path)."""
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    return request.param


@pytest.fixture(scope="module")
def mistral(tiny_model_dir):
    return tiny_model_dir("mistral_window")


def test_mistral_prefill_logits_match_transformers(mistral, path):
    """A 64-token prompt (4x the window) in one prefill: every position's logits within 1e-4;
    the same model without its window is far off past the window (the window is applied)."""
    folder, hf = mistral
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=BS)
    assert llm.engine.model_config.uniform_window == W
    assert llm.engine.max_model_len == 512  # not capped at the window any more
    if path == "pytorch":
        assert type(llm.engine.model.attn_backend) is TorchSDPABackend
    ids = _ids(64, 1)
    ours = prefill_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    for layer in llm.engine.model.layers:
        layer.self_attn.window = None
    assert (prefill_logits(llm, ids) - ref)[W:].abs().max() > 1e-2


def test_mistral_logprobs_match_transformers_in_chunks_and_decode(mistral, path):
    """Chunked prefill (7 tokens a step) of a 50-token prompt, then 30 decode steps far past the
    window: the prompt logprobs and each sampled token's logprob equal transformers' (1e-4)
    and the greedy tokens are identical."""
    folder, hf = mistral
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=BS, max_num_batched_tokens=7)
    prompt = _ids(50, 2)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0,
                                                prompt_logprobs=0))[0]
    toks = out.outputs[0].token_ids
    assert toks == _hf_greedy(hf, prompt, 30)
    seq = prompt + toks
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1)
    want_prompt = [ref[i, seq[i + 1]].item() for i in range(len(prompt) - 1)]
    got_prompt = [lp.logprob for lp in out.prompt_token_logprobs[1:]]
    torch.testing.assert_close(torch.tensor(got_prompt), torch.tensor(want_prompt), atol=1e-4, rtol=0)
    want_out = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks)]
    got_out = [lp.logprob for lp in out.outputs[0].token_logprobs]
    torch.testing.assert_close(torch.tensor(got_out), torch.tensor(want_out, dtype=torch.float32), atol=1e-4, rtol=0)
    assert llm.engine.scheduler.num_chunked_prefills > 0


def test_long_generation_holds_a_bounded_number_of_blocks(mistral, path):
    """One request generates 200 tokens (12x the window) from a pool of 8 blocks (32 tokens,
    a sixth of the sequence): after every step it holds at most ceil((W - 1 + 1) / 4) + 1 = 5
    blocks, its freed entries form the table's prefix, the pool's invariants hold, and its
    tokens are transformers'."""
    folder, hf = mistral
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=8, block_size=BS,
                               max_num_batched_tokens=4))
    prompt = _ids(12, 3)
    eng.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    held, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        eng.kv.check_invariants()
        for req in eng.scheduler.running:  # (the request's one sequence)
            table = eng.kv.block_tables[req.request_id]
            n = eng.kv.num_held_blocks(req)
            held.append(n)
            assert table[: len(table) - n] == [FREED_BLOCK] * (len(table) - n)
            assert eng.kv.num_used_blocks == n
    assert max(held) <= _bound(4) == 6 and max(held[-50:]) <= 5, held
    assert len(eng.kv.block_tables) == 0 and eng.kv.num_free_blocks == 8
    assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 200)
    assert eng.scheduler.num_preemptions == 0


def test_window_too_small_pool_is_refused_but_windowed_pool_runs(mistral):
    """The engine's admission check counts the blocks a windowed request really holds: 110
    tokens need 28 blocks without freeing, 6 with a window of 16 and a 7-token budget."""
    folder, _ = mistral
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=7, block_size=BS,
                               max_num_batched_tokens=7))
    assert eng.kv.blocks_to_run(110, 7) == _bound(7) == 7
    assert eng.kv.blocks_needed(110) == 28
    eng.add_request(_ids(60, 4), SamplingParams(max_tokens=50))
    small = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=6, block_size=BS,
                                 max_num_batched_tokens=7))
    with pytest.raises(ValueError, match="needs 7 KV blocks"):
        small.add_request(_ids(60, 4), SamplingParams(max_tokens=50))


def test_prefix_caching_is_off_for_every_layer_windowed_models(mistral):
    folder, _ = mistral
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=BS, enable_prefix_caching=True)
    assert llm.engine.kv.cache is None and llm.engine.kv.sliding_window == W
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, 4, enable_prefix_caching=True, sliding_window=16)


PROMPTS = [_ids(50, 10), _ids(3, 11), _ids(70, 12), _ids(33, 13)]


def test_batch_equals_alone_with_a_pool_that_holds_only_the_windows(mistral, path):
    """Four prompts (3-70 tokens) generating 40 tokens each (sequences up to 110 tokens = 28
    blocks) with a 7-token budget and a pool of 14 blocks: less than one whole sequence, enough
    for two windows. The batch chunks, preempts (recomputing from scratch) and frees blocks
    behind the windows; every request's tokens equal its run alone and transformers'."""
    folder, hf = mistral
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=14, block_size=BS,
                               max_num_batched_tokens=7))
    ids, final = run_workload(eng, [dict(prompt=p, params=params, arrive=0, abort=None) for p in PROMPTS], 3000)
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.num_chunked_prefills > 0
    for rid, out in final.items():
        assert out.outputs[0].token_ids == _hf_greedy(hf, list(ids[rid]["prompt"]), 40), rid
    assert eng.kv.num_free_blocks == 14


def test_forks_beams_and_seeded_samples_equal_alone(mistral):
    """n = 3 seeded samples (forks share the prompt's blocks, each frees its own reference),
    beam search (clones share blocks) and a long greedy request, in a pool of 24 blocks with a
    5-token budget: each equals its run alone on a roomy engine."""
    folder, _ = mistral
    reqs = [(_ids(40, 20), SamplingParams(max_tokens=30, temperature=0.8, seed=5, n=3)),
            (_ids(20, 21), SamplingParams(max_tokens=25, use_beam_search=True, beam_width=2, n=2, ignore_eos=True)),
            (_ids(55, 22), SamplingParams(max_tokens=35, temperature=0, ignore_eos=True))]

    def summary(out):
        return [(o.token_ids, o.finish_reason) for o in out.outputs]

    alone = []
    for p, sp in reqs:
        roomy = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=128,
                                     block_size=BS, max_num_batched_tokens=64))
        _, fin = run_workload(roomy, [dict(prompt=p, params=sp, arrive=0, abort=None)], 2000)
        alone.append(summary(fin["r0"]))
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=24, block_size=BS,
                               max_num_batched_tokens=5))
    ids, final = run_workload(eng, [dict(prompt=p, params=sp, arrive=i, abort=None)
                                    for i, (p, sp) in enumerate(reqs)], 4000)
    for i in range(len(reqs)):
        assert summary(final[f"r{i}"]) == alone[i], i
    assert eng.kv.num_free_blocks == 24


def test_speculative_decoding_rolls_back_within_the_window(mistral, path):
    """n-gram drafts on a repetitive prompt: rejected drafts are rolled back without touching
    freed blocks, and the greedy tokens are plain decoding's (and transformers')."""
    folder, hf = mistral
    prompt = [5, 6, 7, 8, 9] * 8
    llm = LLM(model=str(folder), dtype="float32", num_blocks=16, block_size=BS, max_num_batched_tokens=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 60)
    assert llm.engine.spec_num_draft_tokens > 0


@st.composite
def workloads(draw):
    """Windowed-model workloads whose pool holds the largest request's windows but often not
    one whole sequence."""
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(3, 383), min_size=1, max_size=60))
        max_tokens = draw(st.integers(1, 40))
        kind = draw(st.sampled_from(["greedy", "seeded", "samples"]))
        if kind == "greedy":
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        elif kind == "seeded":
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=draw(st.integers(0, 99)))
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=draw(st.integers(0, 99)),
                                    n=draw(st.integers(2, 3)))
        requests.append(dict(prompt=tuple(prompt), params=params, arrive=draw(st.integers(0, 10)),
                             abort=draw(st.sampled_from([None] * 5 + [1, 3]))))
    budget = draw(st.sampled_from([1, 3, 8]))
    return dict(budget=budget, num_blocks=_bound(budget) + draw(st.sampled_from([0, 1, 4, 12])),
                max_num_seqs=draw(st.sampled_from([2, 16])), requests=requests)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads())
def test_randomized_windowed_workloads_keep_invariants_and_solo_outputs(mistral, w):
    """free + cached + used == total and the reference counts match the tables after every
    step (run_workload), every held count within the bound, each output its solo run's."""
    folder, _ = mistral
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=w["num_blocks"],
                               block_size=BS, max_num_batched_tokens=w["budget"], max_num_seqs=w["max_num_seqs"]))
    step = eng.step

    def checked_step():
        outs = step()
        for r in eng.scheduler.running:
            assert eng.kv.num_held_blocks(r) <= _bound(w["budget"])
        return outs

    eng.step = checked_step
    ids, final = run_workload(eng, w["requests"], 4000)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    roomy = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=128, block_size=BS))
    for rid, out in final.items():
        if out == "aborted":
            continue
        r = ids[rid]
        _, solo = run_workload(roomy, [dict(prompt=r["prompt"], params=r["params"], arrive=0, abort=None)], 2000)
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in solo["r0"].outputs], rid


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_pools_batch_equals_alone_with_freed_blocks(mistral, kv_cache_dtype):
    """8-bit KV rows (codes + float32 scale) through the windowed C decode kernel and the
    windowed SDPA prefill: the four prompts in a 14-block pool (chunked, preempted, blocks
    freed) give the tokens each gives alone in a roomy pool with the same cache dtype; with int8
    the first 5 tokens are transformers' (8-bit K/V are not exact)."""
    folder, hf = mistral
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    args = dict(model=str(folder), dtype="float32", device="cpu", block_size=BS, kv_cache_dtype=kv_cache_dtype)
    eng = LLMEngine(EngineArgs(num_blocks=14, max_num_batched_tokens=7, **args))
    ids, final = run_workload(eng, [dict(prompt=p, params=params, arrive=0, abort=None) for p in PROMPTS], 3000)
    assert eng.scheduler.num_preemptions > 0
    for i, p in enumerate(PROMPTS):
        roomy = LLMEngine(EngineArgs(num_blocks=128, **args))
        _, solo = run_workload(roomy, [dict(prompt=p, params=params, arrive=0, abort=None)], 2000)
        toks = final[f"r{i}"].outputs[0].token_ids
        assert toks == solo["r0"].outputs[0].token_ids, i
        if kv_cache_dtype == "int8":  # (fp8's 3 mantissa bits flip this random model's first tokens)
            assert toks[:5] == _hf_greedy(hf, p, 40)[:5], i


def test_swap_preemption_with_freed_blocks_recomputes_and_equals_transformers(mistral):
    """preemption_mode="swap" on an every-layer-windowed model: a victim still holding all its
    blocks (within the window) is swapped out and back; one that has freed blocks before its
    window is recomputed (its table has holes that the host pool does not keep). The pool holds
    less than one whole sequence; every request's tokens equal transformers'."""
    folder, hf = mistral
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=14, block_size=BS,
                               max_num_batched_tokens=7, swap_space=0.01, preemption_mode="swap"))
    ids, final = run_workload(eng, [dict(prompt=p, params=params, arrive=0, abort=None) for p in PROMPTS], 3000)
    st = eng.stats()
    assert st["swap_num_swap_outs"] >= 1 and st["swap_num_swap_ins"] == st["swap_num_swap_outs"], st
    assert st["swap_num_recompute_fallbacks"] >= 1, st  # a victim with freed blocks
    for rid, out in final.items():
        assert out.outputs[0].token_ids == _hf_greedy(hf, list(ids[rid]["prompt"]), 40), rid
    assert eng.kv.num_free_blocks == 14 and eng.swap.allocator.num_used == 0
