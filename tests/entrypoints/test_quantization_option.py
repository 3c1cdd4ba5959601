"""``--quantization`` / ``LLM(quantization=...)``: the default, ``"auto"``, keeps a GGUF file's
quantized tensors quantized (``"gguf"``) and loads a Hugging Face folder's weights as they are
(None); ``gguf`` / ``gguf_int8`` asked for a folder is an error naming the option, the model's
format and the values a folder takes (it used to be ignored without a word, and the default
could not be told from an explicit choice)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.worker.layers.linear import Linear

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=0.05, device="cpu")

#: what the error says of the tiny folder, after its path
FOLDER_ERROR = (" keeps a GGUF file's quantized tensors quantized, but the model {path!r} is a Hugging Face folder "
                "(safetensors weights); for it use one of: auto, none, int8, int4, int4_g16, int4_g64, int4_g128, "
                "int4_g256 (default: auto, the weights as they are)")


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _linears(llm) -> list[Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Linear)]


def test_resolution_by_format(tmp_path):
    from kvserve.engine.args import resolve_quantization

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    for q, on_gguf, on_folder in (("auto", "gguf", None), ("none", None, None), (None, None, None),
                                  ("int8", "int8", "int8"), ("int4_g64", "int4_g64", "int4_g64"),
                                  ("gguf_int8", "gguf_int8", ValueError)):
        assert resolve_quantization(q, gguf) == on_gguf, q
        if on_folder is ValueError:
            with pytest.raises(ValueError, match="^quantization='gguf_int8' keeps"):
                resolve_quantization(q, tmp_path)
        else:
            assert resolve_quantization(q, tmp_path) == on_folder, q


@pytest.mark.slow
def test_default_on_a_gguf_file_keeps_its_tensors_quantized(smollm2_path):
    """The default model (SmolLM2, Q4_1): every linear layer held quantized, as before."""
    from kvserve import LLM

    llm = LLM(**KW)
    assert llm.engine.args.quantization == "auto" and llm.engine.core.quantization == "gguf"
    lins = _linears(llm)
    assert len(lins) == 4 * 30 + 1
    assert all(m.quantization == "gguf" and m.qpacked is not None for m in lins)


def test_default_on_a_folder_is_unquantized_and_int4_still_quantizes(folder):
    from kvserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 17, 33, 60, 2]]
    default = LLM(model=folder, **KW)
    assert default.engine.core.quantization is None
    lins = _linears(default)
    assert len(lins) == 2 * 4 + 1 and all(m.quantization is None and m.qpacked is None for m in lins)
    assert default.engine.model.lm_head.quantization is None
    tokens = default.generate(prompt, params)[0].outputs[0].token_ids
    default.shutdown()
    none = LLM(model=folder, quantization="none", **KW)
    assert none.generate(prompt, params)[0].outputs[0].token_ids == tokens
    none.shutdown()
    int4 = LLM(model=folder, quantization="int4", **KW)
    assert int4.engine.core.quantization == "int4"
    assert sum(m.quantization == "int4" and m.qpacked is not None for m in _linears(int4)) == 2 * 4
    assert len(int4.generate(prompt, params)[0].outputs[0].token_ids) == 8
    int4.shutdown()


@pytest.mark.parametrize("q", ["gguf", "gguf_int8"])
def test_gguf_quantization_on_a_folder_is_an_error(folder, q):
    from kvserve import LLM

    with pytest.raises(ValueError) as e:
        LLM(model=folder, quantization=q, **KW)
    assert str(e.value) == f"quantization={q!r}" + FOLDER_ERROR.format(path=folder)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_cli_gguf_on_a_folder_exits_2_naming_the_option(folder, cmd):
    """Before any model process starts (``serve`` used to start serving, ``generate`` to run)."""
    from server_helpers import free_port

    args = ["generate", "hi", "--max-tokens", "2"] if cmd == "generate" else ["serve", "--port", str(free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *args, "--model", folder,
                             "--quantization", "gguf", "--kv-cache-memory", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, out) == (2, ""), err
    assert err == "error: --quantization gguf" + FOLDER_ERROR.format(path=folder) + "\n"
