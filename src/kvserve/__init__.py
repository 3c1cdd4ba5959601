"""kvserve: an LLM inference and serving engine in PyTorch.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`,
:class:`LLMEngine` / :class:`EngineArgs` (the step loop).
"""

from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineArgs", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing kvserve stays cheap
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    if name in ("LLMEngine", "EngineArgs"):
        from kvserve import engine

        return getattr(engine, name)
    if name == "RequestOutput":
        from kvserve.request import RequestOutput

        return RequestOutput
    raise AttributeError(name)
