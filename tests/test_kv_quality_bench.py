"""benchmarks/kv_quality.py's pure pieces (issue #23, point 4), on a tiny random-weight Llama
(tests/tiny_models.py), float32, a few seconds:

* the passkey prompt has exactly the asked length and the key's sentence at the asked depth;
* the teacher-forced perplexity with no compression equals plain ``prompt_logprobs`` perplexity
  of the same tokens (and the forced run's raw top-1 tokens equal the prompt's argmax), and under
  StreamingLLM it differs (the method sees the compressed cache);
* bad inputs name the field.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from kvserve import LLM, SamplingParams

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_quality.py"
_spec = importlib.util.spec_from_file_location("kv_quality_bench", _PATH)
kvq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kvq)


def toy_encode(text: str) -> list[int]:
    """One token per word (ids from a stable hash), digits kept: enough to locate the needle."""
    words = [w.strip(".?") for w in text.split()]
    return [int(w) if w.isdigit() else 100 + sum(map(ord, w)) % 900 for w in words]


@pytest.mark.parametrize("length, depth", [(256, 0.0), (256, 0.5), (1000, 0.3), (1000, 1.0)])
def test_passkey_prompt_length_and_depth(length, depth):
    key = 40417
    ids, start, n = kvq.passkey_prompt(toy_encode, length, depth, key)
    assert len(ids) == length
    head, needle, q = toy_encode(kvq.HEADER), toy_encode(kvq.NEEDLE.format(key=key)), toy_encode(kvq.QUESTION)
    assert ids[start:start + n] == needle and ids[:len(head)] == head and ids[-len(q):] == q
    n_fill = length - len(head) - len(needle) - len(q)
    assert start == len(head) + round(depth * n_fill)
    assert ids.count(key) == 2  # the key appears only in the needle (twice)


def test_passkey_prompt_real_tokenizer_and_errors(tiny_model_dir):
    from transformers import AutoTokenizer

    folder, _ = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(str(folder))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids, start, n = kvq.passkey_prompt(enc, 512, 0.25, 12345)
    assert len(ids) == 512 and "12345" in tok.decode(ids[start:start + n])
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        kvq.passkey_prompt(enc, 512, 1.5, 12345)
    with pytest.raises(ValueError, match="key must be 5 digits"):
        kvq.passkey_prompt(enc, 512, 0.5, 123)
    with pytest.raises(ValueError, match="length must be ≥"):
        kvq.passkey_prompt(enc, 10, 0.5, 12345)
    assert kvq.depths_grid(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="--depths"):
        kvq.depths_grid(0)
    with pytest.raises(ValueError, match="--methods"):
        kvq.policy("lru", 64)


def test_natural_text_is_deterministic():
    a = kvq.natural_text(20000)
    assert len(a) >= 20000 and a == kvq.natural_text(20000)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_blocks=200, block_size=16,
              enable_prefix_caching=False)
    yield llm
    llm.engine.shutdown()


def test_forced_perplexity_none_equals_prompt_logprobs(tiny):
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 380, size=300)]
    m = 100
    full = kvq.forced_logprobs(tiny, ids, m)
    plain = kvq.prompt_logprobs(tiny, ids, m)
    np.testing.assert_allclose(full["logprobs"], plain, rtol=0, atol=1e-4)
    assert math.isclose(kvq.ppl(full["logprobs"]), kvq.ppl(plain), rel_tol=1e-5)
    # the raw top-1 is the prompt's argmax at each position
    o = tiny.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    argmax = [next(t for t, lp in o.prompt_logprobs[i].items() if lp.rank == 1) for i in range(300 - m, 300)]
    assert full["top1"] == argmax
    # compressed: a 64-token StreamingLLM window changes the scored logprobs
    comp = kvq.forced_logprobs(tiny, ids, m, kvq.policy("streaming_llm", 64))
    assert np.max(np.abs(np.array(comp["logprobs"]) - np.array(plain))) > 1e-3
    assert comp["most_blocks"] <= math.ceil(64 / 16) + 2 < full["most_blocks"]
    with pytest.raises(ValueError, match="num_forced must be in"):
        kvq.forced_logprobs(tiny, ids, 300)
