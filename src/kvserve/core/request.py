"""Request state and outputs.

A :class:`Request` is one sequence being generated. Its ``num_tokens`` (prompt + output)
and ``num_computed_tokens`` (tokens whose K/V are in the cache) are all the scheduler looks
at: a prefill chunk, a decode step and a resumed preempted request are the same thing —
compute ``num_tokens - num_computed_tokens`` more tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class TokenLogprob:
    """Logprob of one chosen token plus the top alternatives (raw model distribution): what
    the engine computes per position, and what the OpenAI server formats.

    Attributes:
        token_id: the sampled (or prompt) token.
        logprob: its log-probability (natural log; may be ``-inf``).
        rank: its 1-based rank in the vocabulary (1 + the number of tokens with a strictly
            larger logprob).
        top: the ``k`` most likely tokens ``(token_id, logprob)``, most likely first (``k`` =
            ``SamplingParams.logprobs`` / ``prompt_logprobs``; empty for 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's entry in a position's ``{token_id: Logprob}`` dict.

    Attributes:
        logprob: the log-probability (natural log; may be ``-inf``).
        rank: 1-based rank in the vocabulary.
        decoded_token: the token's own text (its bytes decoded, a partial UTF-8 character as
            U+FFFD; SentencePiece's leading space kept).
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's shapes: one {token_id: Logprob} dict per generated token; per prompt token, None first
LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[Optional[LogprobsOnePosition]]


def logprob_dict(entry: TokenLogprob, token_str) -> LogprobsOnePosition:
    """A :class:`TokenLogprob` in vLLM's shape: ``{token_id: Logprob}`` with the sampled (or
    prompt) token first, at its own rank, then the top alternatives at ranks 1..k (as vLLM
    builds it: a sampled token among the top keeps its place and takes the top entry's rank),
    so ``k`` or ``k + 1`` entries.

    Args:
        entry: the position's logprobs.
        token_str: ``token_id -> str``, the decoded token.
    """
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, token_str(entry.token_id))}
    for rank, (tid, lp) in enumerate(entry.top, start=1):
        out[tid] = Logprob(lp, rank, token_str(tid))
    return out


