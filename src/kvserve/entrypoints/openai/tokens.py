"""Token ids → the strings and bytes that OpenAI's logprobs objects show.

``bytes`` is a token's exact UTF-8 byte sequence (so a client can join the bytes of the
tokens of a character split over several tokens); ``token`` is those bytes decoded with
replacement (:class:`~kvserve.engine.token_strings.TokenStrings`).

Logprobs are floats that may be ``-inf`` (a token masked by logit_bias, top-k...); JSON has
no infinity, so like vLLM we clamp them to ``-9999.0``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from kvserve.core.request import TokenLogprob
from kvserve.engine.token_strings import TokenStrings

MIN_LOGPROB = -9999.0


def safe_logprob(lp: float) -> float:
    """A JSON-safe logprob: -inf and NaN → -9999.0."""
    if lp is None or math.isnan(lp) or lp < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(lp)


class TokenTexts(TokenStrings):
    """Per-token string and bytes of one tokenizer (cached), and the OpenAI logprobs formats.

    Args:
        tokenizer: a transformers tokenizer.
    """

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
