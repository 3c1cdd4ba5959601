"""SamplingParams validation: every invalid value raises ValueError naming its field."""

from __future__ import annotations

import math

import pytest

from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID = [
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=-2)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=1.0)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=True)),
    ("spaces_between_special_tokens", dict(spaces_between_special_tokens="no")),
    # (field named in the message, kwargs)
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.5)),
    ("max_tokens", dict(max_tokens=True)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("min_tokens", dict(min_tokens=None)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="hot")),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=1.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=math.nan)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("frequency_penalty", dict(frequency_penalty=2.0001)),
    ("length_penalty", dict(length_penalty=math.nan)),
    ("logit_bias", dict(logit_bias={5: 101.0})),
    ("logit_bias", dict(logit_bias={5: -100.5})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"abc": 1.0})),
    ("logit_bias", dict(logit_bias={1.5: 1.0})),
    ("logit_bias", dict(logit_bias={5: "x"})),
    ("logit_bias", dict(logit_bias={5: math.nan})),
    ("logit_bias", dict(logit_bias=[5, 1.0])),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[1, -2])),
    ("allowed_token_ids", dict(allowed_token_ids=[1, "a"])),
    ("allowed_token_ids", dict(allowed_token_ids=5)),
    ("bad_words", dict(bad_words=[[]])),
    ("bad_words", dict(bad_words=[[1, -1]])),
    ("bad_words", dict(bad_words=[5])),
    ("bad_words", dict(bad_words=7)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed="42")),
    ("seed", dict(seed=2**63)),  # 64-bit signed range: larger seeds would alias (seed mod 2**64)
    ("seed", dict(seed=-(2**63) - 1)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    ("stop_token_ids", dict(stop_token_ids=3)),
    ("include_stop_str_in_output", dict(include_stop_str_in_output="yes")),
    ("ignore_eos", dict(ignore_eos=1)),
    ("skip_special_tokens", dict(skip_special_tokens=None)),
    ("use_beam_search", dict(use_beam_search="true")),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", dict(logprobs=2.0)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=MAX_LOGPROBS + 1)),
    ("n", dict(n=0)),
    ("n", dict(n=129)),
    ("n", dict(n=None)),
    ("best_of", dict(best_of=0)),
    ("best_of", dict(best_of=1, n=2)),
    ("beam_width", dict(use_beam_search=True, beam_width=0)),
    ("beam_width", dict(use_beam_search=True, beam_width=1, n=2)),
    ("n must be ≤ 64 with use_beam_search", dict(use_beam_search=True, n=128)),
    ("best_of must be ≤ 64 with use_beam_search", dict(use_beam_search=True, n=2, best_of=100)),
    ("logprobs is not supported with use_beam_search", dict(use_beam_search=True, logprobs=2)),
    ("prompt_logprobs is not supported with use_beam_search", dict(use_beam_search=True, prompt_logprobs=0)),
    ("stop is not supported with use_beam_search", dict(use_beam_search=True, stop=["."])),
    ("stop_token_ids is not supported with use_beam_search", dict(use_beam_search=True, stop_token_ids=[30])),
    ("min_tokens is not supported with use_beam_search", dict(use_beam_search=True, min_tokens=2)),
    ("top_p is not supported with use_beam_search", dict(use_beam_search=True, top_p=0.5)),
    ("repetition_penalty is not supported with use_beam_search",
     dict(use_beam_search=True, repetition_penalty=1.2)),
    ("logit_bias is not supported with use_beam_search", dict(use_beam_search=True, logit_bias={3: 1.0})),
]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_value_raises_value_error_naming_field(field, kwargs):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value)


VALID = [
    dict(),
    dict(use_beam_search=True, temperature=0.7, top_k=-1, stop=[], logit_bias={}, seed=3, ignore_eos=True),
    dict(max_tokens=None),
    dict(temperature=0.0),
    dict(temperature=1e-5),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_p=1e-9),
    dict(top_p=1.0),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(repetition_penalty=0.01),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(logit_bias={5: -100, 6: 100.0}),
    dict(allowed_token_ids=[0]),
    dict(bad_words=[[1], [2, 3]]),
    dict(seed=-5),
    dict(seed=2**63 - 1),
    dict(seed=-(2**63)),
    dict(stop_token_ids=[]),
    dict(logprobs=0, prompt_logprobs=MAX_LOGPROBS),
    dict(n=3, best_of=5),
    dict(max_tokens=4, min_tokens=4),
    dict(use_beam_search=True, n=2),
    dict(truncate_prompt_tokens=-1, spaces_between_special_tokens=False),
    dict(truncate_prompt_tokens=1),
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalization():
    p = SamplingParams(stop="END", logit_bias={"50256": -100})  # OpenAI JSON gives string keys
    assert p.stop == ["END"]
    assert p.logit_bias == {50256: -100.0} and isinstance(p.logit_bias[50256], float)
    assert SamplingParams(use_beam_search=True, n=2, best_of=3).beam_width == 3


def test_greedy_and_num_samples():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1, temperature=1.5).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(n=2).num_samples == 2
    assert SamplingParams(n=2, best_of=4).num_samples == 4


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("logit_bias", dict(logit_bias={100: 1.0})),
        ("allowed_token_ids", dict(allowed_token_ids=[3, 100])),
        ("bad_words", dict(bad_words=[[3, 100]])),
        ("stop_token_ids", dict(stop_token_ids=[100])),
    ],
)
def test_check_token_ids(field, kwargs):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        params.check_token_ids(100)
    params.check_token_ids(101)


def test_numpy_scalars_count_as_python_numbers():
    import numpy as np

    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(4), seed=np.uint8(7))
    assert (p.max_tokens, p.temperature, p.top_k, p.seed) == (8, 0.5, 4, 7)
    assert type(p.max_tokens) is int and type(p.temperature) is float
    with pytest.raises(ValueError, match="temperature must satisfy"):
        SamplingParams(temperature=np.float32(-1.0))
    # inside the token-id lists too
    p = SamplingParams(stop_token_ids=[np.int64(5)], allowed_token_ids=[np.int32(3), 4], bad_words=[[np.int64(9), 2]])
    assert p.stop_token_ids == [5] and p.allowed_token_ids == [3, 4] and p.bad_words == [[9, 2]]
    assert all(type(t) is int for t in p.stop_token_ids + p.allowed_token_ids + p.bad_words[0])