@dataclass
class RequestMetrics:
    """Timestamps (seconds, ``time.perf_counter`` clock) and derived latencies."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generated_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token (s), from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        """Time spent waiting before the first schedule (s)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Output tokens after the first, per second of decoding."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        dt = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / dt if dt > 0 else None

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (s)."""
        r = self.decode_tokens_per_s
        return None if r is None else 1.0 / r


@dataclass
class Request:
    """One sequence in the engine.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt (≥ 1 token).
        sampling_params: validated parameters.
        seed: effective seed for the sampler (drawn at random when the params have none).
        eos_token_ids: tokens that end the sequence unless ``ignore_eos``.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens (prompt + output) whose K/V are in the cache.
        priority: lower runs first; FCFS within a level.
        cache_salt: isolates prefix-cache entries per tenant.
        user: who sent it (the OpenAI ``user`` field, or the API key's name), for the
            scheduler's fair share of sequence slots between users; None: the anonymous user.
        token_history: the sampler's incremental record of this sequence's tokens
            (:class:`kvserve.sample.sampler.TokenHistory`, created on first use), which makes the
            repetition/frequency/presence penalties cheap to build every step.
        grammar: the sequence's structured-output grammar state
            (:class:`kvserve.structured_output.manager.StructuredOutputGrammar`), None when unconstrained;
            it has consumed exactly ``output_token_ids``.
        kv_compression: the request's KV compression policy
            (:class:`~kvserve.core.kv_compression.KVCompressionConfig`; its own or the engine's),
            None when its KV is kept whole.
        num_dropped_tokens: computed tokens whose K/V a compaction removed: the request's KV holds
            :attr:`num_kv_tokens` = ``num_computed_tokens - num_dropped_tokens`` tokens, and the
            token at position p (p ≥ the last compaction's length) has KV index
            ``p - num_dropped_tokens`` (its slot; its RoPE position stays p).
        kv_prompt_compressed: SnapKV's selection ran since the request was (re)admitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    prompt: Optional[str] = None
    priority: int = 0
    cache_salt: Optional[str] = None
    user: Optional[str] = None
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Any = None
    error: Optional[str] = None
    num_preemptions: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    parent_id: Optional[str] = None
    sample_index: int = 0
    token_history: Any = field(default=None, repr=False, compare=False)  # sampler.TokenHistory, for penalties
    grammar: Any = field(default=None, repr=False, compare=False)  # structured_output.StructuredOutputGrammar
    # speculative decoding: draft tokens proposed after the last output token (not output yet;
    # the scheduler computes them with it and the rejection sampler verifies them), and the
    # draft model's distributions q for them ([len(spec_token_ids), V]; None for n-gram drafts)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = field(default=None, repr=False, compare=False)
    # prefill/decode disaggregation (kvserve.distributed.kv_transfer): the handle of prompt K/V
    # saved by another engine, loaded when the request is first admitted (then None); what that
    # load did (KVCacheManager._load_transfer: blocks, bytes, seconds, cached_blocks, failed;
    # reported once, with the request's next output); and whether to save this sequence's
    # prompt K/V for another engine when it finishes
    kv_transfer: Any = field(default=None, repr=False, compare=False)
    kv_transfer_stats: Optional[dict] = field(default=None, repr=False, compare=False)
    kv_save: bool = False
    kv_compression: Any = field(default=None, repr=False, compare=False)
    num_dropped_tokens: int = 0
    kv_prompt_compressed: bool = False

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose K/V the request's blocks hold (``num_computed_tokens`` less those a
        compaction dropped)."""
        return self.num_computed_tokens - self.num_dropped_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Prompt plus generated plus draft tokens: what the scheduler may compute."""
        return self.num_tokens + len(self.spec_token_ids)

    def clear_spec(self) -> None:
        """Drop the drafts (after verification, or when the request is preempted)."""
        self.spec_token_ids = []
        self.spec_draft_probs = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens  # resolved to an int by the engine

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: sample index (0..n-1).
        text: generated text (after stop-string truncation).
        token_ids: generated token ids.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (max_tokens
            or max_model_len), ``"abort"``, ``"error"``, or None while running.
        stop_reason: the matched stop string or stop token id, None for EOS/length.
        cumulative_logprob: sum of the raw logprobs of the generated tokens (for a beam: the
            beam's score before length normalization).
        logprobs: with ``SamplingParams(logprobs=k)``, vLLM's shape: per generated token a
            ``{token_id: Logprob}`` dict of the sampled token and the ``k`` most likely ones
            (``k`` or ``k + 1`` entries, :func:`logprob_dict`); else None.
        token_logprobs: the same positions as :class:`TokenLogprob` (what the OpenAI server
            formats); None when not asked.
        delta_text: text added since the request's previous output (for streaming); empty
            for a sequence of an n > 1 request that did not move (it finished earlier).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    cumulative_logprob: float = 0.0
    logprobs: Optional[SampleLogprobs] = None
    delta_text: str = ""
    token_logprobs: Optional[list[TokenLogprob]] = None

    def finished(self) -> bool:
        """Whether this sequence ended (vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (or at the end).

    Attributes:
        request_id: the request's id.
        prompt: the prompt text when given as text.
        prompt_token_ids: the prompt ids.
        outputs: one :class:`CompletionOutput` per returned sample.
        finished: True once every sample finished.
        metrics: timing (TTFT, decode tokens/s, queue time).
        prompt_logprobs: with ``SamplingParams(prompt_logprobs=k)``, vLLM's shape: per prompt
            position a ``{token_id: Logprob}`` dict of the prompt token and the ``k`` most
            likely ones, None for the first position (which nothing predicts); else None.
        prompt_token_logprobs: the same positions as :class:`TokenLogprob` (None first).
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: the error message of a request that failed.
        error_param: for a failure caused by the request's own input (its grammar hit one of
            the structured-output backend's limits), the request field at fault
            (``"structured_outputs"``); None when the engine is at fault.
        kv_transfer_params: for a request sent with ``{"do_remote_decode": True}``, the
            :class:`~kvserve.distributed.kv_transfer.KVTransferHandle` of its saved prompt K/V
            (in the final output), for a decode engine's ``kv_transfer_params``.
        kv_transfer_stats: for a request sent with a handle as ``kv_transfer_params``, what
            taking its prompt K/V cost, from its first output on (the same dict on each output:
            record it once, e.g. when ``finished``): ``{"blocks": int, "bytes": int, "seconds":
            float, "cached_blocks": int, "failed": bool}``: blocks and bytes loaded (all
            workers), seconds spent loading, blocks the prefix cache held (not moved), and
            whether the load failed (the prompt was then recomputed after the cached blocks).
            None for other requests.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    error_param: Optional[str] = None
    kv_transfer_params: Any = None
    kv_transfer_stats: Optional[dict] = None
    prompt_token_logprobs: Optional[list[Optional[TokenLogprob]]] = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
