"""Output processing: sampled tokens → request state → :class:`RequestOutput`.

* :meth:`OutputProcessor.append_tokens`: the stop checks (EOS, stop token ids, ``max_tokens``,
  ``max_model_len``, a completed grammar) and incremental detokenization with stop strings, for
  one token or a verified speculative run, which stops exactly where one-token steps would;
* :meth:`OutputProcessor.make_output`: a request group (``n`` samples, ``best_of``, beams) as
  one :class:`RequestOutput`.

The engine core calls them for the requests of each step; they touch no KV block and no
scheduler queue (the core finishes a request whose status :meth:`append_tokens` returns).
"""

from __future__ import annotations

from typing import Optional

from kvserve.core.request import CompletionOutput, Request, RequestOutput, RequestStatus, TokenLogprob
from kvserve.sample.beam_search import BeamSearchState
from kvserve.sampling_params import SamplingParams


class RequestGroup:
    """The sequences of one user request (n / best_of samples, or the live beams)."""

    def __init__(self, request_id: str, params: SamplingParams, seqs: list[Request],
                 beam: Optional[BeamSearchState] = None) -> None:
        self.request_id = request_id
        self.params = params
        self.seqs = seqs
        self.pending_forks: list[Request] = seqs[1:]
        self.beam = beam
        self.beam_rows: dict[str, tuple[list[int], list[float]]] = {}

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


