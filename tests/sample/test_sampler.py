"""Tests of kvserve.sample.sampler: exact distributions (chi-square), edge cases, seeds, logprobs."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from kvserve.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    compute_logprobs,
    process_logits,
    row_uniform,
    sample_seed,
)
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
N_DRAWS = 20_000
ALPHA = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tests use many small tensors: one intra-op thread avoids thread wake-up
    costs (large on a shared 2-core machine). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ helpers
def _rows(params, n=1, prompt=(), output=(), seed0=0, eos=None):
    prompt, output = list(prompt), list(output)  # shared by the rows (read only)
    return [SamplingRow(params, prompt, output, seed0 + i, eos) for i in range(n)]


def _sample(logits: torch.Tensor, rows: list[SamplingRow]):
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return Sampler()(logits, meta)


def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return process_logits(logits, SamplingMetadata.build(rows, logits.shape[-1], CPU))


def _draw_counts(logits_1d: torch.Tensor, params: SamplingParams, seed0: int = 0) -> np.ndarray:
    """N_DRAWS independent draws (one batch, distinct seeds) → counts per token."""
    V = logits_1d.shape[0]
    logits = logits_1d.unsqueeze(0).repeat(N_DRAWS, 1)
    out = _sample(logits, _rows(params, N_DRAWS, seed0=seed0))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=V)


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The documented distribution, computed independently in float64 numpy.

    temperature → min-p (p ≥ min_p·p_max) → top-k (p ≥ k-th largest) → top-p (keep a
    token when the renormalized mass strictly above it is < top_p; ties with the last
    kept value kept) → renormalize. Asserts that no threshold sits too close to a
    decision (1e-5), so float32 rounding in the sampler cannot flip it.
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    if min_p > 0:
        ratio = p / p.max()
        assert np.min(np.abs(ratio - min_p)) > 1e-5, "min_p on a boundary"
        p[ratio < min_p] = 0.0
    if 0 < top_k < len(p):
        p[p < np.sort(p)[::-1][top_k - 1]] = 0.0
    if top_p < 1.0:
        s = np.sort(p)[::-1]
        before = (np.cumsum(s) - s) / s.sum()
        assert np.min(np.abs(before - top_p)) > 1e-5, "top_p on a boundary"
        kept = int((before < top_p).sum())
        p[p < s[kept - 1]] = 0.0
    return p / p.sum()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit. Cells with expected count < 5 are pooled with their
    neighbours in order of probability (so a long tail keeps its shape).

    Tokens of probability 0 must never be drawn (asserted), and are left out.
    """
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    order = np.argsort(probs[probs > 0], kind="stable")
    obs, exp = counts[probs > 0][order].astype(np.float64), probs[probs > 0][order] * n
    groups, g, acc = np.empty(len(exp), dtype=np.int64), 0, 0.0
    for i, e in enumerate(exp):  # close a group once it expects ≥ 5 draws
        groups[i], acc = g, acc + e
        if acc >= 5:
            g, acc = g + 1, 0.0
    if 0 < acc and g > 0:  # a last group expecting < 5 joins the one before
        groups[groups == g] = g - 1
    obs, exp = np.bincount(groups, obs), np.bincount(groups, exp)
    if len(obs) == 1:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def _logits_flat() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).normal(0.0, 0.5, 64)).float()


def _logits_peaked() -> torch.Tensor:
    x = np.random.default_rng(2).normal(0.0, 1.0, 80)
    x[[7, 3, 50, 21, 66]] = [8.0, 6.7, 6.1, 5.3, 4.4]
    return torch.from_numpy(x).float()


def _logits_ties() -> torch.Tensor:
    groups = [2.0] * 4 + [1.0] * 6 + [0.5] * 10 + [0.0] * 20 + [-1.0] * 24
    perm = np.random.default_rng(3).permutation(len(groups))
    return torch.tensor(np.asarray(groups)[perm], dtype=torch.float32)


VECTORS = {"flat": _logits_flat, "peaked": _logits_peaked, "ties": _logits_ties}

# (params, wrong target's kwargs) per vector and feature; the parameters are chosen so
# that every truncation removes real mass (so the wrong target must be rejected).
CONFIGS = {
    "flat": {
        "temperature": (dict(temperature=0.5), dict(temperature=1.0)),
        "top_k": (dict(top_k=20), dict()),
        "top_p": (dict(top_p=0.5), dict()),
        "min_p": (dict(min_p=0.5), dict()),
        "combined": (dict(temperature=0.9, top_k=40, top_p=0.7, min_p=0.3), dict(temperature=0.9)),
    },
    "peaked": {
        "temperature": (dict(temperature=1.3), dict(temperature=1.0)),
        "top_k": (dict(top_k=3), dict()),
        "top_p": (dict(top_p=0.8), dict()),
        "min_p": (dict(min_p=0.02), dict()),
        "combined": (dict(temperature=1.5, top_k=8, top_p=0.9, min_p=0.01), dict(temperature=1.5)),
    },
    "ties": {  # top-k 6 and top-p 0.3 both cut inside a tie group: the whole group stays
        "temperature": (dict(temperature=0.7), dict(temperature=1.0)),
        "top_k": (dict(top_k=6), dict()),
        "top_p": (dict(top_p=0.3), dict()),
        "min_p": (dict(min_p=0.3), dict()),
        "combined": (dict(temperature=0.8, top_k=30, top_p=0.6, min_p=0.1), dict(temperature=0.8)),
    },
}
CASES = [(v, f) for v in CONFIGS for f in CONFIGS[v]]


