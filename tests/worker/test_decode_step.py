"""The one-call C decode step (``kvserve.kernels.cpu_ops.DecodeStep``): its team path (one
OpenMP region, GEMV rows split in chunks between the threads) gives the per-operation path's
logits bit for bit, dense and GGUF-quantized; ``kv_q_gemv_rows`` computes exactly its rows of
``kv_q_gemv``; and the phase timer (``DecodeStep.profile``, what
``benchmarks/decode_breakdown.py`` reads) times every phase, changes no result and refuses a
buffer it could overrun. Tiny models, plus SmolLM2 (two loads) for the quantized path; ~15 s."""


import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops
from kvserve.worker.layers import quant as Q


def _decode_step(llm):
    step = llm.engine.model._decode_step
    assert step is not None, "the C decode step did not run"
    return step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_times_every_phase_and_changes_no_result(tiny_model_dir, dtype):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=4, device="cpu", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 99, 3, 250, 40, 41], [300, 301]]

    def run():
        return [(o.outputs[0].token_ids, [(t.logprob, t.top) for t in o.outputs[0].token_logprobs])
                for o in llm.generate(prompts, params)]

    plain = run()
    step = _decode_step(llm)
    prof = torch.zeros(len(step.PHASES), dtype=torch.int64)
    step.profile = prof
    timed = run()
    step.profile = None
    assert timed == plain  # bit-equal logprobs: the timer only reads the clock
    t = dict(zip(step.PHASES, prof.tolist()))
    assert set(t) == {"norm", "qkv", "rope", "kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down",
                      "lm_head"}
    assert all(v > 0 for v in t.values()), t  # 11 decode steps ran every phase
    assert sum(t.values()) < 10e9  # ns, not garbage
    after = prof.clone()
    run()
    assert torch.equal(prof, after)  # detached: no more accumulation


def test_profile_rejects_a_buffer_of_the_wrong_kind(tiny_model_dir):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=4, device="cpu")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    step = _decode_step(llm)
    n = len(step.PHASES)
    for bad in (torch.zeros(n - 1, dtype=torch.int64), torch.zeros(n, dtype=torch.int32),
                torch.zeros(2 * n, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="DecodeStep.profile"):
            step.profile = bad
    assert step.profile is None


def _replay(llm, prompt_len: int = 40, prompts=None, max_tokens: int = 3):
    """The decode step and the arguments of its last call with the most sequences, captured from
    a short generation (of ``prompts``, default one prompt of ``prompt_len`` tokens)."""
    cap = {}
    orig = cpu_ops.DecodeStep.__call__

    def spy(self, *a):
        if "call" not in cap or a[0].shape[0] >= cap["call"][1][0].shape[0]:
            cap["call"] = (self, tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in a))
        return orig(self, *a)

    cpu_ops.DecodeStep.__call__ = spy
    try:
        llm.generate(prompts or [list(range(3, 3 + prompt_len))],
                     SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        cpu_ops.DecodeStep.__call__ = orig
    return cap["call"]


def _team_vs_pieces(step, args, threads: int = 2):
    """Logits of the same call on the team path and on the per-operation path."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            step.team = True
            a = step(*args)
            step.team = False
            b = step(*args)
            step.team = True
    finally:
        torch.set_num_threads(prev)
    return a, b


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_team_path_is_bit_identical_to_the_per_operation_path(tiny_model_dir, arch, dtype):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir(arch)
    llm = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=4, device="cpu",
              enable_prefix_caching=False)
    step, args = _replay(llm)
    assert step.team  # on by default for plain weights
    a, b = _team_vs_pieces(step, args)
    assert a.shape == (1, 384) and torch.isfinite(a.float()).all()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="DecodeStep.team"):  # (packed weights need gemv_rows)
        _packed_without_rows().team = True


@pytest.mark.parametrize("arch", ["llama_long", "mistral_window"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_team_attention_over_several_sequences_is_bit_identical(tiny_model_dir, arch, kv_cache_dtype, dtype):
    """Where attention runs the vector kernel, the team's threads share its (sequence, split, KV
    head) items: sequences of 7, 45 and 90 tokens, and on ``llama_long`` one of 700 (attended in
    two splits of its keys; a 16-token window on ``mistral_window``, 8-bit rows with ``int8``),
    give the per-operation path's logits bit for bit."""
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir(arch)
    long = arch == "llama_long"
    llm = LLM(model=str(folder), dtype=dtype, num_blocks=256, block_size=4, device="cpu", enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype, max_model_len=1024 if long else None)
    prompts = [list(range(3, 3 + n)) for n in (7, 45, 90)] + ([[3 + i % 300 for i in range(700)]] if long else [])
    step, args = _replay(llm, prompts=prompts)
    assert args[0].shape[0] == len(prompts)  # a decode token of each in the call
    a, b = _team_vs_pieces(step, args)
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b)


