"""Tiny random Llama/Mistral/Qwen2/Qwen3 models: kvserve's logits equal transformers'."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.attention import AttentionMetadata, CPUPagedAttentionBackend, PrefillSegment, TorchSDPABackend
from kvserve.kernels import cpu_ops
from decode_step_check import assert_c_decode_step_equals_modules
from tiny_models import ARCHS, prefill_logits


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model_dir, arch):
    folder, hf = tiny_model_dir(arch)
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 384, (40,), generator=g).tolist()
    ours = prefill_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _check_greedy_matches_transformers(tiny_model_dir, arch):
    folder, hf = tiny_model_dir(arch)
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=7)
    prompts = [[5, 17, 99, 3, 250, 40, 41, 42, 7, 8, 9, 10, 11], [300, 301], [77] * 9]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref
    assert llm.engine.scheduler.num_chunked_prefills > 0
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(tiny_model_dir, arch):
    """Prefill (chunked over steps) + paged decode gives transformers' greedy tokens."""
    llm = _check_greedy_matches_transformers(tiny_model_dir, arch)
    # On an AVX-512 machine this ran the fused CPU kernels and the C decode attention (on a GPU
    # machine LLM() picks CUDA, and the PyTorch path).
    on_cpu_kernels = cpu_ops.available() and llm.engine.device.type == "cpu"
    assert llm.engine.model.fused_cpu_ops == on_cpu_kernels
    assert isinstance(llm.engine.model.attn_backend, CPUPagedAttentionBackend) == on_cpu_kernels


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pytorch_path_matches_transformers_generate(tiny_model_dir, arch, monkeypatch):
    """The path CUDA and machines without the CPU kernels take (unfused PyTorch ops, SDPA over
    gathered context) is exact too."""
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    llm = _check_greedy_matches_transformers(tiny_model_dir, arch)
    assert not llm.engine.model.fused_cpu_ops
    assert type(llm.engine.model.attn_backend) is TorchSDPABackend


def test_bfloat16_close_to_float32(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    ids = list(range(3, 35))
    a = prefill_logits(LLM(model=str(folder), dtype="float32", num_blocks=16), ids)
    b = prefill_logits(LLM(model=str(folder), dtype="bfloat16", num_blocks=16), ids)
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16  # logits come in the model dtype
    assert (a - b.float()).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_c_decode_step_is_bit_identical_to_the_module_path(tiny_model_dir, arch, dtype, batch, monkeypatch):
    """The one-call C decode step gives exactly the logits of running the model's modules: same
    tokens and bit-equal logprobs, with the step asserted to have run. "large": 12 sequences
    (the AMX linears in bf16 where the CPU has them) with 16-token blocks (AMX attention)."""
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    from kvserve.worker.layers import linear

    folder, _ = tiny_model_dir(arch)
    prompts = [[5, 17, 99, 3, 250, 40, 41], [300, 301], [77] * 9]
    block_size = 4
    if batch == "large":
        prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(12)]
        block_size = 16
        k = linear.cpu_kernels()
        if dtype == "float32" or k is None or not k.has_amx:
            pytest.skip("batches above the gemv limit run in C only on the AMX linears (bf16)")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=block_size, device="cpu")
        return [(o.outputs[0].token_ids, [(t.logprob, t.top) for t in o.outputs[0].token_logprobs])
                for o in llm.generate(prompts, params)]

    assert_c_decode_step_equals_modules(monkeypatch, run)


def test_amx_prefill_attention_close_to_sdpa(tiny_model_dir, monkeypatch):
    """bf16 prefill on the AMX attention kernel (Qwen3's head_dim 32, 16-token blocks) stays
    within bf16 noise of the SDPA path, and the kernel really ran."""
    if not cpu_ops.amx_prefill_supported(torch.bfloat16, 4, 2, 32, 16):
        pytest.skip("needs the CPU kernels on a CPU with AMX-BF16")
    folder, _ = tiny_model_dir("qwen3")
    llm = LLM(model=str(folder), dtype="bfloat16", num_blocks=16, block_size=16, device="cpu")
    eng = llm.engine
    ids = list(range(3, 43))
    T = len(ids)

    def logits(amx: bool) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillSegment(0, T, 0)])
        if amx:
            meta.prefill_block_tables = torch.tensor([[0, 1, 2]])
            meta.prefill_chunks = torch.tensor([[0, T, 0]])
        with torch.inference_mode():
            return eng.model(torch.tensor(ids), torch.arange(T), eng.kv_caches, meta, torch.arange(T))

    calls = []
    real = cpu_ops.paged_attention_prefill
    monkeypatch.setattr(cpu_ops, "paged_attention_prefill", lambda *a: calls.append(1) or real(*a))
    a = logits(amx=True)
    assert len(calls) == eng.model_config.num_layers
    b = logits(amx=False)
    assert len(calls) == eng.model_config.num_layers
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_decode_runs_no_cudnn_attention(tiny_model_dir):
    """On CUDA the PyTorch backend keeps SDPA off cuDNN (attention.CUDA_SDPA_BACKENDS): cuDNN
    built a new graph for every context length, i.e. at every decode step (an H200 decoded
    SmolLM2's shapes at 14 tokens/s in bf16 against 35 in float32)."""
    from torch.profiler import ProfilerActivity, profile

    folder, _ = tiny_model_dir("llama")
    prompts = [[5, 17, 99, 3, 250, 40, 41], [300, 301], [77] * 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model=str(folder), dtype="bfloat16", device="cuda", num_blocks=64, block_size=4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names and not [n for n in names if "cudnn" in n.lower()]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