@functools.lru_cache(maxsize=None)
def _counts(vector: str, feature: str) -> np.ndarray:
    kwargs = CONFIGS[vector][feature][0]
    return _draw_counts(VECTORS[vector](), SamplingParams(**kwargs), seed0=1000 * len(feature))


# ------------------------------------------------------------ distributions
@pytest.mark.parametrize("vector,feature", CASES)
def test_distribution_matches_truncated_target(vector, feature):
    target = reference_probs(VECTORS[vector]().numpy(), **CONFIGS[vector][feature][0])
    p = chi2_pvalue(_counts(vector, feature), target)
    assert p > ALPHA, f"{vector}/{feature}: p = {p:.2e}"


@pytest.mark.parametrize("vector,feature", CASES)
def test_distribution_rejects_wrong_target(vector, feature):
    right_kw, wrong_kw = CONFIGS[vector][feature]
    logits = VECTORS[vector]().numpy()
    right, wrong = reference_probs(logits, **right_kw), reference_probs(logits, **wrong_kw)
    assert 0.5 * np.abs(right - wrong).sum() > 0.02  # the wrong target is really different
    p = chi2_pvalue(_counts(vector, feature), wrong)
    assert p < ALPHA, f"{vector}/{feature}: wrong target not rejected, p = {p:.2e}"


def transformers_order_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """transformers' order: temperature → top-k → top-p → min-p (min-p last)."""
    p = reference_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    p[p / p.max() < min_p] = 0.0
    return p / p.sum()


def test_min_p_before_top_p_differs_from_transformers():
    """With min_p and top_p both set, the nucleus is taken over the min-p survivors;
    transformers' order (min-p after top-p) keeps more tokens and is rejected."""
    kwargs = CONFIGS["flat"]["combined"][0]
    logits = _logits_flat().numpy()
    ours, theirs = reference_probs(logits, **kwargs), transformers_order_probs(logits, **kwargs)
    assert (theirs > 0).sum() > (ours > 0).sum()
    counts = _counts("flat", "combined")
    assert chi2_pvalue(counts, ours) > ALPHA
    assert counts[theirs > ours].sum() == 0  # the extra tokens of transformers never appear


def test_ties_keep_whole_group():
    counts = _counts("ties", "top_k")
    logits = _logits_ties()
    kept = logits >= 1.0  # top_k=6 cuts the group of six 1.0 logits: all 10 tokens stay
    assert (counts[~kept.numpy()] == 0).all() and (counts[kept.numpy()] > 0).all()


