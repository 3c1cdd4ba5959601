"""Executors: how the engine core reaches its workers (:class:`Executor`)."""

from kvserve.executor.abstract import Executor, ExecutorError
from kvserve.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "ExecutorError", "UniProcExecutor"]
