"""Turn a batch of next-token logits into token ids and their logprobs.

Order of logits processing
--------------------------
Every step the model runner hands the sampler ``logits [B, V]`` (one row per sequence
that needs a next token) and a :class:`SamplingMetadata` built from the rows'
:class:`SamplingRow`. The sampler applies, in this order:

1. **logit_bias, allowed_token_ids, bad_words** — the request's hard edits of the
   support. ``logit_bias`` is added to the raw logits (OpenAI semantics: the bias is on
   the model's own scale, so it must come before temperature and penalties rescale
   it). ``allowed_token_ids`` sets every other token to ``-inf``. A single-token bad
   word is always banned; a multi-token bad word bans its last token when the output
   generated so far ends with its preceding tokens (vLLM semantics; the prompt is not
   looked at).
2. **min_tokens** — while ``len(output_token_ids) < min_tokens``, EOS (unless
   ``ignore_eos``: then EOS does not stop anything) and ``stop_token_ids`` are ``-inf``.
3. **penalties** — ``repetition_penalty`` (Hugging Face semantics: for every token
   seen in prompt + output, a positive logit is divided by the penalty, a negative one
   multiplied), then ``frequency_penalty · count + presence_penalty · [count > 0]``
   subtracted over the *output* tokens (OpenAI semantics). Penalties are defined on
   the model's logit scale (the sign rule of the repetition penalty only makes sense
   there), so they come before temperature, as in transformers and vLLM.
4. **greedy short-circuit** — rows with ``temperature == 0`` or ``top_k == 1`` take the
   argmax of the logits processed so far (first index on ties). It comes after steps
   1-3 so greedy decoding still honours bans and penalties, and before temperature
   (no division by zero) and the truncations (which never remove the argmax anyway).
5. **temperature** — ``(x - max) / T`` in float32: subtracting the row max first makes
   the top token exactly 0, so a tiny ``T`` (1e-5) sends the others to large negative
   values or ``-inf`` and never produces NaN or overflow. The rows are then
   exponentiated in place into unnormalized probabilities whose maximum is exactly 1
   (no normalization pass is needed by anything below).
6. **min-p** — drop tokens with ``p < min_p · p_max`` (``p_max`` is 1 here).
7. **top-k** — keep tokens whose probability is ≥ the k-th largest. (Min-p and top-k
   are applied as one cut at the larger of their two thresholds, which is the same
   thing: both keep a prefix of the sorted order.)
8. **top-p** — keep the shortest prefix of the sorted distribution (renormalized over
   what survived 6-7) whose mass reaches ``top_p`` (a token is kept when the mass of
   the strictly higher-ranked tokens is < ``top_p``), so the top token always stays
   and ``top_p = 1e-9`` keeps exactly it.
9. **draw** (see below).

Truncations run after temperature because they must act on the distribution that is
actually sampled (vLLM and transformers agree). Min-p and top-k both keep a prefix of
the sorted order, so they commute; top-p is last because it is the only filter that
depends on the renormalized mass of what survived, so it sees the final candidate set.
**Difference from transformers:** transformers applies temperature → top-k → top-p →
min-p, i.e. its nucleus is computed over the full (top-k) distribution and min-p is
applied afterwards. Here (as in vLLM) min-p comes first and the nucleus is computed
over the min-p survivors, so with both ``min_p`` and ``top_p`` set kvserve can keep
fewer tokens than transformers; with only one of them, or with top-k, the results
are identical.

Ties: every filter is a *value* threshold, so tokens tied with the last kept value are
all kept (top-k may keep more than k tokens; transformers does the same for top-k).
The result never depends on the order in which a sort returns tied tokens.

Logits must be finite or ``-inf`` (``+inf``/NaN are not supported). If steps 1-2
leave a row with no finite logit (e.g. ``allowed_token_ids`` all banned
by ``bad_words`` or ``min_tokens``), that row falls back to its raw logits rather than
producing garbage; the engine should reject such requests at admission.

Randomness
----------
Sampling is by inverse CDF with one uniform number per row: ``u ∈ [0, 1)`` is a
splitmix64 hash of ``(seed, len(output_token_ids))`` computed on the host in
:meth:`SamplingMetadata.build` (53 random bits, :func:`row_uniform`), and the token is
the first index (in vocabulary order) whose cumulative probability exceeds
``u · total``. The cumulative sum is two-level to stay cheap: float32 sums of blocks
of 256 tokens pick the block (float64 cumsum over the blocks), a float64 cumsum
inside that block picks the token. There is no device RNG state at all, so a row's
token depends only on its own processed probabilities, its seed and its step — never
on its batch-mates, their order, the device, or how many other requests were
seeded. Zero-probability tokens can never be drawn. The draw is fully vectorized
(no Python loop over rows or over the vocabulary anywhere in ``Sampler.__call__``),
costs one read of the probabilities, and needs no per-row ``torch.Generator``. The
engine draws a random seed for unseeded requests and should give each of a
request's ``n``/``best_of`` samples its own seed with :func:`sample_seed` (with
``seed + i``, requests seeded s and s + 1 would share samples).

Logprobs
--------
``logprobs``, ``ranks`` and the top-K alternatives come from the **raw** distribution:
``log_softmax`` of the logits given to the sampler, before any of steps 1-8 (vLLM's
default "raw_logprobs"). A rank is ``1 +`` the number of tokens with a strictly larger
raw logit. ``-inf`` logprobs stay ``-inf`` in the tensors; the API layer makes them
JSON-safe.

Cost
----
Each stage runs only if some row of the batch uses it, and then only on the rows that
use it (gather rows → stage → scatter rows); a batch where no row uses any feature
costs max, subtract, exp, one block sum and log_softmax over [B, V]. Bias, bans and penalties touch only the
listed tokens (O(history length), not O(V)); their (row, token) lists are built once
per step by :meth:`SamplingMetadata.build`. Top-p finds its threshold among the top 64
candidates of ``topk`` and retries with 1024, then with a full sort, only the rows whose
nucleus is wider, so the usual narrow nucleus never pays for a sort of the
vocabulary. Ranks and top-K alternatives are computed only for rows that asked for
``logprobs``. Steps 1-3 copy the logits once (the caller's tensor is never modified).
Masks are applied as a float 0/1 tensor and a multiply, which on CPU is several times
faster than ``masked_fill_`` with a bool mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from kvserve.sampling_params import SamplingParams

__all__ = [
    "SamplingRow",
    "SamplingMetadata",
    "SamplerOutput",
    "Sampler",
    "compute_logprobs",
    "process_logits",
    "sample_seed",
    "row_uniform",
]

TokenIds = Union[Sequence[int], torch.Tensor]

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
_TOP_P_WIDTHS = (64, 1024)  # top-p candidate windows before a full sort
_BLOCK = 256  # block size of the two-level inverse-CDF draw


# ---------------------------------------------------------------------------- RNG
def _splitmix64(x: int) -> int:
    """One splitmix64 step (Steele, Lea & Flood 2014) on a 64-bit unsigned int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_uniform(seed: int, step: int, stream: int = 0) -> float:
    """The uniform number in [0, 1) (53 random bits) a row with ``seed`` uses at ``step``.

    ``step`` is the number of tokens the sequence has generated so far; ``stream``
    separates further independent numbers of the same step (e.g. for a rejection
    sampler). Pure function of its arguments.
    """
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) ^ (stream & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def sample_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th of a request's n/best_of samples (a 63-bit int).

    Different indices give unrelated streams, so two requests with seeds s and s + 1
    do not share samples (as they would with ``seed + index``).
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ _splitmix64(index & _MASK64)) >> 1