def test_distribution_large_vocab_multi_block_and_wide_nucleus():
    """V = 2000 (7 full 256-blocks + a partial one), two row kinds in one batch. Even
    rows: a nucleus of < 64 tokens (decided among the first 64 candidates); odd rows: a
    nucleus of > 1024 tokens (needs the retry with 1024 candidates, then the full sort)."""
    V, n = 2000, 6000
    rng = np.random.default_rng(4)
    narrow = rng.normal(0, 1, V)
    narrow[rng.choice(V, 30, replace=False)] += 7.0
    wide = rng.normal(0, 0.3, V)
    s = np.sort(np.exp(wide))[::-1]
    before = (np.cumsum(s) - s) / s.sum()
    k = int(np.searchsorted(before, 0.9))
    p_wide = float((before[k - 1] + before[k]) / 2)  # midway between two decisions
    logits = torch.tensor(np.stack([narrow, wide, narrow] * (n // 3)), dtype=torch.float32)
    params = [SamplingParams(top_p=0.8), SamplingParams(top_p=p_wide)]
    rows = [SamplingRow(params[i % 3 == 1], [], [], seed=77 + i, eos_token_id=None) for i in range(n)]
    out = _sample(logits, rows).sampled_token_ids.numpy()
    kind = np.arange(n) % 3 == 1
    for vec, p, drawn in [(narrow, 0.8, out[~kind]), (wide, p_wide, out[kind])]:
        target = reference_probs(vec, top_p=p)
        assert (target > 0).sum() < 64 if vec is narrow else (target > 0).sum() > 1024
        counts = np.bincount(drawn, minlength=V)
        assert chi2_pvalue(counts, target) > ALPHA  # and nothing outside the nucleus
        assert chi2_pvalue(counts, reference_probs(vec)) < ALPHA  # the untruncated target fails


def test_draw_across_block_boundary():
    V = 600
    logits = torch.full((N_DRAWS, V), -30.0)
    logits[:, [255, 256, 599]] = torch.tensor([1.0, 0.0, 0.5])
    out = _sample(logits, _rows(SamplingParams(), N_DRAWS)).sampled_token_ids.numpy()
    counts = np.bincount(out, minlength=V)
    target = reference_probs(logits[0].numpy())
    assert chi2_pvalue(counts, target) > ALPHA
    assert counts[[255, 256, 599]].sum() == N_DRAWS


def test_row_uniform_is_uniform_and_stable():
    u = np.array([row_uniform(s, 0) for s in range(5000)])
    assert kstest(u, "uniform").pvalue > ALPHA
    assert ((u >= 0) & (u < 1)).all()
    assert row_uniform(123, 4) == row_uniform(123, 4) != row_uniform(123, 5)
    assert row_uniform(-1, 0) == row_uniform((1 << 64) - 1, 0)  # seeds are taken mod 2^64
    assert len({sample_seed(7, i) for i in range(100)}) == 100
    assert sample_seed(7, 1) != sample_seed(8, 0)


# ---------------------------------------------------------------- edge cases
def _assert_close(actual, expected, rtol=0.0, atol=1e-6):
    """Like torch.testing.assert_close (whose first call imports torch.distributed, ~2 s)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    same_inf = (actual == expected) | (actual - expected).abs().le(atol + rtol * expected.abs())
    assert bool(same_inf.all()), f"max difference {(actual - expected).abs().max().item()}"


def _random_logits(B=16, V=100, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_1_equals_greedy():
    logits = _random_logits()
    greedy = _sample(logits, _rows(SamplingParams(temperature=0.0), 16)).sampled_token_ids
    for params in [SamplingParams(top_k=1), SamplingParams(top_k=1, temperature=1.7, top_p=0.5)]:
        assert torch.equal(_sample(logits, _rows(params, 16)).sampled_token_ids, greedy)
    assert torch.equal(greedy, logits.argmax(-1))


def test_tiny_temperature_is_greedy_and_finite():
    logits = _random_logits(B=64)
    logits[::2] *= 1e4  # huge logits too
    logits[1::4, :10] = float("-inf")
    out = _sample(logits, _rows(SamplingParams(temperature=1e-5, logprobs=2), 64))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.isfinite(out.logprobs).all() and not torch.isnan(out.top_logprobs).any()


def test_top_p_tiny_keeps_exactly_the_top_token():
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(5)) * 0.1).repeat(2000, 1)
    out = _sample(logits, _rows(SamplingParams(top_p=1e-9), 2000))
    assert (out.sampled_token_ids == logits[0].argmax()).all()


def test_all_neg_inf_but_one():
    logits = torch.full((5, 40), float("-inf"))
    logits[:, 17] = 0.3
    params = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.2, logprobs=3),
        SamplingParams(temperature=1e-5, repetition_penalty=1.3, frequency_penalty=1.0),
        SamplingParams(temperature=2.0, logit_bias={3: 50.0}),
    ]
    rows = [SamplingRow(p, [1, 17], [17], seed=i, eos_token_id=None) for i, p in enumerate(params)]
    out = _sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [17] * 5
    assert torch.equal(out.logprobs, torch.zeros(5))
    assert out.ranks[2] == 1
    assert out.top_token_ids[2, 0] == 17 and out.top_logprobs[2, 0] == 0.0
    assert torch.isneginf(out.top_logprobs[2, 1:]).all()  # -inf stays -inf


def test_penalty_on_absent_token_changes_nothing():
    logits = _random_logits(B=1, V=50)
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=1.5, frequency_penalty=-1.0)
    rows = [SamplingRow(params, [3, 4], [5, 5], seed=0, eos_token_id=None)]
    x = _process(logits, rows)
    touched = torch.zeros(50, dtype=torch.bool)
    touched[[3, 4, 5]] = True
    assert torch.equal(x[0, ~touched], logits[0, ~touched])
    assert not torch.equal(x[0, touched], logits[0, touched])


def test_no_processing_returns_input_untouched():
    logits = _random_logits()
    before = logits.clone()
    assert _process(logits, _rows(SamplingParams(temperature=0.3, top_p=0.5), 16)) is logits
    _sample(logits, _rows(SamplingParams(repetition_penalty=2.0, logit_bias={1: 5.0}), 16, prompt=[1, 2]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("penalty", [1.3, 0.6, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    V = 120
    logits = _random_logits(B=4, V=V, seed=7)
    logits[:, 0] = 0.0
    histories = [([1, 2, 3, 0], [4, 4, 9]), ([7] * 5, []), ([10, 11], [12, 10, 13]), ([30, 31, 32, 33], [119])]
    rows = [SamplingRow(SamplingParams(repetition_penalty=penalty), p, o, 0, None) for p, o in histories]
    ours = _process(logits, rows)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (p, o) in enumerate(histories):
        theirs = hf(torch.tensor([p + o]), logits[i : i + 1].clone())
        assert torch.equal(ours[i], theirs[0])


def test_presence_and_frequency_penalties_by_hand():
    V = 20
    logits = _random_logits(B=2, V=V, seed=8)
    rows = [
        SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [9, 9, 4], [4, 4, 4, 7], 0, None),
        SamplingRow(SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0), [1], [2, 3, 2], 0, None),
    ]
    expected = logits.clone()
    expected[0, 4] -= 0.25 * 3 + 0.5  # prompt tokens (9; the prompt's 4) are not counted
    expected[0, 7] -= 0.25 * 1 + 0.5
    expected[1, 2] -= 2.0 * 2 - 1.0
    expected[1, 3] -= 2.0 * 1 - 1.0
    _assert_close(_process(logits, rows), expected, rtol=0, atol=1e-6)


def test_repetition_then_frequency_order():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    x = _process(logits, [SamplingRow(params, [2], [0, 1, 1], 0, None)])
    assert x.tolist() == [[2.0 / 2 - 1, -2.0 * 2 - 2, 1.0 / 2]]


def test_logit_bias():
    logits = _random_logits(B=2, V=30)
    rows = [
        SamplingRow(SamplingParams(logit_bias={3: 100.0, 4: -2.5}), [], [], 0, None),
        SamplingRow(SamplingParams(), [], [], 0, None),
    ]
    x = _process(logits, rows)
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 4] -= 2.5
    assert torch.equal(x, expected)
    rows[0] = SamplingRow(SamplingParams(logit_bias={3: 100.0}), [], [], 0, None)
    out = _sample(logits.repeat(50, 1), rows * 50)
    assert (out.sampled_token_ids[0::2] == 3).all()
    # logprobs are raw: the bias does not change them
    _assert_close(out.logprobs[0], torch.log_softmax(logits[0], -1)[3])


def test_allowed_token_ids():
    V = 40
    logits = _random_logits(B=1000, V=V)
    allowed = [2, 5, 33]
    rows = _rows(SamplingParams(allowed_token_ids=allowed, temperature=2.0), 500) + _rows(SamplingParams(), 500)
    out = _sample(logits, rows).sampled_token_ids
    assert set(out[:500].tolist()) == set(allowed)
    assert len(set(out[500:].tolist()) - set(allowed)) > 10
    x = _process(logits[:1], rows[:1])
    mask = torch.zeros(V, dtype=torch.bool)
    mask[allowed] = True
    assert torch.isneginf(x[0, ~mask]).all() and torch.equal(x[0, mask], logits[0, mask])


def test_bad_words():
    V = 30
    logits = torch.zeros(1, V)
    words = [[4], [7, 8, 9], [1, 2]]
    params = SamplingParams(bad_words=words)

    def banned(output):
        x = _process(logits, [SamplingRow(params, [7, 8], output, 0, None)])
        return sorted(torch.isneginf(x[0]).nonzero().squeeze(1).tolist())

    assert banned([]) == [4]  # a single-token bad word is always banned; the prompt is not looked at
    assert banned([7, 8]) == [4, 9]
    assert banned([3, 7, 8]) == [4, 9]
    assert banned([7, 8, 3]) == [4]
    assert banned([8]) == [4]
    assert banned([5, 1]) == [2, 4]
    assert banned([1, 7, 8]) == [4, 9]


def test_min_tokens_masks_eos_and_stop_ids():
    V = 12
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # EOS would win greedy decoding
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 6])

    def masked(output, eos=2, p=params):
        x = _process(logits, [SamplingRow(p, [1], output, 0, eos)])
        return sorted(torch.isneginf(x[0]).nonzero().squeeze(1).tolist())

    assert masked([]) == [2, 5, 6]
    assert masked([1, 1]) == [2, 5, 6]
    assert masked([1, 1, 1]) == []
    assert masked([1], eos=[2, 3]) == [2, 3, 5, 6]  # several EOS ids
    assert masked([1], p=SamplingParams(min_tokens=3, ignore_eos=True)) == []
    out = _sample(logits, [SamplingRow(params, [1], [1, 1], 0, 2)])
    assert out.sampled_token_ids.item() != 2
    out = _sample(logits, [SamplingRow(params, [1], [1, 1, 1], 0, 2)])
    assert out.sampled_token_ids.item() == 2


def test_everything_masked_keeps_allowed_token_ids():
    # allowed_token_ids is a hard constraint: when bans leave no token (here a two-token bad
    # word that only the output so far completes), the bans yield for that row, not the
    # allowed set (the row used to fall back to the raw logits: a token outside the set)
    logits = _random_logits(B=3, V=10)
    logits[:, 7] = 50.0  # the raw argmax, never allowed
    rows = [SamplingRow(SamplingParams(allowed_token_ids=[3], bad_words=[[3]], temperature=0.0), [], [], 0, None),
            SamplingRow(SamplingParams(allowed_token_ids=[4], bad_words=[[4, 4]], temperature=0.0), [1], [4], 0, None),
            SamplingRow(SamplingParams(allowed_token_ids=[4, 5], bad_words=[[4, 4]], seed=1), [1], [4], 0, None)]
    assert _sample(logits, rows).sampled_token_ids.tolist() == [3, 4, 5]
    draws = _draw_counts(logits[0], SamplingParams(allowed_token_ids=[2, 3], bad_words=[[2], [3]]))
    assert set(np.flatnonzero(draws)) <= {2, 3}


def test_tiny_repetition_penalty_stays_finite():
    # 1e-38 divides a positive logit past float32's range: capped at its largest value, the
    # repeated token becomes certain (it used to be +inf, then NaN and a garbage token)
    logits = _random_logits(B=1, V=10)
    logits[0, 6] = 2.0
    for penalty in (1e-38, 1e-45):
        params = SamplingParams(repetition_penalty=penalty, seed=1)
        assert torch.isfinite(_process(logits, _rows(params, prompt=[6]))).all()
        assert _sample(logits, _rows(params, prompt=[6])).sampled_token_ids.item() == 6


def test_token_ids_outside_vocab_rejected():
    for params, field in [
        (SamplingParams(logit_bias={50: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, 50]), "allowed_token_ids"),
        (SamplingParams(bad_words=[[1, 50]]), "bad_words"),
        (SamplingParams(stop_token_ids=[50], min_tokens=1), "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingMetadata.build([SamplingRow(params, [], [], 0, None)], 50, CPU)
        with pytest.raises(ValueError, match=field):
            params.check_token_ids(50)
        params.check_token_ids(51)


def test_low_precision_logits_are_upcast():
    logits = _random_logits(B=8).to(torch.bfloat16)
    out = _sample(logits, _rows(SamplingParams(temperature=0.0, logprobs=1), 8))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError, match="shape"):
        _sample(_random_logits(B=3), _rows(SamplingParams(), 2))


# ---------------------------------------------------------------------- seeds
def test_seeded_row_independent_of_batch():
    V = 500
    gen = torch.Generator().manual_seed(11)
    target_logits = torch.randn(V, generator=gen) * 0.5  # flat: the draw is really random
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.3, min_p=0.1),
        SamplingParams(repetition_penalty=1.5, logprobs=3),
        SamplingParams(allowed_token_ids=[1, 2, 3]),
        SamplingParams(temperature=0.1, bad_words=[[4]]),
        SamplingParams(presence_penalty=1.0, logit_bias={9: 3.0}),
        SamplingParams(top_k=1),
    ]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    tokens = {"alone": [], "batch": [], "reversed": []}
    output: list[int] = []
    for _ in range(12):  # 12 steps of one sequence
        row = SamplingRow(params, [1, 2], list(output), seed=42, eos_token_id=None)
        mates = [SamplingRow(p, [3], [5] * i, seed=i, eos_token_id=0) for i, p in enumerate(others)]
        mate_logits = torch.randn(len(others), V, generator=gen)
        batches = {
            "alone": ([row], target_logits[None], 0),
            "batch": (mates[:4] + [row] + mates[4:], torch.cat([mate_logits[:4], target_logits[None], mate_logits[4:]]), 4),
            "reversed": ((mates[:4] + [row] + mates[4:])[::-1], torch.cat([mate_logits[:4], target_logits[None], mate_logits[4:]]).flip(0), 4),
        }
        for name, (rows, logits, pos) in batches.items():
            tokens[name].append(_sample(logits, rows).sampled_token_ids[pos].item())
        output.append(tokens["alone"][-1])
    assert tokens["alone"] == tokens["batch"] == tokens["reversed"]
    assert len(set(tokens["alone"])) > 6  # it really samples
    other_seed = [
        _sample(target_logits[None], [SamplingRow(params, [1, 2], output[:i], 43, None)]).sampled_token_ids.item()
        for i in range(12)
    ]
    assert other_seed != tokens["alone"]


# ------------------------------------------------------------------- logprobs
def test_compute_logprobs_values_and_ranks_with_ties():
    gen = torch.Generator().manual_seed(12)
    logits = torch.round(torch.randn(32, 60, generator=gen) * 2) / 2  # many ties
    logits[3, :50] = float("-inf")
    tokens = torch.randint(0, 60, (32,), generator=gen)
    tokens[3] = 55
    lp, ranks, top_ids, top_lp = compute_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits, -1)
    _assert_close(lp, ref.gather(1, tokens[:, None]).squeeze(1), rtol=0, atol=1e-6)
    for i in range(32):
        assert ranks[i].item() == 1 + int((logits[i] > logits[i, tokens[i]]).sum())
    _assert_close(top_lp, ref.topk(5, -1).values, rtol=0, atol=1e-6)
    _assert_close(ref.gather(1, top_ids), top_lp, rtol=0, atol=1e-6)
    assert top_ids.dtype == torch.int64 and ranks.dtype == torch.int64 and lp.dtype == torch.float32
    # -inf stays -inf
    lp2, ranks2, _, _ = compute_logprobs(logits[3:4], torch.tensor([0]), 0)
    assert torch.isneginf(lp2).all() and ranks2.item() == 11
    _, _, ids0, lps0 = compute_logprobs(logits, tokens, 0)
    assert ids0.shape == (32, 0) and lps0.shape == (32, 0)


def test_sampler_logprobs_are_raw_and_ranks_only_when_asked():
    logits = _random_logits(B=6, V=50, seed=13)
    params = [
        SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=4),
        SamplingParams(logprobs=1, temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=2, top_p=0.5),
    ]
    rows = [SamplingRow(p, [1, 2], [3], seed=i, eos_token_id=None) for i, p in enumerate(params)]
    out = _sample(logits, rows)
    tok = out.sampled_token_ids
    lp, ranks, top_ids, top_lp = compute_logprobs(logits, tok, 3)
    _assert_close(out.logprobs, lp)
    asked = torch.tensor([p.logprobs is not None for p in params])
    assert torch.equal(out.ranks[asked], ranks[asked]) and (out.ranks[~asked] == 0).all()
    assert out.top_token_ids.shape == (6, 3)
    _assert_close(out.top_logprobs[asked], top_lp[asked])
    assert (out.top_token_ids[~asked] == -1).all() and torch.isneginf(out.top_logprobs[~asked]).all()
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert tok[3] == logits[3].argmax() and tok[4] == logits[4].argmax()
    none = _sample(logits, _rows(SamplingParams(), 6))
    assert none.top_token_ids is None and none.top_logprobs is None


def test_empty_and_greedy_only_batches():
    empty = _sample(torch.zeros(0, 10), [])
    assert empty.sampled_token_ids.shape == (0,) and empty.logprobs.shape == (0,)
    logits = _random_logits(B=4)
    out = _sample(logits, _rows(SamplingParams(temperature=0.0), 4))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert math.isclose(out.logprobs.sum().item(), torch.log_softmax(logits, -1).max(-1).values.sum().item(), rel_tol=1e-6)


def test_token_histories_may_be_tensors():
    logits = _random_logits(B=1, V=40, seed=14)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, bad_words=[[3, 4]], min_tokens=5)
    as_lists = _process(logits, [SamplingRow(params, [1, 2, 39], [5, 3], 0, [6, 7])])
    as_tensors = _process(logits, [SamplingRow(params, torch.tensor([1, 2, 39]), torch.tensor([5, 3]), 0, (6, 7))])
    assert torch.equal(as_lists, as_tensors)
    assert torch.isneginf(as_lists[0, [4, 6, 7]]).all()


# ------------------------------------------------- fast paths (large vocabularies)
from kvserve.sample import sampler as sampler_mod  # noqa: E402
from kvserve.sample.sampler import TokenHistory  # noqa: E402


def _bf16_logits(B, V, seed, scale=3.0):
    """Logits rounded to bfloat16 like a bf16 model's: many exact ties."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(torch.bfloat16).float()


@pytest.mark.parametrize("V", [4096, 4096 + 17, 2000])
@pytest.mark.parametrize("m", [1, 5, 8, 32])
def test_top_m_values_match_topk(V, m):
    """The block pre-selection returns exactly topk's values (ties, -inf, a partial last
    block, a row subset, given block maxima), and indices that hold them."""
    x = _bf16_logits(12, V, seed=V + m)
    x[3, : V // 2] = float("-inf")
    x[4] = 1.0  # every entry tied
    x[5, 100:140] = 50.0  # a tie group wider than m
    ref = x.topk(m, dim=1).values
    for rows in (None, torch.tensor([0, 3, 4, 5, 11])):
        sub = x if rows is None else x[rows]
        for bm in (None, sampler_mod._block_max(x, sampler_mod._SEL_BLOCK)):
            vals, idx = sampler_mod._top_m(x, m, rows, bm)
            assert torch.equal(vals, ref if rows is None else ref[rows])
            assert torch.equal(sub.gather(1, idx), vals)
            assert all(len(set(r)) == m for r in idx.tolist() if r)  # distinct columns


@pytest.mark.parametrize("V", [4096, 1000, 20])
def test_first_argmax_is_first_index_of_the_max(V):
    x = torch.round(_bf16_logits(40, V, seed=V, scale=1.0))  # many ties for the max
    x[7] = 0.0
    x[8, -1] = 100.0  # the max in the (possibly partial) last block
    x[9, :] = float("-inf")
    x[9, V // 3] = 2.0
    ref = torch.from_numpy(np.argmax(x.numpy(), axis=1))  # numpy: first occurrence
    for bs in (sampler_mod._SEL_BLOCK, sampler_mod._ARGMAX_BLOCK):
        bm = sampler_mod._block_max(x, bs)
        assert torch.equal(sampler_mod._first_argmax(x, bm.amax(1), bm, bs, None), ref)
        rows = torch.tensor([1, 8, 9, 30])
        assert torch.equal(sampler_mod._first_argmax(x, bm.amax(1), bm, bs, rows), ref[rows])


def test_candidate_path_distribution_with_ties_across_the_cut():
    """V = 4096 (block pre-selection), bf16-like ties: the top-k cut falls inside a group
    of 30 tied logits that reaches past the first 32 candidates (so those rows are
    retried with more), and min-p/top-p/temperature act on what survives."""
    V, n = 4096, 6000
    rng = np.random.default_rng(21)
    base = rng.normal(0, 1, V)
    top = rng.choice(V, 45, replace=False)
    base[top[:15]] = 6.0 + np.arange(15) * 0.25
    base[top[15:]] = 5.5  # ranks 16-45 tied
    logits = torch.tensor(base, dtype=torch.float32)
    for kwargs in [dict(top_k=20), dict(top_k=20, temperature=0.7, top_p=0.9), dict(top_k=40, min_p=0.05)]:
        out = _sample(logits.repeat(n, 1), _rows(SamplingParams(**kwargs), n, seed0=5)).sampled_token_ids
        counts = np.bincount(out.numpy(), minlength=V)
        target = reference_probs(base.astype(np.float32), **kwargs)
        assert (target > 0).sum() >= 45 or kwargs.get("top_p", 1) < 1 or kwargs.get("min_p", 0) > 0
        assert chi2_pvalue(counts, target) > ALPHA, kwargs


def _vocab_order_draw(x: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Reference of the documented pipeline for one row (top-k set, no greedy): float32
    probabilities as the sampler computes them, value cuts, nucleus in float64, and the
    first token in vocabulary order whose float64 cumulative probability exceeds u · total."""
    probs = (x - x.max()) / params.temperature if params.temperature != 1.0 else x - x.max()
    probs = probs.exp().numpy().astype(np.float64)
    s = np.sort(probs)[::-1]
    thr = max(s[params.top_k - 1], np.float32(params.min_p))
    probs[probs < thr] = 0.0
    if params.top_p < 1.0:
        s = np.sort(probs)[::-1]
        c = np.cumsum(s)
        kept = int(((c - s) < params.top_p * c[-1]).sum())
        probs[probs < s[kept - 1]] = 0.0
    cdf = np.cumsum(probs)
    target = min(u * cdf[-1], cdf[-1] * (1.0 - 2.0**-52))
    return int(np.searchsorted(cdf, target, side="right"))


def test_candidate_draw_is_the_vocab_order_inverse_cdf():
    """The candidate path draws the same token, seed for seed, as the inverse CDF over
    the whole vocabulary in vocabulary order (float64 cumulative sums of the same
    float32 probabilities), whatever the batch's largest k. (V = 16384: k = 50 uses the
    block pre-selection, the mate's k = 300 a plain topk.)"""
    V = 16384
    x = _bf16_logits(1, V, seed=3, scale=1.5)[0]
    for params in [SamplingParams(top_k=50, temperature=0.8, top_p=0.95), SamplingParams(top_k=7, min_p=0.2)]:
        rows = _rows(params, 300, seed0=900)
        mate = SamplingRow(SamplingParams(top_k=300), [], [], 0, None)  # more candidates for everyone
        for batch in (rows, rows + [mate]):
            out = _sample(x.repeat(len(batch), 1), batch).sampled_token_ids[:300].tolist()
            ref = [_vocab_order_draw(x, params, row_uniform(r.seed, 0)) for r in rows]
            assert out == ref


def test_candidate_path_agrees_with_the_full_vocabulary_path():
    """Seed for seed, the candidate path (rows with top-k) draws what the full-vocabulary
    path draws for the same rows (their only differences are float rounding: float32
    block sums in the full path's draw and nucleus total)."""
    V, n = 16384, 400
    x = _bf16_logits(n, V, seed=12, scale=2.0)
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        SamplingParams(top_k=20, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=100, top_p=0.7),
    ]
    rows = [SamplingRow(params[i % 3], [], [], 1000 + i, None) for i in range(n)]
    meta = SamplingMetadata.build(rows, V, CPU)
    bm = sampler_mod._block_max(x, sampler_mod._SEL_BLOCK)
    candidate = sampler_mod._draw(x, bm, meta)
    full = sampler_mod._draw_full(x, bm, meta, list(range(n)))
    assert torch.equal(candidate, full)
    assert len(set(candidate.tolist())) > 50  # it really samples


def test_non_contiguous_logits():
    x = _bf16_logits(5000, 6, seed=13).t()  # [6, 5000], a transposed view
    for params in [SamplingParams(top_k=5, repetition_penalty=1.3), SamplingParams(temperature=0.0, presence_penalty=1.0),
                   SamplingParams(top_p=0.9, allowed_token_ids=list(range(300))), SamplingParams(top_k=40, logprobs=3)]:
        rows = _rows(params, 6, prompt=[1, 2, 3], output=[4, 4])
        a, b = _sample(x, rows), _sample(x.contiguous(), rows)
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)
        _assert_close(a.logprobs, b.logprobs)


def test_seeded_rows_independent_of_batch_on_the_candidate_path():
    V = 16384
    x = _bf16_logits(6, V, seed=8)
    rows = [
        SamplingRow(SamplingParams(top_k=50, temperature=0.8, top_p=0.95, repetition_penalty=1.1), [1, 2, 3], [4, 5], 7, None),
        SamplingRow(SamplingParams(top_k=3), [1], [], 8, None),
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.5), [2], [9, 9], 9, None),
        SamplingRow(SamplingParams(top_k=500, logprobs=2), [], [], 10, None),
        SamplingRow(SamplingParams(top_p=0.5), [], [], 11, None),
        SamplingRow(SamplingParams(top_k=64, min_p=0.1, logit_bias={5: 3.0}), [], [6], 12, None),
    ]
    together = _sample(x, rows).sampled_token_ids.tolist()
    alone = [_sample(x[i : i + 1], [r]).sampled_token_ids.item() for i, r in enumerate(rows)]
    assert together == alone
    perm = [5, 2, 0, 4, 1, 3]
    shuffled = _sample(x[perm], [rows[i] for i in perm]).sampled_token_ids.tolist()
    assert shuffled == [together[i] for i in perm]


def test_in_place_penalties_leave_logits_intact_and_match_process_logits():
    """Penalties and bias without masks are applied to the caller's tensor in place and
    undone: the tokens are those of the processed copy, the logits come back bitwise."""
    V = 4096
    x = _bf16_logits(8, V, seed=4)
    before = x.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 2.0}),
        SamplingParams(top_k=20, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, frequency_penalty=-2.0, logit_bias={3: 50.0, 4: -1.0}),
        SamplingParams(top_p=0.5, repetition_penalty=0.7),
    ] * 2
    hist = [(list(range(i, 300, 7)), [3, 3, 4, 9, i]) for i in range(8)]
    rows = [SamplingRow(p, h[0], h[1], i, None) for i, (p, h) in enumerate(zip(params, hist))]
    out = _sample(x, rows)
    assert torch.equal(x, before)
    processed = _process(x, rows)
    meta = SamplingMetadata.build(rows, V, CPU)
    expected, _ = sampler_mod._choose(processed.clone(), meta)
    assert torch.equal(out.sampled_token_ids, expected)
    greedy = [0, 2, 4, 6]
    assert torch.equal(out.sampled_token_ids[greedy], processed[greedy].argmax(-1))
    _assert_close(out.logprobs, torch.log_softmax(x, -1).gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    # penalties that only lower logits: the raw maxima come from the edited ones
    x[1, 5] = 300.0  # a penalized row maximum, far above the others (a wrong shift overflows)
    before = x.clone()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, top_k=20, repetition_penalty=1.5, presence_penalty=0.5)
        rows = [SamplingRow(params, [5, 6], [7, 8, 5], i, None) for i in range(8)]
        out = _sample(x, rows)
        assert torch.equal(x, before)
        ref = torch.log_softmax(x, -1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
        _assert_close(out.logprobs, ref)


def test_logprobs_top_alternatives_on_a_large_vocab():
    V = 8192
    x = _bf16_logits(10, V, seed=6)
    tokens = torch.arange(10) * 7
    lp, ranks, top_ids, top_lp = compute_logprobs(x, tokens, 6)
    ref = torch.log_softmax(x, -1)
    _assert_close(lp, ref.gather(1, tokens[:, None]).squeeze(1))
    _assert_close(top_lp, ref.topk(6, -1).values)
    _assert_close(ref.gather(1, top_ids), top_lp)
    assert ranks.tolist() == [1 + int((x[i] > x[i, tokens[i]]).sum()) for i in range(10)]


# ------------------------------------------------------------------ token history
def _penalty_edits(rows, V):
    meta = SamplingMetadata.build(rows, V, CPU)
    out = {}
    for name in ("repetition", "freq_presence"):
        e = getattr(meta, name)
        out[name] = None if e is None else sorted(zip(e.rows.tolist(), e.toks.tolist(), e.values.tolist()))
    return out


def test_token_history_incremental_equals_fresh():
    """A history synced step by step gives the same penalty edits as a fresh one, also
    when the output list is replaced, truncated or edited at its end, or holds ids
    outside the vocabulary."""
    V = 50
    rng = np.random.default_rng(0)
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.3)
    prompt = [int(t) for t in rng.integers(0, V, 30)] + [V + 3]  # one id outside the vocabulary
    output: list[int] = []
    hist = TokenHistory()
    for step in range(60):
        if step == 20:
            output = list(output)  # a new list object
        if step == 30:
            del output[-5:]  # truncated
        if step == 40:
            output[-1] = (output[-1] + 1) % V  # last token changed
        output.extend(int(t) for t in rng.integers(0, V + 2, rng.integers(0, 3)))
        with_hist = _penalty_edits([SamplingRow(params, prompt, output, 0, None, history=hist)], V)
        fresh = _penalty_edits([SamplingRow(params, prompt, output, 0, None)], V)
        assert with_hist == fresh, step


