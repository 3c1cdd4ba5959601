"""Start-up and memory: the default KV budget sized from the available memory, the lazily
committed KV pool, the fast GGUF parse and the tokenizer built without AutoTokenizer."""

import logging
import mmap

import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.entrypoints.cli import main
from kvserve.core.kv_cache_manager import GiB, default_kv_cache_memory, zeroed_host_tensor

BPT, BS = 23040, 16  # SmolLM2 in bf16: bytes per token; tokens per block
ONE = 256 * BS * BPT  # one sequence of 4096 tokens: 256 blocks = 0.0879 GiB


# ------------------------------------------------------------------ the default budget
def test_plenty_of_memory_is_capped_at_2_gib():
    gib, why = default_kv_cache_memory(BPT, BS, 4096, 128, available=20 * GiB, fraction=0.5)
    assert gib == 2.0
    assert why == "kv_cache_memory auto: 0.5 x 20.00 GiB available on cpu = 10.00 GiB, capped at 2.00 GiB"


def test_tight_memory_takes_the_fraction():
    gib, why = default_kv_cache_memory(BPT, BS, 4096, 128, available=3 * GiB, fraction=0.25)
    assert gib == 0.75
    assert why == "kv_cache_memory auto: 0.25 x 3.00 GiB available on cpu = 0.75 GiB"


def test_less_than_one_sequence_by_the_fraction_is_raised_to_one_sequence():
    available = ONE + ONE // 2  # holds one sequence, but half of it does not
    gib, why = default_kv_cache_memory(BPT, BS, 4096, 128, available=available, fraction=0.5)
    assert gib * GiB == ONE == 94371840
    assert why.endswith(", raised to one sequence of max_model_len=4096")


def test_below_one_sequence_is_refused_naming_max_model_len():
    with pytest.raises(ValueError, match=r"max_model_len=4096: one sequence of 4096 tokens needs 0\.088 GiB of KV "
                                         r"cache, but only 0\.050 GiB of memory is available on cpu"):
        default_kv_cache_memory(BPT, BS, 4096, 128, available=int(0.05 * GiB))
    # a shorter max_model_len fits in the same memory (4096 tokens of the 0.05 GiB hold 2330)
    gib, _ = default_kv_cache_memory(BPT, BS, 2048, 128, available=int(0.05 * GiB))
    assert gib * GiB == 128 * BS * BPT


def test_the_ceiling_is_what_max_num_seqs_sequences_could_use():
    gib, why = default_kv_cache_memory(BPT, BS, 4096, 2, available=20 * GiB, fraction=0.5)
    assert gib * GiB == 2 * ONE
    assert why.endswith("capped at 0.18 GiB (max_num_seqs=2 full sequences)")


def test_a_sliding_window_bounds_one_sequence():
    # W=512, chunk 256: ceil((511 + 256) / 16) + 1 = 49 blocks, not the 256 of 4096 tokens
    gib, _ = default_kv_cache_memory(BPT, BS, 4096, 1, available=20 * GiB, sliding_window=512,
                                     max_num_batched_tokens=256)
    assert gib * GiB == 49 * BS * BPT


