"""Token ids → the strings and bytes that OpenAI's logprobs objects show.

``bytes`` is a token's exact UTF-8 byte sequence (so a client can join the bytes of the
tokens of a character split over several tokens); ``token`` is those bytes decoded with
replacement. Byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen) store tokens in the
``bytes_to_unicode`` alphabet; SentencePiece tokenizers use ``▁`` for a space and
``<0xNN>`` for raw bytes; anything else falls back to ``tokenizer.decode([id])``.

Logprobs are floats that may be ``-inf`` (a token masked by logit_bias, top-k...); JSON has
no infinity, so like vLLM we clamp them to ``-9999.0``.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any, Optional, Sequence

from kvserve.core.request import TokenLogprob

MIN_LOGPROB = -9999.0
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def safe_logprob(lp: float) -> float:
    """A JSON-safe logprob: -inf and NaN → -9999.0."""
    if lp is None or math.isnan(lp) or lp < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(lp)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """Per-token string and bytes of one tokenizer, cached.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._byte_level = self._detect_byte_level()
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.token_str = lru_cache(maxsize=1 << 16)(self._token_str)

    def _detect_byte_level(self) -> bool:
        try:
            decoder = self.tokenizer.backend_tokenizer.decoder
        except AttributeError:
            return False
        return "ByteLevel" in repr(decoder)

    def _token_bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if tok is None:
            return b""
        if token_id in self._added:
            return tok.encode("utf-8")
        if self._byte_level and all(c in _BYTE_DECODER for c in tok):
            return bytes(_BYTE_DECODER[c] for c in tok)
        m = _HEX_BYTE.match(tok)
        if m:
            return bytes([int(m.group(1), 16)])
        if "▁" in tok:
            return tok.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def _token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # ----------------------------------------------------------- formatters
    def chat_logprobs(self, entries: Sequence[TokenLogprob], k: int) -> list[dict]:
        """``choices[].logprobs.content`` entries: token, logprob, bytes, top_logprobs."""
        out = []
        for e in entries:
            out.append({
                "token": self.token_str(e.token_id),
                "logprob": safe_logprob(e.logprob),
                "bytes": list(self.token_bytes(e.token_id)),
                "top_logprobs": [
                    {"token": self.token_str(t), "logprob": safe_logprob(lp), "bytes": list(self.token_bytes(t))}
                    for t, lp in e.top[:k]
                ],
            })
        return out

    def completion_logprobs(self, entries: Sequence[Optional[TokenLogprob]], token_ids: Sequence[int],
                            k: int, text_offset: int = 0) -> dict:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.

        ``entries[i]`` is the logprob of ``token_ids[i]`` (None for the first prompt token,
        whose logprob is undefined). Each ``top_logprobs`` dict holds the top-k tokens plus the
        chosen one, as OpenAI's does.
        """
        tokens, lps, tops, offsets = [], [], [], []
        pos = text_offset
        for tid, e in zip(token_ids, entries):
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(safe_logprob(e.logprob))
            top = {self.token_str(t): safe_logprob(lp) for t, lp in e.top[:k]}
            top.setdefault(s, safe_logprob(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
