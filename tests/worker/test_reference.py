"""SmolLM2-135M-Instruct in float32 reproduces transformers' greedy outputs token for token."""

import pytest

from kvserve import SamplingParams
from reference_cases import reference_params as _params

pytestmark = pytest.mark.slow


def test_prompt_ids_match_reference(llm_fp32, reference):
    from kvserve.engine.tokenizer import apply_chat_template

    for case in reference["cases"]:
        if "messages" in case:
            ids = apply_chat_template(llm_fp32.tokenizer, case["messages"])
        else:
            ids = llm_fp32.engine.encode(case["prompt"])
        assert ids == case["prompt_ids"]


def test_greedy_matches_reference_batched(llm_fp32, reference):
    cases = reference["cases"]
    outs = llm_fp32.generate([c["prompt_ids"] for c in cases], [_params(c) for c in cases])
    for c, o in zip(cases, outs):
        assert o.token_ids == c["greedy_ids"], c.get("prompt", c.get("messages"))
        if "messages" in c:
            assert o.finish_reason == "stop"  # the chat replies end on <|im_end|>
            assert o.text == c["greedy_text"].replace("<|im_end|>", "")
        else:
            assert o.finish_reason == "length"
            assert o.text == c["greedy_text"]


def test_chat_api_matches_reference(llm_fp32, reference):
    case = next(c for c in reference["cases"] if "messages" in c)
    out = llm_fp32.chat(case["messages"], SamplingParams(max_tokens=48, temperature=0))
    assert out.token_ids == case["greedy_ids"]
    assert out.metrics.ttft is not None and out.metrics.ttft > 0
    # a list of conversations (vLLM's form): one output each, in order
    other = [{"role": "user", "content": "Say hi."}]
    outs = llm_fp32.chat([other, case["messages"]], SamplingParams(max_tokens=48, temperature=0))
    assert len(outs) == 2 and outs[1].token_ids == case["greedy_ids"]
    assert outs[0].token_ids == llm_fp32.chat(other, SamplingParams(max_tokens=48, temperature=0)).token_ids


def test_a_gguf_is_parsed_once_per_start(tmp_path):
    """The config check and the weight loading share one parse of the file (seconds each for SmolLM2)."""
    import shutil

    from kvserve.worker import loader

    src = loader.resolve_model_path(None)
    path = tmp_path / "copy.gguf"
    shutil.copyfile(src, path)
    before = loader._parsed_gguf.cache_info()
    loader.load_model_config(path)
    loader.load_weights(path)
    after = loader._parsed_gguf.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    path.write_bytes(path.read_bytes()[:100])  # a changed file is parsed again (and found corrupt)
    with pytest.raises(loader.ModelLoadError):
        loader.load_model_config(path)
