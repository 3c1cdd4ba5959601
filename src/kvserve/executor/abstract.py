"""The executor interface between the engine core and its workers (vLLM v1's ``Executor``).

The engine core schedules; an executor runs each step's batch on however many workers there
are, wherever they are. The core sees two calls:

* :meth:`Executor.execute_model`: one step's :class:`~kvserve.core.scheduler.SchedulerOutput`
  (with the KV block copies and swaps its workers apply first) in, the driver worker's
  :class:`~kvserve.worker.model_runner.ModelRunnerOutput` out;
* :meth:`Executor.collective_rpc`: call a method on every worker (load, KV allocation, ...)
  and return each worker's result, in rank order.

:class:`~kvserve.executor.uniproc_executor.UniProcExecutor` runs one worker in the core's own
process; executors over several processes (``mp``) or Ray actors implement the same calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from kvserve.core.scheduler import SchedulerOutput
from kvserve.worker.model_runner import ModelRunnerOutput


class ExecutorError(RuntimeError):
    """The executor itself failed (a worker died, the ranks fell out of step): no request's
    fault, and no later step can run. The engine core raises it instead of failing requests
    one by one, and reports itself unhealthy (:meth:`kvserve.engine.core.EngineCore.is_healthy`)."""


class Executor(ABC):
    """Runs the model on the engine's workers."""

    #: number of workers (tensor-parallel ranks)
    world_size: int = 1

    @property
    def is_alive(self) -> bool:
        """Whether every worker can still run steps (an in-process worker always can)."""
        return True

    @property
    def death(self) -> Optional[str]:
        """Why the workers cannot run steps any more (e.g. which rank died), or None."""
        return None

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker; their results in rank order.

        Raises:
            Whatever a worker's method raised (the first one, for several workers).
        """

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every worker; the driver worker's (rank 0's) output.

        Every worker gets the whole step, its ``kv_ops`` included (the block copies and swaps
        the core recorded since the last step: :mod:`kvserve.core.kv_ops`), and applies them
        to its own pools before the forward: that keeps the ranks' shards of the pools in step.

        Raises:
            ExecutorError: the workers cannot run steps any more.
            Whatever the forward or the sampler raised; the engine core then isolates the
            request at fault (:meth:`kvserve.engine.core.EngineCore.step`).
        """
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        """Release the workers (nothing for an in-process worker)."""