class OutputProcessor:
    """Stop checks, detokenization and output building for the engine core.

    Args:
        tokenizer: the model's tokenizer (decodes finished beams).
        max_model_len: the context window: a sequence that reaches it finishes with "length".
    """

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append_tokens(self, req: Request, toks: list[int], lps: list[TokenLogprob], now: float
                      ) -> Optional[RequestStatus]:
        """Append generated tokens (one, or a verified run of several), stopping exactly
        where appending them one at a time would: at the first EOS / stop token (once
        ``min_tokens`` is reached), at ``max_tokens`` / ``max_model_len``, or at the token
        whose text completes a stop string (the detokenizer's ``num_new_tokens_kept``); the
        tokens after it are dropped.

        Returns:
            The status that finishes the request (its ``finished_time`` set; the caller
            finishes it in the scheduler), or None while it goes on.
        """
        p = req.sampling_params
        n0, len0 = len(req.output_token_ids), req.num_tokens
        status, reason, end = None, None, len(toks)
        grammar_end = False
        for i, tok in enumerate(toks):
            n_out = n0 + i + 1
            if req.grammar is not None:  # structured output: the grammar follows every token kept
                # (a verified run's accepted drafts and its last token; the loop stops at the end of
                # the output, and tokens a stop string drops after this finish the request)
                req.grammar.accept_token(tok)
            if n_out >= p.min_tokens:
                if tok in req.eos_token_ids and not p.ignore_eos:
                    status = RequestStatus.FINISHED_STOPPED
                elif p.stop_token_ids and tok in p.stop_token_ids:
                    status, reason = RequestStatus.FINISHED_STOPPED, tok
            if status is None and req.grammar is not None and req.grammar.is_terminated():
                # the token completed the output (nothing but EOS could follow): it ends it, as a stop
                status, grammar_end = RequestStatus.FINISHED_STOPPED, True
            if status is None and (n_out >= p.max_tokens or len0 + i + 1 >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                end = i + 1
                break
        toks = toks[:end]
        # As in vLLM, an EOS or stop token that ends the sequence adds no text unless
        # include_stop_str_in_output (its id stays in token_ids); a token that completes a
        # grammar is text, unless it is EOS (under ignore_eos)
        hide = (status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output
                and (not grammar_end or toks[-1] in req.eos_token_ids))
        detok = req.detokenizer
        if hide:  # the tokens before it, then a flush (which may still complete a stop string)
            upd = detok.update(toks[:-1], n0 + len(toks) - 1) if len(toks) > 1 else None
            delta, kept = (upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)) if upd else ("", 0)
            if upd is None or upd.stop_str is None:
                upd = detok.update([], n0 + len(toks), finished=True)
                delta, kept = delta + upd.text_delta, len(toks)
        else:
            upd = detok.update(toks, n0 + len(toks), finished=status is not None)
            delta, kept = upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)
        if upd.stop_str is not None:
            if kept < len(toks):  # the stop string ends before the run does: drop the rest
                toks, status, reason = toks[:kept], RequestStatus.FINISHED_STOPPED, upd.stop_str
            elif status in (None, RequestStatus.FINISHED_LENGTH):
                # a stop string completed by the last allowed token still ends it as "stop" (vLLM)
                status, reason = RequestStatus.FINISHED_STOPPED, upd.stop_str
        req.output_token_ids.extend(toks)
        if reason is not None:
            req.stop_reason = reason
        for lp in lps[: len(toks)]:
            req.cumulative_logprob += lp.logprob
        if p.logprobs is not None:
            req.output_logprobs.extend(lps[: len(toks)])
        m = req.metrics
        m.num_generated_tokens = len(req.output_token_ids)
        if m.first_token_time is None:
            m.first_token_time = now
        req.output_text = req.detokenizer.output_text
        req.last_delta = delta
        # (a verification counts its accepted drafts computed: never more than the tokens kept)
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        if status is not None:
            m.finished_time = now
        return status

    def make_output(self, group: RequestGroup) -> RequestOutput:
        """The group's :class:`RequestOutput`: the beams (best ``n``, decoded whole), the ``n``
        samples, or under ``best_of`` the ``n`` with the highest cumulative logprob once the
        group finished; each sample's ``delta_text`` is reported once."""
        seqs, params = group.seqs, group.params
        lead = seqs[0]
        if group.beam is not None:
            outs = [
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(list(h.token_ids), skip_special_tokens=params.skip_special_tokens),
                    token_ids=list(h.token_ids),
                    finish_reason="stop" if h.finished_by_eos else "length",
                    cumulative_logprob=h.cum_logprob,
                )
                for i, h in enumerate(group.beam.best(params.n))
            ]
            return RequestOutput(group.request_id, lead.prompt, lead.prompt_token_ids, outs,
                                 group.finished, lead.metrics, num_cached_tokens=lead.num_cached_tokens)
        if params.num_samples == params.n:
            chosen = seqs
        elif group.finished:  # best_of: the n samples with the highest cumulative logprob
            chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            chosen = []  # best_of results are only known at the end
        outs = [
            CompletionOutput(
                index=idx,
                text=s.output_text,
                token_ids=list(s.output_token_ids),
                finish_reason=s.status.value if s.is_finished else None,
                stop_reason=s.stop_reason,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                delta_text=s.last_delta,
            )
            for idx, s in enumerate(chosen)
        ]
        for s in chosen:  # a delta is reported once: a sequence that did not move adds nothing
            s.last_delta = ""
        return RequestOutput(
            request_id=group.request_id,
            prompt=lead.prompt,
            prompt_token_ids=lead.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=lead.metrics,
            # (a one-token prompt has no scored position: just the leading None)
            prompt_logprobs=(list(lead.prompt_logprobs) or [None]) if params.prompt_logprobs is not None else None,
            num_cached_tokens=lead.num_cached_tokens,
        )

    @staticmethod
    def error_output(group: RequestGroup, msg: str, error_param: Optional[str] = None) -> RequestOutput:
        """The final output of a group that failed: every sample ``finish_reason="error"``, the
        text and tokens it had, ``msg`` in ``RequestOutput.error``."""
        lead = group.seqs[0]
        outs = [CompletionOutput(index=i, text=s.output_text, token_ids=list(s.output_token_ids),
                                 finish_reason="error", cumulative_logprob=s.cumulative_logprob)
                for i, s in enumerate(group.seqs[: group.params.n])]
        return RequestOutput(group.request_id, lead.prompt, lead.prompt_token_ids, outs, True, lead.metrics,
                             num_cached_tokens=lead.num_cached_tokens, error=msg, error_param=error_param)
