"""Token ids → each token's own bytes and text, cached per tokenizer.

``bytes`` is a token's exact UTF-8 byte sequence (so a client can join the bytes of the
tokens of a character split over several tokens); the text is those bytes decoded with
replacement. Byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen) store tokens in the
``bytes_to_unicode`` alphabet; SentencePiece tokenizers use ``▁`` for a space and
``<0xNN>`` for raw bytes; anything else falls back to ``tokenizer.decode([id])``. The
OpenAI server's logprobs and the offline ``Logprob.decoded_token`` both read them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


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


class TokenStrings:
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
