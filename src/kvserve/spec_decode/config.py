"""``speculative_config``: which proposer drafts tokens and how many (vLLM's field names).

Accepted forms (a dict, or its JSON text on the command line)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "path/to/small/model", "num_speculative_tokens": 4}
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from kvserve.config import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per verification: [1, 16]
MAX_PROMPT_LOOKUP = 64  # longest n-gram matched: [1, 64]
_FIELDS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration.

    Attributes:
        method: ``"ngram"`` (prompt lookup decoding) or ``"draft_model"``.
        num_speculative_tokens: k, drafts proposed per step and request, in [1, 16].
        prompt_lookup_max / prompt_lookup_min: n-gram lengths tried, longest first
            (ngram only), 1 ≤ min ≤ max ≤ 64.
        model: the draft model's path (draft_model only); it must share the target's
            vocabulary (checked when the engine loads it).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """A config from a dict, its JSON text, a config, or None (no speculation).

        Raises:
            ValueError: naming ``speculative_config.<field>`` and its allowed values: not a
                dict / invalid JSON, an unknown field, a bad ``method``, ``num_speculative_tokens``
                missing or outside [1, 16], lookup lengths outside [1, 64] or min > max, a
                missing ``model`` for ``draft_model``.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        unknown = sorted(set(value) - set(_FIELDS[method]))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown} for method {method!r}; "
                             f"allowed: {list(_FIELDS[method])}")

        def integer(field: str, lo: int, hi: int, default: Optional[int] = None) -> int:
            v = value.get(field, default)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{field} must be an integer in [{lo}, {hi}], got {v!r}")
            return int(v)

        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if method == "ngram":
            hi = integer("prompt_lookup_max", 1, MAX_PROMPT_LOOKUP, 4)
            lo = integer("prompt_lookup_min", 1, MAX_PROMPT_LOOKUP, 1)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be ≤ "
                                 f"speculative_config.prompt_lookup_max ({hi})")
            return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo)
        model = value.get("model")
        if not isinstance(model, (str, os.PathLike)) or not str(model):
            raise ValueError(f"speculative_config.model must be the draft model's path (GGUF file or "
                             f"Hugging Face folder) for method 'draft_model', got {model!r}")
        if not Path(model).expanduser().exists():
            raise ValueError(f"speculative_config.model: the draft model path {str(model)!r} does not exist")
        return cls(method, k, model=str(model))
