"""Tensor parallelism on Ray (``distributed_executor_backend="ray"``): rank 0 in the engine's
process, rank 1 a Ray actor in a placement group, gloo between them.

A mixed workload (chunked prefill, prefix-cache hits, n / best_of / beam search, structured
output, logprobs, swap preemption) gives the same outputs as one rank, on a local Ray instance
that the engine starts and stops; an engine joins a running cluster through ``RAY_ADDRESS``
(the ``kvserve`` CLI in a process of its own) and leaves it running; an unreachable
``RAY_ADDRESS`` fails fast with a clear error and starts nothing; a cluster without the CPUs
fails within the time-out; an actor killed mid-step fails the step with the executor's error.
Nothing is left behind: no Ray process, actor or placement group.

The tests run in file order: the first two need a process that is not connected to Ray yet;
the others share one local Ray instance (``ray_cluster``), stopped at the end of the module.
Several processes on 2 cores (the driver, an actor, Ray's own): slow, but they prove correctness
(no speed is measured here).
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from tp_workload import PROMPTS, mixed_workload, run, summary
from kvserve.executor.multiproc_executor import WorkerDiedError
from kvserve.executor.ray_executor import RayClusterError, RayExecutor, connect_ray



def _engine(folder, tp: int, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=128,
                max_num_batched_tokens=16, tensor_parallel_size=tp, distributed_executor_backend="ray")
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _descendants() -> set[int]:
    """The live (not zombie) processes under this one."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _wait_until(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _our_actors_alive() -> list:
    from ray._private.state import actors

    return [a for a in actors().values() if a["State"] == "ALIVE" and a["ActorClassName"] == "RayWorkerActor"]


def _our_groups_left() -> list:
    return [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith("kvserve-tp") and g["state"] != "REMOVED"]


def _cluster_idle() -> bool:
    """Every CPU free, and no actor or placement group of ours."""
    return (ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU")
            and not _our_actors_alive() and not _our_groups_left())


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------- no Ray in this process yet
def test_bad_configurations_and_an_unreachable_ray_address_fail_fast_and_start_nothing(
        tiny_model_dir, llama, monkeypatch, capsys):
    import kvserve.executor.ray_executor

    assert not ray.is_initialized(), "run this module's tests in file order (a Ray instance is already up)"
    before = _descendants()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 3 attention heads"):
        _engine(tiny_model_dir("llama_3heads")[0], 2)
    with monkeypatch.context() as m:  # a one-core machine: no local Ray instance of 2 ranks
        m.setattr(kvserve.executor.ray_executor, "available_cores", lambda: 1)
        with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 CPU cores .* set RAY_ADDRESS"):
            _engine(llama, 2)
    assert not ray.is_initialized() and _descendants() == before
    silent = socket.socket()  # a port that accepts connections and never answers (no GCS)
    silent.bind(("0.0.0.0", 0))
    silent.listen(8)
    try:
        for address in (f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{silent.getsockname()[1]}",
                        "ray://127.0.0.1:10001"):
            monkeypatch.setenv("RAY_ADDRESS", address)
            t0 = time.monotonic()
            with pytest.raises(RayClusterError, match=r"RAY_ADDRESS=.*distributed_executor_backend='ray'") as e:
                _engine(llama, 2)
            assert time.monotonic() - t0 < 15, address
            assert isinstance(e.value, ValueError) and isinstance(e.value, ConnectionError)
            assert not ray.is_initialized() and _descendants() == before
        # the CLI: one line naming RAY_ADDRESS, exit code 2, no traceback, nothing started
        from kvserve.entrypoints.cli import main

        capsys.readouterr()
        rc = main(["generate", "hello", "--model", str(llama), "--dtype", "float32", "-tp", "2",
                   "--distributed-executor-backend", "ray", "--max-model-len", "128"])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and "RAY_ADDRESS='ray://" in err and "Traceback" not in err
        assert not ray.is_initialized() and _descendants() == before
    finally:
        silent.close()


def test_tp2_on_a_local_ray_instance_equals_one_rank(llama, no_ray_address):
    """No Ray running: the engine starts a local instance, runs a mixed workload with chunked
    prefill, prefix caching, n/best_of/beams, a grammar, logprobs and swap preemption with the
    same outputs as one rank, and stops the instance when it shuts down."""
    assert not ray.is_initialized(), "run this module's tests in file order (a Ray instance is already up)"
    kw = dict(num_blocks=20, swap_space=0.01, preemption_mode="swap")
    ref = run(_engine(llama, 1, **kw), mixed_workload())
    assert not ray.is_initialized()  # (one rank: the worker is in this process, whatever the backend)
    before = _descendants()
    eng = _engine(llama, 2, **kw)
    try:
        ex = eng.executor
        assert isinstance(ex, RayExecutor) and ex.world_size == 2 and ex.started_ray and ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == len(os.sched_getaffinity(0))  # (this machine's cores)
        got = run(eng, mixed_workload())
        assert [summary(o) for o in got] == [summary(o) for o in ref]
        for a, b in zip(got, ref):
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
        assert eng.scheduler.num_preemptions > 0 and eng.stats()["swap_num_swap_outs"] > 0
        assert got[4].num_cached_tokens > 0 and eng.stats()["kv_blocks_in_use"] == 0
        assert ex.is_alive
    finally:
        eng.core.shutdown()
    assert not ray.is_initialized()  # (it started Ray: it stopped it)
    assert _wait_until(lambda: _descendants() <= before), "Ray's processes outlived the engine"