def test_token_history_attach_and_tensors():
    class Owner:
        token_history = None

    o = Owner()
    h = TokenHistory.attach(o)
    assert isinstance(h, TokenHistory) and TokenHistory.attach(o) is h
    prompt, output = torch.tensor([1, 2, 2, 5]), torch.tensor([5, 7, 7])
    h.sync(prompt, output)
    assert sorted(h.seen_ids().tolist()) == [1, 2, 5, 7]
    assert dict(zip(h.output_ids().tolist(), h.output_counts().tolist())) == {5: 1.0, 7: 2.0}


def test_engine_penalties_same_with_and_without_history(tiny_model_dir, monkeypatch):
    """End to end through the model runner: the per-request histories change nothing."""
    from kvserve import LLM

    folder, _ = tiny_model_dir("llama")
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=1),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2),
        SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=0.8, seed=2),
    ]
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [11, 12, 13]]
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    with_hist = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(TokenHistory, "attach", staticmethod(lambda owner: None))
    without = [o.token_ids for o in llm.generate(prompts, params)]
    assert with_hist == without


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_the_general_path(dtype, monkeypatch):
    """A greedy batch with nothing to edit and no logprobs asked takes the fused CPU pass
    (cpu_ops.greedy_sample, no upcast of bf16 logits); it gives the general path's tokens and token
    logprobs bit for bit, ties included."""
    from kvserve.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    logits = (_random_logits(B=64, V=49152, seed=21) * 3).to(dtype)
    logits[5, 100] = logits[5, 40000] = logits[5].float().amax() + 1  # tie: the first index wins
    rows = _rows(SamplingParams(temperature=0.0), 64)
    calls = []
    real = cpu_ops.greedy_sample
    monkeypatch.setattr(cpu_ops, "greedy_sample", lambda x: calls.append(1) or real(x))
    fast = _sample(logits, rows)
    assert calls == [1]
    monkeypatch.setattr(cpu_ops, "greedy_sample", lambda x: None)  # "not finite": the general path
    slow = _sample(logits, rows)
    assert fast.sampled_token_ids[5] == 100
    assert torch.equal(fast.sampled_token_ids, slow.sampled_token_ids)
    assert torch.equal(fast.logprobs, slow.logprobs) and torch.equal(fast.ranks, slow.ranks)
    # asking for logprobs (or any edit) leaves the fast path
    calls.clear()
    monkeypatch.setattr(cpu_ops, "greedy_sample", lambda x: calls.append(1) or real(x))
    _sample(logits, _rows(SamplingParams(temperature=0.0, logprobs=1), 64))
    _sample(logits, _rows(SamplingParams(temperature=0.0, repetition_penalty=1.2), 64, prompt=[3, 4]))
    assert calls == []


