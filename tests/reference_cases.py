"""Sampling parameters of the reference cases (tests/data/smollm2_greedy.json)."""

from kvserve import SamplingParams


def reference_params(case):
    n = case.get("max_tokens", len(case["greedy_ids"]) if "messages" in case else 32)
    if "messages" in case:
        return SamplingParams(max_tokens=n, temperature=0)
    # The reference ran transformers with EOS suppressed for plain prompts (min_new_tokens):
    # the same as min_tokens == max_tokens here.
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
