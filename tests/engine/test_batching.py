"""Batching changes nothing: 16 mixed-length prompts together give exactly the tokens each
gives alone — also under preemption (tiny pool) and chunked prefill (tiny token budget).

The same holds under tensor parallelism: the three tests again at ``tensor_parallel_size=2``
(the ``mp`` executor: rank 1 in a spawned process) on a tiny random Llama (4 query heads, 2 KV
heads: SmolLM2's 9 do not split over 2 ranks), whose own tokenizer makes the 16 prompts 6 to
330 tokens long."""

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def add(a, b):\n    return",
    "1, 2, 3, 4, 5,",
    "Write a haiku about the sea:",
    "The three primary colors are",
    "In 1969, the first humans landed on",
    "Translate to French: good morning ->",
    "A recipe for pancakes needs flour, eggs,",
    "The quick brown fox",
    "Python is a programming language that",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "Dear hiring manager, I am writing to",
    "Q: What is 12 times 12?\nA:",
    "Photosynthesis is the process by which",
]


def _prompts(llm):
    # Mixed lengths from 5 to ~150 tokens: repeat some texts to make long prompts.
    out = []
    for i, t in enumerate(TEXTS):
        ids = llm.engine.encode((t + " ") * (1 + (i * 7) % 13))
        out.append(ids)
    return out


PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm_fp32):
    prompts = _prompts(llm_fp32)
    assert min(map(len, prompts)) <= 8 and max(map(len, prompts)) >= 100
    return prompts, [llm_fp32.generate([p], PARAMS)[0].token_ids for p in prompts]


def test_batch_equals_alone(llm_fp32, alone):
    prompts, expected = alone
    outs = llm_fp32.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == expected


def test_batch_equals_alone_under_preemption(alone):
    prompts, expected = alone
    llm = LLM(dtype="float32", max_model_len=1024, num_blocks=24, block_size=16)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.kv.num_free_blocks == 24


def test_batch_equals_alone_with_chunked_prefill(alone):
    prompts, expected = alone
    llm = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=16)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.scheduler.num_chunked_prefills >= sum(len(p) > 16 for p in prompts)
    assert [o.token_ids for o in outs] == expected


def test_bf16_chunked_prefill_of_a_long_prompt(llm_fp32):
    # The default dtype on this path: bf16 linears on AMX/oneDNN. Chunks that end inside their
    # prompt sample nothing, so the LM head runs on zero rows (this used to crash the process).
    long = llm_fp32.engine.encode("The history of Paris: " * 40 + " The capital of France is")
    prompts = [long, llm_fp32.engine.encode("The capital of France is")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_chunked_prefills >= len(long) // 64
    ref = llm_fp32.generate(prompts, params)
    for o, r in zip(outs, ref):
        assert len(o.token_ids) == 8 and o.finish_reason == "length"
        # the first two fp32 tokens lead by > 1.2 nats, far beyond bf16 rounding: bf16 agrees
        for lp in r.outputs[0].token_logprobs[:2]:
            assert lp.logprob - max(l for t, l in lp.top if t != lp.token_id) > 1.2
        assert o.token_ids[:2] == r.token_ids[:2]


def _tile_kernel_cpu() -> bool:
    from kvserve.worker.layers.linear import cpu_kernels

    k = cpu_kernels()
    return k is not None and k.has_bf16 and not k.has_amx


@pytest.mark.skipif(not _tile_kernel_cpu(), reason="needs a CPU with AVX512-BF16 and no AMX (the tile kernel at every M)")
def test_bf16_outputs_do_not_depend_on_the_other_requests_of_the_batch(smollm2_path):
    # On such a CPU every bf16 linear runs on the AVX512-BF16 tile kernel whatever its number of
    # rows, and a row's result does not depend on the other rows; attention, norms, RoPE and the
    # sampler work per sequence: 16 prompts run alone, in pairs, in fours and all together give
    # the same tokens and bit-identical logprobs (bf16 rounds far more coarsely than fp32, so
    # this holds only because no kernel mixes rows or changes its summation order with them).
    # (Where a long prompt's prefill is cut into chunks is another matter: attention over the
    # cached keys of earlier chunks sums in other blocks, so max_num_batched_tokens changes the
    # last bits of a chunked prompt's logprobs.)
    llm = LLM(dtype="bfloat16", max_model_len=1024, quantization="none", enable_prefix_caching=False)
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

    def run(group):
        outs = []
        for i in range(0, len(prompts), group):
            outs += [(o.token_ids, [t.logprob for t in o.outputs[0].token_logprobs])
                     for o in llm.generate(prompts[i:i + group], params)]
        return outs

    together = run(16)
    assert run(1) == together
    assert run(2) == together
    assert run(4) == together


# ------------------------------------------------------------------ the same at TP = 2

@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _tp2(folder, **kw):
    return LLM(model=folder, dtype="float32", max_model_len=512, tensor_parallel_size=2, **kw)


def _run_tp2(folder, prompts, **kw):
    """The outputs of ``prompts`` batched in a TP = 2 engine, and the engine, shut down (a process
    holds one tensor-parallel group: one such engine at a time)."""
    llm = _tp2(folder, **kw)
    try:
        return [o.token_ids for o in llm.generate(prompts, PARAMS)], llm.engine
    finally:
        llm.engine.core.shutdown()


@pytest.fixture(scope="module")
def tp2_runs(tiny_llama):
    """(prompts, each alone, all batched) in one TP = 2 engine."""
    llm = _tp2(tiny_llama)
    try:
        assert llm.engine.executor.world_size == 2
        prompts = _prompts(llm)
        assert min(map(len, prompts)) <= 8 and max(map(len, prompts)) >= 300
        alone = [llm.generate([p], PARAMS)[0].token_ids for p in prompts]
        batched = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.engine.core.shutdown()
    return prompts, alone, batched


def test_tp2_alone_equals_one_rank(tiny_llama, tp2_runs):
    prompts, expected, _ = tp2_runs
    one = LLM(model=tiny_llama, dtype="float32", max_model_len=512)
    assert [one.generate([p], PARAMS)[0].token_ids for p in prompts] == expected


def test_tp2_batch_equals_alone(tp2_runs):
    _, expected, batched = tp2_runs
    assert batched == expected


def test_tp2_batch_equals_alone_under_preemption(tiny_llama, tp2_runs):
    prompts, expected, _ = tp2_runs
    got, engine = _run_tp2(tiny_llama, prompts, num_blocks=24, block_size=16)  # (the longest needs 22 blocks)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.kv.num_free_blocks == 24


def test_tp2_batch_equals_alone_with_chunked_prefill(tiny_llama, tp2_runs):
    prompts, expected, _ = tp2_runs
    got, engine = _run_tp2(tiny_llama, prompts, max_num_batched_tokens=16)
    assert engine.scheduler.num_chunked_prefills >= sum(len(p) > 16 for p in prompts)
    assert got == expected
