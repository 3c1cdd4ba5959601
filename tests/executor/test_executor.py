"""The executor interface between the engine core and its workers: every step's batch goes
through ``Executor.execute_model`` once, ``collective_rpc`` reaches every worker, and an
executor that wraps another changes no output."""

import pytest

from kvserve import SamplingParams
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.executor import Executor, UniProcExecutor
from kvserve.worker.model_runner import ModelRunnerOutput

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class RecordingExecutor(Executor):
    """Forwards to another executor and records what the core sent it."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.batches: list[int] = []
        self.rpcs: list[str] = []

    def collective_rpc(self, method, args=(), kwargs=None):
        self.rpcs.append(method)
        return self.inner.collective_rpc(method, args, kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert isinstance(scheduler_output, SchedulerOutput)
        self.batches.append(scheduler_output.num_batched_tokens)
        return super().execute_model(scheduler_output)


def _engine(folder) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(folder), dtype="float32", num_blocks=32, block_size=4, max_model_len=64,
                                max_num_batched_tokens=8))


def _run(engine: LLMEngine) -> tuple[list[list[int]], int]:
    for p in PROMPTS:
        engine.add_request(p, PARAMS)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[k] for k in sorted(final, key=lambda r: int(r.split("-")[1]))], steps


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def test_one_process_executor_runs_one_worker(folder):
    engine = _engine(folder)
    assert isinstance(engine.executor, UniProcExecutor) and engine.executor.world_size == 1
    worker = engine.executor.driver_worker
    assert engine.model is worker.model and engine.runner is worker.runner
    assert engine.kv_caches is worker.kv_caches  # (the worker's: the core sends it block ops, kvserve.core.kv_ops)
    # collective_rpc: one result per worker, in rank order
    assert engine.executor.collective_rpc("__getattribute__", ("rank",)) == [0]
    with pytest.raises(AttributeError):
        engine.executor.collective_rpc("no_such_method")


def test_every_step_goes_through_execute_model_once(folder):
    expected, _ = _run(_engine(folder))
    engine = _engine(folder)
    rec = RecordingExecutor(engine.executor)
    engine.core.executor = rec
    outputs, steps = _run(engine)
    assert outputs == expected and all(len(t) == 12 for t in outputs)
    # one call per step that ran, each with that step's tokens (chunked prefill: budget 8)
    assert len(rec.batches) == steps
    assert max(rec.batches) <= 8 and sum(rec.batches) == sum(map(len, PROMPTS)) + 3 * 11
    assert rec.rpcs == ["execute_model"] * steps
