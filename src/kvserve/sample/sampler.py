"""Turn a batch of next-token logits into token ids and their logprobs.

Order of logits processing
--------------------------
Every step the model runner hands the sampler ``logits [B, V]`` (one row per sequence
that needs a next token) and a :class:`SamplingMetadata` built from the rows'
:class:`SamplingRow`. The sampler applies, in this order:

1. **structured output, logit_bias, allowed_token_ids, bad_words** — the request's hard
   edits of the support. A row with a grammar (``structured_outputs``) gets its token bitmask
   (:attr:`SamplingMetadata.grammar_bitmask`, filled by :mod:`kvserve.structured_output.manager`):
   every token the grammar does not allow next is ``-inf``, for all such rows in one
   ``masked_fill`` (the model's padded vocabulary rows included), so nothing later —
   penalties, the greedy argmax, temperature, the truncations, the draw — can pick one. ``logit_bias`` is added to the raw logits (OpenAI semantics: the bias is on
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
4. **greedy short-circuit** — rows with ``temperature < 1e-5`` or ``top_k == 1`` take the
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
by ``bad_words`` or ``min_tokens``), that row is processed again without the bans:
``allowed_token_ids`` is a hard constraint, bad words and min_tokens yield to it (the
engine rejects at admission the requests where that is certain: every allowed token a
one-token bad word, or a stop/EOS token under min_tokens). The grammar is the hardest
constraint: a row still dead (no allowed token in the grammar's mask) is processed once
more with the grammar's mask alone.

Randomness
----------
Sampling is by inverse CDF with one uniform number per row: ``u ∈ [0, 1)`` is a
splitmix64 hash of ``(seed, len(output_token_ids))`` computed on the host in
:meth:`SamplingMetadata.build` (53 random bits, :func:`row_uniform`), and the token is
the first index (in vocabulary order) whose cumulative probability exceeds
``u · total``. Rows with top-k are drawn from their candidates (see Cost): the
survivors sorted by token id, one float64 cumulative sum, which is exactly this
definition. Other rows use a two-level cumulative sum to stay cheap: float32 sums of
blocks of 256 tokens pick the block (float64 cumsum over the blocks), a float64 cumsum
inside that block picks the token; it can differ from the exact one only when
``u · total`` falls within float32 rounding (~1e-7 relative) of a block boundary.
There is no device RNG state at all, so a row's token depends only on its own processed
probabilities, its seed and its step — never on its batch-mates, their order, the
device, or how many other requests were seeded. (The probabilities themselves come from
the model, whose float32 logits can differ in their last bits with the batch's shape:
a draw that lands within that rounding of a token boundary in the CDF can then change.) Zero-probability tokens can never be
drawn. The draw is vectorized over the batch (no Python loop over single rows or over
the vocabulary) and needs no per-row ``torch.Generator``. The engine draws a random
seed for unseeded requests and should give each of a request's ``n``/``best_of``
samples its own seed with :func:`sample_seed` (with ``seed + i``, requests seeded s and
s + 1 would share samples).

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
use it. In passes over the [B, V] logits:

* **Greedy rows**: one argmax (numpy's on CPU, as fast as a max and several times
  faster than torch's ``argmax``/``max(dim)``; elsewhere from block maxima).
* **Rows with top-k** (the candidate path, :func:`_draw_candidates`): one pass takes the
  maxima of blocks of 32 logits; they locate the few blocks that hold the m ≥ k + 1
  largest logits (:func:`_top_m`; numpy's ``argpartition`` on CPU, several times faster
  than ``topk``), and temperature, min-p, top-k, top-p and the draw run on those m
  candidates only. Their probabilities come from the same float32 operations as on the
  full row (bitwise the same values), nothing outside them can survive top-k, and a
  row whose tie with the k-th value reaches the m-th candidate is redone with 4× as
  many. So these rows behave exactly as documented above, for a fraction of the cost.
* **Other sampled rows**: subtract, divide and exp over the row, the min-p/top-p cuts
  and one block-sum pass for the draw. Top-p finds its threshold among the 64 largest
  entries and retries with 1024, then with a full sort (numpy's on CPU), only the rows
  whose nucleus is wider.
* **Logprobs**: one log-sum-exp pass over the raw logits, in cache-sized chunks of rows
  (the [B, V] log_softmax is never materialized); ranks and top-K alternatives only for
  the rows that asked for ``logprobs``.

Bias, bans and penalties touch only the listed tokens (O(history length), not O(V));
their (row, token) lists are built once per step by :meth:`SamplingMetadata.build`,
the penalties' incrementally from each request's :class:`TokenHistory`. When bias and
penalties are the only edits (no allowed ids or bans), they are applied to the caller's
logits in place and undone before the call returns, instead of copying [B, V]; allowed
ids and bans copy the logits once. Masks are applied as a float 0/1 tensor and a
multiply, which on CPU is several times faster than ``masked_fill_`` with a bool mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from kvserve.kernels import cpu_ops
from kvserve.sampling_params import SamplingParams

__all__ = [
    "SamplingRow",
    "TokenHistory",
    "SamplingMetadata",
    "SamplerOutput",
    "Sampler",
    "compute_logprobs",
    "process_logits",
    "sampling_probs",
    "sample_seed",
    "row_uniform",
    "unpack_bitmask",
]

TokenIds = Union[Sequence[int], torch.Tensor]

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
_TOP_P_WIDTHS = (64, 1024)  # top-p candidate windows before a full sort
_BLOCK = 256  # block size of the two-level inverse-CDF draw
_SEL_BLOCK = 32  # block size of the block-maxima pre-selection of the largest entries
_ARGMAX_BLOCK = 256  # block size of the block maxima when no row needs a selection
_CHUNK_BYTES = 1 << 20  # row chunks of the log-partition pass (cache-sized)
_CAND_ALIGN = 32  # the candidate path takes a multiple of this many candidates per row
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit positions of a token bitmask word
_EXP_FLOOR = -87.0  # exp below this is a slow path in torch on CPU (the result is subnormal or 0)


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


# ----------------------------------------------------------------- token history
class TokenHistory:
    """The distinct tokens of one sequence's prompt + output, and the counts of its
    output tokens, kept up to date incrementally for the penalties.

    The engine keeps one per request (``Request.token_history``, created by
    :meth:`attach`) and passes it as :attr:`SamplingRow.history`. Each step
    :meth:`SamplingMetadata.build` then only looks at the tokens appended since the
    previous step, instead of converting the whole prompt + output to a tensor and
    deduplicating it again. A row without a history gets a throw-away one (same result,
    built from scratch).

    Sequences are expected to change only by appending to the output. The history
    remembers the list objects it was synced with and rebuilds itself from scratch when
    a row brings other objects, a prompt of another length, a shorter output, or an
    output whose last previously seen token changed; so a replaced or truncated output
    costs a rebuild, never a wrong penalty. (An output edited in the middle with its
    length and last token unchanged would not be noticed: don't do that.)
    """

    __slots__ = (
        "_prompt", "_n_prompt", "_output", "_n_out", "_last", "_seen", "_all", "_n_all",
        "_out_slot", "_out_ids", "_out_counts", "_n_outu", "_lo", "_hi",
    )

    def __init__(self) -> None:
        self._prompt: Optional[TokenIds] = None
        self._output: Optional[TokenIds] = None
        self._n_prompt = self._n_out = self._n_all = self._n_outu = 0
        self._last: Optional[int] = None
        self._seen: set[int] = set()
        self._all = np.empty(0, dtype=np.int64)  # distinct tokens of prompt + output
        self._out_slot: dict[int, int] = {}  # output token -> its index in _out_ids
        self._out_ids = np.empty(0, dtype=np.int64)  # distinct output tokens
        self._out_counts = np.empty(0, dtype=np.float32)  # their counts
        self._lo = self._hi = 0  # smallest / largest token seen (vocabulary check)

    @staticmethod
    def attach(owner) -> "TokenHistory":
        """``owner.token_history``, created on first use (``owner`` is e.g. a Request)."""
        h = owner.token_history
        if h is None:
            h = owner.token_history = TokenHistory()
        return h

    def sync(self, prompt: TokenIds, output: TokenIds) -> "TokenHistory":
        """Bring the history up to date with ``prompt`` + ``output``; returns self."""
        n = len(output)
        if (
            self._prompt is not prompt
            or self._output is not output
            or len(prompt) != self._n_prompt
            or n < self._n_out
            or (self._n_out > 0 and int(output[self._n_out - 1]) != self._last)
        ):
            self._reset(prompt)
        if n > self._n_out:
            self._add(_as_list(output[self._n_out :]))
            self._last = int(output[n - 1])
        self._output = output
        self._n_out = n
        return self

    def _reset(self, prompt: TokenIds) -> None:
        seen = set(_as_list(prompt))
        n = len(seen)
        self._prompt, self._n_prompt = prompt, len(prompt)
        self._output, self._n_out, self._last = None, 0, None
        self._seen = seen
        self._all = np.empty(max(2 * n, 64), dtype=np.int64)
        self._all[:n] = np.fromiter(seen, dtype=np.int64, count=n)
        self._n_all = n
        self._lo, self._hi = (min(seen), max(seen)) if n else (0, 0)
        self._out_slot = {}
        self._out_ids = np.empty(64, dtype=np.int64)
        self._out_counts = np.empty(64, dtype=np.float32)
        self._n_outu = 0

    def _add(self, tokens: list[int]) -> None:
        seen, slot = self._seen, self._out_slot
        for t in tokens:
            if t not in seen:
                seen.add(t)
                if self._n_all == len(self._all):
                    self._all = np.concatenate([self._all, np.empty_like(self._all)])
                self._all[self._n_all] = t
                self._n_all += 1
                self._lo, self._hi = min(self._lo, t), max(self._hi, t)
            j = slot.get(t)
            if j is None:
                j = slot[t] = self._n_outu
                if j == len(self._out_ids):
                    self._out_ids = np.concatenate([self._out_ids, np.empty_like(self._out_ids)])
                    self._out_counts = np.concatenate([self._out_counts, np.empty_like(self._out_counts)])
                self._out_ids[j] = t
                self._out_counts[j] = 0.0
                self._n_outu += 1
            self._out_counts[j] += 1.0

    def extended(self, output: list[int]) -> "TokenHistory":
        """A copy synced with ``output``, a longer output that starts with the one this
        history is synced with (speculative decoding: the output followed by drafts);
        this history is unchanged. Costs a copy of its sets and arrays (C speed) plus the
        new tokens, instead of a rebuild from scratch."""
        h = TokenHistory.__new__(TokenHistory)
        for name in self.__slots__:
            setattr(h, name, getattr(self, name))
        h._seen, h._out_slot = set(self._seen), dict(self._out_slot)
        h._all, h._out_ids, h._out_counts = self._all.copy(), self._out_ids.copy(), self._out_counts.copy()
        if len(output) > h._n_out:
            h._add(_as_list(output[h._n_out :]))
            h._last = int(output[-1])
        h._output, h._n_out = output, len(output)
        return h

    def seen_ids(self) -> np.ndarray:
        """Distinct tokens of prompt + output (a view; read only, in no particular order)."""
        return self._all[: self._n_all]

    def output_ids(self) -> np.ndarray:
        """Distinct output tokens (a view; read only), matching :meth:`output_counts`."""
        return self._out_ids[: self._n_outu]

    def output_counts(self) -> np.ndarray:
        """How often each of :meth:`output_ids` occurs in the output (float32 view)."""
        return self._out_counts[: self._n_outu]

    def in_vocab(self, vocab_size: int) -> bool:
        """True when every token seen is in [0, vocab_size)."""
        return self._lo >= 0 and self._hi < vocab_size


# --------------------------------------------------------------------- data types
@dataclass
class SamplingRow:
    """One row of the batch: one sequence that needs a next token.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (list of ints or a 1-D int tensor on any device;
            only read when a penalty is set).
        output_token_ids: tokens this sequence generated so far; its length is the
            step used for the seed.
        seed: effective seed (``params.seed`` through :func:`sample_seed`, or a random
            one the engine drew for an unseeded request).
        eos_token_id: the model's EOS id (or a sequence of ids, for models with several),
            masked while ``min_tokens`` is not reached unless ``params.ignore_eos``.
        history: the sequence's persistent :class:`TokenHistory` (optional: it only makes
            the penalties cheaper to build; the result is the same without it).
    """

    params: SamplingParams
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds
    seed: int
    eos_token_id: Union[int, Sequence[int], None]
    history: Optional[TokenHistory] = None


@dataclass
class _TokenEdit:
    """Sparse edit of ``x[rows, toks]``; ``values`` is None for a ban (-inf)."""

    rows: torch.Tensor  # [N] int64, row in the tensor the edit is applied to
    toks: torch.Tensor  # [N] int64
    values: Optional[torch.Tensor] = None  # [N] float32
    flat: Optional[torch.Tensor] = None  # [N] int64 rows · V + toks (edits of the whole batch)

    @classmethod
    def of_batch(cls, rows: torch.Tensor, toks: torch.Tensor, values: torch.Tensor, V: int, device) -> "_TokenEdit":
        """An edit of distinct (row, tok) of the [B, V] batch, with its flat indices."""
        return cls(rows.to(device), toks.to(device), values.to(device), (rows * V + toks).to(device))


@dataclass
class SamplingMetadata:
    """Per-step tensors for the whole batch; build with :meth:`build`.

    ``*_rows``/``*_idx`` fields are index tensors of the rows a stage applies to, or None
    when it applies to all of them; the stage is skipped entirely when its parameter
    field is None. Fields after ``sample_idx`` are indexed in the *sampled* sub-batch
    (the non-greedy rows, in batch order); ``row_*`` are host copies of them.
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
    repetition: Optional[_TokenEdit]  # distinct (row, tok) of prompt+output; values = penalty
    freq_presence: Optional[_TokenEdit]  # distinct (row, tok) of output; values = -delta
    # step 4
    num_greedy: int
    greedy_idx: Optional[torch.Tensor]  # greedy rows (None: all rows, or none when num_greedy == 0)
    sample_idx: Optional[torch.Tensor]  # non-greedy rows (None: all rows sample)
    # steps 5-9 (sampled sub-batch, S rows)
    temperature: Optional[torch.Tensor]  # [S, 1] float32; None when all are 1
    min_p: Optional[torch.Tensor]  # [S, 1] float32 (0: off); None: no row
    top_k: Optional[torch.Tensor]  # [S] int64 in [2, V-1] (0: off); None: no row
    top_p: Optional[torch.Tensor]  # [S, 1] float64 (1: off); None: no row
    uniforms: Optional[torch.Tensor]  # [S] float64 in [0, 1)
    row_min_p: list[float]
    row_top_k: list[int]
    row_top_p: list[float]
    # logprobs
    num_top_logprobs: int  # K = max requested logprobs (0: none)
    logprob_rows: Optional[torch.Tensor]  # rows that requested logprobs; None: all
    any_logprobs: bool
    # step 1, structured output
    grammar_rows: Optional[torch.Tensor] = None  # rows with a grammar (None: all, if grammar_bitmask is set)
    grammar_bitmask: Optional[torch.Tensor] = None  # [G, W] int32: bit j of word w allows token 32·w + j

    @property
    def edits_logits(self) -> bool:
        """Whether some row needs steps 1-3 (grammar, bias, allowed ids, bad words / min_tokens, penalties)."""
        return not (self.logit_bias is None and self.allowed is None and self.bans is None
                    and self.repetition is None and self.freq_presence is None and self.grammar_bitmask is None)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device,
              grammar_rows: Optional[Sequence[int]] = None,
              grammar_bitmask: Optional[torch.Tensor] = None) -> "SamplingMetadata":
        """Gather the rows' parameters into tensors on ``device``.

        One Python pass over the rows (host work proportional to the number of rows
        plus the listed tokens: bias, allowed ids, bad words; for rows with penalties,
        the tokens appended since the last step when the row has a
        :class:`TokenHistory`, else its whole prompt + output).

        Args:
            rows: the batch's rows.
            vocab_size: V, the logits' columns.
            device: where the tensors go.
            grammar_rows: the rows (ascending batch indices) that follow a grammar
                (structured output), and ``grammar_bitmask`` their token bitmasks, ``[G, W]``
                int32 (:func:`kvserve.structured_output.manager.grammar_bitmask`); tokens at or past
                ``32·W`` are not allowed in those rows.

        Raises:
            ValueError: a token id in logit_bias, allowed_token_ids, bad_words or
                stop_token_ids is ≥ ``vocab_size`` (the message names the field); a
                ``grammar_bitmask`` whose row count differs from ``grammar_rows``.
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
        rep_hist: list[TokenHistory] = []
        pen_rows: list[int] = []
        pen_freq: list[float] = []
        pen_pres: list[float] = []
        pen_hist: list[TokenHistory] = []
        greedy_idx: list[int] = []
        sample_idx: list[int] = []
        temps: list[float] = []
        uniforms: list[float] = []
        min_ps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
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
            rep = p.repetition_penalty != 1.0
            freq = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            if rep or freq:
                h = (row.history if row.history is not None else TokenHistory()).sync(row.prompt_token_ids, out)
                if rep:
                    rep_rows.append(i)
                    rep_vals.append(p.repetition_penalty)
                    rep_hist.append(h)
                if freq:
                    pen_rows.append(i)
                    pen_freq.append(p.frequency_penalty)
                    pen_pres.append(p.presence_penalty)
                    pen_hist.append(h)
            if p.greedy:
                greedy_idx.append(i)
            else:
                sample_idx.append(i)
                temps.append(p.temperature)
                uniforms.append(row_uniform(row.seed, n_out))
                min_ps.append(p.min_p)
                top_ks.append(p.top_k if 0 < p.top_k < V else 0)
                top_ps.append(p.top_p)
            if p.logprobs is not None:
                rank_rows.append(i)

        grammar = grammar_bitmask is not None and len(grammar_rows or ()) > 0
        if grammar and (grammar_bitmask.dim() != 2 or grammar_bitmask.shape[0] != len(grammar_rows)):
            raise ValueError(f"grammar_bitmask must have one row per grammar row ({len(grammar_rows)}), "
                             f"got shape {tuple(grammar_bitmask.shape)}")
        S = len(sample_idx)
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)

        def rows_or_none(idx: list[int], n: int) -> Optional[torch.Tensor]:
            return None if len(idx) == n else torch.tensor(idx, **i64)

        # repetition penalty: every distinct (row, token) of prompt + output
        repetition = None
        if rep_rows:
            r, t, lengths, ok = _history_pairs(rep_rows, [h.seen_ids() for h in rep_hist], rep_hist, V)
            factor = torch.repeat_interleave(torch.tensor(rep_vals, dtype=torch.float32), lengths)
            if ok is not None:
                r, t, factor = r[ok], t[ok], factor[ok]
            repetition = _TokenEdit.of_batch(r, t, factor, V, device)
        # frequency / presence: one additive delta per distinct (row, output token)
        freq_presence = None
        if pen_rows:
            r, t, lengths, ok = _history_pairs(pen_rows, [h.output_ids() for h in pen_hist], pen_hist, V)
            counts = torch.from_numpy(np.concatenate([h.output_counts() for h in pen_hist]))
            fr = torch.repeat_interleave(torch.tensor(pen_freq, dtype=torch.float32), lengths)
            pr = torch.repeat_interleave(torch.tensor(pen_pres, dtype=torch.float32), lengths)
            delta = -(fr * counts + pr)
            if ok is not None:
                r, t, delta = r[ok], t[ok], delta[ok]
            freq_presence = _TokenEdit.of_batch(r, t, delta, V, device)

        return cls(
            batch_size=B,
            vocab_size=V,
            device=device,
            logit_bias=_TokenEdit.of_batch(
                torch.tensor(bias[0], dtype=torch.int64), torch.tensor(bias[1], dtype=torch.int64),
                torch.tensor(bias[2], dtype=torch.float32), V, device,
            )
            if bias[0]
            else None,
            allowed_rows=rows_or_none(allowed_rows, B),
            allowed=_TokenEdit(torch.tensor(allowed[0], **i64), torch.tensor(allowed[1], **i64))
            if allowed_rows
            else None,
            bans=_TokenEdit(torch.tensor(bans[0], **i64), torch.tensor(bans[1], **i64)) if bans[0] else None,
            any_masked=bool(allowed_rows or bans[0] or (grammar_bitmask is not None and grammar_rows)),
            repetition=repetition,
            freq_presence=freq_presence,
            num_greedy=B - S,
            greedy_idx=rows_or_none(greedy_idx, B) if greedy_idx else None,
            sample_idx=rows_or_none(sample_idx, B),
            temperature=torch.tensor(temps, **f32).unsqueeze(1) if any(t != 1.0 for t in temps) else None,
            min_p=torch.tensor(min_ps, **f32).unsqueeze(1) if any(min_ps) else None,
            top_k=torch.tensor(top_ks, **i64) if any(top_ks) else None,
            top_p=torch.tensor(top_ps, **f64).unsqueeze(1) if any(p < 1.0 for p in top_ps) else None,
            uniforms=torch.tensor(uniforms, **f64) if S else None,
            row_min_p=min_ps,
            row_top_k=top_ks,
            row_top_p=top_ps,
            num_top_logprobs=max((r.params.logprobs or 0 for r in rows), default=0),
            logprob_rows=rows_or_none(rank_rows, B),
            any_logprobs=bool(rank_rows),
            grammar_rows=rows_or_none(list(grammar_rows), B) if grammar else None,
            grammar_bitmask=grammar_bitmask.to(device) if grammar else None,
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

    @staticmethod
    def cat(parts: Sequence["SamplerOutput"]) -> "SamplerOutput":
        """The rows of ``parts`` one after the other (top columns padded to the widest K with
        -1 / -inf, as for rows that asked for fewer).

        Raises:
            ValueError: ``parts`` is empty.
        """
        if not parts:
            raise ValueError("parts must hold at least one SamplerOutput")
        k = max(p.top_token_ids.shape[1] if p.top_token_ids is not None else 0 for p in parts)
        ids, lps = [], []
        for p in parts:
            b = p.sampled_token_ids.shape[0]
            have = p.top_token_ids.shape[1] if p.top_token_ids is not None else 0
            dev = p.sampled_token_ids.device
            pad_ids = torch.full((b, k - have), -1, dtype=torch.long, device=dev)
            pad_lps = torch.full((b, k - have), float("-inf"), dtype=torch.float32, device=dev)
            ids.append(pad_ids if have == 0 else torch.cat([p.top_token_ids, pad_ids], 1))
            lps.append(pad_lps if have == 0 else torch.cat([p.top_logprobs, pad_lps], 1))
        return SamplerOutput(
            sampled_token_ids=torch.cat([p.sampled_token_ids for p in parts]),
            logprobs=torch.cat([p.logprobs for p in parts]),
            ranks=torch.cat([p.ranks for p in parts]),
            top_token_ids=torch.cat(ids) if k else None,
            top_logprobs=torch.cat(lps) if k else None,
        )


# ------------------------------------------------------------------------ sampler
@functools.lru_cache(maxsize=64)
def _zero_ranks(batch_size: int) -> torch.Tensor:
    """``[batch_size]`` int64 zeros: the ranks of :meth:`Sampler.greedy`'s rows (none asked for
    logprobs). Shared between calls (read-only: the engine only reads ranks) so that the fast
    path allocates nothing more after a decode step has left the caches cold."""
    return torch.zeros(batch_size, dtype=torch.int64)


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row with these parameters, ``num_output_tokens`` into its output, gets the
    bare argmax from :class:`Sampler`: greedy, no logprobs asked, and none of steps 1-3 (logit
    bias, allowed ids, bad words, ``min_tokens`` not reached yet, penalties; a grammar is the
    caller's to check). A batch of such rows can skip :class:`SamplingRow` and
    :meth:`SamplingMetadata.build` (:meth:`Sampler.greedy`)."""
    p = params
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words
            and num_output_tokens >= p.min_tokens and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0)