def test_unknown_available_memory_keeps_the_old_default():
    gib, why = default_kv_cache_memory(BPT, BS, 4096, 128, available=None)
    assert gib == 2.0 and "unknown" in why


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_bad_fraction_is_refused_naming_the_field(bad, tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
        LLM(model=str(tmp_path / "nope.gguf"), kv_cache_memory_fraction=bad)


@pytest.mark.parametrize("value", ["0", "1.01", "nan"])
def test_bad_fraction_option(value, capsys):
    assert main(["generate", "hi", "--kv-cache-memory-fraction", value]) == 2
    assert capsys.readouterr().err.startswith("error: --kv-cache-memory-fraction must be in (0, 1]")


def _fake_available(monkeypatch, nbytes):
    import kvserve.core.kv_cache_manager
    import kvserve.engine.core

    monkeypatch.setattr(kvserve.engine.core, "available_memory", lambda device: nbytes)
    monkeypatch.setattr(kvserve.core.kv_cache_manager, "available_memory", lambda device: nbytes)


def test_engine_starts_with_memory_for_one_sequence_only(tiny_model_dir, monkeypatch, caplog):
    folder, _ = tiny_model_dir("llama")
    probe = LLM(model=str(folder), dtype="float32", num_blocks=1, max_model_len=512)
    bpt = probe.engine.kv_spec.bytes_per_token
    one = 512 * bpt  # 32 blocks of 16
    _fake_available(monkeypatch, one + 1000)
    with caplog.at_level(logging.INFO, logger="kvserve.engine.core"):
        llm = LLM(model=str(folder), dtype="float32", max_model_len=512)
    assert llm.engine.kv_spec.num_blocks == 32 and llm.engine.kv_spec.capacity_tokens == 512
    assert "raised to one sequence of max_model_len=512" in caplog.text
    out = llm.generate([[1] * 500], __import__("kvserve").SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12  # a full-length request runs
    _fake_available(monkeypatch, one - 1)
    with pytest.raises(ValueError, match="max_model_len=512: one sequence of 512 tokens needs"):
        LLM(model=str(folder), dtype="float32", max_model_len=512)
    # an explicit budget keeps its meaning
    assert LLM(model=str(folder), dtype="float32", max_model_len=512,
               kv_cache_memory=16 * 16 * bpt / GiB).engine.kv_spec.num_blocks == 16


# ------------------------------------------------------------------ the lazily committed pool
def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_kv_pool_reads_zero_and_is_committed_only_where_written():
    before = _rss_kib()
    t = zeroed_host_tensor((1024, 16, 8, 64), torch.bfloat16)  # 16 MiB
    assert t.shape == (1024, 16, 8, 64) and t.is_contiguous() and t.data_ptr() % mmap.PAGESIZE == 0
    assert torch.count_nonzero(t).item() == 0  # reading maps the shared zero page
    assert _rss_kib() - before < 4 * 1024
    t[:512].fill_(1.0)  # 8 MiB written
    assert 7 * 1024 < _rss_kib() - before < 12 * 1024
    assert t.sum().item() == 512 * 16 * 8 * 64
    for dt in (torch.int8, torch.float8_e4m3fn, torch.float32):
        z = zeroed_host_tensor((3, 5), dt)
        z[1] = 2
        assert z.float().sum().item() == 10


# ------------------------------------------------------------------ GGUF parse and tokenizer
def test_fast_gguf_parse_equals_gguf_reader(smollm2_path):
    from gguf import GGUFReader

    from kvserve.worker.loader import _parse_gguf

    ours = _parse_gguf(smollm2_path)
    ref = GGUFReader(str(smollm2_path))
    assert ours.metadata == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(b.shape.tolist()) and a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)


def test_truncated_gguf_is_still_explained(smollm2_path, tmp_path):
    from kvserve.worker.loader import ModelLoadError, load_model_config

    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_path.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="the file is truncated or is not a valid GGUF file"):
        load_model_config(path)


def test_gguf_tokenizer_is_the_one_autotokenizer_builds(smollm2_path):
    from transformers import AutoTokenizer

    from kvserve.engine.tokenizer import apply_chat_template, load_tokenizer

    ours = load_tokenizer(smollm2_path)
    ref = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True)
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    for text in ["The capital of France is", "  two\n\n\ttabs ünïcödé 👋", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.chat_template) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.chat_template)
    messages = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(ours, messages) == apply_chat_template(ref, messages)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_torch_dequantize_is_bit_identical_to_gguf(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvserve.worker.loader import _dequantize

    q = GGMLQuantizationType[qtype]
    w = (np.random.default_rng(0).standard_normal((48, 256)) * 3).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    data = quantize(w, q)
    ours, ref = _dequantize(data, q), np.asarray(dequantize(data, q), dtype=np.float32)
    assert ours.dtype == np.float32 and ours.size == w.size
    assert np.array_equal(ours.reshape(-1).view(np.uint32), ref.reshape(-1).view(np.uint32))
