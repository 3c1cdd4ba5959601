"""Inference-time compute: spend more generation on a prompt to get a better answer.

- :func:`best_of_n` draws N samples and keeps the one a verifier scores highest (verifier
  reranking, Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"). A verifier
  is any function of (prompt, completion) → score; :class:`LLMJudge` is a generative verifier
  (the probability a model gives to "Yes" over "No" when asked whether the completion is
  correct) and :class:`MeanLogprobVerifier` the sample's own mean token logprob.
- :func:`self_consistency` draws N reasoning paths, extracts each one's final answer and
  returns the majority answer (Wang et al. 2023, "Self-Consistency Improves Chain of Thought
  Reasoning in Language Models"), optionally weighting each vote by the path's probability.
- :func:`generate_with_thinking_budget` bounds a reasoning model's thinking by budget forcing
  (Muennighoff et al. 2025, "s1: Simple test-time scaling"): at ``max_thinking_tokens`` the
  end-of-thinking delimiter is appended and the model answers; a model that ends its thinking
  before ``min_thinking_tokens`` has the delimiter replaced by "Wait" and thinks on.

Everything runs through one :class:`kvserve.LLM` in batches: the N samples of a prompt are one
request with ``n = N`` (they share the prompt's KV blocks), and the verifier's prompts and the
answer phase after thinking start with text the engine has just computed, which the prefix
cache serves without recomputation.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, Union

from kvserve.entrypoints.llm import LLM
from kvserve.core.request import CompletionOutput
from kvserve.sampling_params import SamplingParams
from kvserve.engine.tokenizer import apply_chat_template

PromptType = Union[str, Sequence[int]]

#: the most samples one call draws per prompt (SamplingParams' own limit on n)
MAX_SAMPLES = 128


@dataclass
class Candidate:
    """One sampled completion.

    Attributes:
        text: generated text.
        token_ids: generated token ids.
        finish_reason: as in :class:`kvserve.core.request.CompletionOutput`.
        cumulative_logprob: sum of the raw logprobs of ``token_ids`` (nats).
        score: the verifier's score (:func:`best_of_n`), or None.
        answer: the extracted final answer (:func:`self_consistency`), or None.
    """

    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    cumulative_logprob: float
    score: Optional[float] = None
    answer: Optional[str] = None

    @property
    def mean_logprob(self) -> float:
        """Mean raw logprob per generated token (nats; 0 for an empty completion)."""
        return self.cumulative_logprob / len(self.token_ids) if self.token_ids else 0.0

    @classmethod
    def of(cls, c: CompletionOutput) -> "Candidate":
        return cls(c.text, list(c.token_ids), c.finish_reason, c.cumulative_logprob)


@dataclass
class BestOfNResult:
    """:func:`best_of_n`'s result for one prompt.

    Attributes:
        best: the highest-scoring candidate (the first of them on a tie).
        candidates: all N candidates in sample order, each with its ``score``.
    """

    best: Candidate
    candidates: list[Candidate]

    @property
    def text(self) -> str:
        return self.best.text


@dataclass
class SelfConsistencyResult:
    """:func:`self_consistency`'s result for one prompt.

    Attributes:
        answer: the answer with the most (weighted) votes; None when no path gave one.
        votes: answer → its (weighted) votes.
        candidates: all N paths in sample order, each with its extracted ``answer``.
    """

    answer: Optional[str]
    votes: dict[str, float]
    candidates: list[Candidate]

    @property
    def agreement(self) -> float:
        """The winning answer's share of all votes (0 when there is no answer)."""
        total = sum(self.votes.values())
        return self.votes[self.answer] / total if self.answer is not None and total > 0 else 0.0


@dataclass
class ThinkingOutput:
    """:func:`generate_with_thinking_budget`'s result for one prompt.

    Attributes:
        thinking_token_ids: the thinking as the model continued it (tokens, any "Wait"
            inserted, and the delimiter where the model wrote it; a forced delimiter is not
            included).
        thinking_text: their text.
        answer: the answer phase's completion (text, token ids, finish reason).
        num_thinking_tokens: tokens the model generated while thinking ("Wait" and a forced
            delimiter not counted); at most ``max_thinking_tokens``.
        forced_end: True if the budget ran out (or the model stopped without the delimiter)
            and the delimiter was appended for it.
        num_waits: how many times "Wait" replaced an early delimiter.
    """

    thinking_token_ids: list[int]
    thinking_text: str
    answer: CompletionOutput
    num_thinking_tokens: int
    forced_end: bool
    num_waits: int

    @property
    def text(self) -> str:
        return self.answer.text