def _fused_greedy(logits: torch.Tensor) -> Optional[SamplerOutput]:
    """:meth:`Sampler.greedy` (the model runner's call for plain-greedy batches), and the fast path
    of :meth:`Sampler.__call__` for greedy batches with nothing to edit."""
    if logits.dim() != 2 or logits.shape[0] == 0 or not cpu_ops.supports(logits) or logits.stride(-1) != 1:
        return None
    fast = cpu_ops.greedy_sample(logits.detach())
    if fast is None:
        return None
    tokens, logprobs = fast
    return SamplerOutput(tokens, logprobs, _zero_ranks(tokens.shape[0]), None, None)


class Sampler:
    """Stateless sampler; see the module docstring for the order of processing."""

    @staticmethod
    def greedy(logits: torch.Tensor) -> Optional[SamplerOutput]:
        """What :meth:`__call__` returns for a batch of :func:`plain_greedy` rows, from the fused
        kernel (one pass over the logits in their dtype: the first argmax, and its raw logprob
        ``-log_z``); None where that kernel does not apply (not a CPU float32/bfloat16 tensor with
        unit last stride, or a row whose maximum is not finite): call :meth:`__call__` then.

        Args:
            logits: ``[B, V]``, ``B > 0``.
        """
        return _fused_greedy(logits)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [B, V] next-token logits on any device; upcast to float32 if needed.
                Unchanged when the call returns (bias and penalties may be applied to it
                in place during the call and are undone: don't read it concurrently).
            meta: built for these B rows and this V.

        Returns:
            A :class:`SamplerOutput` on ``logits.device``.
        """
        if logits.dim() != 2 or logits.shape != (meta.batch_size, meta.vocab_size):
            raise ValueError(
                f"logits must have shape [{meta.batch_size}, {meta.vocab_size}], got {tuple(logits.shape)}"
            )
        if meta.num_greedy == meta.batch_size > 0 and not meta.any_logprobs and not meta.edits_logits:
            # greedy, nothing to edit, no logprobs asked: one fused pass over the (bf16) logits
            # gives what the general path does (the token's logprob is 0 - log_z)
            fast = _fused_greedy(logits)
            if fast is not None:
                return fast
        raw = logits.detach() if logits.dtype == torch.float32 else logits.detach().float()
        if meta.batch_size == 0:
            empty = torch.empty(0, dtype=torch.int64, device=raw.device)
            return SamplerOutput(empty, raw.new_empty(0), empty.clone(), None, None)
        edits = meta.logit_bias or meta.repetition or meta.freq_presence
        writable = not logits.requires_grad and (torch.is_inference_mode_enabled() or not raw.is_inference())
        if edits and not meta.any_masked and raw.is_contiguous() and writable:
            # only additive / multiplicative edits: apply them in place, undo them after
            flat, saved = _edit_in_place(raw, meta)
            try:
                tokens, mx = _choose(raw, meta)
                raw_max = _raw_max(raw, mx, flat, saved)
            finally:
                raw.view(-1).index_copy_(0, flat, saved)
        else:
            x = process_logits(raw, meta)
            tokens, mx = _choose(x, meta)
            raw_max = mx if x is raw else None
        lp, ranks, top_ids, top_lp = _logprobs(
            raw, tokens, meta.num_top_logprobs, meta.logprob_rows, meta.any_logprobs, row_max=raw_max
        )
        return SamplerOutput(tokens, lp, ranks, top_ids, top_lp)


def process_logits(raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 1-3 (bias, allowed ids, bad words, min_tokens, penalties) on float32 logits.

    Returns ``raw`` itself when no row needs any of them, else a processed copy; rows
    left with no finite logit are processed again without the bans (allowed_token_ids is a
    hard constraint; bad_words and min_tokens yield to it).
    """
    if not meta.edits_logits:
        return raw
    x = _edited(raw, meta, bans=True)
    if meta.any_masked:  # steps 1-2 may have masked a whole row
        dead = torch.isneginf(x.amax(dim=-1))
        if bool(dead.any()):  # (e.g. a multi-token bad word that admission cannot foresee)
            x[dead] = _edited(raw, meta, bans=False)[dead]
            if meta.grammar_bitmask is not None and meta.allowed is not None:
                dead = torch.isneginf(x.amax(dim=-1))
                if bool(dead.any()):  # allowed_token_ids outside the grammar: the grammar wins
                    x[dead] = _edited(raw, meta, bans=False, allowed=False)[dead]
    return x


def _edited(raw: torch.Tensor, meta: SamplingMetadata, bans: bool, allowed: bool = True) -> torch.Tensor:
    """A copy of ``raw`` with steps 1-3: the grammar's mask, bias, (``allowed``: allowed ids),
    (``bans``: bad words and min_tokens), penalties."""
    x = raw.clone(memory_format=torch.contiguous_format)  # the edits' flat indices need it
    if meta.grammar_bitmask is not None:
        if x.dtype == torch.float32 and cpu_ops.supports(x):  # one branch-free pass over the masked rows
            cpu_ops.apply_token_bitmask_(x, meta.grammar_bitmask, meta.grammar_rows)
        else:
            x = _on_rows(x, meta.grammar_rows, lambda sub: _apply_bitmask(sub, meta.grammar_bitmask))
    if meta.logit_bias is not None:
        x.view(-1).index_add_(0, meta.logit_bias.flat, meta.logit_bias.values)
    if allowed and meta.allowed is not None:
        x = _on_rows(x, meta.allowed_rows, lambda sub: _keep_only(sub, meta.allowed))
    if bans and meta.bans is not None:
        x.index_put_((meta.bans.rows, meta.bans.toks), torch.tensor(_NEG_INF, device=x.device))
    _penalize(x, meta)
    return x


def _penalize(x: torch.Tensor, meta: SamplingMetadata, rep_values: Optional[torch.Tensor] = None) -> None:
    """Step 3 in place on a contiguous x: repetition, then frequency and presence
    penalties. ``rep_values``: x at the repetition edits, when the caller has it."""
    xf = x.view(-1)
    if meta.repetition is not None:
        e = meta.repetition
        v = xf.index_select(0, e.flat) if rep_values is None else rep_values
        # (a tiny penalty overflows a positive logit: cap it at the dtype's largest value,
        # which keeps the token certain instead of giving +inf and then NaN)
        pen = torch.where(v < 0, v * e.values, v / e.values).clamp_(max=torch.finfo(x.dtype).max)
        xf.index_copy_(0, e.flat, pen)
    if meta.freq_presence is not None:
        xf.index_add_(0, meta.freq_presence.flat, meta.freq_presence.values)


def _edit_in_place(x: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1 and 3 in place on a contiguous x when there are no masks (the result is
    bitwise that of :func:`process_logits`: the same operations on the same values).
    Returns (flat indices, original values) of every entry touched, to undo the edits
    with ``x.view(-1).index_copy_(0, flat, values)``; an entry may be listed twice (with
    the same value). Saves copying the [B, V] logits every step when penalties are on."""
    edits = [e for e in (meta.logit_bias, meta.repetition, meta.freq_presence) if e is not None]
    flat = edits[0].flat if len(edits) == 1 else torch.cat([e.flat for e in edits])
    xf = x.view(-1)
    saved = xf.index_select(0, flat)
    if meta.logit_bias is not None:
        xf.index_add_(0, meta.logit_bias.flat, meta.logit_bias.values)
    _penalize(x, meta, saved if edits[0] is meta.repetition and len(edits) == 1 else None)
    return flat, saved


def _raw_max(x: torch.Tensor, mx: torch.Tensor, flat: torch.Tensor, saved: torch.Tensor) -> Optional[torch.Tensor]:
    """Row maxima of the unedited logits, from those of the edited x (``mx``) and the
    original values ``saved`` at the edited entries ``flat`` (:func:`_edit_in_place`),
    when no edit raised a value (e.g. repetition penalties > 1): then the unedited
    maximum is max(mx, the largest original value of the row's edited entries). None
    otherwise (the caller takes ``amax`` of the unedited logits)."""
    if bool((x.view(-1).index_select(0, flat) > saved).any()):
        return None
    rows = torch.div(flat, x.shape[1], rounding_mode="floor")
    return mx.scatter_reduce(0, rows, saved, reduce="amax")


def _apply_bitmask(sub: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every entry of ``sub`` [G, V] whose bit in ``bitmask`` [G, W] int32
    is clear (bit j of word w stands for column 32·w + j; columns past 32·W are cleared)."""
    return sub.masked_fill_(unpack_bitmask(bitmask, sub.shape[1]).logical_not_(), _NEG_INF)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[G, W]`` int32 token bitmasks → ``[G, vocab_size]`` bool (True: allowed).

    Tokens at or past ``32·W`` (beyond the grammar's vocabulary) are not allowed.
    """
    G, W = bitmask.shape
    shifts = _BIT_SHIFTS if bitmask.device.type == "cpu" else _BIT_SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts).bitwise_and_(1).view(G, W * 32)
    if W * 32 >= vocab_size:
        return bits[:, :vocab_size].bool()
    out = torch.zeros(G, vocab_size, dtype=torch.bool, device=bitmask.device)
    out[:, : W * 32] = bits.bool()
    return out


def _keep_only(sub: torch.Tensor, allowed: _TokenEdit) -> torch.Tensor:
    out = torch.full_like(sub, _NEG_INF)
    out[allowed.rows, allowed.toks] = sub[allowed.rows, allowed.toks]
    return out


def _choose(x: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-9: greedy rows take the argmax, the others are drawn.

    Returns the tokens [B] and the row maxima of ``x`` [B]. A greedy-only batch takes
    one argmax pass. Otherwise one pass gives the block maxima, from which come the row
    maxima, the greedy rows' argmax and the candidate selection (blocks of
    ``_SEL_BLOCK`` when some row has top-k, so that the selection reads few entries).
    """
    B = x.shape[0]
    if meta.num_greedy == B:
        tokens = _argmax(x)
        return tokens, x.gather(1, tokens.unsqueeze(1)).squeeze(1)
    bs = _SEL_BLOCK if meta.top_k is not None else _ARGMAX_BLOCK
    bm = _block_max(x, bs)
    mx = bm.amax(dim=1)
    drawn = _draw(x, bm, meta)
    if meta.num_greedy == 0:
        return drawn, mx
    tokens = torch.empty(B, dtype=torch.int64, device=x.device)
    tokens[meta.greedy_idx] = _first_argmax(x, mx, bm, bs, meta.greedy_idx)
    tokens[meta.sample_idx] = drawn
    return tokens, mx


def _block_max(x: torch.Tensor, bs: int) -> torch.Tensor:
    """Maxima of the blocks of ``bs`` columns of x [R, V] → [R, ceil(V / bs)]; a
    partial last block (V not a multiple of bs) is the last column."""
    R, V = x.shape
    nb = V // bs
    parts = []
    if nb:
        parts.append(x.unfold(1, bs, bs).amax(dim=2))
    if V > nb * bs:
        parts.append(x[:, nb * bs :].amax(dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First column holding the row maximum of x [R, V]: numpy's argmax on CPU (as fast
    as ``amax``, several times faster than ``max(dim)``/``argmax``), else from the block
    maxima (:func:`_first_argmax`)."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.argmax(x.numpy(), axis=1))
    bm = _block_max(x, _ARGMAX_BLOCK)
    return _first_argmax(x, bm.amax(dim=1), bm, _ARGMAX_BLOCK, None)


def _first_argmax(
    x: torch.Tensor, mx: torch.Tensor, bm: torch.Tensor, bs: int, rows: Optional[torch.Tensor]
) -> torch.Tensor:
    """First column holding the row maximum, for ``rows`` of x (None: all), from the row
    maxima ``mx`` and the block maxima ``bm`` (:func:`_block_max` with block size
    ``bs``): the first block whose maximum is the row's, then the first entry of that
    block equal to it. Exact, and a few times cheaper on CPU than ``max(dim)`` or
    ``argmax`` over the full rows."""
    V = x.shape[1]
    if rows is not None:
        bm, mx = bm[rows], mx[rows]
    m = mx.unsqueeze(1)
    blk = (bm == m).to(torch.uint8).argmax(dim=1, keepdim=True)  # first max: first True
    cols = (blk * bs + torch.arange(bs, device=x.device)).clamp_(max=V - 1)
    r = torch.arange(x.shape[0], device=x.device) if rows is None else rows
    pos = (x[r.unsqueeze(1), cols] == m).to(torch.uint8).argmax(dim=1, keepdim=True)
    return cols.gather(1, pos).squeeze(1)


def _top_m(
    x: torch.Tensor,
    m: int,
    rows: Optional[torch.Tensor] = None,
    bm: Optional[torch.Tensor] = None,
    values_only: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The m largest entries of each row of ``x[rows]`` (None: all rows), best first:
    (values [R, m], column indices [R, m], or None with ``values_only``).

    The values are exactly those of ``topk`` (the multiset of the m largest); among
    entries tied in value, which columns come back is unspecified, as for ``topk``.
    When the vocabulary is large compared with m, only a few entries are searched,
    chosen with the maxima of blocks of ``_SEL_BLOCK`` columns (``bm``: those of all of
    ``x``, from :func:`_block_max`, when the caller has them): with L the m-th largest
    block maximum, m entries are ≥ L, so each of the m largest entries is ≥ L, and lies
    in one of the m blocks whose maxima are the largest (another block's entries are
    ≤ its maximum ≤ L) or in the partial last block. Only those blocks are searched.
    """
    V = x.shape[1]
    bs = _SEL_BLOCK
    nb = V // bs
    if m * bs * 4 > V:  # few blocks per candidate: select from the whole rows
        return _select(x if rows is None else x[rows], m, values_only)
    if bm is None:
        if rows is not None:
            x, rows = x[rows], None
        bm = _block_max(x, bs)
    elif rows is not None:
        bm = bm[rows]
    R = bm.shape[0]
    r = torch.arange(R, device=x.device) if rows is None else rows
    sel = _largest(bm[:, :nb], m)  # the m blocks with the largest maxima
    if V == nb * bs and x.is_contiguous():  # one contiguous copy per block
        cand = x.view(-1, bs).index_select(0, (sel + (r * nb).unsqueeze(1)).reshape(-1)).view(R, m * bs)
        vals, pos = _select(cand, m, values_only)
        return vals, None if values_only else sel.gather(1, pos // bs) * bs + pos % bs
    cols = (sel.unsqueeze(2) * bs + torch.arange(bs, device=x.device)).reshape(R, m * bs)
    if V > nb * bs:  # the partial last block is always searched
        tail = torch.arange(nb * bs, V, device=x.device).expand(R, V - nb * bs)
        cols = torch.cat([cols, tail], dim=1)
    vals, pos = _select(x[r.unsqueeze(1), cols], m, values_only)
    return vals, None if values_only else cols.gather(1, pos)


def _largest(t: torch.Tensor, m: int) -> torch.Tensor:
    """Positions of the m largest entries of each row of t [R, n] (m ≤ n), in no order.
    On CPU numpy's introselect (``argpartition``), several times faster than topk."""
    n = t.shape[1]
    if t.device.type != "cpu" or m == n:
        return t.topk(m, dim=1, sorted=False).indices
    return torch.from_numpy(np.argpartition(t.numpy(), n - m, axis=1)[:, n - m :])


def _select(t: torch.Tensor, m: int, values_only: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The m largest entries of each row of t [R, n], best first: (values, positions, or
    None with ``values_only``); on CPU through numpy's partition (see :func:`_largest`)."""
    n = t.shape[1]
    if t.device.type != "cpu" or m == n:
        vals, pos = t.topk(m, dim=1)
        return vals, None if values_only else pos
    if values_only:
        part = torch.from_numpy(np.partition(t.numpy(), n - m, axis=1)[:, n - m :])
        return part.sort(dim=1, descending=True).values, None
    pos = _largest(t, m)
    vals, order = t.gather(1, pos).sort(dim=1, descending=True)
    return vals, pos.gather(1, order)


def _sorted_desc(t: torch.Tensor) -> torch.Tensor:
    """The rows of t sorted in descending order (values only); numpy's sort on CPU."""
    if t.device.type != "cpu":
        return t.sort(dim=1, descending=True).values
    return torch.from_numpy(np.sort(t.numpy(), axis=1)).flip(1)


def _draw(x: torch.Tensor, bm: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 5-9 for the S sampled rows of x (processed logits [B, V]) → tokens [S].

    Rows with top-k take the candidate path (:func:`_draw_candidates`), retried with 4×
    as many candidates for the rows whose top-k survivors (ties with the k-th value)
    did not all fit; the other rows take the full-vocabulary path (:func:`_draw_full`).
    """
    S = len(meta.row_top_k)
    cand = [j for j in range(S) if meta.row_top_k[j] > 0]
    full = [j for j in range(S) if meta.row_top_k[j] == 0]
    if not full:
        tok, ok, m = _draw_candidates(x, bm, meta, cand, 0)
        if bool(ok.all()):
            return tok
    out = torch.empty(S, dtype=torch.int64, device=x.device)
    if full:
        out[torch.tensor(full, device=x.device)] = _draw_full(x, bm, meta, full)
        m = 0
    else:  # the first round is done: keep its results
        ok_list = ok.tolist()
        out[torch.tensor(cand, device=x.device)] = tok
        cand = [c for c, good in zip(cand, ok_list) if not good]
    while cand:  # always ends: with all V columns as candidates every row is ok
        tok, ok, m = _draw_candidates(x, bm, meta, cand, 4 * m)
        out[torch.tensor(cand, device=x.device)] = tok
        cand = [c for c, good in zip(cand, ok.tolist()) if not good]
    return out


def _batch_rows(meta: SamplingMetadata, sub: list[int], device) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(index of ``sub`` in the sampled sub-batch or None when it is all of it, batch rows)."""
    S = len(meta.row_top_k)
    j = None if len(sub) == S else torch.tensor(sub, dtype=torch.int64, device=device)
    if meta.sample_idx is None:
        return j, (torch.arange(S, device=device) if j is None else j)
    return j, (meta.sample_idx if j is None else meta.sample_idx[j])


def _draw_candidates(
    x: torch.Tensor, bm: torch.Tensor, meta: SamplingMetadata, cand: list[int], min_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Steps 5-9 on the largest entries only, for sampled rows ``cand`` that have top-k.

    The m largest logits of each row are taken (:func:`_top_m`; m ≥ k + 1 and ≥
    ``min_m``). Their probabilities come from the same float32 operations as on the
    full row (``(x - max) / T``, exp: bitwise the same values). Every entry outside them
    has a logit ≤ the m-th largest, hence a probability ≤ that of the m-th candidate; so
    when the m-th candidate is below the min-p/top-k threshold (the k-th largest
    probability, ties included, or ``min_p``), nothing outside survives step 7, and the
    cuts, top-p and the draw see exactly what they would see on the full row. The cuts
    are the same value thresholds; the nucleus mass is a float64 sum; the draw is the
    same inverse CDF in vocabulary order (the candidates sorted by token id, one float64
    cumulative sum over them). Candidates beyond a row's survivors have probability 0,
    so m (the batch's largest k, rounded up) never changes a row's result.

    Returns (tokens [C], ok [C] bool, m). A row is not ok when the m-th candidate is
    still kept (ties with the k-th value reach it): draw it again with more candidates.
    With m = V every row is ok.
    """
    j, brows = _batch_rows(meta, cand, x.device)
    V = x.shape[1]
    ks = [meta.row_top_k[c] for c in cand]
    # a multiple of _CAND_ALIGN, so the float32 kernels below never run a scalar tail
    # loop (whose exp may round differently): every row is computed the same way
    m = min(max(-(-(max(ks) + 1) // _CAND_ALIGN) * _CAND_ALIGN, min_m), V)
    vals, idx = _top_m(x, m, brows, bm)
    probs = vals - vals[:, :1]  # x - max, as on the full row
    if meta.temperature is not None:
        probs.div_(meta.temperature if j is None else meta.temperature[j])
    probs.exp_()
    k = torch.tensor(ks, dtype=torch.int64, device=x.device).unsqueeze(1)
    thr = probs.gather(1, k - 1)  # the k-th largest probability
    if meta.min_p is not None:
        thr = torch.maximum(thr, meta.min_p if j is None else meta.min_p[j])
    ok = (probs[:, -1:] < thr).squeeze(1) if m < V else torch.ones(len(cand), dtype=torch.bool, device=x.device)
    _zero_below(probs, thr)  # min-p and top-k (a prefix of the candidates survives)
    if meta.top_p is not None:  # the survivors are still sorted, best first
        p = meta.top_p if j is None else meta.top_p[j]
        mass = probs.to(torch.float64)
        cum = mass.cumsum(dim=1)
        kept = ((cum - mass) < p * cum[:, -1:]).sum(dim=1, keepdim=True)  # ≥ 1
        t = probs.gather(1, kept - 1).masked_fill_(p >= 1.0, 0.0)
        _zero_below(probs, t)
    # inverse CDF in vocabulary order over the candidates
    toks, order = idx.sort(dim=1)
    cdf = probs.gather(1, order).to(torch.float64).cumsum(dim=1)
    total = cdf[:, -1:]
    u = meta.uniforms if j is None else meta.uniforms[j]
    target = _below_total(u.unsqueeze(1) * total, total)
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=m - 1)
    return toks.gather(1, pos).squeeze(1), ok, m


def _draw_full(x: torch.Tensor, bm: torch.Tensor, meta: SamplingMetadata, sub: list[int]) -> torch.Tensor:
    """Steps 5-9 over the whole vocabulary for sampled rows ``sub`` → tokens [len(sub)]
    (:func:`_probs_full`, then the inverse-CDF draw)."""
    probs, j = _probs_full(x, bm, meta, sub)
    return _inverse_cdf(probs, meta.uniforms if j is None else meta.uniforms[j])


def sampling_probs(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each sampled row draws from: steps 5-8 (temperature, min-p, top-k,
    top-p) on processed logits (:func:`process_logits`).

    Args:
        x: [B, V] float32 processed logits of the whole batch.
        meta: built for these B rows; its sampled rows (``meta.sample_idx``) are used.

    Returns:
        [S, V] float32 unnormalized probabilities (each row's maximum is 1, the tokens
        the truncations removed are 0), rows in the order of the sampled sub-batch. The
        speculative rejection sampler needs them whole; the sampler itself only draws.
    """
    S = len(meta.row_top_k)
    if S == 0:
        return x.new_empty(0, x.shape[1])
    return _probs_full(x, _block_max(x, _ARGMAX_BLOCK), meta, list(range(S)))[0]


def _probs_full(x: torch.Tensor, bm: torch.Tensor, meta: SamplingMetadata, sub: list[int]
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Steps 5-8 over the whole vocabulary for sampled rows ``sub`` → (unnormalized probs
    [len(sub), V], index of ``sub`` in the sampled sub-batch or None when it is all of it).

    The rows are copied with their maximum subtracted, so the top token is exactly 0;
    after temperature they are exponentiated in place into unnormalized probabilities
    with maximum exactly 1; min-p, top-k and top-p then zero entries (value thresholds
    on probabilities are the same as on logits, exp being monotone). Min-p and top-k
    are both "keep p ≥ threshold" with thresholds that do not depend on each other
    (min-p's is ``min_p · 1``; the k-th largest of the min-p survivors is the k-th
    largest overall, or 0 if fewer survive), so they are applied as one cut at the
    larger of the two thresholds. (The sampler sends rows with top-k to the candidate
    path; this one handles them too, and serves as its reference in the tests.)
    """
    j, brows = _batch_rows(meta, sub, x.device)
    R = len(sub)
    mx = bm.amax(dim=1) if R == x.shape[0] else bm[brows].amax(dim=1)
    xs = x - mx.unsqueeze(1) if R == x.shape[0] else x[brows].sub_(mx.unsqueeze(1))
    if meta.temperature is not None:
        xs.div_(meta.temperature if j is None else meta.temperature[j])
    if meta.grammar_bitmask is None:
        probs = xs.exp_()
    else:  # most of a masked row is -inf, and torch's exp takes ~15x longer on inputs below -87
        keep = torch.gt(xs, _NEG_INF, out=torch.empty_like(xs))  # (exp(-87) ~ 1.6e-38 changes no draw)
        probs = xs.clamp_(min=_EXP_FLOOR).exp_().mul_(keep)
    min_p = [meta.row_min_p[c] for c in sub]
    top_k = [meta.row_top_k[c] for c in sub]
    top_p = [meta.row_top_p[c] for c in sub]
    cut = [i for i in range(R) if min_p[i] > 0.0 or top_k[i] > 0]
    if cut:
        probs = _on_rows(probs, _index_or_none(cut, R, x.device),
                         lambda rows: _min_p_top_k(rows, [min_p[i] for i in cut], [top_k[i] for i in cut]))
    nucleus = [i for i in range(R) if top_p[i] < 1.0]
    if nucleus:
        p = torch.tensor([top_p[i] for i in nucleus], dtype=torch.float64, device=x.device).unsqueeze(1)
        probs = _on_rows(probs, _index_or_none(nucleus, R, x.device), lambda rows: _top_p(rows, p))
    return probs, j


def _index_or_none(idx: list[int], n: int, device) -> Optional[torch.Tensor]:
    return None if len(idx) == n else torch.tensor(idx, dtype=torch.int64, device=device)


def _min_p_top_k(probs: torch.Tensor, min_p: list[float], top_k: list[int]) -> torch.Tensor:
    """Zero entries below max(min_p, k-th largest) (ties with the k-th kept). probs [U, V];
    top_k 0 means off."""
    thr = torch.tensor(min_p, dtype=torch.float32, device=probs.device).unsqueeze(1)
    rows = [i for i, k in enumerate(top_k) if k > 0]
    if rows:
        k = torch.tensor([top_k[i] for i in rows], dtype=torch.int64, device=probs.device).unsqueeze(1)
        r = _index_or_none(rows, len(top_k), probs.device)
        kth = _top_m(probs, int(k.max()), r, values_only=True)[0].gather(1, k - 1)
        if r is None:
            thr = torch.maximum(thr, kth)
        else:
            thr[r] = torch.maximum(thr[r], kth)
    return _zero_below(probs, thr)


def _zero_below(probs: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """probs[i, j] = 0 where probs[i, j] < thr[i] (in place). A float 0/1 mask and a
    multiply: on CPU several times faster than ``masked_fill_`` with a bool mask."""
    keep = torch.ge(probs, thr, out=torch.empty_like(probs))
    return probs.mul_(keep)


def _top_p(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter on unnormalized probs [R, V]; p [R, 1] float64.

    A token is kept when the mass of the entries before it in descending order is
    < p · total; the threshold is the smallest kept value, found among the 64 largest
    entries (:func:`_top_m`). Rows whose nucleus is wider are retried with 1024
    candidates, then with a full sort (one host sync per round, rows retried only).
    """
    R, V = probs.shape
    limit = p * probs.sum(dim=-1, keepdim=True).to(torch.float64)
    thr = torch.empty(R, 1, dtype=probs.dtype, device=probs.device)
    pending: Optional[torch.Tensor] = None  # rows still undecided; None: all
    for width in _top_p_widths(V):
        lim = limit if pending is None else limit[pending]
        if width == V:
            vals = _sorted_desc(probs if pending is None else probs[pending])
        else:
            vals = _top_m(probs, width, pending, values_only=True)[0]  # sorted, best first
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
    row_max: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Token logprobs for all rows; ranks and top-``num_top`` only for ``rows``
    (None: all rows; nothing when ``any_rows`` is False). Other rows get rank 0,
    top ids -1 and top logprobs -inf.

    A logprob is ``(x - max) - log(sum(exp(x - max)))``, the formula of
    ``log_softmax``, evaluated only where needed: the full [B, V] log_softmax is never
    materialized. ``row_max``: the row maxima of ``raw`` when the caller has them.
    """
    tokens = tokens.to(device=raw.device, dtype=torch.int64)
    mx = (raw.amax(dim=1) if row_max is None else row_max).unsqueeze(1)
    log_z = _log_partition(raw, mx)
    tok = tokens.unsqueeze(1)
    tok_raw = raw.gather(1, tok)
    token_lp = ((tok_raw - mx) - log_z).squeeze(1)
    ranks = torch.zeros_like(tokens)
    top_ids = top_lp = None
    if not any_rows:
        return token_lp, ranks, top_ids, top_lp
    if rows is None:
        sub_raw, sub_tok_raw, sub_mx, sub_log_z = raw, tok_raw, mx, log_z
    else:
        sub_raw, sub_tok_raw, sub_mx, sub_log_z = raw[rows], tok_raw[rows], mx[rows], log_z[rows]
    larger = torch.gt(sub_raw, sub_tok_raw, out=torch.empty_like(sub_raw))
    sub_ranks = larger.sum(dim=-1).to(torch.int64) + 1  # exact: counts < 2^24
    if num_top > 0:
        vals, sub_top_ids = _top_m(sub_raw, min(num_top, raw.shape[1]))
        sub_top_lp = (vals - sub_mx) - sub_log_z
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


def _log_partition(raw: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(raw - mx))) per row → [B, 1] (mx [B, 1], the row maxima).

    On CPU with the fused kernels: one pass per row (:func:`cpu_ops.log_sum_exp`, ~1.8x the
    chunked torch ops at [64, 49152]). Otherwise over chunks of rows (about ``_CHUNK_BYTES``
    each) through one reused buffer: the subtract, exp and sum of a chunk then run in cache
    instead of streaming a [B, V] temporary through memory three times (~1.5x faster on CPU).
    """
    B, V = raw.shape
    if raw.dtype == torch.float32 and raw.stride(-1) == 1 and cpu_ops.supports(raw):
        return cpu_ops.log_sum_exp(raw, mx)
    step = max(1, _CHUNK_BYTES // (4 * V))
    if step >= B:
        return (raw - mx).exp_().sum(dim=1, keepdim=True).log_()
    out = torch.empty(B, 1, dtype=raw.dtype, device=raw.device)
    buf = torch.empty(step, V, dtype=raw.dtype, device=raw.device)
    for i in range(0, B, step):
        n = min(step, B - i)
        chunk = torch.sub(raw[i : i + n], mx[i : i + n], out=buf[:n])
        torch.sum(chunk.exp_(), dim=1, keepdim=True, out=out[i : i + n])
    return out.log_()


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


def _as_list(seq: TokenIds) -> list[int]:
    if isinstance(seq, torch.Tensor):
        return seq.reshape(-1).tolist()
    return seq if isinstance(seq, list) else list(seq)


def _history_pairs(
    row_ids: list[int], arrays: list[np.ndarray], hists: list[TokenHistory], V: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(rows, toks, lengths, keep) int64 CPU tensors for every token of every array
    (array i belongs to batch row ``row_ids[i]``); ``keep`` masks out tokens outside
    [0, V), None when there are none."""
    lengths = torch.tensor([len(a) for a in arrays], dtype=torch.int64)
    toks = torch.from_numpy(np.concatenate(arrays))
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.int64), lengths)
    keep = None if all(h.in_vocab(V) for h in hists) else (toks >= 0) & (toks < V)
    return rows, toks, lengths, keep
