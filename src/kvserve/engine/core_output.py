"""What the engine core reports after a step: token deltas, no text.

The engine core appends sampled tokens to its sequences and applies the stop conditions that
need only token ids (:func:`append_output_tokens`: EOS, ``stop_token_ids``, ``max_tokens``,
``max_model_len``, a completed grammar). Text is the front end's business: the
:class:`~kvserve.engine.output_processor.OutputProcessor` detokenizes the deltas, finds stop
strings and tells the core which samples they ended (vLLM v1's split between ``EngineCore``
and ``OutputProcessor``). So a step's outputs carry only what changed, whatever the length of
the sequences: they cross to the API process of ``kvserve serve`` cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.core.request import Request, RequestMetrics, RequestStatus, TokenLogprob


@dataclass
class SampleDelta:
    """The tokens one sample (sequence) of a request gained in a step.

    Attributes:
        index: the sample's index in its request (``0 .. n - 1``, or ``best_of - 1``).
        new_token_ids: the tokens appended (one, or a verified speculative run).
        new_logprobs: the raw logprob of each new token (float, natural log); the sample's
            cumulative logprob is their running sum.
        new_token_logprobs: one :class:`TokenLogprob` per new token (with its top
            alternatives) when the request asked for ``logprobs``, else None.
        finish_reason: ``"stop"`` or ``"length"`` when the core ended the sample with these
            tokens, else None (the front end may still end it at a stop string).
        stop_reason: the stop token id that ended it (None for EOS, length, a grammar).
        stop_token: the last new token is an EOS or stop token that ended the sample: its
            text is not output unless ``include_stop_str_in_output``.
    """

    index: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_token_logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    stop_token: bool = False

    def extend(self, other: "SampleDelta") -> None:
        """Append a later delta of the same sample (several appends before one output)."""
        self.new_token_ids += other.new_token_ids
        self.new_logprobs += other.new_logprobs
        if other.new_token_logprobs is not None:
            self.new_token_logprobs = (self.new_token_logprobs or []) + other.new_token_logprobs
        self.finish_reason, self.stop_reason, self.stop_token = other.finish_reason, other.stop_reason, other.stop_token


@dataclass
class BeamOutput:
    """One of the best ``n`` beams of a beam search, whole (its tokens change every step)."""

    token_ids: list[int]
    cumulative_logprob: float
    finished_by_eos: bool


@dataclass
class EngineCoreOutput:
    """A request's progress in one step of the engine core.

    Attributes:
        request_id: the request's id.
        samples: the samples that gained tokens this step (beam search: none).
        finished: every sequence of the request finished in the core.
        metrics: the request's timing (its first sequence's).
        num_cached_tokens: prompt tokens served from the prefix cache.
        new_prompt_logprobs: prompt logprob entries computed since the previous output (the
            first entry of all is None: the first position has no logprob), when asked.
        beams: beam search: the best ``n`` beams, whole, in order; else None.
        error: the message of a request that failed (then ``finished``); its samples' tokens
            of this step, if any, are in ``samples``.
        error_param: the request field at fault for an error caused by the request's own
            input, else None.
        kv_transfer_params: in the final output of a request sent with
            ``{"do_remote_decode": True}``: the handle of its saved prompt K/V.
        kv_transfer_stats: in the first output of a request sent with a handle: what loading
            its prompt K/V did (``RequestOutput.kv_transfer_stats``); else None.
    """

    request_id: str
    samples: list[SampleDelta] = field(default_factory=list)
    finished: bool = False
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    new_prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    beams: Optional[list[BeamOutput]] = None
    error: Optional[str] = None
    error_param: Optional[str] = None
    kv_transfer_params: Any = None
    kv_transfer_stats: Optional[dict] = None


def append_output_tokens(req: Request, toks: list[int], lps: list[TokenLogprob], now: float,
                         max_model_len: int) -> tuple[Optional[RequestStatus], SampleDelta]:
    """Append generated tokens (one, or a verified run of several) to ``req``, stopping
    exactly where appending them one at a time would: at the first EOS / stop token (once
    ``min_tokens`` is reached), at ``max_tokens`` / ``max_model_len``, or at the token that
    completes the request's grammar; the tokens after it are dropped. Stop strings are the
    front end's (:class:`~kvserve.engine.output_processor.OutputProcessor`).

    Args:
        req: the sequence (its grammar, if any, accepts the kept tokens).
        toks: the new token ids.
        lps: one :class:`TokenLogprob` per token.
        now: ``time.perf_counter()`` (the first token's and the finish time).
        max_model_len: the context window, tokens.

    Returns:
        ``(status, delta)``: the status that finishes the request (its ``finished_time`` set;
        the caller finishes it in the scheduler) or None, and the tokens kept as a
        :class:`SampleDelta`.
    """
    p = req.sampling_params
    n0, len0 = len(req.output_token_ids), req.num_tokens
    status, reason, end = None, None, len(toks)
    grammar_end = False
    for i, tok in enumerate(toks):
        n_out = n0 + i + 1
        if req.grammar is not None:  # structured output: the grammar follows every token kept
            req.grammar.accept_token(tok)
        if n_out >= p.min_tokens:
            if tok in req.eos_token_ids and not p.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif p.stop_token_ids and tok in p.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, tok
        if status is None and req.grammar is not None and req.grammar.is_terminated():
            # the token completed the output (nothing but EOS could follow): it ends it, as a stop
            status, grammar_end = RequestStatus.FINISHED_STOPPED, True
        if status is None and (n_out >= p.max_tokens or len0 + i + 1 >= max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            end = i + 1
            break
    toks, lps = toks[:end], lps[:end]
    req.output_token_ids.extend(toks)
    if reason is not None:
        req.stop_reason = reason
    for lp in lps:
        req.cumulative_logprob += lp.logprob
    if p.logprobs is not None:
        req.output_logprobs.extend(lps)
    m = req.metrics
    m.num_generated_tokens = len(req.output_token_ids)
    if m.first_token_time is None:
        m.first_token_time = now
    # (a verification counts its accepted drafts computed: never more than the tokens kept)
    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
    if status is not None:
        m.finished_time = now
    # As in vLLM, an EOS or stop token that ends the sequence adds no text unless
    # include_stop_str_in_output (its id stays in token_ids); a token that completes a grammar
    # is text, unless it is EOS (under ignore_eos)
    stop_token = (status is RequestStatus.FINISHED_STOPPED
                  and (not grammar_end or toks[-1] in req.eos_token_ids))
    delta = SampleDelta(req.sample_index, list(toks), [lp.logprob for lp in lps],
                        list(lps) if p.logprobs is not None else None,
                        status.value if status is not None else None, reason, stop_token)
    return status, delta
