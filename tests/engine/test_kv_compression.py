"""KV compression (issue #23): StreamingLLM, SnapKV and H2O on the paged cache, float32, tiny
random-weight models (tests/tiny_models.py).

What is checked:
* the configs' errors name the field (``kv_compression.window``, ...), offline (SamplingParams,
  LLM(kv_compression=...), the engine's limits);
* a request shorter than its budget gives exactly the tokens of no compression;
* StreamingLLM: a 4,000-token generation holds at most ceil(260 / 16) + 2 blocks at every step and
  its first 256 tokens equal those of no compression; its tokens equal a transformers reference
  whose attention mask hides the dropped positions (same RoPE positions, same lazy rule), so the
  kernels read exactly the kept tokens at their original positions;
* SnapKV's and H2O's kept positions (per layer and KV head) equal a NumPy reference computed from
  the same attention inputs (the queries and the cached keys each layer saw), and the K cache rows
  after each compaction are the kept positions' keys;
* preemption by swap reproduces the unpreempted compressed run exactly; by recompute it restarts the
  policy and stays within the bound; n > 1 samples and structured output run compressed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker import attention as attention_mod

STREAM = {"method": "streaming_llm", "sink_tokens": 4, "window": 32}


def greedy(max_tokens: int, comp=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, kv_compression=comp, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    folder, hf = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_blocks=400, block_size=16)
    yield llm, hf
    llm.engine.shutdown()


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = np.random.default_rng(seed)
    return [int(t) for t in g.integers(3, 380, size=n)]


# ---------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("cfg, field", [
    ({"method": "lru"}, "kv_compression.method"),
    ({"method": "streaming_llm", "window": 0}, "kv_compression.window"),
    ({"method": "streaming_llm", "window": 8, "sink_tokens": -1}, "kv_compression.sink_tokens"),
    ({"method": "streaming_llm"}, "kv_compression.window"),
    ({"method": "h2o", "budget": 0, "recent": 0}, "kv_compression.budget"),
    ({"method": "h2o", "budget": 8, "recent": 8}, "kv_compression.recent"),
    ({"method": "snapkv", "budget": -3}, "kv_compression.budget"),
    ({"method": "snapkv", "budget": 64, "kernel_size": 4}, "kv_compression.kernel_size"),
    ({"method": "snapkv", "budget": 16, "observation_window": 16}, "kv_compression.observation_window"),
    ({"method": "h2o", "budget": 8.5, "recent": 1}, "kv_compression.budget"),
    ({"method": "h2o", "budget": 8, "recent": 1, "window": 3}, "kv_compression: unknown field"),
    ("[1, 2]", "kv_compression must be an object"),
])
def test_bad_config_names_the_field(cfg, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SamplingParams(kv_compression=cfg)


def test_engine_limits_name_the_field(tiny, tiny_model_dir):
    llm, _ = tiny
    with pytest.raises(ValueError, match=r"kv_compression\.budget must be at most max_model_len \(512\)"):
        llm.generate([[5, 6, 7]], greedy(4, {"method": "h2o", "budget": 600, "recent": 8}))
    with pytest.raises(ValueError, match=r"kv_compression\.window"):
        llm.generate([[5, 6, 7]], greedy(4, {"method": "streaming_llm", "sink_tokens": 4, "window": 510}))
    with pytest.raises(ValueError, match="kv_compression is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, kv_compression=STREAM)
    with pytest.raises(ValueError, match=r"kv_compression\.method"):
        LLM(model=str(tiny_model_dir("llama")[0]), dtype="float32", kv_compression='{"method": "x"}')
    with pytest.raises(ValueError, match=r"kv_compression\.budget must be at most max_model_len"):
        LLM(model=str(tiny_model_dir("llama")[0]), dtype="float32", max_model_len=64, num_blocks=16,
            kv_compression={"method": "snapkv", "budget": 100})


def test_sliding_window_model_refused(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("mistral_window")[0]), dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="kv_compression is not supported for models with sliding-window layers"):
        llm.generate([[5, 6, 7]], greedy(4, STREAM))
    llm.engine.shutdown()


# ---------------------------------------------------------------------------- under budget
@pytest.mark.parametrize("comp", [
    {"method": "streaming_llm", "sink_tokens": 4, "window": 200},
    {"method": "snapkv", "budget": 100, "observation_window": 8},
    {"method": "h2o", "budget": 200, "recent": 16},
])
def test_under_budget_equals_no_compression(tiny, comp):
    llm, _ = tiny
    prompts = [prompt_ids(30, 1), prompt_ids(50, 2)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40))]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40, comp))]
    assert got == ref
    assert llm.engine.core.num_kv_compactions == 0


# ---------------------------------------------------------------------------- StreamingLLM
def test_streaming_4000_tokens_bounded_blocks(tiny_model_dir):
    """sink 4 + window 256: at most ceil(260/16) + 2 blocks at every step of a 4,000-token
    generation; the first 256 tokens are those of no compression; it is admitted in a pool that
    holds a sixth of it."""
    folder = tiny_model_dir("llama_long")[0]
    # a pool of 40 blocks (640 tokens): the whole sequence could never fit, the policy's bound does
    # (22 blocks for 260 + 15 + a 64-token chunk, + 17 for the fresh copy of the first compaction)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=4096, num_blocks=40, block_size=16,
              max_num_batched_tokens=64)
    eng = llm.engine
    prompt = prompt_ids(12, 3)
    ref = llm.generate([prompt], greedy(256))[0].outputs[0].token_ids
    comp = {"method": "streaming_llm", "sink_tokens": 4, "window": 256}
    with pytest.raises(ValueError, match="needs 251 KV blocks"):
        llm.generate([prompt], greedy(4000))
    rid = eng.add_request(prompt, greedy(4000, comp))
    bound = math.ceil(260 / 16) + 2
    most, steps, out = 0, 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        req = next(iter(eng.core.scheduler.running), None)
        if req is not None:
            held = eng.core.kv.num_held_blocks(req)
            assert held <= bound, (steps, held)
            assert req.num_kv_tokens <= 260 + 16
            most = max(most, held)
        steps += 1
    toks = out.outputs[0].token_ids
    assert out.request_id == rid and len(toks) == 4000
    assert toks[:256] == ref
    assert most == bound - 1  # (kept 260 + one block of slack, then back)
    assert eng.core.num_kv_compactions == (4000 + 12 - 276) // 16 + 1
    st = eng.stats()
    assert st["kv_compactions"] == eng.core.num_kv_compactions
    assert st["kv_compression_dropped_tokens"] == 16 * st["kv_compactions"]  # (276 -> 260 each time)
    eng.core.kv.check_invariants()
    eng.shutdown()


def hf_streaming(hf, prompt: list[int], n: int, sinks: int, window: int, bs: int) -> list[int]:
    """Greedy tokens of the transformers model where each query sees only the positions StreamingLLM
    keeps (the engine's lazy rule: compact to sinks + window once sinks + window + bs are kept),
    through a 2-D attention mask with the dropped positions zeroed, explicit position ids."""
    from transformers import DynamicCache

    visible: list[bool] = []
    past = DynamicCache()
    ids, out = list(prompt), []

    def compact():
        kept = [i for i, v in enumerate(visible) if v]
        if len(kept) >= sinks + window + bs:
            for i in kept[sinks:len(kept) - window]:
                visible[i] = False

    with torch.no_grad():
        for step in range(n):
            start = len(visible)
            visible.extend([True] * len(ids))
            o = hf(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                   attention_mask=torch.tensor([visible], dtype=torch.long), past_key_values=past, use_cache=True)
            past = o.past_key_values
            compact()
            tok = int(o.logits[0, -1].argmax())
            out.append(tok)
            ids = [tok]
    return out


def test_streaming_matches_masked_reference(tiny):
    """Several compactions (prompt 40, sinks 4, window 32, block 16): the engine's tokens equal the
    masked transformers reference token for token."""
    llm, hf = tiny
    prompt = prompt_ids(40, 4)
    got = llm.generate([prompt], greedy(150, STREAM))[0].outputs[0].token_ids
    want = hf_streaming(hf, prompt, 150, 4, 32, 16)
    assert got == want
    full = llm.generate([prompt], greedy(150))[0].outputs[0].token_ids
    assert full != got  # (the compaction changed something: the test can fail)


# ---------------------------------------------------------------------------- SnapKV / H2O
class ProbeRecorder:
    """Wraps attention.record_kv_probes: per call (layer), per probe, the float32 queries of its rows
    and the keys of its context as the engine's attention saw them."""

    def __init__(self, monkeypatch):
        self.calls: list[list[tuple]] = []
        orig = attention_mod.record_kv_probes

        def rec(q, k_cache, meta, scale):
            from kvserve.worker import kv_quant

            self.scale = scale
            self.calls.append([(p.request_id, q.index_select(0, p.rows).float().cpu().numpy().copy(),
                                p.query_kv.cpu().numpy().copy(),
                                kv_quant.gather(k_cache, p.context_slots, q.dtype).float().cpu().numpy().copy())
                               for p in meta.kv_probes])
            orig(q, k_cache, meta, scale)

        monkeypatch.setattr(attention_mod, "record_kv_probes", rec)


def np_colsums(q: np.ndarray, qkv: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[KVH, c]: softmax(q·kᵀ·scale) over the causal context, summed over rows and group heads."""
    m, H, hd = q.shape
    c, KVH, _ = k.shape
    g = H // KVH
    out = np.zeros((KVH, c), dtype=np.float64)
    for h in range(H):
        logits = (q[:, h, :].astype(np.float64) @ k[:, h // g, :].astype(np.float64).T) * scale  # [m, c]
        logits[np.arange(c)[None, :] > qkv[:, None]] = -np.inf
        p = np.exp(logits - logits.max(1, keepdims=True))
        out[h // g] += (p / p.sum(1, keepdims=True)).sum(0)
    return out


def np_topk_stable(x: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-x, kind="stable")[:k])


def np_h2o_compact(scores: np.ndarray, positions: np.ndarray, budget: int, recent: int):
    """H2O's selection on the NumPy side: per layer and KV head, the top ``budget - recent``
    accumulated scores among the older tokens (stable) plus the ``recent`` newest; returns the
    kept ``(scores, positions)``, both ``[L, KVH, budget]``."""
    L, KVH, n = scores.shape
    idx = np.array([[np.concatenate([np_topk_stable(scores[l, h, : n - recent], budget - recent),
                                     np.arange(n - recent, n)])
                     for h in range(KVH)] for l in range(L)])
    return np.take_along_axis(scores, idx, -1), np.take_along_axis(positions, idx, -1)


def test_snapkv_kept_positions_match_numpy(tiny, monkeypatch):
    llm, _ = tiny
    core = llm.engine.core
    rec = ProbeRecorder(monkeypatch)
    B, W, K = 24, 6, 5
    prompt = prompt_ids(90, 5)
    eng = llm.engine
    rid = eng.add_request(prompt, greedy(3, {"method": "snapkv", "budget": B, "observation_window": W,
                                             "kernel_size": K}))
    seq = next(iter(core.groups[rid].seqs))
    eng.step()  # the prompt (one chunk), then the selection is recorded
    L = core.model_config.num_layers
    assert len(rec.calls) == L and all(len(c) == 1 for c in rec.calls)
    want = []
    for layer in range(L):
        _, q, qkv, k = rec.calls[layer][0]
        assert q.shape[0] == W and list(qkv) == list(range(90 - W, 90))
        sums = np_colsums(q, qkv, k, rec.scale)  # [KVH, 90]
        per_head = []
        for h in range(sums.shape[0]):
            s = sums[h, : 90 - W]
            padded = np.concatenate([np.full(K // 2, -np.inf), s, np.full(K // 2, -np.inf)])
            pooled = np.array([padded[i : i + K].max() for i in range(90 - W)])
            per_head.append(np.concatenate([np_topk_stable(pooled, B - W), np.arange(90 - W, 90)]))
        want.append(per_head)
    want = np.array(want)  # [L, KVH, B]
    eng.step()  # the compaction is applied before this step's forward
    comp = core.executor.driver_worker.kv_mover.compressor
    kept = comp.last_keep[seq.request_id].cpu().numpy()
    np.testing.assert_array_equal(kept, want)
    assert seq.num_dropped_tokens == 90 - B and seq.num_kv_tokens == B + 1
    # the K rows now in KV slots 0..B-1 are the kept positions' keys, per layer and head
    full_k = [rec.calls[layer][0][3] for layer in range(L)]  # [90, KVH, hd] from the prefill
    table = core.kv.block_tables[seq.request_id]
    for layer in range(L):
        kc = llm.engine.core.kv_caches[layer][0]
        for h in range(kc.shape[2]):
            rows = np.stack([kc[table[j // 16], j % 16, h].cpu().numpy() for j in range(B)])
            np.testing.assert_array_equal(rows, full_k[layer][want[layer, h], h])
    while eng.has_unfinished_requests():
        eng.step()
    core.kv.check_invariants()


def test_h2o_kept_positions_match_numpy(tiny, monkeypatch):
    """H2O (budget 20, recent 6, block 16: a compaction at 36 cached tokens) over a 30-token prompt
    and 60 decode steps: the reference accumulates the column sums of every query (NumPy, from the
    queries and keys each layer saw), keeps the 14 heaviest before the 6 most recent tokens at each
    compaction, and its kept positions equal the engine's, per layer and KV head, every step."""
    llm, _ = tiny
    core, eng = llm.engine.core, llm.engine
    rec = ProbeRecorder(monkeypatch)
    B, R, bs = 20, 6, 16
    prompt = prompt_ids(30, 6)
    rid = eng.add_request(prompt, greedy(60, {"method": "h2o", "budget": B, "recent": R}))
    seq = core.groups[rid].seqs[0]
    comp = core.executor.driver_worker.kv_mover.compressor
    L = core.model_config.num_layers
    KVH = core.model_config.num_kv_heads
    scores = np.zeros((L, KVH, 0))
    positions = np.zeros((L, KVH, 0), dtype=np.int64)
    keys: dict[tuple[int, int, int], np.ndarray] = {}  # (layer, head, position) -> its key
    compactions = 0
    while eng.has_unfinished_requests():
        first = len(rec.calls)
        dropped = seq.num_dropped_tokens
        eng.step()
        calls = rec.calls[first:]
        assert len(calls) == L, (len(seq.output_token_ids), seq.status, seq.num_kv_tokens)
        for layer in range(L):
            _, q, qkv, k = calls[layer][0]
            c = k.shape[0]
            if c > scores.shape[-1]:  # new tokens: their positions follow the KV index + dropped
                n0 = scores.shape[-1]
                scores = np.concatenate([scores, np.zeros((L, KVH, c - n0))], -1) if layer == 0 else scores
                if layer == 0:
                    positions = np.concatenate([positions, np.broadcast_to(np.arange(n0, c) + dropped,
                                                                           (L, KVH, c - n0))], -1)
            for h in range(KVH):
                for j in range(c):
                    key = (layer, h, int(positions[layer, h, j]))
                    if key in keys:  # a kept key is the same key, wherever it moved
                        np.testing.assert_array_equal(k[j, h], keys[key])
                    keys[key] = k[j, h].copy()
            scores[layer] += np_colsums(q, qkv, k, rec.scale)
        st = comp.states.get(seq.request_id)
        assert st is not None
        # the engine's bookkeeping after this step (its last compaction applied before the forward)
        np.testing.assert_array_equal(st.positions.cpu().numpy(), positions)
        np.testing.assert_allclose(st.scores.cpu().numpy(), scores, rtol=1e-4, atol=1e-5)
        n = scores.shape[-1]
        if seq.status.value == "running" and n >= B + bs:
            scores, positions = np_h2o_compact(scores, positions, B, R)
            compactions += 1
    assert compactions >= 3
    core.kv.check_invariants()



# ---------------------------------------------------------------------------- with the rest of the engine
def test_prefix_cache_never_stores_compacted_blocks(tiny):
    """A StreamingLLM request's prompt blocks enter the cache (exact K/V, inserted before its first
    compaction); nothing after that does: a later request with its prompt + output hits at most the
    prompt's full blocks, where an uncompressed run's hits its whole context."""
    llm, _ = tiny
    prompt = prompt_ids(40, 7)
    got = llm.generate([prompt], greedy(100, STREAM, seed=1))[0].outputs[0].token_ids
    follow = prompt + got[:60]
    hit = llm.generate([follow], greedy(1, STREAM))[0].num_cached_tokens
    assert hit <= 48  # (3 full blocks of the prompt: its 52-token KV compacted after that)
    full = llm.generate([prompt_ids(40, 8)], greedy(100, seed=1))[0].outputs[0].token_ids
    hit_full = llm.generate([prompt_ids(40, 8) + full[:60]], greedy(1))[0].num_cached_tokens
    assert hit_full >= 96
    # SnapKV / H2O score every query they compute: they take no prefix-cache hit
    snap = {"method": "snapkv", "budget": 24, "observation_window": 8}
    assert llm.generate([prompt], greedy(1, snap))[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy(1, STREAM))[0].num_cached_tokens == 39  # (all but the last token)
    llm.engine.core.kv.check_invariants()


@pytest.mark.parametrize("comp", [STREAM, {"method": "h2o", "budget": 24, "recent": 8}])
def test_n_samples_each_compress_alone(tiny, comp):
    """n = 3 greedy samples (forked copy-on-write for StreamingLLM; each computing its prompt for
    H2O, whose scores need every query) equal the n = 1 run."""
    llm, _ = tiny
    prompt = prompt_ids(40, 9)
    one = llm.generate([prompt], greedy(90, comp))[0].outputs[0].token_ids
    outs = llm.generate([prompt], greedy(90, comp, n=3))[0].outputs
    assert [o.token_ids for o in outs] == [one] * 3
    llm.engine.core.kv.check_invariants()


def test_structured_output_under_compression(tiny):
    llm, _ = tiny
    prompt = prompt_ids(60, 10)  # (compacted right after the prompt: 60 >= 4 + 32 + 16)
    o = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=0, kv_compression=STREAM,
                                              structured_outputs={"regex": "[0-9]{3,90}"}))[0].outputs[0]
    import re

    assert re.fullmatch("[0-9]{3,90}", o.text) or (o.finish_reason == "length" and re.fullmatch("[0-9]*", o.text))
    assert llm.engine.core.num_kv_compactions > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption(tiny_model_dir, mode):
    """A pool of 12 blocks for 4 requests that each hold up to 4: preemptions. Swap brings each
    request's compacted KV and its scores back (the same tokens as each run alone); recompute
    restarts the policy on prompt + output (the tokens then differ after the preemption) and stays
    within the blocks."""
    folder = tiny_model_dir("llama")[0]
    kw = dict(swap_space=0.01, preemption_mode="swap") if mode == "swap" else {}
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_blocks=12, block_size=16,
              max_num_batched_tokens=64, enable_prefix_caching=False, **kw)
    alone = LLM(model=str(folder), dtype="float32", max_model_len=512, num_blocks=64, block_size=16,
                max_num_batched_tokens=64, enable_prefix_caching=False)
    core = check_preemption_workload(llm, alone, [STREAM, {"method": "h2o", "budget": 24, "recent": 8}] * 2, mode)
    core.kv.check_invariants()
    llm.engine.shutdown()
    alone.engine.shutdown()