# ------------------------------------------------------------------------- verifiers
class Verifier(Protocol):
    """Scores completions: higher is better. ``score(prompts, completions)`` gets parallel
    lists (prompt text, :class:`Candidate`) and returns one float per pair."""

    def score(self, prompts: list[str], completions: list[Candidate]) -> list[float]: ...


class MeanLogprobVerifier:
    """Scores a completion by its mean raw token logprob under the model that generated it
    (a confidence score that costs no extra compute; unlike the cumulative logprob used by
    ``best_of`` it does not favour short completions)."""

    def score(self, prompts: list[str], completions: list[Candidate]) -> list[float]:
        return [c.mean_logprob for c in completions]


class FunctionVerifier:
    """Wraps ``fn(prompt_text, completion_text) -> float`` (a unit-test runner, an answer
    checker, a reward model) as a :class:`Verifier`.

    Raises:
        TypeError: from ``score`` if ``fn`` returns something that is not a real number.
    """

    def __init__(self, fn: Callable[[str, str], float]) -> None:
        self.fn = fn

    def score(self, prompts: list[str], completions: list[Candidate]) -> list[float]:
        out = []
        for p, c in zip(prompts, completions):
            s = self.fn(p, c.text)
            if not isinstance(s, numbers.Real) or isinstance(s, bool):
                raise TypeError(f"verifier: the function returned {type(s).__name__}, expected a real number")
            if math.isnan(s):
                raise ValueError("verifier: the function returned NaN, expected a real number")
            out.append(float(s))
        return out


class LLMJudge:
    """Generative verifier: asks a model whether a completion answers the prompt correctly
    and scores it with ``log P(yes) − log(P(yes) + P(no))`` (nats, ≤ 0), the log-probability
    of "Yes" among the two answers (Zhang et al. 2024, "Generative Verifiers: Reward
    Modeling as Next-Token Prediction").

    ``P(yes)`` is the probability of the tokens of ``yes`` right after the judge prompt: both
    continuations are scored as prompt logprobs in one batched forward (each judge prompt is
    computed once and shared through the prefix cache).

    Args:
        llm: the judge model (may be the generating one).
        template: ``template(prompt, completion) -> str``, the judge prompt; the default
            renders, with the model's chat template, a user message that shows the question
            and the proposed answer and asks for Yes or No.
        yes, no: the two answers as the judge would write them next (a leading space or not
            matters to the tokenizer).

    Raises:
        ValueError: ``yes`` or ``no`` is empty or both encode to the same tokens.
    """

    def __init__(self, llm: LLM, template: Optional[Callable[[str, str], str]] = None,
                 yes: str = "Yes", no: str = "No") -> None:
        self.llm = llm
        self.template = template
        tok = llm.tokenizer
        self.yes_ids = tok.encode(yes, add_special_tokens=False) if yes else []
        self.no_ids = tok.encode(no, add_special_tokens=False) if no else []
        if not self.yes_ids or not self.no_ids:
            raise ValueError("LLMJudge: yes and no must be non-empty strings")
        if self.yes_ids == self.no_ids:
            raise ValueError(f"LLMJudge: yes ({yes!r}) and no ({no!r}) encode to the same tokens")

    def judge_prompt_ids(self, prompt: str, completion: str) -> list[int]:
        """The judge prompt's token ids for one pair (before the yes/no tokens)."""
        if self.template is not None:
            return self.llm.engine.encode(self.template(prompt, completion))
        msg = (f"Question:\n{prompt}\n\nProposed answer:\n{completion}\n\n"
               "Is the proposed answer correct? Reply with Yes or No.")
        return apply_chat_template(self.llm.tokenizer, [{"role": "user", "content": msg}],
                                   add_generation_prompt=True)

    def score(self, prompts: list[str], completions: list[Candidate]) -> list[float]:
        heads = [self.judge_prompt_ids(p, c.text) for p, c in zip(prompts, completions)]
        batch = [h + ids for h in heads for ids in (self.yes_ids, self.no_ids)]
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outs = self.llm.generate(batch, params)
        scores = []
        for i, h in enumerate(heads):
            lp_yes = _suffix_logprob(outs[2 * i], len(self.yes_ids))
            lp_no = _suffix_logprob(outs[2 * i + 1], len(self.no_ids))
            scores.append(lp_yes - _logaddexp(lp_yes, lp_no))
        return scores


