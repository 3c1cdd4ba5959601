"""Output processing (the front end's): the engine core's token deltas → :class:`RequestOutput`.

The engine core reports, per request and step, the tokens each sample gained
(:class:`~kvserve.engine.core_output.EngineCoreOutput`). The :class:`OutputProcessor` keeps
each request's text: it detokenizes the new tokens incrementally (UTF-8 safe,
:class:`~kvserve.engine.detokenizer.IncrementalDetokenizer`), ends a sample at a stop string
(the tokens after the one that completes it are dropped, so a verified speculative run stops
exactly where one-token steps would), writes the logprobs of the kept tokens in vLLM's
``{token_id: Logprob}`` shape too, and builds the request's ``n`` samples, ``best_of``
selection or beams into one :class:`RequestOutput`.

It runs where requests arrive: in the offline engine's process, and in the API process of
``kvserve serve`` while the core runs in its own. A sample it ends at a stop string is one the
core does not know has ended: :meth:`OutputProcessor.process_outputs` returns those samples,
and the caller has the core finish them (:meth:`EngineCore.finish_samples`); until that
arrives, the core's further tokens for them are ignored here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from kvserve.core.request import (
    CompletionOutput,
    LogprobsOnePosition,
    RequestOutput,
    TokenLogprob,
    logprob_dict,
)
from kvserve.engine.core_output import BeamOutput, EngineCoreOutput, SampleDelta
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.token_strings import TokenStrings
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _no_text(token_id: int) -> None:
    """The ``decoded_token`` of a request with ``detokenize=False``."""
    return None


class _Sample:
    """The front end's state of one sample: its kept tokens, text and finish."""

    __slots__ = ("index", "detokenizer", "token_ids", "token_logprobs", "logprobs", "cumulative_logprob",
                 "finish_reason", "stop_reason", "delta")

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, logprobs: bool) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.token_logprobs: Optional[list[TokenLogprob]] = [] if logprobs else None
        self.logprobs: Optional[list[LogprobsOnePosition]] = [] if logprobs else None  # (vLLM's shape)
        self.cumulative_logprob = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.delta = ""  # text gained since the request's previous output

    @property
    def text(self) -> str:
        return self.detokenizer.output_text


@dataclass
class RequestState:
    """A request as the front end tracks it, from its arrival to its final output."""

    request_id: str
    params: SamplingParams
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_Sample]
    prompt_token_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    prompt_logprobs: Optional[list[Optional[LogprobsOnePosition]]] = None  # (vLLM's shape)
    beams: list[BeamOutput] = field(default_factory=list)
    kv_transfer_stats: Optional[dict] = None  # (the core sends it once; every output carries it)

    @property
    def finished(self) -> bool:
        return bool(self.samples) and all(s.finish_reason is not None for s in self.samples)