def check_preemption_workload(llm, alone, comps, mode: str):
    """Four compressed requests (policies ``comps``) in ``llm``'s tight pool, against each run
    alone in ``alone``: preemptions happened; with swap the tokens equal the solo runs', with
    recompute they differ (recomputed K/V then compacted) but the same workload again gives the
    same tokens; every finished request's scores are dropped on the workers (the forget ops
    apply with the next step). Returns ``llm``'s engine core."""
    prompts = [prompt_ids(30, 20 + i) for i in range(4)]
    params = [greedy(120, c) for c in comps]
    want = [alone.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert all(len(g) == 120 for g in got)
    if mode == "swap":
        assert core.swap.num_swap_outs > 0 and core.swap.num_swap_drops == 0
        assert got == want
    else:
        assert got != want  # (recomputed K/V then compacted: not the state the first run had)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert again == got
    llm.generate([[5, 6]], greedy(1))
    assert core.executor.driver_worker.kv_mover.compressor.states == {}
    return core


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_speculative_decoding_streaming(tiny_model_dir):
    """n-gram drafts verified over a compacted KV: the run completes with drafts accepted."""
    folder = tiny_model_dir("llama")[0]
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_blocks=64, block_size=16,
              speculative_config=SPEC)
    prompt = [5, 6, 7, 8, 9] * 8
    o = llm.generate([prompt], greedy(150, STREAM))[0].outputs[0]
    core = llm.engine.core
    assert len(o.token_ids) == 150 and core.num_kv_compactions > 0 and core.spec_num_draft_tokens > 0
    core.kv.check_invariants()
    llm.engine.shutdown()