# --------------------------------------------------------------------- data types
@dataclass
class SamplingRow:
    """One row of the batch: one sequence that needs a next token.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (list of ints or a 1-D int tensor on any device;
            only read when ``repetition_penalty != 1``).
        output_token_ids: tokens this sequence generated so far; its length is the
            step used for the seed.
        seed: effective seed (``params.seed`` through :func:`sample_seed`, or a random
            one the engine drew for an unseeded request).
        eos_token_id: the model's EOS id (or a sequence of ids, for models with several),
            masked while ``min_tokens`` is not reached unless ``params.ignore_eos``.
    """

    params: SamplingParams
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds
    seed: int
    eos_token_id: Union[int, Sequence[int], None]


@dataclass
class _TokenEdit:
    """Sparse edit of ``x[rows, toks]``; ``values`` is None for a ban (-inf)."""

    rows: torch.Tensor  # [N] int64, row in the tensor the edit is applied to
    toks: torch.Tensor  # [N] int64
    values: Optional[torch.Tensor] = None  # [N] float32


@dataclass
class SamplingMetadata:
    """Per-step tensors for the whole batch; build with :meth:`build`.

    ``*_rows`` fields are index tensors of the rows a stage applies to, or None when it
    applies to all of them; the stage is skipped entirely when its parameter field is
    None. Fields after ``sample_idx`` are indexed in the *sampled* sub-batch (the
    non-greedy rows, in batch order).
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    # steps 1-3 (whole batch)
    logit_bias: Optional[_TokenEdit]
    allowed_rows: Optional[torch.Tensor]  # rows with allowed_token_ids (None: all)
    allowed: Optional[_TokenEdit]  # rows index into allowed_rows' sub-batch
    bans: Optional[_TokenEdit]  # bad_words + min_tokens, values None
    any_masked: bool  # some row has allowed ids or bans
    repetition: Optional[_TokenEdit]  # unique (row, tok) of prompt+output; values = penalty
    freq_presence: Optional[_TokenEdit]  # unique (row, tok) of output; values = -delta
    # step 4
    num_greedy: int
    sample_idx: Optional[torch.Tensor]  # non-greedy rows (None: all rows sample)
    # steps 5-9 (sampled sub-batch)
    temperature: Optional[torch.Tensor]  # [S, 1] float32; None when all are 1
    cut_rows: Optional[torch.Tensor]  # rows with min-p or top-k (None: all S)
    min_p: Optional[torch.Tensor]  # [U, 1] float32 over cut_rows (0: off); None: no row
    top_k_rows: Optional[torch.Tensor]  # rows of the cut_rows sub-batch with top-k
    top_k: Optional[torch.Tensor]  # [Uk] int64 in [2, V-1]; None: no row
    max_top_k: int
    top_p_rows: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]  # [Sp, 1] float64
    uniforms: Optional[torch.Tensor]  # [S] float64 in [0, 1)
    # logprobs
    num_top_logprobs: int  # K = max requested logprobs (0: none)
    logprob_rows: Optional[torch.Tensor]  # rows that requested logprobs; None: all
    any_logprobs: bool

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """Gather the rows' parameters into tensors on ``device``.

        One Python pass over the rows (host work proportional to the number of rows
        plus the listed tokens: bias, allowed ids, bad words, and the token history of
        rows with penalties).

        Raises:
            ValueError: a token id in logit_bias, allowed_token_ids, bad_words or
                stop_token_ids is ≥ ``vocab_size`` (the message names the field).
        """
        device = torch.device(device)
        V = int(vocab_size)
        B = len(rows)
        bias = ([], [], [])
        allowed_rows: list[int] = []
        allowed = ([], [])
        bans = ([], [])
        rep_rows: list[int] = []
        rep_vals: list[float] = []
        rep_seqs: list[TokenIds] = []
        pen_rows: list[int] = []
        pen_freq: list[float] = []
        pen_pres: list[float] = []
        pen_seqs: list[TokenIds] = []
        sample_idx: list[int] = []
        temps: list[float] = []
        uniforms: list[float] = []
        cut_rows: list[int] = []
        cut_min_p: list[float] = []
        top_k = ([], [])
        top_p = ([], [])
        max_k = 0
        rank_rows: list[int] = []

        for i, row in enumerate(rows):
            p = row.params
            out = row.output_token_ids
            n_out = len(out)
            if p.logit_bias:
                for tok, b in p.logit_bias.items():
                    _check_tok("logit_bias", tok, V)
                    bias[0].append(i)
                    bias[1].append(tok)
                    bias[2].append(b)
            if p.allowed_token_ids is not None:
                local = len(allowed_rows)
                allowed_rows.append(i)
                for tok in p.allowed_token_ids:
                    _check_tok("allowed_token_ids", tok, V)
                    allowed[0].append(local)
                    allowed[1].append(tok)
            if p.bad_words:
                tail = _tail(out, max(len(w) for w in p.bad_words) - 1)
                for word in p.bad_words:
                    _check_tok("bad_words", word[-1], V)
                    n = len(word) - 1  # a prefix that must end the output
                    if n == 0 or (n <= len(tail) and tail[len(tail) - n :] == list(word[:-1])):
                        bans[0].append(i)
                        bans[1].append(word[-1])
            if n_out < p.min_tokens:
                for tok in p.stop_token_ids or ():
                    _check_tok("stop_token_ids", tok, V)
                    bans[0].append(i)
                    bans[1].append(tok)
                if not p.ignore_eos:
                    for tok in _eos_ids(row.eos_token_id):
                        if 0 <= tok < V:
                            bans[0].append(i)
                            bans[1].append(tok)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
                rep_vals.append(p.repetition_penalty)
                rep_seqs.append(row.prompt_token_ids)
                rep_seqs.append(out)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                pen_rows.append(i)
                pen_freq.append(p.frequency_penalty)
                pen_pres.append(p.presence_penalty)
                pen_seqs.append(out)
            if not p.greedy:
                j = len(sample_idx)
                sample_idx.append(i)
                temps.append(p.temperature)
                uniforms.append(row_uniform(row.seed, n_out))
                use_top_k = 0 < p.top_k < V
                if p.min_p > 0.0 or use_top_k:
                    if use_top_k:
                        top_k[0].append(len(cut_rows))
                        top_k[1].append(p.top_k)
                        max_k = max(max_k, p.top_k)
                    cut_rows.append(j)
                    cut_min_p.append(p.min_p)
                if p.top_p < 1.0:
                    top_p[0].append(j)
                    top_p[1].append(p.top_p)
            if p.logprobs is not None:
                rank_rows.append(i)

        S = len(sample_idx)
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)

        def rows_or_none(idx: list[int], n: int) -> Optional[torch.Tensor]:
            return None if len(idx) == n else torch.tensor(idx, **i64)

        # repetition penalty: every distinct (row, token) of prompt + output
        repetition = None
        if rep_rows:
            r, t = _flat_pairs(rep_seqs, [x for x in rep_rows for _ in (0, 1)], V)
            keys = torch.unique(r * V + t)
            r, t = keys // V, keys % V
            factor = torch.tensor(rep_vals, dtype=torch.float32)
            row_pos = torch.searchsorted(torch.tensor(rep_rows), r)
            repetition = _TokenEdit(r.to(device), t.to(device), factor[row_pos].to(device))
        # frequency / presence: one additive delta per distinct (row, output token)
        freq_presence = None
        if pen_rows:
            r, t = _flat_pairs(pen_seqs, pen_rows, V)
            keys, counts = torch.unique(r * V + t, return_counts=True)
            r, t = keys // V, keys % V
            row_pos = torch.searchsorted(torch.tensor(pen_rows), r)
            fr = torch.tensor(pen_freq, dtype=torch.float32)[row_pos]
            pr = torch.tensor(pen_pres, dtype=torch.float32)[row_pos]
            delta = -(fr * counts.to(torch.float32) + pr)
            freq_presence = _TokenEdit(r.to(device), t.to(device), delta.to(device))

        return cls(
            batch_size=B,
            vocab_size=V,
            device=device,
            logit_bias=_TokenEdit(
                torch.tensor(bias[0], **i64), torch.tensor(bias[1], **i64), torch.tensor(bias[2], **f32)
            )
            if bias[0]
            else None,
            allowed_rows=rows_or_none(allowed_rows, B),
            allowed=_TokenEdit(torch.tensor(allowed[0], **i64), torch.tensor(allowed[1], **i64))
            if allowed_rows
            else None,
            bans=_TokenEdit(torch.tensor(bans[0], **i64), torch.tensor(bans[1], **i64)) if bans[0] else None,
            any_masked=bool(allowed_rows or bans[0]),
            repetition=repetition,
            freq_presence=freq_presence,
            num_greedy=B - S,
            sample_idx=rows_or_none(sample_idx, B),
            temperature=torch.tensor(temps, **f32).unsqueeze(1) if any(t != 1.0 for t in temps) else None,
            cut_rows=rows_or_none(cut_rows, S),
            min_p=torch.tensor(cut_min_p, **f32).unsqueeze(1) if any(cut_min_p) else None,
            top_k_rows=rows_or_none(top_k[0], len(cut_rows)),
            top_k=torch.tensor(top_k[1], **i64) if top_k[0] else None,
            max_top_k=max_k,
            top_p_rows=rows_or_none(top_p[0], S),
            top_p=torch.tensor(top_p[1], **f64).unsqueeze(1) if top_p[0] else None,
            uniforms=torch.tensor(uniforms, **f64) if S else None,
            num_top_logprobs=max((r.params.logprobs or 0 for r in rows), default=0),
            logprob_rows=rows_or_none(rank_rows, B),
            any_logprobs=bool(rank_rows),
        )


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of B rows.

    Attributes:
        sampled_token_ids: [B] int64.
        logprobs: [B] float32, raw logprob of the sampled token (log_softmax of the
            logits given to the sampler).
        ranks: [B] int64, 1-based rank of the sampled token in the raw distribution
            (1 + number of strictly larger raw logits). Computed only for rows whose
            ``params.logprobs`` is not None; 0 for the other rows.
        top_token_ids: [B, K] int64, K = max requested ``logprobs`` in the batch, raw
            order (best first); None when K == 0. A row that asked for k < K uses its
            first k columns; rows that did not ask hold -1.
        top_logprobs: [B, K] float32 matching ``top_token_ids``; None when K == 0;
            -inf in rows that did not ask.
    """

    sampled_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_token_ids: Optional[torch.Tensor]
    top_logprobs: Optional[torch.Tensor]