@dataclass
class ProcessedOutputs:
    """What :meth:`OutputProcessor.process_outputs` made of a step's core outputs.

    Attributes:
        request_outputs: one :class:`RequestOutput` per request that changed.
        finished_samples: ``(request_id, sample index)`` of the samples that a stop string
            ended here while the core still runs them: the core must finish them.
        failed: ids of requests whose output processing raised (they got an error output):
            the core must abort them.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    finished_samples: list[tuple[str, int]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class OutputProcessor:
    """Detokenization, stop strings and :class:`RequestOutput` building.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.strings = TokenStrings(tokenizer)  # (Logprob.decoded_token)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], prompt: Optional[str],
                    params: SamplingParams) -> None:
        """Track a request the core accepted under ``request_id`` (its params as the core
        resolved them)."""
        samples = [] if params.use_beam_search else [
            _Sample(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params), params.logprobs is not None)
            for i in range(params.num_samples)]
        asked = params.prompt_logprobs is not None
        self.requests[request_id] = RequestState(request_id, params, prompt, prompt_token_ids, samples,
                                                 [] if asked else None, [] if asked else None)

    def abort_request(self, request_id: str) -> None:
        """Forget a request (unknown ids are ignored)."""
        self.requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply a step's core outputs; outputs of requests not tracked here (aborted, or
        ended by a stop string before the core heard of it) are ignored.

        A request whose processing raises (a bug, a tokenizer that chokes on its tokens) ends
        with ``finish_reason="error"`` alone; the others go on.
        """
        res = ProcessedOutputs()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            if out.kv_transfer_stats is not None:
                state.kv_transfer_stats = out.kv_transfer_stats
            try:
                if out.error is not None:
                    res.request_outputs.append(self._error_output(state, out))
                    continue
                stopped = self._apply(state, out)
                if state.finished or out.finished:
                    del self.requests[out.request_id]
                    if not out.finished:  # the core still runs every sample the stop strings ended
                        res.finished_samples.extend((out.request_id, i) for i in stopped)
                elif stopped:
                    res.finished_samples.extend((out.request_id, i) for i in stopped)
                res.request_outputs.append(self._make_output(state, out))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                logger.error("request %s failed in output processing", out.request_id, exc_info=e)
                self.requests.pop(out.request_id, None)
                res.failed.append(out.request_id)
                res.request_outputs.append(self._error_output(state, out, f"{type(e).__name__}: {e}"))
        return res

    # ------------------------------------------------------------ internals
    def _apply(self, state: RequestState, out: EngineCoreOutput) -> list[int]:
        """Take in ``out``'s deltas; returns the indices of the samples a stop string ended."""
        if out.new_prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_token_logprobs.extend(out.new_prompt_logprobs)
            strs = self._token_str(state.params)
            state.prompt_logprobs.extend(None if e is None else logprob_dict(e, strs) for e in out.new_prompt_logprobs)
        if out.beams is not None:
            state.beams = out.beams
        stopped = []
        for d in out.samples:
            s = state.samples[d.index]
            if s.finish_reason is not None:
                continue  # ended here by a stop string; the core had not heard of it yet
            if self._append(s, d, state.params):
                stopped.append(d.index)
        if out.finished:  # (aborted in the core meanwhile, or the end of a beam search)
            for s in state.samples:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
        return stopped

    def _token_str(self, p: SamplingParams):
        """``token_id -> Logprob.decoded_token``: the token's text, or None with ``detokenize=False`` (vLLM)."""
        return self.strings.token_str if p.detokenize else _no_text

    def _append(self, s: _Sample, d: SampleDelta, p: SamplingParams) -> bool:
        """Detokenize ``d``'s tokens into ``s``, cut at a stop string; True when a stop string
        ended the sample while the core goes on with it."""
        toks, n0 = d.new_token_ids, len(s.token_ids)
        detok = s.detokenizer
        finish, reason = d.finish_reason, d.stop_reason
        if d.stop_token and not p.include_stop_str_in_output:
            # the tokens before it, then a flush (which may still complete a stop string)
            upd = detok.update(toks[:-1], n0 + len(toks) - 1) if len(toks) > 1 else None
            delta, kept = (upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)) if upd else ("", 0)
            if upd is None or upd.stop_str is None:
                upd = detok.update([], n0 + len(toks), finished=True)
                delta, kept = delta + upd.text_delta, len(toks)
        else:
            upd = detok.update(toks, n0 + len(toks), finished=finish is not None)
            delta, kept = upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)
        if upd.stop_str is not None:
            if kept < len(toks):  # the stop string ends before the run does: drop the rest
                toks, finish, reason = toks[:kept], "stop", upd.stop_str
            elif finish in (None, "length"):
                # a stop string completed by the last allowed token still ends it as "stop" (vLLM)
                finish, reason = "stop", upd.stop_str
        k = len(toks)
        s.token_ids += toks
        s.cumulative_logprob += sum(d.new_logprobs[:k])
        if s.logprobs is not None and d.new_token_logprobs is not None:
            s.token_logprobs += d.new_token_logprobs[:k]
            strs = self._token_str(p)
            s.logprobs += [logprob_dict(e, strs) for e in d.new_token_logprobs[:k]]
        s.delta += delta
        if finish is not None:
            s.finish_reason, s.stop_reason = finish, reason
        return finish is not None and d.finish_reason is None

    def _make_output(self, state: RequestState, out: EngineCoreOutput) -> RequestOutput:
        """The request's :class:`RequestOutput`: the beams (best ``n``, decoded whole), the
        ``n`` samples, or under ``best_of`` the ``n`` with the highest cumulative logprob once
        every sample finished; each sample's ``delta_text`` is reported once."""
        params = state.params
        finished = state.finished or out.finished
        metrics = out.metrics
        if metrics is not None and state.samples:
            metrics.num_generated_tokens = len(state.samples[0].token_ids)
            if finished and metrics.finished_time is None:
                metrics.finished_time = time.perf_counter()
        if params.use_beam_search:
            outs = [
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(b.token_ids, skip_special_tokens=params.skip_special_tokens)
                    if params.detokenize else "",
                    token_ids=list(b.token_ids),
                    finish_reason="stop" if b.finished_by_eos else "length",
                    cumulative_logprob=b.cumulative_logprob,
                )
                for i, b in enumerate(state.beams)
            ]
        else:
            if params.num_samples == params.n:
                chosen = state.samples
            elif finished:  # best_of: the n samples with the highest cumulative logprob
                chosen = sorted(state.samples, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
            else:
                chosen = []  # best_of results are only known at the end
            outs = [
                CompletionOutput(
                    index=idx,
                    text=s.text,
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    delta_text=s.delta,
                    token_logprobs=list(s.token_logprobs) if s.token_logprobs is not None else None,
                )
                for idx, s in enumerate(chosen)
            ]
            for s in chosen:  # a delta is reported once: a sample that did not move adds nothing
                s.delta = ""
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=metrics,
            # (a one-token prompt has no scored position: just the leading None)
            prompt_logprobs=(list(state.prompt_logprobs) or [None]) if state.prompt_logprobs is not None else None,
            num_cached_tokens=out.num_cached_tokens,
            kv_transfer_params=out.kv_transfer_params,
            kv_transfer_stats=state.kv_transfer_stats,
            prompt_token_logprobs=(list(state.prompt_token_logprobs) or [None])
            if state.prompt_token_logprobs is not None else None,
        )

    def _error_output(self, state: RequestState, out: EngineCoreOutput, msg: Optional[str] = None) -> RequestOutput:
        """The final output of a request that failed (in the core: ``out.error``; here:
        ``msg``): every sample ``finish_reason="error"``, the text it had and every token the
        core appended, the message in ``RequestOutput.error``."""
        self.requests.pop(state.request_id, None)
        if state.params.use_beam_search:
            outs = [CompletionOutput(i, self.tokenizer.decode(b.token_ids), list(b.token_ids), "error",
                                     cumulative_logprob=b.cumulative_logprob) for i, b in enumerate(state.beams)]
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                                 outs or [CompletionOutput(0, "", [], "error")], True, out.metrics,
                                 num_cached_tokens=out.num_cached_tokens, error=msg or out.error,
                                 error_param=out.error_param if msg is None else None,
                                 kv_transfer_stats=state.kv_transfer_stats)
        by_index = {d.index: d for d in out.samples}
        outs = []
        for s in state.samples[: state.params.n]:
            d = by_index.get(s.index)
            extra = d.new_token_ids if d is not None and s.finish_reason is None else []
            outs.append(CompletionOutput(index=s.index, text=s.text, token_ids=s.token_ids + extra,
                                         finish_reason="error", cumulative_logprob=s.cumulative_logprob))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, True, out.metrics,
                             num_cached_tokens=out.num_cached_tokens, error=msg or out.error,
                             error_param=out.error_param if msg is None else None,
                             kv_transfer_stats=state.kv_transfer_stats)
