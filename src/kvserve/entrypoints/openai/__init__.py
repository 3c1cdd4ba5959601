"""The OpenAI-compatible HTTP server (``kvserve serve``).

:func:`build_app` wraps an :class:`~kvserve.engine.llm_engine.LLMEngine` in a FastAPI app whose
lifespan runs the engine's step loop in a background thread (:class:`AsyncEngine`), or, given
:class:`~kvserve.engine.args.EngineArgs` (``kvserve serve``'s default), starts the engine core in
its own process and talks to it over pipes (:class:`MPAsyncEngine`,
:class:`~kvserve.engine.core_client.CoreClient`).
"""

from kvserve.entrypoints.openai.api import OpenAIServer, build_app
from kvserve.entrypoints.openai.async_engine import AsyncEngine, EngineStoppedError, MPAsyncEngine

__all__ = ["AsyncEngine", "EngineStoppedError", "MPAsyncEngine", "OpenAIServer", "build_app"]