def _packed_without_rows():
    step = cpu_ops.DecodeStep.__new__(cpu_ops.DecodeStep)
    step._team_ok, step._team = False, False
    return step


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
@pytest.mark.parametrize("n_prompts", [1, 10])
def test_team_path_on_quantized_smollm2_is_bit_identical(smollm2_path, quantization, n_prompts):
    """The team path (one OpenMP region a step) on GGUF weights kept quantized gives the
    per-operation path's logits bit for bit; with 10 sequences its bf16 cache's attention items
    are whole (sequence, split) pairs, every KV head in one pass (at least 4 pairs a thread)."""
    if Q.q_kernels() is None or Q.q_kernels().gemv_rows is None:
        pytest.skip("needs the qgemv kernels")
    llm = LLM(dtype="bfloat16", max_model_len=256, kv_cache_memory=0.1, quantization=quantization,
              enable_prefix_caching=False)
    if n_prompts == 1:
        step, args = _replay(llm, prompt_len=70)
    else:
        prompts = [list(range(3 + i, 23 + 8 * i)) for i in range(n_prompts)]
        step, args = _replay(llm, prompts=prompts, max_tokens=40)
    assert step.team and args[0].shape[0] == n_prompts
    a, b = _team_vs_pieces(step, args)
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b)


@pytest.mark.parametrize("qtype,int8", [("Q4_1", False), ("Q8_0", False), ("Q4_1", True), ("Q6_K", False),
                                        ("Q6_K", True), ("Q2_K", False), ("dense", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_gemv_rows_computes_exactly_its_rows_of_q_gemv(qtype, int8, dtype):
    """Every packed layout (32-value blocks of 4 and 8 bits, the per-16 ``sub16`` form of the
    K-quants) and a dense descriptor (an int4 model's float LM head)."""
    from test_gguf_quant import random_weight

    k = Q.q_kernels()
    if k is None or k.gemv_rows is None:
        pytest.skip("needs the qgemv kernels")
    if dtype == torch.bfloat16 and not k.has_bf16:
        pytest.skip("needs AVX512_BF16")
    g = torch.Generator().manual_seed(0)
    N = 70  # not a multiple of 4: a partial last row group
    K = 512 if qtype.endswith("_K") else 96
    M = 2
    if qtype == "dense":
        from kvserve.worker.layers import linear as L

        weight = torch.randn(N, K, generator=g).to(dtype)
        bias = torch.randn(N, generator=g).to(dtype)
        gk = L.cpu_kernels()
        if gk is None:
            pytest.skip("needs the gemv kernels")
        desc = Q.dense_descriptor(weight, bias, gk.bf16 if dtype == torch.bfloat16 else gk.f32)
    else:
        p = Q.pack_gguf([random_weight(qtype, N, K)])
        assert (p.sub == 16) == qtype.endswith("_K")
        bias = torch.randn(N, generator=g)
        desc = Q.gemv_descriptor(p, bias, dtype, int8)
    x = torch.randn(M, K, generator=g).to(dtype)
    full = torch.empty(M, N, dtype=dtype)
    k.gemv(x.data_ptr(), K, desc.data_ptr(), None, full.data_ptr(), N, M, N, K, 1)
    part = torch.full((M, N), float("nan"), dtype=dtype)
    for n0, n1 in ((0, 16), (16, 52), (52, N)):
        k.gemv_rows(x.data_ptr(), K, desc.data_ptr(), None, part.data_ptr(), N, M, N, K, n0, n1)
    assert torch.isfinite(full.float()).all()
    assert torch.equal(part, full)
    part2 = torch.full((M, N), float("nan"), dtype=dtype)
    k.gemv_rows(x.data_ptr(), K, desc.data_ptr(), None, part2.data_ptr(), N, M, N, K, 20, 40)
    assert torch.equal(part2[:, 20:40], full[:, 20:40]) and torch.isnan(part2[:, :20].float()).all() \
        and torch.isnan(part2[:, 40:].float()).all()
