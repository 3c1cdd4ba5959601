"""KV compression policies: which cached tokens a request keeps once its KV outgrows a budget.

A policy is set per engine (``LLM(kv_compression=...)``, ``--kv-compression JSON``) or per request
(``SamplingParams(kv_compression=...)``, the OpenAI requests' ``kv_compression`` field; a request's
own setting wins, ``{"method": "none"}`` turns the engine's off). Three methods:

* ``{"method": "streaming_llm", "sink_tokens": 4, "window": W}``: StreamingLLM (Xiao et al. 2023,
  "Efficient Streaming Language Models with Attention Sinks"): the first ``sink_tokens`` tokens
  (attention sinks) and the ``window`` most recent ones.
* ``{"method": "snapkv", "budget": B, "observation_window": 32, "kernel_size": 7}``: SnapKV
  (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): once the prompt
  is computed, per layer and KV head, the attention weights of the prompt's last
  ``observation_window`` queries onto the earlier keys are summed over the window (and over the
  query heads of the GQA group), max-pooled along the keys with ``kernel_size`` (stride 1, same
  length), and the ``B - observation_window`` best earlier keys are kept with the window itself.
  Only the prompt is compressed (as in the paper): generated tokens are all kept.
* ``{"method": "h2o", "budget": B, "recent": R}``: H2O (Zhang et al. 2023, "H2O: Heavy-Hitter
  Oracle for Efficient Generative Inference of Large Language Models"): per layer and KV head, the
  attention weight each cached key received, accumulated over every query computed so far (the
  prompt's and each decode step's, summed over the GQA group), ranks the keys; the ``B - R``
  heaviest keys before the ``R`` most recent tokens are kept with those ``R``.

Compaction is lazy by one block (``block_size`` tokens): StreamingLLM and H2O compact once the KV
holds ``kept + block_size`` tokens, back to ``kept`` (``sink_tokens + window``, or ``budget``), so
the K/V copy happens every ``block_size`` decode steps rather than every step; a query then sees
between ``kept`` and ``kept + block_size - 1`` cached tokens plus itself. The kept tokens are
moved into the first slots of the request's blocks (:class:`~kvserve.core.kv_ops.Compaction`);
they keep their RoPE rotation (keys are cached after RoPE), and new tokens get their true
positions (the model runner takes the KV index of a token as its position minus
``Request.num_dropped_tokens``). With a 2-/4-bit KV cache (``kv_cache_dtype`` int4 / int2) the
kept tokens' K/V are read as the attention read them and requantized into the new blocks, a
partial last block's rows kept in the model dtype, and SnapKV's / H2O's scores are the weights
of the keys each query attended (dequantized blocks, model-dtype rows of its own block):
:mod:`kvserve.worker.kv_compressor`.

The selection functions here are the reference (PyTorch, vectorized over layers and heads); the
workers call them on their own KV heads' scores (:mod:`kvserve.worker.kv_compressor`).
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from kvserve.config import json_object

METHODS = ("streaming_llm", "snapkv", "h2o", "none")
#: the fields each method takes (besides ``method``), with their defaults (None: required)
FIELDS: dict[str, dict[str, Optional[int]]] = {
    "streaming_llm": {"sink_tokens": 4, "window": None},
    "snapkv": {"budget": None, "observation_window": 32, "kernel_size": 7},
    "h2o": {"budget": None, "recent": None},
    "none": {},
}


@dataclass(frozen=True)
class KVCompressionConfig:
    """A validated KV compression policy (module docstring). Build it with :meth:`parse`.

    Attributes:
        method: ``"streaming_llm"``, ``"snapkv"``, ``"h2o"`` or ``"none"``.
        sink_tokens: StreamingLLM's attention sinks (tokens, ≥ 0).
        window: StreamingLLM's recent window (tokens, ≥ 1).
        budget: SnapKV's / H2O's kept tokens (≥ 1).
        observation_window: SnapKV's last prompt queries that vote (1 ≤ w < budget).
        kernel_size: SnapKV's max-pool width along the keys (odd, ≥ 1).
        recent: H2O's most recent tokens always kept (0 ≤ R < budget).
    """

    method: str
    sink_tokens: int = 4
    window: int = 0
    budget: int = 0
    observation_window: int = 32
    kernel_size: int = 7
    recent: int = 0

    @staticmethod
    def parse(value: Any, field: str = "kv_compression") -> Optional["KVCompressionConfig"]:
        """A config from a dict, its JSON text, a config, or None (None).

        Raises:
            ValueError: naming ``{field}.<name>``: not an object, an unknown method or field, a
                value that is not an integer or lies outside its range (given in the message).
        """
        if value is None or isinstance(value, KVCompressionConfig):
            return value
        value = json_object(value, field, '{"method": "streaming_llm", "window": 256}')
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{field}.method must be one of {list(METHODS)}, got {method!r}")
        allowed = FIELDS[method]
        unknown = sorted(set(value) - set(allowed) - {"method"})
        if unknown:
            raise ValueError(f"{field}: unknown field(s) {unknown} for method {method!r}; its fields are "
                             f"{['method', *allowed]}")
        kw: dict[str, int] = {}
        for name, default in allowed.items():
            v = value.get(name, default)
            if v is None:
                raise ValueError(f"{field}.{name} is required for method {method!r}")
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise ValueError(f"{field}.{name} must be an integer, got {v!r}")
            kw[name] = int(v)
        cfg = KVCompressionConfig(method, **kw)
        cfg._check(field)
        return cfg

    def _check(self, field: str) -> None:
        def need(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ValueError(f"{field}.{name} must be {rule}, got {getattr(self, name)}")

        if self.method == "streaming_llm":
            need("sink_tokens", self.sink_tokens >= 0, "≥ 0")
            need("window", self.window >= 1, "≥ 1")
        elif self.method == "snapkv":
            need("budget", self.budget >= 1, "≥ 1")
            need("observation_window", 1 <= self.observation_window < self.budget,
                 f"in [1, budget) = [1, {self.budget})")
            need("kernel_size", self.kernel_size >= 1 and self.kernel_size % 2 == 1, "an odd integer ≥ 1")
        elif self.method == "h2o":
            need("budget", self.budget >= 1, "≥ 1")
            need("recent", 0 <= self.recent < self.budget, f"in [0, budget) = [0, {self.budget})")

    def check_fits(self, max_model_len: int, field: str = "kv_compression") -> None:
        """Raises ValueError naming ``{field}.budget`` (``.window``) when the kept tokens exceed
        ``max_model_len``: a budget no sequence can reach."""
        if self.method == "streaming_llm" and self.sink_tokens + self.window > max_model_len:
            raise ValueError(f"{field}.window: sink_tokens + window = {self.sink_tokens + self.window} must be at "
                             f"most max_model_len ({max_model_len})")
        if self.method in ("snapkv", "h2o") and self.budget > max_model_len:
            raise ValueError(f"{field}.budget must be at most max_model_len ({max_model_len}), got {self.budget}")

    # ------------------------------------------------------------------ policy
    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def uses_scores(self) -> bool:
        """Whether the selection needs attention weights (SnapKV, H2O): the workers then record
        the column sums of the probabilities of the request's queries."""
        return self.method in ("snapkv", "h2o")

    @property
    def kept(self) -> int:
        """Tokens left after a compaction."""
        return self.sink_tokens + self.window if self.method == "streaming_llm" else self.budget

    def max_kv_tokens(self, num_prompt_tokens: int, max_tokens: int, max_chunk: int, block_size: int) -> int:
        """Most tokens a request's KV holds at once under this policy (its admission bound): the
        whole ``prompt + max_tokens`` at most; StreamingLLM / H2O: ``kept + block_size - 1`` plus
        one step's chunk (``max_chunk`` tokens, compacted after the step); SnapKV: the prompt
        (computed whole before the selection), then ``budget + max_tokens``."""
        full = num_prompt_tokens + max_tokens
        if self.method in ("streaming_llm", "h2o"):
            return min(full, self.kept + block_size - 1 + max_chunk)
        if self.method == "snapkv":
            return min(full, max(num_prompt_tokens, self.budget + max_tokens))
        return full

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"method": self.method, **{k: d[k] for k in FIELDS[self.method]}}


