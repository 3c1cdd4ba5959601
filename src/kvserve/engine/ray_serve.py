"""Engine replicas deployed on Ray Serve: :class:`ReplicaDeployment`.

One Ray Serve application per replica, each with one deployment of one
:class:`~kvserve.engine.replica.EngineReplica` (so the front end addresses each replica by
name: its router picks the replica, and ``/metrics`` and ``/health`` report each one). Ray
Serve runs the replicas' actors, checks their health every :data:`HEALTH_CHECK_PERIOD_S`
seconds and replaces a replica whose actor died or whose ``check_health`` failed.

Ray itself: this process joins the cluster named by ``RAY_ADDRESS``, or starts a local Ray
instance (stopped with :meth:`ReplicaDeployment.shutdown`). Across machines, start a Ray
cluster (``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others)
and run ``kvserve serve`` with ``RAY_ADDRESS=HEAD:6379``: Ray places the replicas on the
nodes with free CPUs (``--replica-cpus`` each), and the prefill replicas' KV blocks reach the
decode replicas through Ray's object store.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Optional

from kvserve.engine.core_proc import CoreInfo

logger = logging.getLogger("kvserve.engine.ray_serve")

#: seconds between Ray Serve's health checks of a replica
HEALTH_CHECK_PERIOD_S = 2.0
#: seconds a health check may take
HEALTH_CHECK_TIMEOUT_S = 30.0
#: requests (streams and command calls) a replica accepts at once: the engine queues, not Ray
MAX_ONGOING_REQUESTS = 100_000
#: the local Ray instance's object store when replicas move KV blocks (bytes)
PD_OBJECT_STORE_BYTES = 1 << 30


class ReplicaStartError(RuntimeError):
    """A replica did not start (its deployment failed, or timed out)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its ``name`` (``replica-0``, ``prefill-0``, ``decode-1``), its ``role``
    (``"replica"``, ``"prefill"`` or ``"decode"``) and its Ray Serve application's name."""

    name: str
    role: str
    app_name: str


