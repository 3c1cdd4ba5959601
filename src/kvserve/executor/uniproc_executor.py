"""The one-process executor: a single worker, called directly in the engine core's process."""

from __future__ import annotations

from typing import Any, Optional

from kvserve.executor.abstract import Executor
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs one :class:`~kvserve.worker.worker.Worker` in this process.

    Args:
        worker: the worker (rank 0 of 1).
    """

    world_size = 1

    def __init__(self, worker: Worker) -> None:
        self.driver_worker = worker

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]
