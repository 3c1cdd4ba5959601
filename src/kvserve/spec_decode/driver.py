"""The engine core's side of speculative decoding: drafts after a step, verifications applied.

The engine core calls :meth:`SpecDecodeDriver.propose` at the end of a step for the requests
that decode next, and :meth:`SpecDecodeDriver.rollback` for each verification before it
appends the verified tokens. Drafts are scheduled like any other tokens (the scheduler's one
token budget) and verified as ``k + 1`` decode rows by the model runner's rejection sampler
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").
"""

from __future__ import annotations

import logging
from typing import Callable, ContextManager, Optional

import numpy as np
import torch

from kvserve.core.request import Request
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.spec_decode.ngram_proposer import NgramProposer
from kvserve.worker.model_runner import SpecResult

logger = logging.getLogger(__name__)


class SpecDecodeDriver:
    """Proposes drafts, cuts them to a constrained request's grammar, counts the outcome.

    Args:
        proposer: an :class:`NgramProposer` or a :class:`DraftModelProposer`.

    Attributes:
        num_drafts: verifications with at least one draft.
        num_draft_tokens: drafts verified.
        num_accepted_tokens: drafts accepted.
        num_grammar_cut_tokens: drafts dropped before verification, after one that the
            request's grammar rejects.
    """

    def __init__(self, proposer: NgramProposer | DraftModelProposer) -> None:
        self.proposer = proposer
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_grammar_cut_tokens = 0

    @classmethod
    def from_config(cls, config: Optional[SpeculativeConfig], model_config, tokenizer, dtype, device,
                    num_blocks: int, block_size: int, max_model_len: int,
                    draft_kv_dtype: Optional[torch.dtype] = None) -> Optional["SpecDecodeDriver"]:
        """The driver of ``speculative_config`` (None without one); a draft model gets a KV
        pool of ``num_blocks`` blocks like the target's, in ``draft_kv_dtype`` (default: ``dtype``;
        :class:`DraftModelProposer`).

        Raises:
            ValueError: naming ``speculative_config.model`` when the draft model cannot be
                loaded or does not fit the target (see :class:`DraftModelProposer`).
        """
        if config is None:
            return None
        if config.method == "ngram":
            return cls(NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                     config.prompt_lookup_max))
        return cls(DraftModelProposer(config.model, config.num_speculative_tokens, model_config, tokenizer, dtype,
                                      device, num_blocks, block_size, max_model_len, draft_kv_dtype))

    def rollback(self, req: Request, res: SpecResult) -> None:
        """Roll back the K/V of a verification's rejected drafts and count it:
        ``num_computed_tokens`` then counts the last token and the accepted drafts only, so the
        rejected drafts' slots are rewritten later and never reach the prefix cache. The
        caller appends ``res.token_ids`` (accepted drafts, then the correction or bonus)."""
        req.num_computed_tokens -= res.num_drafts - res.num_accepted
        req.clear_spec()
        self.num_drafts += 1
        self.num_draft_tokens += res.num_drafts
        self.num_accepted_tokens += res.num_accepted

    def propose(self, reqs: list[Request], rooms: list[int], running_ids: set[str],
                isolated: Callable[[Request], ContextManager]) -> None:
        """Set ``spec_token_ids`` (and a draft model's ``spec_draft_probs``) of ``reqs``, at most
        ``rooms[i]`` drafts each.

        Structured output: the proposers do not know the grammar, so a constrained request's
        drafts are cut at the first one its grammar rejects (:meth:`fit_to_grammar`); the
        verification then runs every position under the grammar's mask.

        Args:
            reqs: the requests that decode next (one token computed short of their end).
            rooms: how many drafts each may take.
            running_ids: the running requests' ids: a draft model frees the draft KV of the
                others (finished, aborted, preempted), so its pool, sized like the target's,
                never holds more than the running requests.
            isolated: a context manager for one request's own work (an exception inside fails
                that request alone).
        """
        if isinstance(self.proposer, NgramProposer):
            for req, room in zip(reqs, rooms):
                with isolated(req):
                    req.spec_token_ids = self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64), room)
                    if req.grammar is not None:
                        self.fit_to_grammar(req)
            return
        self.proposer.retain(running_ids)
        if not reqs:
            return
        try:
            drafts = self.proposer.propose(reqs, rooms)
        except Exception:  # noqa: BLE001 - drafts are an optimization: decode without them
            logger.exception("the draft model failed; these requests decode without drafts this step")
            for req in reqs:
                self.proposer.free(req.request_id)
            return
        for req, (ids, q) in zip(reqs, drafts):
            req.spec_token_ids, req.spec_draft_probs = ids, q
            if req.grammar is not None:
                with isolated(req):
                    self.fit_to_grammar(req)

    def fit_to_grammar(self, req: Request) -> None:
        """Cut a constrained request's drafts at the first one its grammar rejects.

        Drafts with a one-hot q (n-gram, or a greedy request's draft-model argmax) are cut
        right before it: rejecting such a draft would draw from ``max(p - onehot, 0) = p``
        (its masked p is 0), which is what the position draws from once the draft is gone.
        A draft drawn from the draft model's q is kept as the last draft: its p is 0, so it is
        rejected with certainty and the correction is drawn from ``normalize(max(p - q, 0))``;
        drawing from p there instead would skew the output toward the tokens q favours
        (Leviathan et al. 2023: the residual is what makes the output exactly p).
        """
        ids = req.spec_token_ids
        n = req.grammar.valid_prefix(ids)
        if n == len(ids):
            return
        q = req.spec_draft_probs
        keep = n + 1 if q is not None else n
        self.num_grammar_cut_tokens += len(ids) - keep
        req.spec_token_ids = list(ids[:keep])
        if q is not None:
            req.spec_draft_probs = q[:keep]
        if not req.spec_token_ids:
            req.clear_spec()

    def stats(self) -> dict:
        """Speculative-decoding counters (vLLM's names): verifications with drafts
        (``num_drafts``), drafts verified and accepted, the acceptance rate (accepted /
        proposed drafts) and the mean acceptance length (tokens emitted per verification:
        1 + accepted / verifications). ``spec_decode_num_grammar_cut_tokens`` (kvserve's own)
        counts the drafts of structured-output requests dropped before verification because
        their grammar rejects a draft before them (they are not in ``num_draft_tokens``)."""
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_grammar_cut_tokens": self.num_grammar_cut_tokens,
            "spec_decode_num_drafts": d,
            "spec_decode_num_draft_tokens": t,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / t if t else 0.0,
            "spec_decode_mean_acceptance_length": 1.0 + a / d if d else 0.0,
        }

    @staticmethod
    def empty_stats() -> dict:
        """:meth:`stats` of an engine without speculation: every counter 0."""
        return SpecDecodeDriver(None).stats()
