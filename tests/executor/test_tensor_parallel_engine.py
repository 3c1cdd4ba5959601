"""Tensor parallelism through the engine (``tensor_parallel_size=2``, the ``mp`` executor: rank 0
in the engine's process, rank 1 in a spawned process, gloo between them).

Every feature composes with it: the outputs of a mixed workload (chunked prefill, prefix-cache
hits, n / best_of / beam search, structured output, stop strings, preemption by swap and by
recompute, n-gram speculative decoding, int8 KV, a sliding window, Gemma 3) equal those of the
same engine at one rank; bad configurations fail before any process starts; a rank that dies
fails the step with an error and leaves no process behind.

Two processes on 2 cores: slow, but they prove correctness (no speed is measured here).
"""

import multiprocessing
import os
import signal
import time

import pytest

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from tp_workload import PROMPTS, mixed_workload, run, summary
from kvserve.executor.multiproc_executor import MultiprocExecutor, WorkerDiedError



def _engine(folder, tp: int, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=128,
                max_num_batched_tokens=16, tensor_parallel_size=tp)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def _same_as_one_rank(folder, requests, **kw):
    ref = run(_engine(folder, 1, **kw), requests)
    eng = _engine(folder, 2, **kw)
    try:
        assert isinstance(eng.executor, MultiprocExecutor) and eng.executor.world_size == 2
        got = run(eng, requests)
        assert [summary(o) for o in got] == [summary(o) for o in ref]
        for a, b in zip(got, ref):
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
        assert eng.stats()["kv_blocks_in_use"] == 0
        return eng, got
    finally:
        eng.core.shutdown()


def test_tp2_mixed_workload_equals_one_rank_with_swap_preemption(llama):
    """A tight pool (preemption by swap), chunked prefill, prefix caching, n/best_of/beams,
    a grammar and logprobs: the same outputs as at one rank."""
    eng, got = _same_as_one_rank(llama, mixed_workload(), num_blocks=20, swap_space=0.01, preemption_mode="swap")
    assert eng.scheduler.num_preemptions > 0 and eng.stats()["swap_num_swap_outs"] > 0
    assert got[4].num_cached_tokens > 0