# ------------------------------------------------- one Ray instance for the rest
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance (2 CPUs) started as kvserve starts one; stopped at the end, and
    then no process of it is left."""
    before = _descendants()
    assert connect_ray(2, torch.device("cpu"))
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    assert _wait_until(lambda: _descendants() <= before), "Ray's processes outlived ray.shutdown()"


def test_not_enough_cpus_fails_within_the_timeout(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) exceeds the 2 CPUs of the Ray cluster"):
        RayExecutor(3, torch.float32, torch.device("cpu"), distributed_timeout_s=2.0)
    blocker = ray.util.placement_group([{"CPU": 1}])  # someone else holds one of the two CPUs
    assert blocker.wait(timeout_seconds=30)
    try:
        with pytest.raises(ValueError, match=r"could not reserve 2 bundles of one CPU .* within 2 s: 1 of its 2 CPUs"):
            RayExecutor(2, torch.float32, torch.device("cpu"), distributed_timeout_s=2.0)
        assert time.monotonic() - t0 < 15
        assert not _our_groups_left() and ray.is_initialized()  # (not its Ray to stop)
    finally:
        ray.util.remove_placement_group(blocker)
    assert _wait_until(_cluster_idle)


def test_an_actor_killed_mid_step_fails_the_step_and_leaves_nothing(llama, ray_cluster, monkeypatch):
    eng = _engine(llama, 2)
    ex = eng.executor
    assert not ex.started_ray
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    send = ex._send_forward

    def send_then_kill(kv_ops, inputs):  # the batch went out; then rank 1's actor is killed
        refs = send(kv_ops, inputs)
        ray.kill(ex.actors[0])
        return refs

    monkeypatch.setattr(ex, "_send_forward", send_then_kill)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(a Ray actor\) died during forward") as e:
        for _ in range(60):
            eng.step()
    assert time.monotonic() - t0 < 30 and "killed by `ray.kill`" in str(e.value)
    assert not ex.is_alive and not eng.core.is_healthy()
    with pytest.raises(WorkerDiedError):  # every later step fails at once
        eng.step()
    eng.core.shutdown()
    assert ray.is_initialized()  # (the cluster is not the executor's)
    assert _wait_until(_cluster_idle)


def test_an_actor_that_dies_between_steps_makes_the_engine_unhealthy(llama, ray_cluster):
    """The engine's health (``/health``) asks Ray: an actor that died while the engine was
    idle shows before any step runs; the next step fails at once."""
    eng = _engine(llama, 2)
    try:
        assert eng.core.is_healthy()
        ray.kill(eng.executor.actors[0])
        assert _wait_until(lambda: not eng.core.is_healthy(), 15)
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(a Ray actor\) died"):
            eng.step()
    finally:
        eng.core.shutdown()
    assert _wait_until(_cluster_idle)


def test_tp2_int4_kv_on_ray_actors_equals_one_rank(llama, ray_cluster):
    """2-/4-bit KV on Ray actors, which get their inputs by value (no memory shared with the
    driver): the residual map reaches the actor with each step, so its partial-block copies
    (n / best_of / beams) and its reads of partial blocks match the driver's. The mixed
    workload with swap preemption gives the one-rank outputs."""
    kw = dict(num_blocks=24, swap_space=0.01, preemption_mode="swap", kv_cache_dtype="int4")
    ref = run(_engine(llama, 1, **kw), mixed_workload())
    eng = _engine(llama, 2, **kw)
    try:
        assert isinstance(eng.executor, RayExecutor)
        got = run(eng, mixed_workload())
        assert [summary(o) for o in got] == [summary(o) for o in ref]
        assert eng.scheduler.num_preemptions > 0 and eng.stats()["swap_num_swap_outs"] > 0
    finally:
        eng.core.shutdown()
    assert _wait_until(_cluster_idle)


def test_joining_a_running_cluster_through_ray_address(llama, ray_cluster):
    """``kvserve generate -tp 2 --distributed-executor-backend ray`` in a process of its own, with
    RAY_ADDRESS naming this module's Ray instance: it joins it, prints the one-rank text, and
    leaves the cluster running with every CPU free again."""
    from kvserve import LLM

    prompt, max_tokens = "The quick brown fox", 12
    want = LLM(model=str(llama), dtype="float32", max_model_len=128, kv_cache_memory=0.01).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0].text
    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster,
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "generate", prompt, "--model", str(llama),
                        "--dtype", "float32", "-tp", "2", "--distributed-executor-backend", "ray", "--max-model-len",
                        "128", "--kv-cache-memory", "0.01", "--max-tokens", str(max_tokens), "-v"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"joined the Ray cluster at {ray_cluster}" in p.stderr
    assert p.stdout == want + "\n"
    assert _wait_until(_cluster_idle)
    assert ray.is_initialized() and ray.get(ray.remote(lambda: 1).remote(), timeout=60) == 1  # (still serving)
