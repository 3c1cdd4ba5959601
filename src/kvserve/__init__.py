"""kvserve: an LLM inference and serving engine in PyTorch.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`,
:class:`LLMEngine` / :class:`EngineArgs` (the step loop), and the outputs
(:class:`RequestOutput`, :class:`CompletionOutput`, :class:`Logprob`: vLLM's shapes).
"""

import os as _os
import sys as _sys

# OpenMP threads that busy-wait between parallel regions (libgomp's default spins ~300k times)
# collapse when another process wants the same cores: next to a PyTorch job on this 2-core
# machine, decode fell from ~100 to 1 token/s; with a 1000-spin wait it keeps ~33, at a cost
# of ~5% on an idle machine. libgomp reads this once, when torch loads it, so it only applies
# when kvserve is imported before torch (the `kvserve` CLI and server); set GOMP_SPINCOUNT or
# OMP_WAIT_POLICY yourself to override.
if "torch" not in _sys.modules:
    _os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LLMEngine", "EngineArgs", "RequestOutput",
           "CompletionOutput", "Logprob", "GenerationError", "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing kvserve stays cheap
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM

        return LLM
    if name in ("LLMEngine", "EngineArgs"):
        from kvserve.engine import llm_engine as engine

        return getattr(engine, name)
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "TokenLogprob"):
        from kvserve.core import request

        return getattr(request, name)
    if name == "GenerationError":
        from kvserve.entrypoints.llm import GenerationError

        return GenerationError
    raise AttributeError(name)
