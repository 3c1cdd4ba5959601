"""Incremental detokenization with UTF-8-safe streaming and stop strings.

Two layers, both O(1) amortized work per generated token:

1. Token ids → text (``_TextDecoder``), as vLLM and Hugging Face's ``TextStreamer``
   do it: keep a *prefix offset* and a *read offset* into the token ids, decode only
   the window ``ids[prefix:]`` and emit what it adds beyond ``decode(ids[prefix:read])``.
   Text whose decoding ends in U+FFFD (an incomplete UTF-8 sequence, e.g. the first
   bytes of an emoji split over byte-level BPE tokens) is held back until later
   tokens complete it. The window starts with a few prompt tokens, so the leading
   space of the first generated token survives for tokenizers (SentencePiece) that
   strip it at the start of a decode.
2. Text → stream with stop strings (``IncrementalDetokenizer``): each stop string is
   searched only in the newly added text plus ``len(stop) - 1`` characters before it;
   a tail of the text that could still become a stop string is held back from the
   stream, so a stream never shows any part of a stop string (unless
   ``include_stop_str_in_output``); on a match the text is cut at the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from kvserve.sampling_params import SamplingParams

# How many prompt tokens give the first generated token its decoding context (vLLM: 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """What one ``IncrementalDetokenizer.update`` produced.

    Attributes:
        text_delta: new text for the stream (may be ""); the concatenation of all
            deltas of a sequence is its final ``output_text``.
        stop_str: the stop string that matched in this update, else ``None``. When
            set, the sequence must finish (with reason "stop").
        num_new_tokens_kept: only with ``stop_str``: how many of this update's
            ``new_token_ids`` to keep, up to and including the token whose text
            completes the stop string (1 for a usual single-token update; 0 if the
            match lies in text of earlier tokens that was held back as an incomplete
            UTF-8 character; for several tokens, up to the one whose one-token update
            matched). The caller drops the tokens after them.
    """

    text_delta: str
    stop_str: Optional[str] = None
    num_new_tokens_kept: Optional[int] = None


class _TextDecoder:
    """Token ids → text, in deltas that never end inside a UTF-8 character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A fast tokenizer without clean-up decodes exactly as its Rust backend does; calling
        # the backend directly skips transformers' per-call Python (4.3 -> 1.4 us a decode).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend_decode = (backend.decode if backend is not None and hasattr(backend, "decode")
                                and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a UTF-8 character would make the first delta
        # wrong; shorten the context until it decodes cleanly (else use none).
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        self._ids: list[int] = context
        self._prefix = 0  # window start
        self._read = len(context)  # end of the tokens whose text was emitted
        self._prefix_text = self._decode(context)  # decode(ids[prefix:read]), cached

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens added whose text is not yet emitted (held as incomplete UTF-8)."""
        return len(self._ids) - self._read

    def add(self, new_token_ids: list[int], flush: bool) -> str:
        """Append tokens; return the text they complete (all of it when ``flush``)."""
        self._ids.extend(new_token_ids)
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        # Wait while the window adds nothing or ends in an incomplete character.
        if not flush and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT)):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return delta

    def held_text(self) -> str:
        """The text of the tokens added but not yet emitted, up to their last complete
        character (what :meth:`add` holds back while the window ends inside a character)."""
        return self._decode(self._ids[self._prefix :])[len(self._prefix_text) :].rstrip(_REPLACEMENT)

    def window(self) -> tuple[int, int]:
        """(prefix offset, length of the decoded prefix text): the state that a later
        ``text_lengths`` call measures from."""
        return self._prefix, len(self._prefix_text)

    def text_lengths(self, window: tuple[int, int], num_new: int) -> list[int]:
        """For k = 0..num_new: how many characters of text the tokens up to the k-th
        of the last ``num_new`` added give beyond what was emitted before ``window``
        was taken (trailing U+FFFD not counted). Used only after a stop match."""
        prefix, prefix_len = window
        n0 = len(self._ids) - num_new
        return [
            len(self._decode(self._ids[prefix : n0 + k]).rstrip(_REPLACEMENT)) - prefix_len
            for k in range(num_new + 1)
        ]


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into streamed text and checks stop strings.

    Usage (once per generated sequence)::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        upd = detok.update(new_ids, num_output_tokens, finished=is_last_step)
        stream(upd.text_delta)
        if upd.stop_str is not None: ...  # finish with reason "stop"

    The caller must pass ``finished=True`` on the last update of a sequence that ends
    for another reason (EOS, stop token, max_tokens, abort): that flushes text held
    back as an incomplete UTF-8 character or as a possible stop-string prefix. After
    a stop string matched, further updates return an empty delta. The text of a final
    EOS / stop token is part of the output only if the caller passes that token and
    ``skip_special_tokens`` is False; to leave it out, flush with
    ``update([], n, finished=True)`` instead.

    Guarantees: deltas never end inside a UTF-8 character (no spurious U+FFFD);
    ``emitted_offset`` never goes back; the concatenation of deltas equals the final
    ``output_text``, which equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``
    when no stop string matched (for byte-level BPE tokenizers; for SentencePiece the
    first token keeps its leading space, which a bare decode strips). Stop strings fire
    only once ``num_output_tokens >= params.min_tokens``; the text is cut before the
    match, or after it with ``include_stop_str_in_output``.

    Cost per update: two decodes of a window of a few tokens plus a scan of
    ``len(new text) + longest stop string`` characters.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        # (detokenize=False: no text at all, every update an empty delta)
        self._decoder = _TextDecoder(tokenizer, prompt_token_ids, params.skip_special_tokens) \
            if params.detokenize else None
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # A stream holds back up to len(stop) - 1 characters that may start a stop string.
        self._hold_stops = self._stops if not self._include_stop else []
        # Text = emitted text (kept as parts, joined lazily) + _pending (decoded, not
        # yet streamed: at most len(longest stop) - 1 characters between updates).
        # _recent = the last (longest stop - 1) characters of the text, for the search.
        self._recent_len = max((len(s) for s in self._stops), default=1) - 1
        self._emitted_parts: list[str] = []
        self._emitted = 0
        self._pending = ""
        self._recent = ""
        self._stop_str: Optional[str] = None
        self._finished = False

    # ------------------------------------------------------------------ state
    @property
    def output_text(self) -> str:
        """All text decoded so far (including text still held back from the stream),
        cut at the stop string, which is kept only with ``include_stop_str_in_output``."""
        if len(self._emitted_parts) > 1:
            self._emitted_parts = ["".join(self._emitted_parts)]
        return "".join(self._emitted_parts) + self._pending

    @property
    def emitted_offset(self) -> int:
        """Characters of ``output_text`` already returned as deltas (never decreases)."""
        return self._emitted

    @property
    def stop_str(self) -> Optional[str]:
        """The stop string that ended the sequence, if one did."""
        return self._stop_str

    @property
    def finished(self) -> bool:
        """True after a stop string matched or an update with ``finished=True``."""
        return self._finished

    # ----------------------------------------------------------------- update
    def update(self, new_token_ids: list[int], num_output_tokens: int, finished: bool = False) -> DetokenizerUpdate:
        """Add newly generated tokens and return the text that can be streamed now.

        Args:
            new_token_ids: tokens generated since the last update (usually 1; several
                with speculative decoding; may be empty, e.g. a final flush).
            num_output_tokens: tokens generated so far including these (for
                ``min_tokens``).
            finished: the sequence ends now for another reason (EOS, stop token,
                length, abort): emit everything held back.

        Returns:
            The delta for the stream and, if a stop string matched, which one (the
            sequence must then finish; the caller keeps only
            ``num_new_tokens_kept`` of ``new_token_ids``).

        Several tokens are taken as that many one-token updates (``num_output_tokens``
        counting each, ``finished`` applying to the last), stopping at the first stop-string
        match: the text, the holding back of incomplete UTF-8 characters and the stop
        matches are then those of the same tokens given one at a time (decoding them in one
        window would hold back all their text when the last ends inside a character, and
        a stop string in it would be found a step late). ``num_new_tokens_kept`` is then
        the number of tokens up to and including the one whose update matched.
        """
        if self._finished or self._decoder is None:
            self._finished = self._finished or finished
            return DetokenizerUpdate("")
        new_token_ids = list(new_token_ids)
        if len(new_token_ids) > 1:
            return self._update_each(new_token_ids, num_output_tokens, finished)
        window = self._decoder.window()
        delta = self._decoder.add(new_token_ids, flush=finished)
        # buf = the end of the text: up to _recent_len old characters, then the new ones.
        buf = self._recent + delta
        old = len(self._recent)
        self._pending += delta
        if delta and self._stops and num_output_tokens >= self._min_tokens:
            match = self._find_stop(buf, old)
            if match is not None:
                return self._stop(buf, old, match, window, len(new_token_ids))
        elif self._stops and num_output_tokens >= self._min_tokens and self._decoder.num_pending_tokens:
            # The new text ends inside a UTF-8 character and is held back, but a stop string
            # may already be complete in the characters before it: stop at this token, not at
            # the one that completes the character.
            held = self._decoder.held_text()
            match = self._find_stop(self._recent + held, old) if held else None
            if match is not None:
                self._pending += held
                return self._stop(self._recent + held, old, match, window, len(new_token_ids))
        if self._recent_len:
            self._recent = buf[-self._recent_len :]
        if finished:
            self._finished = True
            return DetokenizerUpdate(self._emit(len(self._pending)))
        return DetokenizerUpdate(self._emit(len(self._pending) - self._held_back_chars(buf)))

    def _update_each(self, new_token_ids: list[int], num_output_tokens: int, finished: bool) -> DetokenizerUpdate:
        """Several tokens as one-token updates (see :meth:`update`)."""
        first = num_output_tokens - len(new_token_ids)
        deltas = []
        last = len(new_token_ids) - 1
        for j, tok in enumerate(new_token_ids):
            upd = self.update([tok], first + j + 1, finished=finished and j == last)
            deltas.append(upd.text_delta)
            if upd.stop_str is not None:
                return DetokenizerUpdate("".join(deltas), stop_str=upd.stop_str, num_new_tokens_kept=j + 1)
        return DetokenizerUpdate("".join(deltas))

    # --------------------------------------------------------------- helpers
    def _emit(self, n: int) -> str:
        """Stream the first ``n`` pending characters."""
        if n <= 0:
            return ""
        delta, self._pending = self._pending[:n], self._pending[n:]
        self._emitted_parts.append(delta)
        self._emitted += n
        return delta

    def _find_stop(self, buf: str, old: int) -> Optional[tuple[int, str]]:
        """Earliest (index in buf, stop) among matches that end after ``buf[:old]``."""
        best: Optional[tuple[int, str]] = None
        for s in self._stops:
            i = buf.find(s, max(0, old - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_back_chars(self, buf: str) -> int:
        """Length of the longest tail of the text (which ends with ``buf``) that is a
        proper prefix of a stop string; 0 with ``include_stop_str_in_output``."""
        if not self._hold_stops or not buf:
            return 0
        last = buf[-1]
        longest = 0
        for s in self._hold_stops:
            # candidates: prefixes s[:k] ending with buf's last character
            k = s.rfind(last, 0, min(len(s) - 1, len(buf)))
            while k + 1 > longest:
                if buf.endswith(s[: k + 1]):
                    longest = k + 1
                    break
                k = s.rfind(last, 0, k)
        return longest

    def _stop(
        self, buf: str, old: int, match: tuple[int, str], window: tuple[int, int], num_new: int
    ) -> DetokenizerUpdate:
        index, stop = match
        end_in_buf = index + len(stop) if self._include_stop else index
        kept = num_new
        if num_new > 0:  # find the first new token whose text reaches the match end
            lengths = self._decoder.text_lengths(window, num_new)
            need = index + len(stop) - old  # characters of new text the match needs
            kept = next((k for k, n in enumerate(lengths) if n >= need), num_new)
        # The pending text is the end of buf; cut it where the output ends.
        self._pending = self._pending[: len(self._pending) - (len(buf) - end_in_buf)]
        self._stop_str = stop
        self._finished = True
        return DetokenizerUpdate(self._emit(len(self._pending)), stop_str=stop, num_new_tokens_kept=kept)
