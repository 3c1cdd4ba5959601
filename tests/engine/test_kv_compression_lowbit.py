"""KV compression (StreamingLLM, SnapKV, H2O) over a 2-/4-bit KV cache (``kv_cache_dtype`` int4 /
int2, KIVI: :mod:`kvserve.worker.kv_quant_lowbit`), float32, the tiny random Llama (2 layers, 2 KV
heads, head_dim 16, block 16).

What is checked:
* a request shorter than its budget gives exactly the tokens of no compression (same KV dtype);
* StreamingLLM (4 sinks, window 60) over a 600-token int4 generation holds at most
  ceil(64 / 16) + 2 blocks at every step, and its first 60 tokens equal those of no compression;
* SnapKV's and H2O's kept positions, per layer and KV head, equal a NumPy reference computed from
  the attention weights of the keys each query saw, rebuilt here from the pools (full blocks
  dequantized from their codes, a query's own block in the model dtype unless it is the block's last
  slot); after a SnapKV compaction the new full block is the kept rows quantized again and the
  partial one's residual slot holds the kept rows;
* a mixed batch (none, StreamingLLM, H2O, SnapKV) equals each request alone; chunked prefill gives
  the tokens of a one-chunk prefill;
* in a small pool, swap preemption gives each request's solo tokens, recompute preemption the same
  tokens on a second run (the policy restarts on prompt + output, deterministically); every block
  and residual slot is free at the end;
* an engine-wide policy equals the per-request one, ``{"method": "none"}`` turns it off, n = 3
  forks each equal n = 1; the PyTorch attention backend (CUDA's path) batches exactly too; at
  tensor_parallel_size=2 (slow) the tokens equal one rank's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.core.kv_compression import KVCompressionConfig
from kvserve.worker import attention as attention_mod
from kvserve.worker import kv_quant_lowbit as lb

from test_kv_compression import (STREAM, check_preemption_workload, greedy, np_h2o_compact, np_topk_stable,
                                 prompt_ids)

H2O = {"method": "h2o", "budget": 24, "recent": 8}
SNAP = {"method": "snapkv", "budget": 24, "observation_window": 8}


def make(folder, kv: str, **kw) -> LLM:
    base = dict(dtype="float32", max_model_len=512, num_blocks=200, block_size=16, kv_cache_dtype=kv)
    return LLM(model=str(folder), **{**base, **kw})


@pytest.fixture(scope="module")
def int4(tiny_model_dir):
    llm = make(tiny_model_dir("llama")[0], "int4")
    yield llm
    llm.engine.shutdown()


def all_free(llm: LLM) -> None:
    """Every block and every residual slot back once nothing runs (a step's freed blocks give their
    slots back at the next end_step)."""
    kv = llm.engine.core.kv
    kv.end_step()
    kv.check_invariants()
    assert kv.residual.num_free == kv.residual.num_slots and bool((kv.residual.map == -1).all())
    assert kv.num_used_blocks == 0


# ---------------------------------------------------------------------------- under budget
@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_under_budget_equals_no_compression(tiny_model_dir, request, kv):
    llm = request.getfixturevalue("int4") if kv == "int4" else make(tiny_model_dir("llama")[0], kv)
    c0 = llm.engine.core.num_kv_compactions
    prompts = [prompt_ids(30, 1), prompt_ids(50, 2)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40))]
    for comp in ({"method": "streaming_llm", "sink_tokens": 4, "window": 200},
                 {"method": "snapkv", "budget": 100, "observation_window": 8},
                 {"method": "h2o", "budget": 200, "recent": 16}):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40, comp))]
        assert got == ref, comp
    assert llm.engine.core.num_kv_compactions == c0
    # over budget the policy does compact, and changes the tokens (the test above can fail)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40, STREAM))]
    assert llm.engine.core.num_kv_compactions > c0 and got != ref
    all_free(llm)
    if kv != "int4":
        llm.engine.shutdown()


# ---------------------------------------------------------------------------- StreamingLLM
def test_streaming_long_generation_bounded_blocks(tiny_model_dir):
    """sink 4 + window 60, int4: at most ceil(64/16) + 2 blocks at every step of a 600-token
    generation, whatever the residual slots; the first 60 tokens equal those of no compression."""
    llm = make(tiny_model_dir("llama_long")[0], "int4", max_model_len=1024, num_blocks=40, max_num_batched_tokens=64)
    eng = llm.engine
    prompt = prompt_ids(12, 3)
    ref = llm.generate([prompt], greedy(60))[0].outputs[0].token_ids
    rid = eng.add_request(prompt, greedy(600, {"method": "streaming_llm", "sink_tokens": 4, "window": 60}))
    bound = math.ceil(64 / 16) + 2
    most, out = 0, None
    res = eng.core.kv.residual
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        req = next(iter(eng.core.scheduler.running), None)
        if req is not None:
            held = eng.core.kv.num_held_blocks(req)
            assert held <= bound
            assert req.num_kv_tokens <= 64 + 16
            most = max(most, held)
            # the partial last block (if any) has a residual slot, the full ones none
            table = eng.core.kv.block_tables[req.request_id]
            n = req.num_kv_tokens
            assert [res.has(b) for b in table[: n // 16]] == [False] * (n // 16)
            if n % 16:
                assert res.has(table[n // 16])
    toks = out.outputs[0].token_ids
    assert out.request_id == rid and len(toks) == 600
    assert toks[:60] == ref
    assert most == bound - 1
    assert eng.core.num_kv_compactions == (600 + 12 - 80) // 16 + 1
    all_free(llm)
    eng.shutdown()


# ---------------------------------------------------------------------------- SnapKV / H2O
def seen_keys(q_rows_kv: np.ndarray, k_step: torch.Tensor, k_cache: lb.LowBitPool, meta, p) -> np.ndarray:
    """``[m, c, KVH, hd]`` float32: the keys each probe row attended, rebuilt from the pools after
    the step's write: key j of row p is in the model dtype when it is in p's block and p is not
    the block's last slot (this step's k, or the block's residual slot), else as stored (a full
    block dequantized from its codes, the trailing partial block from its residual slot)."""
    bs = k_cache.block_size
    slots = p.context_slots
    c = slots.shape[0]
    step_slots = {int(s): i for i, s in enumerate(meta.slot_mapping.tolist())}
    raw = []
    stored = []
    for j in range(c):
        s = int(slots[j])
        blk, off = s // bs, s % bs
        slot = int(meta.residual_map[blk])
        model = k_step[step_slots[s]] if s in step_slots else k_cache.residual[slot, off]
        raw.append(model.float())
        if (j // bs + 1) * bs <= c:  # full after the step: its packed codes
            deq = lb.dequantize_blocks(k_cache.data[blk : blk + 1], k_cache.bits, True, bs, k_cache.head_dim,
                                       k_cache.model_dtype)[0, off]
            stored.append(deq.float())
        else:
            stored.append(model.float())
    raw_t, stored_t = torch.stack(raw).cpu().numpy(), torch.stack(stored).cpu().numpy()
    out = np.empty((len(q_rows_kv), c, *raw_t.shape[1:]), dtype=np.float32)
    for i, pk in enumerate(q_rows_kv):
        own = (np.arange(c) // bs == pk // bs) & (pk % bs != bs - 1)
        out[i] = np.where(own[:, None, None], raw_t, stored_t)
    return out


class LowBitProbeRecorder:
    """Wraps attention.record_kv_probes: per call (layer), per probe, the float32 queries of its rows,
    their KV indices and the keys each row attended (:func:`seen_keys`)."""

    def __init__(self, monkeypatch):
        self.calls: list[list[tuple]] = []
        orig = attention_mod.record_kv_probes

        def rec(q, k_cache, meta, scale, k=None):
            assert isinstance(k_cache, lb.LowBitPool) and k is not None
            self.scale = scale
            calls = [(p.request_id, q.index_select(0, p.rows).float().cpu().numpy().copy(),
                      p.query_kv.cpu().numpy().copy(), seen_keys(p.query_kv.cpu().numpy(), k, k_cache, meta, p))
                     for p in meta.kv_probes]
            orig(q, k_cache, meta, scale, k=k)
            sums = meta.derived["kv_probe"][-1]  # (this layer's column sums, one per probe)
            self.calls.append([(*c, s.cpu().numpy().copy()) for c, s in zip(calls, sums)])

        monkeypatch.setattr(attention_mod, "record_kv_probes", rec)


def np_colsums_rows(q: np.ndarray, qkv: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[KVH, c]: softmax(q·kᵀ·scale) over the causal context with row i's own keys ``k[i]``, summed
    over rows and group heads (float64)."""
    m, H, hd = q.shape
    _, c, KVH, _ = k.shape
    g = H // KVH
    out = np.zeros((KVH, c), dtype=np.float64)
    for i in range(m):
        for h in range(H):
            logits = (k[i, :, h // g, :].astype(np.float64) @ q[i, h].astype(np.float64)) * scale  # [c]
            logits[np.arange(c) > qkv[i]] = -np.inf
            e = np.exp(logits - logits.max())
            out[h // g] += e / e.sum()
    return out


def test_snapkv_kept_positions_match_numpy(int4, monkeypatch):
    llm = int4
    core, eng = llm.engine.core, llm.engine
    rec = LowBitProbeRecorder(monkeypatch)
    B, W, K, n, bs = 24, 12, 5, 90, 16
    rid = eng.add_request(prompt_ids(n, 5), greedy(3, {"method": "snapkv", "budget": B, "observation_window": W,
                                                       "kernel_size": K}))
    seq = core.groups[rid].seqs[0]
    eng.step()  # the prompt (one chunk), then the selection is recorded
    L = core.model_config.num_layers
    assert len(rec.calls) == L and all(len(c) == 1 for c in rec.calls)
    want, seen = [], []
    for layer in range(L):
        _, q, qkv, k, got = rec.calls[layer][0]
        assert q.shape[0] == W and list(qkv) == list(range(n - W, n))
        # the window (positions 78..89): the row at 78 sees its block 4 in the model dtype, the one
        # at 79 (block 4's last slot: the step filling it quantizes it) dequantized, as the rows of
        # block 5 (the trailing partial block, in the model dtype for all) see it
        assert not np.array_equal(k[0, 64:79], k[1, 64:79]) and np.array_equal(k[1], k[2])
        sums = np_colsums_rows(q, qkv, k, rec.scale)  # [KVH, n]
        np.testing.assert_allclose(got, sums, rtol=1e-5, atol=1e-6)  # (the engine's window scores)
        per_head = []
        for h in range(sums.shape[0]):
            s = sums[h, : n - W]
            padded = np.concatenate([np.full(K // 2, -np.inf), s, np.full(K // 2, -np.inf)])
            pooled = np.array([padded[i : i + K].max() for i in range(n - W)])
            per_head.append(np.concatenate([np_topk_stable(pooled, B - W), np.arange(n - W, n)]))
        want.append(per_head)
        seen.append(k[-1])  # [n, KVH, hd]: the keys as stored (the last row: its own block is the partial one)
    want = np.array(want)  # [L, KVH, B]
    eng.step()  # the compaction is applied before this step's forward
    kept = core.executor.driver_worker.kv_mover.compressor.last_keep[seq.request_id].cpu().numpy()
    np.testing.assert_array_equal(kept, want)
    assert seq.num_dropped_tokens == n - B and seq.num_kv_tokens == B + 1
    # the new table: block 0 holds kept rows 0..15 quantized again; block 1 the kept rows 16..23 (then
    # this step's token) in its residual slot, in the model dtype
    table = core.kv.block_tables[seq.request_id]
    res = core.kv.residual
    assert not res.has(table[0]) and res.has(table[1])
    for layer in range(L):
        kc = core.kv_caches[layer][0]
        rows = np.stack([seen[layer][want[layer, h], h] for h in range(kc.num_kv_heads)], 1)  # [B, KVH, hd]
        requant = lb.dequantize_blocks(lb.quantize_blocks(torch.from_numpy(rows[:bs]).unsqueeze(0), kc.bits, True),
                                       kc.bits, True, bs, kc.head_dim, torch.float32)[0]
        got = kc.dequantize(torch.tensor([table[0]], device=kc.data.device))[0]
        np.testing.assert_array_equal(got.cpu().numpy(), requant.cpu().numpy())
        np.testing.assert_array_equal(kc.residual[int(res.map[table[1]]), : B - bs].cpu().numpy(), rows[bs:])
    while eng.has_unfinished_requests():
        eng.step()
    all_free(llm)


def test_h2o_kept_positions_match_numpy(int4, monkeypatch):
    """H2O (budget 20, recent 6: a compaction at 36 cached tokens) over a 30-token prompt and 60
    decode steps: the reference accumulates the column sums of every query over the keys it saw,
    keeps the 14 heaviest before the 6 most recent at each compaction, and its kept positions and
    scores equal the engine's, per layer and KV head, after every step."""
    llm = int4
    core, eng = llm.engine.core, llm.engine
    rec = LowBitProbeRecorder(monkeypatch)
    B, R, bs = 20, 6, 16
    rid = eng.add_request(prompt_ids(30, 6), greedy(60, {"method": "h2o", "budget": B, "recent": R}))
    seq = core.groups[rid].seqs[0]
    comp = core.executor.driver_worker.kv_mover.compressor
    L, KVH = core.model_config.num_layers, core.model_config.num_kv_heads
    scores = np.zeros((L, KVH, 0))
    positions = np.zeros((L, KVH, 0), dtype=np.int64)
    compactions = 0
    while eng.has_unfinished_requests():
        first = len(rec.calls)
        dropped = seq.num_dropped_tokens
        eng.step()
        calls = rec.calls[first:]
        assert len(calls) == L
        for layer in range(L):
            _, q, qkv, k, _ = calls[layer][0]
            c = k.shape[1]
            if c > scores.shape[-1] and layer == 0:  # new tokens: their positions follow the KV index + dropped
                n0 = scores.shape[-1]
                scores = np.concatenate([scores, np.zeros((L, KVH, c - n0))], -1)
                positions = np.concatenate([positions, np.broadcast_to(np.arange(n0, c) + dropped,
                                                                       (L, KVH, c - n0))], -1)
            scores[layer] += np_colsums_rows(q, qkv, k, rec.scale)
        st = comp.states[seq.request_id]
        np.testing.assert_array_equal(st.positions.cpu().numpy(), positions)
        np.testing.assert_allclose(st.scores.cpu().numpy(), scores, rtol=1e-4, atol=1e-5)
        n = scores.shape[-1]
        if seq.status.value == "running" and n >= B + bs:
            scores, positions = np_h2o_compact(scores, positions, B, R)
            compactions += 1
    assert compactions >= 3
    assert len({tuple(r) for r in positions.reshape(-1, positions.shape[-1])}) > 1  # (per-head selections differ)
    all_free(llm)


# ---------------------------------------------------------------------------- batching, chunking, preemption
def test_mixed_batch_and_chunked_prefill_equal_each_alone(int4, tiny_model_dir):
    """None, StreamingLLM, H2O and SnapKV batched together give each request's solo tokens; so does
    a run whose prompts are prefilled in 16-token chunks, where no compaction falls between the
    chunks (a StreamingLLM or H2O prompt shorter than kept + block_size; SnapKV compresses after
    the whole prompt): the scores and the kept rows do not depend on the chunking."""
    llm = int4
    comps = [None, STREAM, H2O, SNAP]
    prompts = [prompt_ids(45 + 5 * i, 30 + i) for i in range(4)]
    alone = [llm.generate([p], greedy(70, c))[0].outputs[0].token_ids for p, c in zip(prompts, comps)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(70, c) for c in comps])]
    assert batched == alone
    assert len({tuple(a) for a in alone}) == 4
    short = [prompt_ids(47, 40), prompt_ids(37, 41), prompt_ids(50, 42)]  # (< 52, < 40; a window over 2 chunks)
    one = [llm.generate([p], greedy(50, c))[0].outputs[0].token_ids for p, c in zip(short, comps[1:])]
    chunked = make(tiny_model_dir("llama")[0], "int4", max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in chunked.generate(short, [greedy(50, c) for c in comps[1:]])]
    assert chunked.engine.core.num_kv_compactions >= 6
    assert got == one
    all_free(chunked)
    chunked.engine.shutdown()
    all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption(tiny_model_dir, mode):
    """12 blocks for 4 requests that each hold up to 4, int4: swap brings each request's compacted
    KV (packed blocks, the partial block's residual rows) and its scores back, the tokens of each run
    alone; recompute restarts the policy on prompt + output and gives the same tokens again on a
    second run. Every block and residual slot is free at the end."""
    folder = tiny_model_dir("llama")[0]
    kw = dict(swap_space=0.01, preemption_mode="swap") if mode == "swap" else {}
    llm = make(folder, "int4", max_model_len=512, num_blocks=12, max_num_batched_tokens=64,
               enable_prefix_caching=False, **kw)
    alone = make(folder, "int4", max_model_len=512, num_blocks=64, max_num_batched_tokens=64,
                 enable_prefix_caching=False)
    core = check_preemption_workload(llm, alone, [STREAM, H2O] * 2, mode)
    assert core.num_kv_compactions > 0
    all_free(llm)
    llm.engine.shutdown()
    alone.engine.shutdown()


def test_engine_policy_per_request_override_and_forks(int4, tiny_model_dir):
    """An engine-wide policy (``LLM(kv_compression=...)``) with int4 gives the tokens of the same
    policy set per request; ``{"method": "none"}`` turns it off (the tokens of no compression);
    n = 3 greedy samples (forks sharing blocks, copied on write: a partial block through residual
    slots) each equal the n = 1 run."""
    prompt = prompt_ids(50, 50)
    per_request = int4.generate([prompt], greedy(60, H2O))[0].outputs[0].token_ids
    plain = int4.generate([prompt], greedy(60))[0].outputs[0].token_ids
    assert per_request != plain
    for comp in (STREAM, H2O):
        one = int4.generate([prompt], greedy(60, comp))[0].outputs[0].token_ids
        outs = int4.generate([prompt], greedy(60, comp, n=3))[0].outputs
        assert [o.token_ids for o in outs] == [one] * 3
    all_free(int4)
    eng = make(tiny_model_dir("llama")[0], "int4", kv_compression=H2O)
    assert eng.generate([prompt], greedy(60))[0].outputs[0].token_ids == per_request
    assert eng.generate([prompt], greedy(60, {"method": "none"}))[0].outputs[0].token_ids == plain
    assert eng.engine.core.num_kv_compactions > 0
    all_free(eng)
    eng.engine.shutdown()


def test_sdpa_backend(tiny_model_dir, monkeypatch):
    """The PyTorch backend (what runs where the C kernels do not: CUDA, other dtypes) records the
    same lowbit probes: a mixed batch equals each request alone, and H2O's and SnapKV's runs finish
    with every block and slot back."""
    from kvserve.worker import worker as worker_mod

    monkeypatch.setattr(worker_mod, "default_backend", lambda *a, **k: attention_mod.TorchSDPABackend())
    llm = make(tiny_model_dir("llama")[0], "int4")
    assert type(llm.engine.executor.driver_worker.model.attn_backend) is attention_mod.TorchSDPABackend
    comps = [None, STREAM, H2O, SNAP]
    prompts = [prompt_ids(45 + 5 * i, 60 + i) for i in range(4)]
    alone = [llm.generate([p], greedy(50, c))[0].outputs[0].token_ids for p, c in zip(prompts, comps)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(50, c) for c in comps])]
    assert batched == alone and llm.engine.core.num_kv_compactions >= 12
    all_free(llm)
    llm.engine.shutdown()


@pytest.mark.slow  # (two spawned ranks: ~10-20 s on 2 shared cores)
def test_tensor_parallel_equals_one_rank(int4, tiny_model_dir):
    """At tensor_parallel_size=2 with int4 each rank scores, requantizes and compacts its own KV
    heads (the residual slots travel in the compaction op; the probes read the step's residual
    map, which reaches rank 1 with each step): the tokens equal the one-rank engine's."""
    prompt = prompt_ids(60, 13)
    comps = [STREAM, H2O, SNAP]
    want = [o.outputs[0].token_ids for o in int4.generate([prompt] * 3, [greedy(50, c) for c in comps])]
    tp = make(tiny_model_dir("llama")[0], "int4", num_blocks=64, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate([prompt] * 3, [greedy(50, c) for c in comps])]
        assert tp.engine.core.num_kv_compactions >= 5
        all_free(tp)
    finally:
        tp.engine.shutdown()
    assert got == want


# ---------------------------------------------------------------------------- speculative decoding
def _oracle(core, reference: list[int], k: int, kept: int, bs: int):
    """A proposer that knows the run without speculation (``reference``: prompt + its output): step
    i drafts ``i % (k + 1)`` of its next tokens, then wrong ones (accepted, then rejected), but never
    more right ones than keep the KV at or below ``kept + bs`` tokens, where the run without drafts
    compacts: the compactions then fall at the same KV lengths, with blocks filled and sealed by
    verifications that accepted and rejected drafts."""
    step = iter(range(10 ** 6))

    def propose(token_ids, max_drafts):
        L = len(token_ids)
        n = core.scheduler.running[0].num_kv_tokens  # (the step adds the last token and the accepted drafts)
        d = min(k, max_drafts)
        a = max(0, min(next(step) % (k + 1), kept + bs - n - 1, d, len(reference) - L - 1))
        right = [int(t) for t in reference[L : L + a]]
        wrong = [(int(reference[L + a]) + 1) % 300 + 3] * (d - a) if L + a < len(reference) else []
        return right + wrong

    return propose


@pytest.mark.parametrize("kv", ["int4", "int2"])
@pytest.mark.parametrize("policy", [STREAM, H2O, SNAP], ids=["streaming_llm", "h2o", "snapkv"])
def test_speculation_with_compression_gives_the_tokens_of_decoding(tiny_model_dir, kv, policy):
    """KV compression with speculative decoding over a 2-/4-bit cache: verifications that accept
    and reject drafts (blocks sealed by verifications, blocks keeping their residual slot because
    rows of rejected drafts were written in them) between compactions that read the kept rows from
    both, and H2O's scores counting accepted queries only: the tokens equal the run without
    speculation, with as many compactions; every block and residual slot free at the end."""
    folder = tiny_model_dir("llama")[0]
    prompt, max_tokens = prompt_ids(30, 6), 110
    plain = make(folder, kv)
    want = plain.generate([prompt], greedy(max_tokens, policy))[0].outputs[0].token_ids
    plain_compactions = plain.engine.core.num_kv_compactions
    plain.engine.shutdown()
    llm = make(folder, kv, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    core = llm.engine.core
    kept = KVCompressionConfig.parse(policy).kept
    core.spec.proposer.propose = _oracle(core, prompt + want, 3, kept, 16)
    got = llm.generate([prompt], greedy(max_tokens, policy))[0].outputs[0].token_ids
    assert got == want
    assert core.num_kv_compactions == plain_compactions and plain_compactions >= (1 if policy is SNAP else 4)
    spec = core.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert core.kv.num_verify_sealed > 0 and core.kv.num_verify_unsealed > 0
    llm.generate([[5, 6]], greedy(1))
    all_free(llm)
    llm.engine.shutdown()
