"""The OpenAI-compatible HTTP server (``kvserve serve``).

:func:`build_app` wraps an :class:`~kvserve.engine.llm_engine.LLMEngine` in a FastAPI app whose
lifespan runs the engine's step loop in a background thread (:class:`AsyncEngine`), or, given
:class:`~kvserve.engine.args.EngineArgs` (``kvserve serve``'s default), starts the engine core in
its own process and talks to it over pipes (:class:`MPAsyncEngine`,
:class:`~kvserve.engine.core_client.CoreClient`).

The names below are imported on first use: ``kvserve``'s command line imports
``kvserve.entrypoints.openai.cli`` to register ``serve``, and ``generate`` must not pay for FastAPI.
"""

import importlib

_EXPORTS = {"OpenAIServer": "kvserve.entrypoints.openai.api", "build_app": "kvserve.entrypoints.openai.api",
            "AsyncEngine": "kvserve.entrypoints.openai.async_engine",
            "EngineStoppedError": "kvserve.entrypoints.openai.async_engine",
            "MPAsyncEngine": "kvserve.entrypoints.openai.async_engine"}

__all__ = ["AsyncEngine", "EngineStoppedError", "MPAsyncEngine", "OpenAIServer", "build_app"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