def replica_specs(data_parallel_size: int = 1, prefill_replicas: int = 0, decode_replicas: int = 0,
                  app_prefix: str = "kvserve") -> list[ReplicaSpec]:
    """The replicas of a deployment: ``data_parallel_size`` plain ones, or
    ``prefill_replicas`` + ``decode_replicas`` disaggregated ones.

    Raises:
        ValueError: naming the option and its range: ``data_parallel_size`` not an integer ≥ 1,
            a negative or non-integer replica count, only one of the prefill and decode counts,
            or both kinds given.
    """
    if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool) or data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be an integer ≥ 1 (1: one engine, no replicas), "
                         f"got {data_parallel_size!r}")
    for name, v in (("--prefill-replicas", prefill_replicas), ("--decode-replicas", decode_replicas)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an integer ≥ 0 (0: no prefill/decode disaggregation, which needs "
                             f"--prefill-replicas and --decode-replicas both ≥ 1), got {v!r}")
    if prefill_replicas or decode_replicas:
        if data_parallel_size > 1:
            raise ValueError("give either --data-parallel-size or --prefill-replicas/--decode-replicas, not both")
        if prefill_replicas < 1 or decode_replicas < 1:
            raise ValueError(f"--prefill-replicas and --decode-replicas must both be ≥ 1 (prefill/decode "
                             f"disaggregation), got {prefill_replicas} and {decode_replicas}")
        roles = [("prefill", i) for i in range(prefill_replicas)] + [("decode", i) for i in range(decode_replicas)]
    else:
        roles = [("replica", i) for i in range(data_parallel_size)]
    return [ReplicaSpec(f"{role}-{i}", role, f"{app_prefix}-{role}-{i}") for role, i in roles]


class ReplicaDeployment:
    """Engine replicas on Ray Serve for one front end.

    Args:
        args: the :class:`~kvserve.engine.args.EngineArgs` of every replica (checked here, before
            anything starts; prefill and decode replicas get ``kv_connector="ray"``).
        specs: the replicas (:func:`replica_specs`).
        replica_cpus: Ray CPUs reserved per replica (None: 1 in a cluster; on a local instance
            this machine's cores shared out, at least 1 thread each).
        log_level: the ``kvserve`` loggers' level in the replicas.
        start_timeout_s: how long the replicas may take to load their model.

    Raises:
        ValueError: bad arguments (naming the field), a missing model (nothing was started); more
            CPUs (replicas × ``replica_cpus``) than the Ray cluster has, or has free
            (:func:`check_replica_cpus`; nothing was deployed, a local Ray instance is stopped).
        RayClusterError: ``RAY_ADDRESS`` cannot be reached.
        ReplicaStartError: a replica failed to start (the deployment is torn down).
    """

    def __init__(self, args, specs: list[ReplicaSpec], replica_cpus: Optional[float] = None,
                 log_level: int = logging.WARNING, start_timeout_s: float = 600.0) -> None:
        import torch

        from kvserve.executor.ray_executor import LOCAL_OBJECT_STORE_BYTES, _actor_env, connect_ray
        from kvserve.worker.loader import resolve_model_path
        from kvserve.worker.worker import available_cores

        args.check(option_names=True)
        if args.tensor_parallel_size > 1:
            raise ValueError("--tensor-parallel-size > 1 with replicas on Ray Serve is not supported yet: "
                             "use one or the other")
        if replica_cpus is not None and not (isinstance(replica_cpus, (int, float)) and 0 < replica_cpus <= 1024):
            raise ValueError(f"--replica-cpus must be in (0, 1024], got {replica_cpus!r}")
        args.resolved_quantization(resolve_model_path(args.model), option_names=True)  # (fails here, before Ray starts)
        disaggregated = any(s.role != "replica" for s in specs)
        self.specs = list(specs)
        self.args = args
        self.handles: dict = {}
        self.started_ray = connect_ray(1, torch.device("cpu"), num_cpus=len(specs) + 1,
                                       object_store_bytes=PD_OBJECT_STORE_BYTES if disaggregated
                                       else LOCAL_OBJECT_STORE_BYTES)
        try:
            cores = available_cores()
            self.num_threads = replica_threads(replica_cpus, cores, len(specs), self.started_ray)
            if replica_cpus is None:
                replica_cpus = max(cores / len(specs), 0.01) if self.started_ray else 1.0
            self.replica_cpus = replica_cpus
            check_replica_cpus(replica_cpus, self.specs, _ray_cpus())
            self._deploy(log_level, _actor_env(), disaggregated, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _deploy(self, log_level: int, env: dict, disaggregated: bool, timeout_s: float) -> None:
        from ray import serve

        from kvserve.engine.replica import EngineReplica

        serve.start(proxy_location="Disabled")
        targets = []
        for spec in self.specs:
            args = replace(self.args, kv_connector="ray") if disaggregated else self.args
            dep = serve.deployment(EngineReplica).options(
                name=spec.name, num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
                ray_actor_options={"num_cpus": self.replica_cpus, "runtime_env": {"env_vars": env}})
            targets.append(serve.RunTarget(dep.bind(args, self.num_threads, log_level), name=spec.app_name,
                                           route_prefix=None))
        serve.run_many(targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.app_states()
            failed = {n: s for n, s in states.items() if s[0] in ("DEPLOY_FAILED", "UNHEALTHY")}
            if failed:
                name, (state, message) = next(iter(failed.items()))
                raise ReplicaStartError(f"replica {name} failed to start ({state}): {_first_error(message)}")
            if all(s[0] == "RUNNING" for s in states.values()):
                break
            if time.monotonic() > deadline:
                raise ReplicaStartError(f"the replicas did not start within {timeout_s:.0f} s: {states}")
            time.sleep(0.5)
        for spec in self.specs:
            self.handles[spec.name] = serve.get_app_handle(spec.app_name)

    def app_states(self) -> dict[str, tuple[str, str]]:
        """``{replica name: (application status, message)}`` from ``serve.status()``
        (``RUNNING``, ``DEPLOYING``, ``UNHEALTHY``, ``DEPLOY_FAILED``...; ``MISSING`` if gone)."""
        from ray import serve

        apps = serve.status().applications
        out = {}
        for spec in self.specs:
            app = apps.get(spec.app_name)
            out[spec.name] = ("MISSING", "") if app is None else (str(getattr(app.status, "value", app.status)),
                                                                  app.message or "")
        return out

    def info(self, name: str, timeout_s: float = 30.0) -> CoreInfo:
        """The replica's :class:`CoreInfo` (its engine, its pid).

        Raises:
            TimeoutError, RayActorError...: the replica did not answer.
        """
        return self.handles[name].info.remote().result(timeout_s=timeout_s)

    def shutdown(self) -> None:
        """Stop the replicas: stop the local Ray instance if this process started one (its
        processes, the replicas', go with it), else delete the replicas' applications."""
        try:
            import ray

            if not ray.is_initialized():
                return
            if self.started_ray:
                ray.shutdown()
                return
            from ray import serve

            for spec in self.specs:
                try:
                    serve.delete(spec.app_name, _blocking=False)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.exception("stopping the replicas failed")
        finally:
            self.started_ray = False


def _describe(specs: list[ReplicaSpec]) -> str:
    """``"2 replicas"``, or ``"3 replicas (1 prefill + 2 decode)"``."""
    roles = {}
    for s in specs:
        roles[s.role] = roles.get(s.role, 0) + 1
    kinds = " + ".join(f"{n} {role}" for role, n in roles.items() if role != "replica")
    return f"{len(specs)} replica{'s' if len(specs) != 1 else ''}" + (f" ({kinds})" if kinds else "")


def _ray_cpus() -> tuple[float, float]:
    """``(CPUs of the Ray cluster, CPUs free now)``: ``ray.cluster_resources()`` and
    ``ray.available_resources()``."""
    import ray

    return ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)


def replica_threads(replica_cpus: Optional[float], cores: int, num_replicas: int, local: bool) -> int:
    """torch threads of each replica: ``--replica-cpus`` (whole CPUs, at least 1) when given, as
    its help says, else the local machine's ``cores`` shared out among ``num_replicas`` on a
    local Ray instance (``local``) and 1 in a cluster (the default Ray CPUs there)."""
    if replica_cpus is not None:
        return max(1, int(replica_cpus))
    return max(1, cores // num_replicas) if local else 1


def check_replica_cpus(replica_cpus: float, specs: list[ReplicaSpec], cluster_cpus: tuple[float, float]) -> None:
    """Fail before anything is deployed when the replicas cannot all be placed: Ray Serve
    would otherwise wait for the CPUs forever (``serve.run`` of a replica that no node can
    take never fails).

    Args:
        replica_cpus: Ray CPUs per replica (``--replica-cpus``).
        specs: the replicas.
        cluster_cpus: ``(the cluster's CPUs, the CPUs free now)`` (:func:`_ray_cpus`).

    Raises:
        ValueError: naming ``--replica-cpus``, the CPUs the replicas need (replicas ×
            ``replica_cpus``) and the cluster's (all of them, or those free).
    """
    total, free = cluster_cpus
    need = replica_cpus * len(specs)
    what = f"{_describe(specs)} of --replica-cpus {replica_cpus:g} need {need:g} Ray CPUs"
    if need > total + 1e-9:
        raise ValueError(f"{what}, but the Ray cluster has {total:g} CPUs (ray.cluster_resources()): lower "
                         f"--replica-cpus or the number of replicas, or add nodes to the cluster (RAY_ADDRESS)")
    if need > free + 1e-9:
        raise ValueError(f"{what}, but only {free:g} of the Ray cluster's {total:g} CPUs are free (others hold "
                         f"them: `ray status`): lower --replica-cpus or the number of replicas")


def _first_error(message: str) -> str:
    """The last line of a Ray traceback in a status message (the exception), or the message."""
    lines = [ln for ln in (message or "").strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "(no message)"


def default_app_prefix() -> str:
    """``kvserve-<pid>``: the replicas of two front ends on one cluster do not collide."""
    return f"kvserve-{os.getpid()}"
