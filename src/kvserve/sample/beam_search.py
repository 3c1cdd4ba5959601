"""Beam search bookkeeping (the candidate selection of one step), independent of KV memory.

Semantics follow Hugging Face transformers' ``generate(num_beams=W, early_stopping=True)``
(the vectorized beam search of transformers ≥ 4.50), so kvserve returns the same best
sequence:

* each step, every live beam ``b`` with cumulative logprob ``s_b`` proposes its top ``2W``
  next tokens; the ``2W`` best ``(s_b + log p(tok | beam b))`` over all beams are kept, in
  descending order;
* a candidate that ends the sequence (an EOS token, or reaching ``max_tokens``) becomes a
  finished hypothesis only if it ranks among the first ``W`` candidates; its score is
  ``cum_logprob / output_len ** length_penalty`` where ``output_len`` counts generated tokens
  including the EOS (the prompt is not counted);
* the next live beams are the first ``W`` candidates that do not end;
* the search stops once ``W`` hypotheses are finished (``early_stopping=True``) or every
  candidate ends (``max_tokens`` reached); the best ``n`` hypotheses by score are returned.

Logprobs are the raw model distribution (``log_softmax`` of the logits), as transformers
uses when no logits processor is active.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


def length_normalized_score(cum_logprob: float, output_len: int, length_penalty: float) -> float:
    """``cum_logprob / output_len ** length_penalty``, also where the power leaves the float
    range (|length_penalty| in the thousands): a power beyond the largest float scores
    ``-0.0`` (``cum_logprob`` is ≤ 0), one that underflows to 0 scores ``-inf`` (0.0 for a
    zero ``cum_logprob``)."""
    try:
        return cum_logprob / output_len**length_penalty
    except OverflowError:
        return -0.0 if cum_logprob < 0 else 0.0
    except ZeroDivisionError:
        return -math.inf if cum_logprob < 0 else 0.0


@dataclass(frozen=True)
class BeamCandidate:
    """A continuation: beam ``parent`` extended by ``token``, with its new cumulative logprob."""

    parent: int
    token: int
    cum_logprob: float


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished sequence. ``finished_by_eos`` is False when it ended at ``max_tokens``."""

    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float
    finished_by_eos: bool


@dataclass
class BeamSearchState:
    """Beam search over one prompt.

    Args:
        beam_width: W, the number of live beams (≥ 1).
        max_tokens: most generated tokens.
        length_penalty: exponent of the output length in the score.
        eos_token_ids: tokens that finish a hypothesis (empty when ``ignore_eos``).
    """

    beam_width: int
    max_tokens: int
    length_penalty: float
    eos_token_ids: tuple[int, ...]
    finished: list[BeamHypothesis] = field(default_factory=list)
    done: bool = False

    def step(
        self,
        beam_outputs: Sequence[Sequence[int]],
        beam_cum_logprobs: Sequence[float],
        top_token_ids: Sequence[Sequence[int]],
        top_logprobs: Sequence[Sequence[float]],
    ) -> list[BeamCandidate]:
        """Advance every live beam by one token.

        Args:
            beam_outputs: generated tokens of each live beam (all the same length).
            beam_cum_logprobs: cumulative logprob of each live beam.
            top_token_ids, top_logprobs: per live beam, its ``≥ 2W`` most likely next tokens
                and their logprobs, in descending order.

        Returns:
            The next live beams (up to W), best first; empty once :attr:`done`.
        """
        w = self.beam_width
        cands = [
            BeamCandidate(b, int(t), cum + float(lp))
            for b, cum in enumerate(beam_cum_logprobs)
            for t, lp in zip(top_token_ids[b][: 2 * w], top_logprobs[b][: 2 * w])
        ]
        cands.sort(key=lambda c: c.cum_logprob, reverse=True)
        cands = cands[: 2 * w]
        new_len = len(beam_outputs[0]) + 1
        at_max = new_len >= self.max_tokens
        live: list[BeamCandidate] = []
        for rank, c in enumerate(cands):
            is_eos = c.token in self.eos_token_ids
            if is_eos or at_max:
                if rank < w:
                    self.finished.append(
                        BeamHypothesis(
                            token_ids=tuple(beam_outputs[c.parent]) + (c.token,),
                            cum_logprob=c.cum_logprob,
                            score=length_normalized_score(c.cum_logprob, new_len, self.length_penalty),
                            finished_by_eos=is_eos,
                        )
                    )
            elif len(live) < w:
                live.append(c)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[w:]
        if len(self.finished) >= w or not live:
            self.done = True
            return []
        return live

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` finished hypotheses with the highest score."""
        return self.finished[:n]
