"""The OpenAI-compatible HTTP server (``kvserve serve``).

:func:`build_app` wraps an :class:`~kvserve.engine.llm_engine.LLMEngine` in a FastAPI app whose
lifespan runs the engine's step loop in a background thread (:class:`AsyncEngine`).
"""

from kvserve.entrypoints.openai.api import OpenAIServer, build_app
from kvserve.entrypoints.openai.async_engine import AsyncEngine, EngineStoppedError

__all__ = ["AsyncEngine", "EngineStoppedError", "OpenAIServer", "build_app"]