@pytest.mark.parametrize("temperature", [1e-46, 1e-30, 9e-6])
def test_temperature_below_1e_5_is_greedy(temperature):
    # 1e-46 rounds to 0 in float32: it used to divide by zero (garbage tokens; with top_p a crash)
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    greedy = _sample(logits, _rows(SamplingParams(temperature=0.0), 4))
    for extra in ({}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
        out = _sample(logits, _rows(SamplingParams(temperature=temperature, seed=1, **extra), 4))
        assert torch.equal(out.sampled_token_ids, greedy.sampled_token_ids), extra
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_sampler_output_cat_pads_top_columns():
    """Rows of steps run piecewise (engine fault isolation): the widest top-k wins, the
    other rows are padded like rows that asked for fewer logprobs."""
    a = SamplerOutput(torch.tensor([4]), torch.tensor([-0.5]), torch.tensor([1]),
                      torch.tensor([[4, 7]]), torch.tensor([[-0.5, -1.5]]))
    b = SamplerOutput(torch.tensor([9, 2]), torch.tensor([-0.25, -2.0]), torch.tensor([0, 0]), None, None)
    c = SamplerOutput.cat([b, a])
    assert c.sampled_token_ids.tolist() == [9, 2, 4] and c.logprobs.tolist() == [-0.25, -2.0, -0.5]
    assert c.ranks.tolist() == [0, 0, 1]
    assert c.top_token_ids.tolist() == [[-1, -1], [-1, -1], [4, 7]]
    assert c.top_logprobs.tolist() == [[float("-inf")] * 2] * 2 + [[-0.5, -1.5]]
    assert SamplerOutput.cat([b]).top_token_ids is None
    with pytest.raises(ValueError, match="parts"):
        SamplerOutput.cat([])