# ---------------------------------------------------------------------- selection
def streaming_keep(num_tokens: int, sink_tokens: int, window: int) -> list[int]:
    """KV indices StreamingLLM keeps of ``num_tokens``: ``[0, sink_tokens)`` and the last
    ``window`` (all of them when ``num_tokens <= sink_tokens + window``), ascending."""
    if num_tokens <= sink_tokens + window:
        return list(range(num_tokens))
    return list(range(sink_tokens)) + list(range(num_tokens - window, num_tokens))


def snapkv_keep(scores: torch.Tensor, budget: int, observation_window: int, kernel_size: int) -> torch.Tensor:
    """SnapKV's kept KV indices (Li et al. 2024, Algorithm 1).

    Args:
        scores: ``[..., n]`` float, per layer / KV head the attention probabilities of the last
            ``observation_window`` queries onto each of the ``n`` keys, summed over those queries
            and the query heads of the group (``n > budget``).
        budget, observation_window, kernel_size: as :class:`KVCompressionConfig`.

    Returns:
        ``[..., budget]`` int64 ascending: the top ``budget - observation_window`` keys of
        ``[0, n - observation_window)`` by ``max_pool1d(scores, kernel_size, stride 1, padding
        kernel_size // 2)`` (ties: the lower index), then the window ``[n - w, n)``.
    """
    n = scores.shape[-1]
    w = observation_window
    prefix = scores[..., : n - w].float()
    lead = prefix.shape[:-1]
    pooled = F.max_pool1d(prefix.reshape(-1, 1, n - w), kernel_size, stride=1, padding=kernel_size // 2)
    pooled = pooled.reshape(*lead, n - w)
    top = _topk_stable(pooled, budget - w)
    window = torch.arange(n - w, n, dtype=torch.long, device=scores.device).expand(*lead, w)
    return torch.cat([top, window], dim=-1)


def h2o_keep(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """H2O's kept KV indices (Zhang et al. 2023).

    Args:
        scores: ``[..., n]`` float, per layer / KV head the accumulated attention probability of
            each of the ``n`` keys (``n > budget``).

    Returns:
        ``[..., budget]`` int64 ascending: the ``budget - recent`` heaviest keys of
        ``[0, n - recent)`` (ties: the lower index), then ``[n - recent, n)``.
    """
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    top = _topk_stable(scores[..., : n - recent].float(), budget - recent)
    tail = torch.arange(n - recent, n, dtype=torch.long, device=scores.device).expand(*lead, recent)
    return torch.cat([top, tail], dim=-1)


def _topk_stable(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``x`` along the last dim, ties to the lower index, sorted
    ascending (a stable descending sort: deterministic, and what NumPy's stable argsort gives)."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
