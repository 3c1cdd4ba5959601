"""N-gram proposer: prompt lookup decoding (Saxena 2023; vLLM's ``method="ngram"``).

The drafts for a sequence are the tokens that followed the most recent earlier occurrence
of its last n tokens in prompt + output, for the largest n in
``[prompt_lookup_min, prompt_lookup_max]`` that occurs. No model runs: the draft
distribution q is one-hot on each proposed token.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens per sequence by n-gram lookup.

    Args:
        num_speculative_tokens: k, most tokens proposed.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """Drafts continuing ``token_ids``.

        Args:
            token_ids: [L] int64, the sequence (prompt + output), last token included.
            max_drafts: most tokens to return (≤ k is used).

        Returns:
            Up to ``min(k, max_drafts)`` token ids; empty when no n-gram of the allowed
            lengths occurs earlier in the sequence.

        Cost: O(L) vectorized work — one comparison pass finds the earlier positions
        holding the last token, and each n is checked only at those positions.
        """
        k = min(self.k, max_drafts)
        L = len(token_ids)
        if k <= 0 or L < self.n_min + 1:
            return []
        # ends[j]: a match of the n-gram would end at position j < L - 1 (a token follows it)
        ends = np.flatnonzero(token_ids[: L - 1] == token_ids[L - 1])
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            cand = ends[ends >= n - 1]
            if cand.size == 0:
                continue
            ok = np.ones(cand.size, dtype=bool)
            for d in range(1, n):  # (n ≤ 64 comparisons, each over the candidates at once)
                ok &= token_ids[cand - d] == token_ids[L - 1 - d]
            hits = cand[ok]
            if hits.size:
                j = int(hits[-1]) + 1  # the most recent occurrence
                return token_ids[j : j + k].tolist()
        return []