def test_tp2_recompute_int8_kv_and_ngram_speculation_equal_one_rank(llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    reqs = [(p * 3, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in PROMPTS]
    eng, _ = _same_as_one_rank(llama, reqs, num_blocks=30, kv_cache_dtype="int8", speculative_config=spec)
    assert eng.stats()["spec_decode_num_draft_tokens"] > 0 and eng.scheduler.num_preemptions > 0


def test_tp2_draft_model_speculation_with_a_grammar_equals_one_rank(llama, tiny_model_dir):
    """The draft model stays whole in the engine core's process (rank 0's), outside the ranks'
    group (it was built as rank 0 of 2, its first forward waited for a rank that never ran it
    and the step failed after the time-out). Greedy, seeded and grammar-constrained requests;
    the draft is a tiny Qwen3 with the same vocabulary (another model: drafts accepted and
    rejected)."""
    spec = {"method": "draft_model", "model": str(tiny_model_dir("qwen3")[0]), "num_speculative_tokens": 3}
    reqs = [(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) for p in PROMPTS]
    reqs.append((PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)))
    reqs.append((PROMPTS[2], SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta gamma"]))))
    eng, _ = _same_as_one_rank(llama, reqs, speculative_config=spec, distributed_timeout_s=30)
    draft = eng.core.proposer.model
    assert (draft.tp_size, draft.layers[0].self_attn.num_heads) == (1, 4)
    stats = eng.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_tp2_lowbit_kv_with_swap_and_block_copies_equals_one_rank(llama, kv):
    """2-/4-bit KV at two ranks: each rank packs its KV heads, and the residual map (the
    partial blocks' model-dtype slots) reaches rank 1 with each step. The mixed workload's
    n / best_of / beams copy partial blocks (read through the map) and the tight pool swaps
    running requests out with their residual rows: the same outputs as at one rank."""
    eng, got = _same_as_one_rank(llama, mixed_workload(), num_blocks=24, swap_space=0.01, preemption_mode="swap",
                                 kv_cache_dtype=kv)
    stats = eng.stats()
    assert eng.scheduler.num_preemptions > 0 and stats["swap_num_swap_outs"] > 0
    assert got[4].num_cached_tokens > 0
    r = eng.core.kv.residual  # (the last frees' slots come back after the step that would follow)
    r.end_step()
    eng.core.kv.check_invariants()
    assert r.num_free == r.num_slots and bool((r.map == -1).all())


def test_tp2_int4_kv_with_ngram_speculation_equals_one_rank(llama):
    """int4 KV with n-gram speculation at two ranks: the verification's residual slots (kept
    through the step, settled after sampling) reach rank 1 with the next step's map; a tight
    pool preempts. The same outputs as at one rank."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    reqs = [(p * 3, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in PROMPTS]
    eng, _ = _same_as_one_rank(llama, reqs, num_blocks=24, kv_cache_dtype="int4", speculative_config=spec)
    stats = eng.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["kv_verify_sealed_blocks"] > 0 and eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["mistral_window", "gemma3", "llama_mqa"])
def test_tp2_sliding_windows_gemma3_and_replicated_kv_heads_equal_one_rank(tiny_model_dir, arch):
    reqs = [(p * 4, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in PROMPTS[:3]]
    _same_as_one_rank(tiny_model_dir(arch)[0], reqs)


def test_tp2_the_driver_steps_on_its_share_of_the_cores(llama):
    """torch's thread count is per thread: the driver's worker, built on a thread of the
    executor's, still steps on cores // 2 threads in the engine's thread and in any other that
    steps it (the in-process server's loop), not on the process's default (on 2 cores: 1 and 1,
    not 2 beside rank 1's 1)."""
    import threading

    import torch

    from kvserve.worker.worker import available_cores

    share = max(1, available_cores() // 2)
    seen = []
    eng = _engine(llama, 2)
    try:
        runner = eng.executor.driver_worker.runner
        orig = runner.execute
        runner.execute = lambda *a, **k: seen.append(torch.get_num_threads()) or orig(*a, **k)
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        eng.step()
        t = threading.Thread(target=lambda: [eng.step() for _ in range(3)])
        t.start()
        t.join(60)
    finally:
        eng.core.shutdown()
    assert len(seen) == 4 and set(seen) == {share}


# ------------------------------------------------------------------ errors
def _no_children():
    return not multiprocessing.active_children()


def test_bad_configurations_fail_before_any_process_starts(tiny_model_dir, llama, monkeypatch):
    import kvserve.engine.core

    assert _no_children()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 3 attention heads"):
        _engine(tiny_model_dir("llama_3heads")[0], 2)
    assert _no_children()
    monkeypatch.setattr(kvserve.engine.core, "available_cores", lambda: 1)  # (a one-core machine)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 CPU cores"):
        _engine(llama, 2)
    assert _no_children()
    with pytest.raises(ValueError, match="tensor_parallel_size must be ≥ 1"):
        EngineArgs(tensor_parallel_size=0).check()
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        EngineArgs(distributed_executor_backend="mpi").check()


def test_a_second_tp_engine_in_one_process_is_a_clear_error(llama):
    """One process group per process: a second TP engine while the first runs fails at once,
    before any process starts (it took the first one's group, waited for ranks that never
    met it, and its shutdown then left that group); the first carries on."""
    first = _engine(llama, 2)
    try:
        children = set(multiprocessing.active_children())
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="already holds a tensor-parallel group"):
            _engine(llama, 2)
        assert time.monotonic() - t0 < 10 and set(multiprocessing.active_children()) == children
        got = run(first, [(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
        assert len(got[0].outputs[0].token_ids) == 4
    finally:
        first.core.shutdown()
    _engine(llama, 2).core.shutdown()  # once it is shut down, another may start


def test_llm_shutdown_and_a_collected_engine_free_the_group(llama):
    """``LLM.shutdown()`` stops the ranks; an engine dropped without it stops them when it is
    collected; a shut-down engine's late finalizer leaves the next engine's group alone."""
    import gc

    from kvserve import LLM

    llm = LLM(model=str(llama), dtype="float32", num_blocks=64, block_size=4, max_model_len=128,
              tensor_parallel_size=2)
    ranks = list(llm.engine.executor.procs)
    llm.shutdown()
    assert not any(p.is_alive() for p in ranks)
    second = _engine(llama, 2)
    del llm
    gc.collect()  # (the first engine's finalizer runs now: it must not leave the second's group)
    got = run(second, [(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
    assert len(got[0].outputs[0].token_ids) == 4
    ranks = list(second.executor.procs)
    del second, got
    gc.collect()
    assert not any(p.is_alive() for p in ranks) and _no_children()
    _engine(llama, 2).core.shutdown()  # the group was left: another may start


def test_a_dead_rank_fails_the_step_and_leaves_nothing(llama):
    eng = _engine(llama, 2)
    rank1 = eng.executor.procs[0]
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    os.kill(rank1.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        for _ in range(60):
            eng.step()
    assert time.monotonic() - t0 < 30
    assert not eng.executor.is_alive
    with pytest.raises(WorkerDiedError):  # every later step fails at once
        eng.step()
    eng.core.shutdown()
    assert _no_children()
