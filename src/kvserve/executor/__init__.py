"""Executors: how the engine core reaches its workers (:class:`Executor`)."""

from kvserve.executor.abstract import Executor
from kvserve.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
