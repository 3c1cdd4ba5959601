"""Verification of draft tokens by exact rejection sampling.

Speculative sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers
via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling"): a request with k drafts ``x_1..x_k`` drawn
from draft distributions ``q_1..q_k`` is run through the target model once over its last
token and the drafts, which gives target distributions ``p_1..p_{k+1}``. Then, for
i = 1..k, draft ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the
first rejection a token is drawn from ``normalize(max(p_i - q_i, 0))`` and the rest is
discarded; if all k are accepted a bonus token is drawn from ``p_{k+1}``. Every emitted
token is then distributed exactly as if drawn from the target alone, one at a time.

``p_i`` is the distribution kvserve's sampler would draw from at that position
(:mod:`kvserve.sample.sampler`: the structured-output grammar's mask, bias, allowed ids, bad
words, min_tokens and penalties computed over the output *followed by the drafts before
position i*, then temperature, min-p, top-k, top-p). With a grammar, ``meta`` carries one
bitmask row per verified position (:func:`kvserve.structured_output.manager.speculative_bitmask`):
p_i is the masked distribution, a draft the grammar forbids has p = 0 and is always
rejected, and the correction is drawn from ``max(p_i - q_i, 0)`` under the mask. The n-gram proposer's ``q_i`` is one-hot on ``x_i``: accept with
probability ``p_i(x_i)``, and on rejection draw from ``p_i`` with ``x_i`` removed.
Greedy rows accept while the draft equals the target argmax, then emit the argmax, so
their output is token for token that of non-speculative greedy decoding.

Randomness: the acceptance test of position i uses ``row_uniform(seed, n_out + i,
stream=1)`` and the draw at position i the same number the sampler would use there,
``row_uniform(seed, n_out + i)``, where ``n_out`` is the request's output length before
the step: results depend only on the request's seed, never on its batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvserve.sample.sampler import (
    SamplingMetadata,
    _argmax,
    _inverse_cdf,
    _logprobs,
    process_logits,
    row_uniform,
    sampling_probs,
)

ACCEPT_STREAM = 1  # row_uniform stream of the acceptance tests (the draws use stream 0)


@dataclass
class DraftBatch:
    """The drafts of the R requests being verified, in batch order.

    Attributes:
        num_drafts: k_r ≥ 1 per request; request r owns ``k_r + 1`` consecutive logits rows
            (its last token's, then one per draft).
        draft_token_ids: per request its k_r drafts.
        draft_probs: per request a [k_r, V] tensor of its draft distributions q (rows sum
            to 1), or None for a one-hot proposer (n-gram).
        seeds: per request its sampling seed.
        num_output_tokens: per request its output length before this step.
    """

    num_drafts: list[int]
    draft_token_ids: list[list[int]]
    draft_probs: list[Optional[torch.Tensor]]
    seeds: list[int]
    num_output_tokens: list[int]


@dataclass
class RejectionSamplerOutput:
    """Per request: the tokens it emits this step and how many drafts it accepted.

    Attributes:
        token_ids: per request ``num_accepted + 1`` tokens (the accepted drafts, then the
            target's correction or bonus token).
        num_accepted: per request, accepted drafts (0..k_r).
        logprobs: [N] float32 raw logprob of the token emitted at each of the N rows (rows
            after a request's last emitted token hold that of its draft, unused).
        ranks: [N] int64 (0 for rows that did not ask for logprobs).
        top_token_ids / top_logprobs: [N, K] or None, as in :class:`SamplerOutput`.
        row_offsets: per request its first row.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_token_ids: Optional[torch.Tensor]
    top_logprobs: Optional[torch.Tensor]
    row_offsets: list[int]


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: DraftBatch) -> RejectionSamplerOutput:
    """Verify the drafts of a batch (see the module docstring).

    Args:
        logits: [N, V] target logits, ``N = sum(k_r + 1)``: request r's rows in order of
            position (any float dtype; computed in float32).
        meta: :class:`SamplingMetadata` built for these N rows, row i of request r with
            the request's output followed by its first i drafts.
        drafts: the drafts and their distributions.

    Returns:
        The emitted tokens per request, with the raw logprobs of the tokens of every row.

    Raises:
        ValueError: ``logits`` does not have ``sum(k_r + 1)`` rows, or a draft
            distribution is not [k_r, V].
    """
    N, V = logits.shape
    R = len(drafts.num_drafts)
    counts = [k + 1 for k in drafts.num_drafts]
    if sum(counts) != N:
        raise ValueError(f"logits has {N} rows, the drafts need sum(k + 1) = {sum(counts)}")
    for k, q in zip(drafts.num_drafts, drafts.draft_probs):
        if q is not None and tuple(q.shape) != (k, V):
            raise ValueError(f"draft_probs must be [k, V] = [{k}, {V}] per request, got {tuple(q.shape)}")
    dev = logits.device
    raw = logits.detach().float()
    x = process_logits(raw, meta)
    offsets = [0] * R
    for r in range(1, R):
        offsets[r] = offsets[r - 1] + counts[r - 1]
    K = max(drafts.num_drafts)
    # [R, K] drafts and their rows, padded (pad rows point at the request's bonus row)
    pad_tok = [d + [0] * (K - len(d)) for d in drafts.draft_token_ids]
    draft_tok = torch.tensor(pad_tok, dtype=torch.int64, device=dev)
    ar = torch.arange(K, device=dev)
    ks = torch.tensor(drafts.num_drafts, dtype=torch.int64, device=dev)
    valid = ar.unsqueeze(0) < ks.unsqueeze(1)  # [R, K]
    row = torch.tensor(offsets, dtype=torch.int64, device=dev).unsqueeze(1) + torch.minimum(ar.unsqueeze(0), ks.unsqueeze(1))

    greedy = torch.zeros(N, dtype=torch.bool, device=dev)
    if meta.num_greedy == N:
        greedy[:] = True
    elif meta.num_greedy:
        greedy[meta.greedy_idx] = True
    # target token where greedy: the argmax of the processed logits (first on ties)
    target = torch.zeros(N, dtype=torch.int64, device=dev)
    if meta.num_greedy:
        g = torch.arange(N, device=dev) if meta.num_greedy == N else meta.greedy_idx
        target[g] = _argmax(x if meta.num_greedy == N else x[g])
    # p for the sampled rows, normalized, scattered into an [N, V] view only where sampled
    probs = None
    if meta.num_greedy < N:
        sidx = torch.arange(N, device=dev) if meta.sample_idx is None else meta.sample_idx
        p = sampling_probs(x, meta)
        p = p / p.sum(dim=1, keepdim=True)
        probs = torch.zeros(N, V, dtype=torch.float32, device=dev)
        probs[sidx] = p
    # q at each draft (1 for one-hot proposers), as [R, K]
    q_at = torch.ones(R, K, dtype=torch.float32, device=dev)
    for r, q in enumerate(drafts.draft_probs):
        if q is not None:
            k = drafts.num_drafts[r]
            q_at[r, :k] = q.to(dev, torch.float32).gather(1, draft_tok[r, :k].unsqueeze(1)).squeeze(1)

    accept = draft_tok == target[row]  # greedy rows
    if probs is not None:
        u_acc = torch.tensor(
            [[row_uniform(drafts.seeds[r], drafts.num_output_tokens[r] + i, ACCEPT_STREAM) for i in range(K)]
             for r in range(R)], dtype=torch.float64, device=dev)
        p_at = probs[row, draft_tok].to(torch.float64)
        # accept with probability min(1, p / q): u < p / q  ⇔  u · q < p (q > 0 for a proposed draft)
        accept = torch.where(greedy[row], accept, u_acc * q_at.to(torch.float64) < p_at)
    accept &= valid
    num_acc = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepted drafts [R]
    last_row = torch.tensor(offsets, dtype=torch.int64, device=dev) + num_acc  # row of the last emitted token
    final = target[last_row].clone()
    if probs is not None:
        sampled_r = (~greedy[last_row]).nonzero().squeeze(1)
        if sampled_r.numel():
            lr = last_row[sampled_r]
            dist = probs[lr].clone()
            rejected = num_acc[sampled_r] < ks[sampled_r]
            rej_r = sampled_r[rejected]
            if rej_r.numel():  # residual max(p - q, 0) at the first rejected position
                a = num_acc[rej_r]
                sub = rejected.nonzero().squeeze(1)
                q_rows = _draft_rows(drafts, rej_r.tolist(), a.tolist(), draft_tok, V, dev)
                resid = (dist[sub] - q_rows).clamp_(min=0.0)
                empty = resid.sum(dim=1) <= 0  # p == q up to rounding: then any draw from p is exact
                dist[sub] = torch.where(empty.unsqueeze(1), dist[sub], resid)
            u = torch.tensor([row_uniform(drafts.seeds[r], drafts.num_output_tokens[r] + int(n))
                              for r, n in zip(sampled_r.tolist(), num_acc[sampled_r].tolist())],
                             dtype=torch.float64, device=dev)
            final[sampled_r] = _inverse_cdf(dist, u)
    # the token emitted at every row: drafts up to the last one, then the final token
    emitted = torch.cat([draft_tok, torch.zeros(R, 1, dtype=torch.int64, device=dev)], dim=1)
    emitted[torch.arange(R, device=dev), num_acc] = final
    flat_rows = torch.cat([torch.arange(c, device=dev) + o for c, o in zip(counts, offsets)])
    flat_tok = torch.cat([emitted[r, : counts[r]] for r in range(R)])
    tok_by_row = torch.empty(N, dtype=torch.int64, device=dev)
    tok_by_row[flat_rows] = flat_tok
    lp, ranks, top_ids, top_lp = _logprobs(raw, tok_by_row, meta.num_top_logprobs, meta.logprob_rows,
                                           meta.any_logprobs)
    n_acc = num_acc.tolist()
    em = emitted.tolist()
    return RejectionSamplerOutput(
        token_ids=[em[r][: n_acc[r] + 1] for r in range(R)],
        num_accepted=n_acc,
        logprobs=lp,
        ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_lp,
        row_offsets=offsets,
    )


def _draft_rows(drafts: DraftBatch, reqs: Sequence[int], positions: Sequence[int], draft_tok: torch.Tensor,
                V: int, dev) -> torch.Tensor:
    """q at the given (request, draft position) pairs as [len(reqs), V]: the draft model's
    distribution, or one-hot on the draft for one-hot proposers."""
    out = torch.zeros(len(reqs), V, dtype=torch.float32, device=dev)
    for j, (r, i) in enumerate(zip(reqs, positions)):
        q = drafts.draft_probs[r]
        if q is None:
            out[j, draft_tok[r, i]] = 1.0
        else:
            out[j] = q[i].to(dev, torch.float32)
    return out