# ------------------------------------------------------------------------ sampler
class Sampler:
    """Stateless sampler; see the module docstring for the order of processing."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [B, V] next-token logits on any device; upcast to float32 if needed.
                Not modified.
            meta: built for these B rows and this V.

        Returns:
            A :class:`SamplerOutput` on ``logits.device``.
        """
        if logits.dim() != 2 or logits.shape != (meta.batch_size, meta.vocab_size):
            raise ValueError(
                f"logits must have shape [{meta.batch_size}, {meta.vocab_size}], got {tuple(logits.shape)}"
            )
        raw = logits if logits.dtype == torch.float32 else logits.float()
        if meta.batch_size == 0:
            empty = torch.empty(0, dtype=torch.int64, device=raw.device)
            return SamplerOutput(empty, raw.new_empty(0), empty.clone(), None, None)
        x = process_logits(raw, meta)
        tokens = _choose(x, meta)
        lp, ranks, top_ids, top_lp = _logprobs(
            raw, tokens, meta.num_top_logprobs, meta.logprob_rows, meta.any_logprobs
        )
        return SamplerOutput(tokens, lp, ranks, top_ids, top_lp)


def process_logits(raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 1-3 (bias, allowed ids, bad words, min_tokens, penalties) on float32 logits.

    Returns ``raw`` itself when no row needs any of them, else a processed copy; rows
    left with no finite logit fall back to their raw logits.
    """
    if meta.logit_bias is None and meta.allowed is None and meta.bans is None and (
        meta.repetition is None and meta.freq_presence is None
    ):
        return raw
    x = raw.clone()
    if meta.logit_bias is not None:
        e = meta.logit_bias
        x.index_put_((e.rows, e.toks), e.values, accumulate=True)
    if meta.allowed is not None:
        x = _on_rows(x, meta.allowed_rows, lambda sub: _keep_only(sub, meta.allowed))
    if meta.bans is not None:
        x.index_put_((meta.bans.rows, meta.bans.toks), torch.tensor(_NEG_INF, device=x.device))
    if meta.repetition is not None:
        e = meta.repetition
        v = x[e.rows, e.toks]
        x[e.rows, e.toks] = torch.where(v < 0, v * e.values, v / e.values)
    if meta.freq_presence is not None:
        e = meta.freq_presence
        x.index_put_((e.rows, e.toks), e.values, accumulate=True)
    if meta.any_masked:  # steps 1-2 may have masked a whole row
        dead = torch.isneginf(x.amax(dim=-1))
        if bool(dead.any()):  # every token masked: fall back to the raw logits
            x[dead] = raw[dead]
    return x


def _keep_only(sub: torch.Tensor, allowed: _TokenEdit) -> torch.Tensor:
    out = torch.full_like(sub, _NEG_INF)
    out[allowed.rows, allowed.toks] = sub[allowed.rows, allowed.toks]
    return out


def _choose(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 4-9: greedy rows take the argmax, the others are drawn."""
    if meta.sample_idx is None:  # no greedy row
        xs = x - x.amax(dim=-1, keepdim=True)
        return _draw_rows(xs, meta)
    mx, tokens = x.max(dim=-1)  # first index on ties (faster than argmax on CPU)
    if meta.num_greedy == meta.batch_size:
        return tokens
    xs = x[meta.sample_idx]
    xs -= mx[meta.sample_idx].unsqueeze(1)
    tokens[meta.sample_idx] = _draw_rows(xs, meta)
    return tokens


def _draw_rows(xs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 5-9 on the sampled sub-batch ``xs`` [S, V] (a private copy, row max 0).

    After temperature the rows are exponentiated in place into unnormalized
    probabilities with maximum exactly 1; min-p, top-k and top-p then zero entries
    (value thresholds on probabilities are the same as on logits, exp being monotone).
    Min-p and top-k are both "keep p ≥ threshold" with thresholds that do not depend
    on each other (min-p's is ``min_p · 1``; the k-th largest of the min-p survivors is
    the k-th largest overall, or 0 if fewer survive), so they are applied as one cut at
    the larger of the two thresholds.
    """
    if meta.temperature is not None:
        xs.div_(meta.temperature)
    probs = xs.exp_()
    if meta.min_p is not None or meta.top_k is not None:
        probs = _on_rows(probs, meta.cut_rows, lambda sub: _min_p_top_k(sub, meta))
    if meta.top_p is not None:
        p = meta.top_p
        probs = _on_rows(probs, meta.top_p_rows, lambda sub: _top_p(sub, p))
    return _inverse_cdf(probs, meta.uniforms)


def _min_p_top_k(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Zero entries below max(min_p, k-th largest) (ties with the k-th kept). probs [U, V]."""
    thr = meta.min_p if meta.min_p is not None else probs.new_zeros(probs.shape[0], 1)
    if meta.top_k is not None:
        rows = meta.top_k_rows
        src = probs if rows is None else probs[rows]
        kth = src.topk(meta.max_top_k, dim=-1).values.gather(1, (meta.top_k - 1).unsqueeze(1))
        if rows is None:
            thr = torch.maximum(thr, kth)
        else:
            thr = thr.clone()
            thr[rows] = torch.maximum(thr[rows], kth)
    return _zero_below(probs, thr)


def _zero_below(probs: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """probs[i, j] = 0 where probs[i, j] < thr[i] (in place). A float 0/1 mask and a
    multiply: on CPU several times faster than ``masked_fill_`` with a bool mask."""
    keep = torch.ge(probs, thr, out=torch.empty_like(probs))
    return probs.mul_(keep)


def _top_p(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter on unnormalized probs [R, V]; p [R, 1] float64.

    A token is kept when the mass of the entries before it in descending order is
    < p · total; the threshold is the smallest kept value, found among the top 64
    candidates of ``topk``. Rows whose nucleus is wider are retried with 1024
    candidates, then with a full sort (one host sync per round, rows retried only).
    """
    R, V = probs.shape
    limit = p * probs.sum(dim=-1, keepdim=True).to(torch.float64)
    thr = torch.empty(R, 1, dtype=probs.dtype, device=probs.device)
    pending: Optional[torch.Tensor] = None  # rows still undecided; None: all
    for width in _top_p_widths(V):
        sub = probs if pending is None else probs[pending]
        lim = limit if pending is None else limit[pending]
        if width == V:
            vals = sub.sort(dim=-1, descending=True).values
        else:
            vals = sub.topk(width, dim=-1).values  # sorted, best first
        mass = vals.to(torch.float64)
        before = mass.cumsum(dim=-1) - mass  # mass strictly above each candidate
        kept = (before < lim).sum(dim=-1, keepdim=True)  # ≥ 1 since before[0] = 0 < lim
        t = vals.gather(1, kept - 1)
        if pending is None:
            thr = t
        else:
            thr[pending] = t
        if width == V:
            break
        # decided if the first dropped candidate is inside the window or the rest are 0
        done = (kept.squeeze(1) < width) | (vals[:, -1] == 0)
        if bool(done.all()):
            break
        pending = (~done).nonzero().squeeze(1) if pending is None else pending[~done]
    return _zero_below(probs, thr)


def _top_p_widths(V: int) -> list[int]:
    widths = [w for w in _TOP_P_WIDTHS if w < V]
    return widths + [V]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability ∝ probs [S, V]; u [S] float64 in [0, 1).

    Two levels so that no [S, V] float64 tensor is made: float32 sums of blocks of
    ``_BLOCK`` entries (one read of probs), a float64 cumsum over the blocks picks the
    block, and a float64 cumsum inside that block picks the token. The block choice is
    exact up to float32 rounding of each block sum (relative error ~1e-7); the choice
    inside the block is exact. A zero-probability entry is never returned: the block
    chosen has a positive float32 sum, hence a positive entry, and the in-block target
    is kept below the block's float64 total.
    """
    S, V = probs.shape
    bs = min(_BLOCK, V)
    nb, rem = divmod(V, bs)
    sums = probs.unfold(1, bs, bs).sum(dim=-1)  # [S, nb] view of the full blocks
    if rem:
        sums = torch.cat([sums, probs[:, nb * bs :].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.to(torch.float64).cumsum(dim=-1)
    target = _below_total(u.unsqueeze(1) * cdf[:, -1:], cdf[:, -1:])
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    start = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * bs + torch.arange(bs, device=probs.device)  # [S, bs]
    blk = probs.gather(1, cols.clamp(max=V - 1))
    if rem:  # the last block is partial
        blk = blk.masked_fill(cols >= V, 0.0)
    blk_cdf = blk.to(torch.float64).cumsum(dim=-1)
    rest = _below_total(target - start, blk_cdf[:, -1:]).clamp_(min=0.0)
    pos = torch.searchsorted(blk_cdf, rest, right=True).clamp_(max=bs - 1)
    return cols.gather(1, pos).squeeze(1).clamp_(max=V - 1)


def _below_total(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """min(target, largest float64 below total): the first cdf entry > it then exists
    and has positive mass."""
    return torch.minimum(target, total * (1.0 - 2.0**-52))


def _on_rows(x: torch.Tensor, rows: Optional[torch.Tensor], fn) -> torch.Tensor:
    """Apply ``fn`` (which may work in place) to ``x[rows]`` only, or to all of x."""
    if rows is None:
        return fn(x)
    x[rows] = fn(x[rows])
    return x


# ----------------------------------------------------------------------- logprobs
def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs of given tokens, their ranks, and the top alternatives.

    Used for sampled tokens and for ``prompt_logprobs`` (there ``logits[i]`` is the
    prediction after prompt position i and ``token_ids[i]`` the prompt token i + 1).

    Args:
        logits: [N, V] (any float dtype; computed in float32).
        token_ids: [N] int64.
        num_top: K ≥ 0 alternatives per row.

    Returns:
        token_logprobs [N] float32 (``log_softmax(logits)[i, token_ids[i]]``),
        ranks [N] int64 (1 + number of strictly larger logits in the row),
        top_ids [N, K] int64 and top_logprobs [N, K] float32, best first.
    """
    lp, ranks, top_ids, top_lp = _logprobs(logits.float(), token_ids, num_top, None, True)
    if top_ids is None:
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
        top_lp = torch.empty(lp.shape[0], 0, dtype=torch.float32, device=lp.device)
    return lp, ranks, top_ids, top_lp


def _logprobs(
    raw: torch.Tensor,
    tokens: torch.Tensor,
    num_top: int,
    rows: Optional[torch.Tensor],
    any_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Token logprobs for all rows; ranks and top-``num_top`` only for ``rows``
    (None: all rows; nothing when ``any_rows`` is False). Other rows get rank 0,
    top ids -1 and top logprobs -inf."""
    tokens = tokens.to(device=raw.device, dtype=torch.int64)
    lsm = torch.log_softmax(raw, dim=-1)
    tok = tokens.unsqueeze(1)
    token_lp = lsm.gather(1, tok).squeeze(1)
    ranks = torch.zeros_like(tokens)
    top_ids = top_lp = None
    if not any_rows:
        return token_lp, ranks, top_ids, top_lp
    sub_raw, sub_lsm, sub_tok = (raw, lsm, tok) if rows is None else (raw[rows], lsm[rows], tok[rows])
    larger = torch.gt(sub_raw, sub_raw.gather(1, sub_tok), out=torch.empty_like(sub_raw))
    sub_ranks = larger.sum(dim=-1).to(torch.int64) + 1  # exact: counts < 2^24
    if num_top > 0:
        sub_top_lp, sub_top_ids = sub_lsm.topk(min(num_top, raw.shape[1]), dim=-1)
    if rows is None:
        ranks = sub_ranks
        if num_top > 0:
            top_ids, top_lp = sub_top_ids, sub_top_lp
    else:
        ranks[rows] = sub_ranks
        if num_top > 0:
            B, K = raw.shape[0], sub_top_ids.shape[1]
            top_ids = torch.full((B, K), -1, dtype=torch.int64, device=raw.device)
            top_lp = torch.full((B, K), _NEG_INF, dtype=torch.float32, device=raw.device)
            top_ids[rows] = sub_top_ids
            top_lp[rows] = sub_top_lp
    return token_lp, ranks, top_ids, top_lp


# ------------------------------------------------------------------------ helpers
def _check_tok(field: str, tok: int, vocab_size: int) -> None:
    if not 0 <= tok < vocab_size:
        raise ValueError(f"{field}: token id {tok} is outside the vocabulary [0, {vocab_size})")


def _eos_ids(eos: Union[int, Sequence[int], None]) -> Sequence[int]:
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else eos


def _tail(seq: TokenIds, n: int) -> list[int]:
    """The last n tokens of seq as a list of ints."""
    if n <= 0:
        return []
    part = seq[len(seq) - n :] if len(seq) > n else seq
    return part.tolist() if isinstance(part, torch.Tensor) else list(part)


def _flat_pairs(seqs: list[TokenIds], row_of_seq: list[int], V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) int64 CPU tensors for every token of every seq; tokens ≥ V dropped."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    if all(not isinstance(s, torch.Tensor) for s in seqs):
        toks = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    else:
        toks = torch.cat([torch.as_tensor(s, dtype=torch.int64).reshape(-1).cpu() for s in seqs])
    rows = torch.repeat_interleave(torch.tensor(row_of_seq, dtype=torch.int64), lengths)
    ok = (toks >= 0) & (toks < V)
    return rows[ok], toks[ok]
