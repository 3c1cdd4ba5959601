"""Structured output: constrain generation to a JSON schema, regex, choice list or grammar.

The grammars run on llguidance (https://github.com/guidance-ai/llguidance): an Earley parser
over a lexer of derivative-based regexes, which computes the set of tokens that keep the
output a prefix of the language ("token masks") in well under a millisecond per step.

* :class:`StructuredOutputManager` (one per engine) owns the llguidance tokenizer (built on
  first use from the engine's Hugging Face tokenizer, ~0.5 s for a 49k vocabulary) and a
  bounded LRU cache of compiled grammars keyed by the request's spec. It turns a
  :class:`~kvserve.sampling_params.StructuredOutputsParams` into a per-sequence
  :class:`StructuredOutputGrammar` (a copy of the cached matcher), and reports an invalid
  schema, regex or grammar as a ``ValueError`` naming the field.
* :class:`StructuredOutputGrammar` is one sequence's matcher: the engine advances it with
  every token the sequence samples (so its state depends on the output tokens only, and
  preemption, which keeps them, never disturbs it) and ends the sequence when the grammar
  is complete.
* :func:`grammar_bitmask` fills the token bitmasks of a batch's constrained rows, ``[G, W]``
  int32 (bit ``j`` of word ``w`` allows token ``32·w + j``); the sampler applies them to the
  logits before anything else chooses a token (:mod:`kvserve.sample.sampler`, step 1).
* Speculative decoding: :meth:`StructuredOutputGrammar.valid_prefix` finds where the grammar
  stops accepting a request's drafts (the engine truncates them there), and
  :func:`speculative_bitmask` fills one bitmask row per verified position (row ``i``: the
  state after the first ``i`` drafts) by advancing each matcher through its drafts and
  rolling it back, so that the rejection sampler's target distribution at every position
  is the masked one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from kvserve.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputManager", "StructuredOutputGrammar", "grammar_bitmask", "speculative_bitmask"]

#: Compiled grammars kept per engine (least recently used dropped first).
DEFAULT_GRAMMAR_CACHE_SIZE = 128


class GrammarLimitError(RuntimeError):
    """A request's grammar hit one of llguidance's limits while it ran (e.g. ``a{1000000}``, a
    JSON schema whose ``$ref`` loops, a grammar that can never end): the request's own input is
    at fault, so the server answers 400 (``param``: the field), not 500."""

    param = "structured_outputs"


class StructuredOutputGrammar:
    """The grammar state of one sequence (an llguidance ``LLMatcher``).

    Attributes:
        matcher: the matcher; it has consumed exactly the sequence's output tokens.
        vocab_size: size of the matcher's vocabulary (its bitmask has ``ceil(vocab_size / 32)``
            words); at least the model's vocabulary, padded rows of the model's LM head
            included (they are never allowed).
    """

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept_token(self, token_id: int) -> None:
        """Advance the grammar by one sampled token.

        Raises:
            GrammarLimitError: the grammar rejects the token. The sampler only draws tokens
                the mask allows, so the grammar hit one of llguidance's limits (its Earley row
                size, item count, regex size): the request's own grammar is at fault. The
                message is llguidance's.
        """
        if not self.matcher.consume_token(token_id):
            # (llguidance appends its parser state to the message: the first line says it)
            raise GrammarLimitError(f"structured output: the grammar rejected token {token_id}: "
                                    f"{_first_lines(self.matcher.get_error() or 'not allowed here', 1)}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts, one after another, from its current
        state (llguidance's ``validate_tokens``; the matcher is left as it was). EOS counts as
        accepted where the output may end. 0 for a matcher in an error state."""
        if not tokens or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens(list(tokens)))

    def is_terminated(self) -> bool:
        """True when the output is complete: the grammar allows nothing more (EOS at most)."""
        return self.matcher.is_stopped()

    def is_error(self) -> bool:
        return self.matcher.is_error()