def _final_scores(llm: LLM, num_kv_tokens: int) -> dict:
    """sequence id -> its H2O/SnapKV scores ``[L, KVH, c]`` as the worker forgets it (it finished),
    its set-aside verification rows counted up to ``num_kv_tokens``."""
    comp = llm.engine.core.executor.driver_worker.kv_mover.compressor
    forget, out = comp.forget, {}

    def capture(request_id):
        if request_id in comp.states:
            comp.settle(request_id, num_kv_tokens)
            out[request_id] = comp.states[request_id].scores.clone()
        forget(request_id)

    comp.forget = capture
    return out


def test_speculative_decoding_counts_only_accepted_queries(tiny_model_dir):
    """H2O with n-gram drafts, a budget the request never reaches: the tokens equal the run without
    speculation (greedy), and so do the scores at the end: every input token's query counted once,
    a rejected draft's never (each (layer, KV head) row of scores sums to G = 2 query heads x the
    input tokens: each query's softmax sums to 1 per head). Then H2O and SnapKV at budgets that
    compact, batched with drafts: SnapKV (compacted after prefill, before any draft) gives the
    tokens it gives without speculation, H2O runs within its bound; drafts were accepted and
    rejected; nothing leaks."""
    folder = str(tiny_model_dir("llama")[0])
    prompt = [5, 6, 7, 8, 9] * 8 + prompt_ids(20, 3)
    big = {"method": "h2o", "budget": 400, "recent": 8}
    n = len(prompt) + 80 - 1  # input tokens: the prompt and the output but its last
    runs = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        llm = LLM(model=folder, dtype="float32", max_model_len=512, num_blocks=64, block_size=16,
                  speculative_config=spec)
        scores = _final_scores(llm, n)
        out = llm.generate([prompt], greedy(80, big))[0]
        llm.generate([[5, 6]], greedy(1))  # (a step after the request's end: the worker forgets it)
        assert len(scores) == 1  # (keyed by the sequence's id)
        runs[name] = (out.outputs[0].token_ids, scores.popitem()[1], llm)
    (plain_ids, plain, _), (spec_ids, spec, llm) = runs["plain"], runs["spec"]
    core = llm.engine.core
    assert core.spec.num_accepted_tokens > 0 and core.spec.num_draft_tokens > core.spec.num_accepted_tokens
    assert spec_ids == plain_ids
    G = core.model_config.num_heads // core.model_config.num_kv_heads
    assert plain.shape[-1] == n and bool((spec[..., n:] == 0).all())
    torch.testing.assert_close(spec[..., :n], plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(spec.sum(-1), torch.full(spec.shape[:2], float(G * n), device=spec.device),
                               rtol=1e-5, atol=1e-3)
    runs["plain"][2].engine.shutdown()

    h2o = {"method": "h2o", "budget": 24, "recent": 8}
    snap = {"method": "snapkv", "budget": 24, "observation_window": 8}
    accepted = core.spec.num_accepted_tokens
    outs = llm.generate([prompt, prompt[:50]], [greedy(120, h2o), greedy(60, snap)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [120, 60]
    assert core.spec.num_accepted_tokens > accepted and core.num_kv_compactions >= 3
    plain_llm = LLM(model=folder, dtype="float32", max_model_len=512, num_blocks=64, block_size=16)
    assert outs[1].outputs[0].token_ids == plain_llm.generate([prompt[:50]], greedy(60, snap))[0].outputs[0].token_ids
    plain_llm.engine.shutdown()
    llm.generate([[5, 6]], greedy(1))  # (the workers forget finished requests at the next step)
    core.kv.check_invariants()
    assert core.kv.num_used_blocks == 0
    comp = core.executor.driver_worker.kv_mover.compressor
    assert comp.states == {} and comp.pending == {}
    llm.engine.shutdown()


def test_cli_refuses_bad_config_naming_the_option(capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["generate", "hi", "--kv-compression", '{"method": "streaming_llm", "window": 0}'])
    err = capsys.readouterr().err
    assert rc != 0 and "--kv-compression.window must be ≥ 1, got 0" in err


# ---------------------------------------------------------------------------- HTTP
def test_http_field(tiny, tiny_model_dir):
    import httpx
    from server_helpers import ServerThread

    from kvserve.engine.llm_engine import EngineArgs, LLMEngine

    llm, _ = tiny
    folder = tiny_model_dir("llama")[0]
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", max_model_len=512, num_blocks=200,
                                  kv_compression={"method": "h2o", "budget": 24, "recent": 8}))
    prompt = prompt_ids(40, 11)
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with ServerThread(engine, names=["tiny"]) as s:
        url = s.base_url + "/v1/completions"
        for bad, msg in [({"method": "streaming_llm", "window": 0}, "kv_compression.window must be ≥ 1"),
                         ({"method": "h2o", "budget": 0, "recent": 0}, "kv_compression.budget must be ≥ 1"),
                         ({"method": "zip"}, "kv_compression.method must be one of"),
                         ({"method": "snapkv", "budget": 4096}, "kv_compression.budget must be at most max_model_len"),
                         ({"method": "streaming_llm", "sink_tokens": -2, "window": 8}, "kv_compression.sink_tokens")]:
            r = httpx.post(url, json={**base, "kv_compression": bad}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "kv_compression" and msg in err["message"], err
        r = httpx.post(s.base_url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
            "kv_compression": STREAM}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_compression"
        texts = {}
        for name, comp in [("stream", STREAM), ("none", {"method": "none"}), ("default", None)]:
            body = {**base, **({"kv_compression": comp} if comp is not None else {})}
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
        s.wait_idle()
        metrics = httpx.get(s.base_url + "/metrics", timeout=30).text
    engine.shutdown()
    got = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
           if line.startswith("kvserve:kv_compactions_total") or line.startswith("kvserve:kv_compression_dropped")}
    # 40 + 59 tokens computed: streaming compacts 52 -> 36 three times (after positions 51, 67, 83),
    # h2o (the default) 40 -> 24 four times (after the prompt, then positions 55, 71, 87)
    assert got == {"kvserve:kv_compactions_total": 7.0, "kvserve:kv_compression_dropped_tokens_total": 112.0}
    offline = {name: llm.generate([prompt], greedy(60, comp)).__getitem__(0).outputs[0].text
               for name, comp in [("stream", STREAM), ("none", None),
                                  ("default", {"method": "h2o", "budget": 24, "recent": 8})]}
    assert texts == offline
    assert texts["default"] != texts["none"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_bfloat16_and_8bit_cache(tiny_model_dir, kv_cache_dtype):
    """bfloat16 (and an int8 or int4 KV cache): every policy runs, compacts and finishes with its
    tokens (the probes read the cache in the model dtype, dequantized, and score in float32; int4's
    kept rows are requantized from bfloat16: tests/engine/test_kv_compression_lowbit.py)."""
    llm = LLM(model=str(tiny_model_dir("llama")[0]), dtype="bfloat16", max_model_len=512, num_blocks=64,
              block_size=16, kv_cache_dtype=kv_cache_dtype)
    prompt = prompt_ids(60, 12)
    for comp in (STREAM, {"method": "h2o", "budget": 24, "recent": 8},
                 {"method": "snapkv", "budget": 24, "observation_window": 8}):
        o = llm.generate([prompt], greedy(40, comp))[0].outputs[0]
        assert o.finish_reason == "length" and len(o.token_ids) == 40
    assert llm.engine.core.num_kv_compactions >= 3
    llm.engine.core.kv.check_invariants()
    llm.engine.shutdown()


@pytest.mark.slow  # (two spawned ranks: ~10-20 s on 2 shared cores)
def test_tensor_parallel_equals_one_rank(tiny, tiny_model_dir):
    """At tensor_parallel_size=2 each rank scores and compacts its own KV heads (the per-head
    selections of SnapKV / H2O are local to a head): the tokens equal the one-rank engine's."""
    llm, _ = tiny
    prompt = prompt_ids(60, 13)
    comps = [STREAM, {"method": "h2o", "budget": 24, "recent": 8},
             {"method": "snapkv", "budget": 24, "observation_window": 8}]
    want = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, [greedy(50, c) for c in comps])]
    tp = LLM(model=str(tiny_model_dir("llama")[0]), dtype="float32", max_model_len=512, num_blocks=64,
             block_size=16, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate([prompt] * 3, [greedy(50, c) for c in comps])]
        assert tp.engine.core.num_kv_compactions >= 5
    finally:
        tp.engine.shutdown()
    assert got == want


def test_mixed_batch_equals_each_alone(tiny):
    """Uncompressed, StreamingLLM, H2O and SnapKV requests batched together (decode rows with and
    without probes, different KV offsets in one step) give each request's solo tokens."""
    llm, _ = tiny
    comps = [None, STREAM, {"method": "h2o", "budget": 24, "recent": 8},
             {"method": "snapkv", "budget": 24, "observation_window": 8}]
    prompts = [prompt_ids(45 + 5 * i, 30 + i) for i in range(4)]
    alone = [llm.generate([p], greedy(70, c))[0].outputs[0].token_ids for p, c in zip(prompts, comps)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(70, c) for c in comps])]
    assert batched == alone
