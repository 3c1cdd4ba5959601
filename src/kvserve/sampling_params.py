"""Per-request sampling parameters, validated at construction.

Field names follow vLLM (and OpenAI where OpenAI has one). Every invalid value
raises ``ValueError`` naming the field and its allowed range, so that a bad
request is rejected before it reaches the engine.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import numpy as np

from kvserve.core.kv_compression import KVCompressionConfig

MAX_LOGPROBS = 20


#: Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5

#: Fields beam search does not apply, with their "off" values (an empty list or dict is off too).
_NOT_WITH_BEAM_SEARCH = {
    "logprobs": (None,), "prompt_logprobs": (None,), "min_tokens": (0,), "top_k": (0, -1), "top_p": (1.0,),
    "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "logit_bias": (None,), "allowed_token_ids": (None,), "bad_words": (None,), "stop": (None,),
    "stop_token_ids": (None,),
}


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a formal language (structured output; vLLM's names).

    Set exactly one of:

    Attributes:
        json: a JSON Schema (a dict, or its JSON text): the output is one JSON value that
            validates against it (keywords llguidance does not implement are refused).
        regex: a regular expression (Rust ``regex`` syntax) that the whole output must match.
        choice: a non-empty list of strings; the output is exactly one of them.
        grammar: a context-free grammar whose ``start`` rule the whole output must match: Lark
            syntax as llguidance reads it (``start: "a" NUM`` / ``NUM: /[0-9]+/``), or llama.cpp's
            GBNF (``root ::= ...``), which llguidance converts.
        json_object: True: the output is any JSON object (OpenAI's JSON mode).
        disable_any_whitespace: for ``json`` / ``json_object``: no whitespace between JSON
            tokens (compact JSON). By default any amount is allowed where JSON allows it, as in
            vLLM, which lets a model that likes to indent do so (and a poor one pad with it).

    Only the shape is checked here (types, exactly one kind, a non-empty choice of strings);
    the engine compiles the grammar when it admits the request and reports an invalid schema,
    regex or grammar there, as a ``ValueError`` naming the field (``structured_outputs.regex``)
    with llguidance's message.

    Raises:
        ValueError: no kind or more than one set, or a value of the wrong type (the message
            names the field).
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {value!r}")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             + (f"got {len(kinds)}: {', '.join(kinds)}" if kinds else "got none"))
        if self.json is not None:
            if isinstance(self.json, str):
                require_utf8(self.json, "structured_outputs.json")
            elif isinstance(self.json, dict):
                try:
                    _json.dumps(self.json, allow_nan=False)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"structured_outputs.json: the schema is not JSON-serializable: {e}") from None
            else:
                raise ValueError(f"structured_outputs.json must be a JSON Schema (a dict or its JSON text), "
                                 f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
                require_utf8(value, f"structured_outputs.{name}")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar must not be empty")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or len(self.choice) == 0:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str):
                    raise ValueError(f"structured_outputs.choice[{i}] must be a string, got {c!r}")
                require_utf8(c, f"structured_outputs.choice[{i}]")
            self.choice = list(self.choice)

    def kinds(self) -> list[str]:
        """The names of the constraint fields that are set (exactly one once constructed)."""
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """The constraint's kind: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        return self.kinds()[0]