def _suffix_logprob(out, n: int) -> float:
    """Sum of the prompt logprobs of the last ``n`` prompt tokens."""
    return sum(lp.logprob for lp in out.prompt_token_logprobs[-n:])


def _logaddexp(a: float, b: float) -> float:
    m = max(a, b)
    return m if m == -math.inf else m + math.log(math.exp(a - m) + math.exp(b - m))


# ------------------------------------------------------------------------ shared parts
def _as_list(prompts) -> tuple[list[PromptType], bool]:
    """(prompts as a list, whether one prompt was given)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], numbers.Integral)):
        return [prompts], True
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts), False


def _prompt_text(llm: LLM, p: PromptType) -> str:
    return p if isinstance(p, str) else llm.tokenizer.decode(list(p), skip_special_tokens=False)


def _sample_params(sampling_params: Optional[SamplingParams], n: int, what: str) -> SamplingParams:
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    sp = sampling_params if sampling_params is not None else SamplingParams(max_tokens=256)
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
    if sp.use_beam_search:
        raise ValueError(f"sampling_params.use_beam_search: {what} draws independent samples; beam search is "
                         "not supported")
    if n > 1 and sp.temperature == 0:
        raise ValueError(f"sampling_params.temperature: {what} needs temperature > 0 for its {n} samples to "
                         "differ (greedy decoding gives the same completion n times)")
    return dataclasses.replace(sp, n=n, best_of=None)


# ------------------------------------------------------------------------- best-of-N
def best_of_n(llm: LLM, prompts: PromptType | Sequence[PromptType], n: int,
              verifier: Verifier | Callable[[str, str], float],
              sampling_params: Optional[SamplingParams] = None,
              verifier_prompts: Optional[Sequence[str]] = None):
    """Draw ``n`` samples per prompt and keep the one ``verifier`` scores highest.

    Args:
        llm: the generating model.
        prompts: a string, a token-id list, or a list of either (rendered prompts: apply the
            chat template first for a chat model).
        n: samples per prompt, in [1, 128].
        verifier: a :class:`Verifier` (``.score(prompts, candidates)``), or a function
            ``(prompt_text, completion_text) -> float``.
        sampling_params: how each sample is drawn (``n`` and ``best_of`` are replaced);
            default temperature 1, at most 256 tokens.
        verifier_prompts: the text the verifier sees as each prompt (one per prompt), e.g.
            the bare question when ``prompts`` are chat-template renderings; default the
            prompts' own text.

    Returns:
        A :class:`BestOfNResult` for one prompt, or a list of them in prompt order.

    Raises:
        ValueError: ``n`` out of range, greedy sampling with n > 1, beam search, a
            ``verifier_prompts`` of the wrong length, or a prompt the engine refuses
            (:class:`kvserve.entrypoints.llm.GenerationError`).
        TypeError: ``verifier`` is neither a Verifier nor callable, or returns a non-number.
    """
    plist, single = _as_list(prompts)
    if hasattr(verifier, "score") and callable(verifier.score):
        v = verifier
    elif callable(verifier):
        v = FunctionVerifier(verifier)
    else:
        raise TypeError(f"verifier must have a score(prompts, completions) method or be a function "
                        f"(prompt, completion) -> float; got {type(verifier).__name__}")
    params = _sample_params(sampling_params, n, "best_of_n")
    if verifier_prompts is not None:
        if isinstance(verifier_prompts, str):
            verifier_prompts = [verifier_prompts]
        if len(verifier_prompts) != len(plist) or not all(isinstance(t, str) for t in verifier_prompts):
            raise ValueError(f"verifier_prompts must be {len(plist)} string(s), one per prompt; got "
                             f"{verifier_prompts!r:.80}")
    outs = llm.generate(plist, params)
    texts = list(verifier_prompts) if verifier_prompts is not None else [_prompt_text(llm, p) for p in plist]
    cands = [[Candidate.of(c) for c in o.outputs] for o in outs]
    flat_prompts = [t for t, cs in zip(texts, cands) for _ in cs]
    flat = [c for cs in cands for c in cs]
    scores = list(v.score(flat_prompts, flat))
    if len(scores) != len(flat):
        raise ValueError(f"verifier: returned {len(scores)} scores for {len(flat)} completions")
    for c, s in zip(flat, scores):
        c.score = float(s)
        if math.isnan(c.score):
            raise ValueError("verifier: a score is NaN; scores must be real numbers (higher is better)")
    results = [BestOfNResult(best=max(cs, key=lambda c: c.score), candidates=cs) for cs in cands]
    return results[0] if single else results


# ------------------------------------------------------------------ self-consistency
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` with thousands separators removed ("1,200.50" → "1200.50"),
    or None; the default answer extractor of :func:`self_consistency` (math word problems)."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def self_consistency(llm: LLM, prompts: PromptType | Sequence[PromptType], n: int,
                     extract_answer: Callable[[str], Optional[str]] = last_number,
                     sampling_params: Optional[SamplingParams] = None,
                     weighting: str = "count"):
    """Sample ``n`` reasoning paths per prompt and return the majority answer.

    Args:
        llm: the generating model.
        prompts: a string, a token-id list, or a list of either.
        n: paths per prompt, in [1, 128].
        extract_answer: text → answer string, or None when the path gives none (such paths
            do not vote); default :func:`last_number`.
        sampling_params: how each path is drawn (``n``/``best_of`` replaced).
        weighting: ``"count"`` (one vote per path, Wang et al.'s majority vote) or
            ``"probability"`` (each vote weighs ``exp(mean token logprob)`` of its path, their
            normalized weighted sum).

    Returns:
        A :class:`SelfConsistencyResult` for one prompt, or a list of them. The answer is
        the one with the most votes; a tie goes to the answer that appeared first.

    Raises:
        ValueError: ``n`` or ``weighting`` out of range, greedy sampling with n > 1, beam
            search, a prompt the engine refuses.
        TypeError: ``extract_answer`` is not callable or returns something that is not a
            string or None.
    """
    if weighting not in ("count", "probability"):
        raise ValueError(f"weighting must be 'count' or 'probability', got {weighting!r}")
    if not callable(extract_answer):
        raise TypeError(f"extract_answer must be a function text -> answer or None, got "
                        f"{type(extract_answer).__name__}")
    plist, single = _as_list(prompts)
    params = _sample_params(sampling_params, n, "self_consistency")
    outs = llm.generate(plist, params)
    results = []
    for o in outs:
        cands = [Candidate.of(c) for c in o.outputs]
        votes: Counter = Counter()
        for c in cands:
            a = extract_answer(c.text)
            if a is not None and not isinstance(a, str):
                raise TypeError(f"extract_answer returned {type(a).__name__}, expected a string or None")
            c.answer = a
            if a is not None:
                votes[a] += 1.0 if weighting == "count" else math.exp(c.mean_logprob)
        # Counter keeps first-seen order, and max() keeps the first of equal maxima
        answer = max(votes, key=votes.__getitem__) if votes else None
        results.append(SelfConsistencyResult(answer=answer, votes=dict(votes), candidates=cands))
    return results[0] if single else results


# ---------------------------------------------------------------- thinking budget
@dataclass
class _Thinking:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    waits: int = 0
    forced: bool = False
    done: bool = False


def generate_with_thinking_budget(
    llm: LLM,
    prompts: PromptType | Sequence[PromptType],
    max_thinking_tokens: int,
    sampling_params: Optional[SamplingParams] = None,
    *,
    min_thinking_tokens: int = 0,
    think_end: str = "</think>",
    wait: str = "Wait",
    max_waits: int = 8,
    thinking_params: Optional[SamplingParams] = None,
):
    """Generate with the model's thinking bounded by budget forcing (s1, Muennighoff et al. 2025).

    The prompt must leave the model thinking (for a reasoning model, its rendered chat
    prompt, which ends inside the thinking block). Phase 1 generates the thinking until the
    model writes ``think_end`` or ``max_thinking_tokens`` are spent; at the budget (or if the
    model stops without the delimiter) the delimiter's tokens are appended for it. A model
    that writes the delimiter before ``min_thinking_tokens`` has it replaced by ``wait`` and
    goes on thinking (at most ``max_waits`` times). Phase 2 generates the answer with
    ``sampling_params`` from the prompt, the thinking and the delimiter, as token ids (so the
    engine's prefix cache serves the whole thinking). All prompts run batched.

    Args:
        llm: the model.
        prompts: a string, a token-id list, or a list of either.
        max_thinking_tokens: the thinking budget, ≥ 1 (tokens the model generates; a
            "Wait" and a forced delimiter are not counted).
        sampling_params: the answer phase (``n`` must be 1); default ``SamplingParams()``.
        min_thinking_tokens: in [0, max_thinking_tokens].
        think_end: the end-of-thinking delimiter (non-empty).
        wait: the text that replaces an early delimiter (non-empty).
        max_waits: in [0, 64].
        thinking_params: how the thinking is sampled (its ``max_tokens``, ``stop``,
            ``include_stop_str_in_output`` and ``n`` are set here); default: the answer
            phase's temperature, top-k/p and seed.

    Returns:
        A :class:`ThinkingOutput` for one prompt, or a list of them.

    Raises:
        ValueError: an argument out of range (named), ``sampling_params.n`` > 1, beam
            search, a prompt the engine refuses.
    """
    for name, value, lo, hi in (("max_thinking_tokens", max_thinking_tokens, 1, None),
                                ("min_thinking_tokens", min_thinking_tokens, 0, max_thinking_tokens),
                                ("max_waits", max_waits, 0, 64)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo or (
                hi is not None and isinstance(hi, numbers.Integral) and value > hi):
            rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise ValueError(f"{name} must be an integer {rng}, got {value!r}")
    for name, value in (("think_end", think_end), ("wait", wait)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    sp = sampling_params if sampling_params is not None else SamplingParams()
    for name, p in (("sampling_params", sp), ("thinking_params", thinking_params)):
        if p is not None and not isinstance(p, SamplingParams):
            raise TypeError(f"{name} must be a SamplingParams, got {type(p).__name__}")
        if p is not None and (p.n != 1 or p.use_beam_search or (p.best_of or 1) > 1):
            raise ValueError(f"{name}: generate_with_thinking_budget generates one sequence per prompt "
                             f"(n=1, no best_of or beam search); got n={p.n}, best_of={p.best_of}, "
                             f"use_beam_search={p.use_beam_search}")
    limit = llm.engine.max_model_len - 1
    if max_thinking_tokens > limit:
        raise ValueError(f"max_thinking_tokens must be an integer in [1, {limit}] (max_model_len - 1), got "
                         f"{max_thinking_tokens}")
    base = thinking_params if thinking_params is not None else SamplingParams(
        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed)
    plist, single = _as_list(prompts)
    tok = llm.tokenizer
    end_ids = tok.encode(think_end, add_special_tokens=False)
    wait_ids = tok.encode(wait, add_special_tokens=False)
    eos = set(llm.engine.eos_token_ids)
    states = [_Thinking(prompt_ids=llm.engine.encode(p) if isinstance(p, str) else [int(t) for t in p])
              for p in plist]

    while True:
        active = [s for s in states if not s.done]
        if not active:
            break
        params = [dataclasses.replace(base, max_tokens=max_thinking_tokens - s.generated, stop=[think_end],
                                      include_stop_str_in_output=True, n=1, best_of=None, stop_token_ids=None)
                  for s in active]
        outs = llm.generate([s.prompt_ids + s.tokens for s in active], params)
        for s, o in zip(active, outs):
            c = o.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"thinking phase ended with finish_reason={c.finish_reason!r}: {o.error}")
            s.tokens += c.token_ids
            s.generated += len(c.token_ids)
            by_delimiter = c.finish_reason == "stop" and c.stop_reason == think_end
            if by_delimiter and s.generated < min_thinking_tokens and s.waits < max_waits:
                s.tokens = _strip_delimiter(tok, s.tokens, end_ids, think_end) + wait_ids
                s.waits += 1
                continue
            if not by_delimiter:  # the budget ran out, or the model ended (EOS) without the delimiter
                while s.tokens and s.tokens[-1] in eos:
                    s.tokens.pop()
                s.forced = True
            s.done = True

    answers = llm.generate([s.prompt_ids + s.tokens + (end_ids if s.forced else []) for s in states], sp)
    results = [ThinkingOutput(thinking_token_ids=s.tokens,
                              thinking_text=tok.decode(s.tokens, skip_special_tokens=False),
                              answer=a.outputs[0], num_thinking_tokens=s.generated, forced_end=s.forced,
                              num_waits=s.waits)
               for s, a in zip(states, answers)]
    return results[0] if single else results


def _strip_delimiter(tok, tokens: list[int], end_ids: list[int], think_end: str) -> list[int]:
    """``tokens`` without the trailing delimiter: its own tokens when the model wrote exactly
    those, else the text re-encoded without it (the delimiter merged into other tokens)."""
    if end_ids and tokens[-len(end_ids):] == end_ids:
        return tokens[: -len(end_ids)]
    text = tok.decode(tokens, skip_special_tokens=False)
    cut = text.rfind(think_end)
    return tok.encode(text[:cut] if cut >= 0 else text, add_special_tokens=False)