class StructuredOutputManager:
    """Compiles structured-output specs into grammars for one engine (thread-safe).

    Args:
        tokenizer: the model's Hugging Face tokenizer (a fast one).
        vocab_size: the model's vocabulary (logits columns); may exceed the tokenizer's.
        eos_token_ids: the tokens that end a sequence; the grammars allow them exactly where
            the output may end.
        cache_size: compiled grammars kept (LRU).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.cache_size = int(cache_size)
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def ll_tokenizer(self):
        """The llguidance tokenizer (built on first use, ~0.5 s for a 49k vocabulary).

        Raises:
            ValueError: the tokenizer is not a fast (Rust) tokenizer or has no EOS token.
        """
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_ll_tokenizer()
            return self._ll_tokenizer

    def _build_ll_tokenizer(self):
        import llguidance.hf

        if not self.eos_token_ids:
            raise ValueError("structured_outputs: the model has no EOS token, so no grammar could end")
        n_vocab = max(self.vocab_size, len(self.tokenizer))
        try:
            return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids)
        except Exception as e:  # llguidance raises ValueError / RuntimeError
            raise ValueError(f"structured_outputs: cannot use this model's tokenizer "
                             f"({type(self.tokenizer).__name__}) for structured output: {e}") from e

    @staticmethod
    def grammar_spec(params: StructuredOutputsParams) -> tuple[str, str, str]:
        """(field, format, text) of a spec; the cache key is (format, text). The format is
        llguidance's (``json_schema``, ``regex``, ``choice``, ``grammar``), or ``json_compact``
        for a JSON schema without free whitespace.

        Raises:
            ValueError: ``json`` given as text that is not JSON.
        """
        kind = params.kind
        fmt = "json_compact" if params.disable_any_whitespace else "json_schema"
        if kind == "json":
            if isinstance(params.json, str):
                try:
                    json.loads(params.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from None
                return kind, fmt, params.json
            return kind, fmt, json.dumps(params.json, ensure_ascii=False)  # (property order kept)
        if kind == "json_object":
            return kind, fmt, '{"type": "object"}'
        if kind == "choice":
            return kind, "choice", json.dumps(params.choice, ensure_ascii=False)
        if kind == "regex":
            return kind, "regex", params.regex
        return kind, "grammar", params.grammar

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a spec: a fresh llguidance matcher, from the cache if it is there.

        Raises:
            ValueError: ``structured_outputs.<field>: invalid ...: <llguidance's message>`` for
                an invalid JSON schema (or one using keywords llguidance does not support), regex
                or grammar.
        """
        import llguidance

        field, fmt, text = self.grammar_spec(params)
        key = (fmt, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        ll_tokenizer = self.ll_tokenizer
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
                "grammar": "grammar"}[field]
        try:
            if fmt in ("json_schema", "json_compact"):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": fmt == "json_schema"})
            else:
                grammar = llguidance.grammar_from(fmt, text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{field}: invalid {what}: {e}") from None
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{field}: invalid {what}: {_first_lines(matcher.get_error())}")
        probe = matcher.deep_copy()  # the first step's mask: some limits are hit there already
        probe.compute_bitmask()
        if probe.is_error():  # (its first line says it; a parser-state dump follows)
            raise ValueError(f"structured_outputs.{field}: invalid {what}: {_first_lines(probe.get_error(), 1)}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A grammar state for one new sequence (a copy of the compiled matcher, ~0.05 ms).

        Raises:
            ValueError: as :meth:`compile`.
        """
        return StructuredOutputGrammar(self.compile(params).deep_copy(), self.ll_tokenizer.vocab_size)


def _first_lines(msg: str, n: int = 12) -> str:
    lines = msg.strip().splitlines()
    return "\n".join(lines[:n]) + (" ..." if len(lines) > n else "")


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def _fill_rows(mask: torch.Tensor, rows: Sequence[tuple[Any, int]]) -> None:
    """Fill ``mask[row]`` with the next-token bitmask of each ``(matcher, row)``; several rows
    in parallel in llguidance's thread pool (the GIL released)."""
    import llguidance.torch as llt

    if len(rows) == 1:
        llt.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
    else:
        llt.fill_next_token_bitmask_par(_executor(), list(rows), mask)


def grammar_bitmask(grammars: Sequence[StructuredOutputGrammar]) -> torch.Tensor:
    """The token bitmasks of the next step for ``grammars`` → ``[G, W]`` int32 on the CPU.

    Bit ``j`` of word ``w`` of row ``i`` is set when token ``32·w + j`` may follow the output of
    sequence ``i`` (EOS only where the output may end). Rows of several grammars are computed
    in parallel by llguidance's thread pool (with the GIL released). A grammar in an error
    state (one of llguidance's limits hit) gets an all-ones row: its sequence then samples
    freely and fails with the grammar's message when the token is accepted
    (:meth:`StructuredOutputGrammar.accept_token`), alone.

    Raises:
        ValueError: the grammars have different vocabulary sizes.
    """
    if not grammars:
        return torch.empty(0, 0, dtype=torch.int32)
    vocab = grammars[0].vocab_size
    if any(g.vocab_size != vocab for g in grammars):
        raise ValueError("grammar_bitmask: the grammars have different vocabulary sizes")
    mask = torch.empty(len(grammars), (vocab + 31) // 32, dtype=torch.int32)
    _fill_rows(mask, [(g.matcher, i) for i, g in enumerate(grammars)])
    for i, g in enumerate(grammars):
        if g.matcher.is_error():
            mask[i] = -1
    return mask


def speculative_bitmask(grammars: Sequence[StructuredOutputGrammar], drafts: Sequence[Sequence[int]],
                        num_valid: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The token bitmasks of the ``k_r + 1`` verified positions of each grammar's drafts
    → ``[sum(k_r + 1), W]`` int32 on the CPU, request r's rows consecutive and in order.

    Row ``i`` of request r is the mask of the state after its first ``i`` drafts: the matcher
    consumes the drafts one at a time and the row is filled after each (rows at the same
    depth of all requests in one call of llguidance's thread pool, the GIL released); then
    every matcher is rolled back by what it consumed, so it leaves exactly as it came.

    Args:
        grammars: one per verified request.
        drafts: per request its k_r drafts.
        num_valid: per request how many leading drafts the grammar accepts (default: all).
            The rows after the first ``num_valid[r] + 1`` (states after a draft the grammar
            rejects) are all-ones: their draft is rejected with certainty (its p is 0), so
            nothing is ever drawn at them. A grammar in an error state gets all-ones rows, as
            in :func:`grammar_bitmask`.

    Raises:
        ValueError: the grammars have different vocabulary sizes, or ``drafts`` /
            ``num_valid`` do not have one entry per grammar.
        RuntimeError: a matcher rejected a draft it had validated, or could not roll back
            (a bug: the matchers would no longer follow their sequences).
    """
    if len(drafts) != len(grammars) or (num_valid is not None and len(num_valid) != len(grammars)):
        raise ValueError("speculative_bitmask: drafts and num_valid need one entry per grammar")
    if not grammars:
        return torch.empty(0, 0, dtype=torch.int32)
    vocab = grammars[0].vocab_size
    if any(g.vocab_size != vocab for g in grammars):
        raise ValueError("speculative_bitmask: the grammars have different vocabulary sizes")
    ks = [len(d) for d in drafts]
    offsets = [0] * len(grammars)
    for r in range(1, len(grammars)):
        offsets[r] = offsets[r - 1] + ks[r - 1] + 1
    # m[r]: drafts the matcher consumes (those the grammar accepts); rows 0..m[r] are filled
    m = [0 if g.matcher.is_error() else min(k if num_valid is None else int(v), k)
         for g, k, v in zip(grammars, ks, num_valid if num_valid is not None else ks)]
    mask = torch.full((sum(ks) + len(grammars), (vocab + 31) // 32), -1, dtype=torch.int32)
    consumed = [0] * len(grammars)
    try:
        for depth in range(max(m) + 1):
            live = [r for r in range(len(grammars)) if depth <= m[r] and not grammars[r].matcher.is_error()]
            if not live:
                break
            _fill_rows(mask, [(grammars[r].matcher, offsets[r] + depth) for r in live])
            for r in live:
                if depth < m[r]:
                    if not grammars[r].matcher.consume_token(int(drafts[r][depth])):
                        raise RuntimeError(f"structured output: the grammar rejected draft {drafts[r][depth]} "
                                           f"that it had validated")
                    consumed[r] += 1
    finally:
        for g, n in zip(grammars, consumed):
            if n and not g.matcher.rollback(n):
                raise RuntimeError(f"structured output: the grammar could not roll back {n} draft tokens")
    # a state with nothing allowed (past the end of the output) or in error: all-ones (never drawn at)
    mask[(mask == 0).all(dim=1)] = -1
    return mask