@dataclass
class SamplingParams:
    """How to turn a prompt's logits into tokens.

    Attributes:
        max_tokens: Most tokens to generate (≥ 1). ``None`` means up to ``max_model_len``.
        min_tokens: EOS, stop tokens and stop strings are suppressed until this many
            tokens were generated (0 ≤ min_tokens ≤ max_tokens).
        temperature: ≥ 0; 0 (or anything below ``GREEDY_TEMPERATURE`` = 1e-5, as in vLLM)
            means greedy (argmax).
        top_k: Keep the k most likely tokens; 0 or -1 disables.
        top_p: Nucleus sampling, 0 < p ≤ 1.
        min_p: Drop tokens whose probability is below ``min_p · p_max``; 0 ≤ min_p ≤ 1.
        repetition_penalty: > 0, Hugging Face semantics over prompt and output tokens
            (positive logits divided, negative multiplied); 1 disables.
        presence_penalty: -2 ≤ x ≤ 2, OpenAI semantics over output tokens.
        frequency_penalty: -2 ≤ x ≤ 2, OpenAI semantics over output tokens.
        logit_bias: token id → additive bias in [-100, 100].
        allowed_token_ids: if set, every other token is masked.
        bad_words: words that must never be generated: strings (as vLLM takes them; the
            engine bans each with and without a leading space) or token id sequences.
        seed: makes the random numbers of the request's draws depend only on the seed and
            the step (not on other requests); the model's logits can still differ in their
            last float bits with the batch, which moves a draw that lands that close to a
            token boundary. A 64-bit signed integer, -2**63 ≤ seed < 2**63 (the range of
            vLLM's OpenAI API).
        stop: strings that end generation (matched across token boundaries).
        stop_token_ids: token ids that end generation besides EOS.
        include_stop_str_in_output: keep the matched stop string in the text (and the text of
            an EOS or stop token that ends the sequence, which is left out otherwise, as in
            vLLM; its id is in ``token_ids`` either way).
        ignore_eos: keep generating past EOS.
        skip_special_tokens: leave special tokens out of the text.
        detokenize: False returns the token ids only (the outputs' text is ""), as vLLM's
            ``detokenize``; stop strings, which match the text, are then an error.
        spaces_between_special_tokens: accepted for vLLM compatibility; it has no effect with
            the fast (Rust) tokenizers kvserve decodes with, as in vLLM's fast detokenizer.
        truncate_prompt_tokens: keep only the last k tokens of the prompt (left truncation,
            k ≥ 1); -1 keeps the last ``max_model_len - 1`` (room for one generated token);
            None keeps the whole prompt.
        logprobs: number of top alternatives (0..20) to return per generated token;
            ``None`` returns none.
        prompt_logprobs: likewise for every prompt position after the first.
        n: number of samples to return.
        best_of: number of samples to draw; the ``n`` with the highest cumulative
            logprob are returned (best_of ≥ n).
        structured_outputs: a :class:`StructuredOutputsParams` (or a dict of its fields):
            constrain the output to a JSON schema, regex, choice list or grammar. Each sample
            (``n``) follows the grammar on its own; the request ends with ``"stop"`` as soon as
            the grammar is complete (nothing but EOS could follow), even before ``min_tokens``
            and with ``ignore_eos``; ``max_tokens`` first gives ``"length"`` and an incomplete
            output. Not with beam search.
        kv_compression: a KV compression policy for this request (a dict, its JSON text or a
            :class:`~kvserve.core.kv_compression.KVCompressionConfig`): StreamingLLM, SnapKV or H2O
            (see :mod:`kvserve.core.kv_compression`); None takes the engine's
            (``LLM(kv_compression=...)``), ``{"method": "none"}`` turns it off. Not with beam search.
        use_beam_search / beam_width / length_penalty: beam search; the score is
            ``cum_logprob / output_len ** length_penalty``. Beams are ranked on the model's raw
            logprobs (temperature and seed do not apply); the fields that would edit them or
            stop a beam (penalties, top-k/p, min-p, logit_bias, allowed_token_ids, bad_words,
            stop, stop_token_ids, min_tokens) and logprobs/prompt_logprobs are errors with it.
    """

    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[list[int]]] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: Optional[int] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    beam_width: Optional[int] = None
    length_penalty: float = 1.0
    structured_outputs: Optional[StructuredOutputsParams] = None
    kv_compression: Optional[Any] = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy scalars (np.int64, np.float32, ...) count as Python numbers
            if isinstance(getattr(self, f.name), np.generic):
                setattr(self, f.name, getattr(self, f.name).item())
        for name in ("allowed_token_ids", "stop_token_ids"):  # ... also inside the id lists
            ids = getattr(self, name)
            if isinstance(ids, (list, tuple)) and any(isinstance(t, np.generic) for t in ids):
                setattr(self, name, [t.item() if isinstance(t, np.generic) else t for t in ids])
        if isinstance(self.bad_words, (list, tuple)) and any(
                isinstance(w, (list, tuple)) and any(isinstance(t, np.generic) for t in w) for w in self.bad_words):
            self.bad_words = [[t.item() if isinstance(t, np.generic) else t for t in w]
                              if isinstance(w, (list, tuple)) else w for w in self.bad_words]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:
            self.logit_bias = _bias_dict(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {unknown}; the fields are json, regex, "
                                 f"choice, grammar, json_object, disable_any_whitespace")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.kv_compression = KVCompressionConfig.parse(self.kv_compression)  # (raises naming kv_compression.<field>)
        self._validate()

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        _int("max_tokens", self.max_tokens, lo=1, allow_none=True)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _float("temperature", self.temperature, lo=0.0)
        _int("top_k", self.top_k, lo=-1)
        _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _float("min_p", self.min_p, lo=0.0, hi=1.0)
        _float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _float("length_penalty", self.length_penalty)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("allowed_token_ids", "bad_words", "stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _int("logit_bias key", tok, lo=0)
                _float(f"logit_bias[{tok}]", bias, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise ValueError("allowed_token_ids must not be empty")
            for tok in self.allowed_token_ids:
                _int("allowed_token_ids entry", tok, lo=0)
        if self.bad_words is not None:
            for word in self.bad_words:
                if isinstance(word, str) and word:
                    require_utf8(word, "bad_words entry")
                    continue  # tokenized by the engine
                if not isinstance(word, (list, tuple)) or len(word) == 0:
                    raise ValueError("bad_words must be a list of non-empty strings or non-empty token id lists")
                for tok in word:
                    _int("bad_words entry", tok, lo=0)
        _int("seed", self.seed, lo=-(2**63), hi=2**63 - 1, allow_none=True)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (up to max_model_len - 1) or an integer ≥ 1, "
                             f"got {k!r}")
        if self.stop is not None:
            for s in self.stop:
                if not isinstance(s, str) or s == "":
                    raise ValueError("stop must be a list of non-empty strings")
                require_utf8(s, "stop string")
            if self.stop and not self.detokenize:
                raise ValueError("stop: stop strings match the text, which detokenize=False does not make; "
                                 "use stop_token_ids, or detokenize=True")
        if self.stop_token_ids is not None:
            for tok in self.stop_token_ids:
                _int("stop_token_ids entry", tok, lo=0)
        _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, allow_none=True)
        _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS, allow_none=True)
        _int("n", self.n, lo=1, hi=128)
        _int("best_of", self.best_of, lo=1, hi=128, allow_none=True)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        if self.use_beam_search:
            _int("beam_width", self.beam_width, lo=1, hi=64, allow_none=True)
            if self.beam_width is None:
                for what in ("n", "best_of"):
                    v = getattr(self, what)
                    if v is not None and v > 64:
                        raise ValueError(f"{what} must be ≤ 64 with use_beam_search (the beam width is "
                                         f"max(n, best_of), at most 64), got {v}")
                self.beam_width = max(self.n, self.best_of or 1)
            if self.beam_width < self.n:
                raise ValueError(f"beam_width must be at least n ({self.n}), got {self.beam_width}")
            if self.kv_compression is not None and self.kv_compression.enabled:
                raise ValueError("kv_compression is not supported with use_beam_search (beams share their KV blocks "
                                 "copy-on-write by position, which compaction would break); use {\"method\": \"none\"}")
            if self.structured_outputs is not None:  # (as vLLM)
                raise ValueError(f"structured_outputs is not supported with use_beam_search (beams are ranked on the "
                                 f"model's raw log-probabilities, without the grammar's mask); got a "
                                 f"{self.structured_outputs.kind} constraint")
            for name, off in _NOT_WITH_BEAM_SEARCH.items():
                value = getattr(self, name)
                if not (value in off or (isinstance(value, (list, dict)) and not value)):
                    raise ValueError(f"{name} is not supported with use_beam_search (beams are ranked on the "
                                     f"model's raw log-probabilities and return only their cumulative_logprob); got "
                                     f"{name}={value!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Check that every token id the params name is inside the vocabulary.

        Call at request admission; the sampler raises the same error later otherwise.

        Raises:
            ValueError: an id in logit_bias, allowed_token_ids, bad_words or
                stop_token_ids is ≥ ``vocab_size`` (the message names the field).
        """
        groups = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            # (string words become ids through the engine's tokenizer: always in the vocabulary)
            "bad_words": [t for w in self.bad_words or () if not isinstance(w, str) for t in w],
            "stop_token_ids": list(self.stop_token_ids or ()),
        }
        for name, ids in groups.items():
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    # --------------------------------------------------------------- derived
    @property
    def greedy(self) -> bool:
        """True when the sampler may take the argmax (temperature below 1e-5, or top_k 1).

        A temperature that small only sharpens the distribution onto its argmax anyway, and
        one below ~1.4e-45 would round to 0 in float32 (a division by zero)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """Number of sequences drawn for the request (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n


def _bias_dict(bias) -> dict[int, float]:
    """logit_bias as {int: float}; JSON gives string keys ("50256": -100)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tok = int(k) if not isinstance(k, (bool, float)) else None
        except (TypeError, ValueError):
            tok = None
        if tok is None:
            raise ValueError(f"logit_bias keys must be integer token ids, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"logit_bias[{tok}] must be a number, got {v!r}")
        out[tok] = float(v)
    return out


def require_utf8(text: str, what: str) -> str:
    """``text`` unchanged; ValueError naming ``what`` if it holds lone surrogates, i.e. came
    from bytes that are not UTF-8 (Python keeps such command-line, stdin or
    ``errors="surrogateescape"`` bytes as lone surrogates, which no tokenizer takes and no
    generated text can contain)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text (a lone surrogate {text[e.start]!r} at character "
                         f"{e.start})") from None
    return text


def _int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, allow_none: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name} must be an integer, got None")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _range(name, value, lo, hi, False, False)


def _float(
    name: str, value, lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    _range(name, value, lo, hi, lo_open, False)


def _range(name, value, lo, hi, lo_open, hi_open) -> None:
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi))
    )
    if bad:
        lo_s = "" if lo is None else (f"{lo} < " if lo_open else f"{lo} ≤ ")
        hi_s = "" if hi is None else f" ≤ {hi}"
        raise ValueError(f"{name} must satisfy {lo_s}{name}{hi_s}, got {value!r}")
