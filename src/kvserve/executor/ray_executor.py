"""The Ray executor: tensor-parallel ranks as Ray actors (``--distributed-executor-backend ray``).

The design is :class:`~kvserve.executor.multiproc_executor.MultiprocExecutor`'s with Ray in place
of :mod:`multiprocessing`, so that the same code spans machines: rank 0, the *driver*, is a
:class:`~kvserve.worker.worker.Worker` in the engine core's own process; ranks ``1 .. N-1`` are
Ray actors (:class:`RayWorkerActor`), each holding a ``Worker`` over its shard. The ranks form a
``torch.distributed`` group (gloo on CPU, NCCL on CUDA) whose rendezvous is the driver node's IP
and a port free there (``tcp://<driver ip>:<port>``).

Ray. When this process is not connected to Ray yet, the executor connects (:func:`connect_ray`):

* ``RAY_ADDRESS`` set (``host:port`` of a cluster's GCS, as ``ray start --head --port`` prints;
  or ``auto``): it joins that cluster. The address is checked first, with a socket connection and
  a gRPC handshake of a few seconds (:func:`check_ray_address`): ``ray.init`` of an address where
  no GCS answers waits minutes. Ray Client addresses (``ray://``) are refused: the driver rank
  runs in this process, which must be a node of the cluster.
* ``RAY_ADDRESS`` unset: it starts a private local Ray instance (``address="local"``: never a
  cluster that another user started with ``ray start`` on this machine), sized to this machine
  (``num_cpus`` = the cores this process may run on), with a small object store
  (:data:`LOCAL_OBJECT_STORE_BYTES`: the steps' tensors are small and go inline), no dashboard,
  Ray's own logging at WARNING and the actors' output left in Ray's session logs
  (``/tmp/ray/session_latest/logs``), not echoed here.

A process already connected to Ray (``ray.init`` called by the application) is used as it is.
Only an executor that started Ray stops it (:meth:`RayExecutor.shutdown`).

Placement, as vLLM does (``vllm/executor/ray_utils.py``): one placement group of ``N`` bundles of
``{"CPU": 1}`` (``{"GPU": 1}`` on CUDA), strategy ``PACK`` (as few nodes as possible, several
when one is not enough), the driver's bundle included: bundle 0 is pinned to the driver's node
(``node:<ip>``) and reserved for it, so that the cluster hands the driver's core (GPU) to no
one else; rank ``r`` is the actor in bundle ``r``. A group that spans nodes is logged (each
step's all-reduces then cross the network). On CUDA the driver takes a GPU of its node that no
actor on that node was given.

One step (:meth:`RayExecutor.execute_model`): the driver's model runner builds the batch tensors;
the executor sends them, with the step's KV block ops, to every actor once
(``actor.execute_forward.remote(kv_ops, input_ids, positions, meta, logits_indices)``: small
arguments travel inline in the call, not through the object store); all ranks apply the block
ops and run the forward together; the logits are gathered to the driver, which alone samples;
then the driver waits for the actors' replies (``ray.get`` with ``distributed_timeout_s``).
:meth:`~RayExecutor.collective_rpc` calls a worker method on every rank (loading, KV
allocation); the actors' results come back without their tensors (the KV pools stay there).

Faults, as in the ``mp`` executor: an actor that dies (``ray.exceptions.RayActorError``) makes
the call fail with :class:`~kvserve.executor.multiproc_executor.WorkerDiedError` naming its rank;
a step that fails once its batch went to the actors (an actor raised, or the driver did
mid-forward) may have left the ranks' collectives out of step: the actors are killed and the
step fails with a ``WorkerDiedError`` too. Either way the executor is unusable from then on
(:attr:`RayExecutor.is_alive` False: every later call fails at once; the engine core ends its
requests with the error and reports itself unhealthy). A step that fails before its batch went
out (the driver building it) is an ordinary request error. The actors are owned by this process:
Ray ends them when it exits, and a local Ray instance started here goes with it (at exit, or on
SIGTERM: ``ray.init`` installs a handler that exits through it; after a SIGKILL, Ray's own
agent processes linger about a minute and a half before they notice and exit).

Errors at construction, before any process of ours starts (none is left behind after any):

* ``ValueError``: the ``ray`` package is missing; on a local instance, more ranks than this
  machine's cores (CUDA devices); more ranks than the cluster has CPUs (GPUs);
* :class:`RayClusterError` (a ``ValueError`` and a ``ConnectionError``), naming ``RAY_ADDRESS``
  and ``distributed_executor_backend``: the cluster cannot be reached;
* ``ValueError``: the cluster has the CPUs (GPUs) but the placement group could not be reserved
  within ``distributed_timeout_s`` (others hold them: ``ray status``);
* ``WorkerDiedError`` / the rank's exception: an actor died or failed while starting.

Several processes on 2 shared cores are slow (each actor starts a Python with torch, Ray adds
its own processes): the tests prove correctness, they measure no speed.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch

from kvserve.executor.abstract import Executor
from kvserve.executor.multiproc_executor import WorkerDiedError, _picklable_error, _portable, build_driver_worker
from kvserve.worker.worker import Worker, available_cores

logger = logging.getLogger(__name__)

#: object store of a local Ray instance started by kvserve (Ray's minimum is 75 MiB)
LOCAL_OBJECT_STORE_BYTES = 96 << 20
#: how long the reachability check of ``RAY_ADDRESS`` may take, per stage (seconds)
RAY_PROBE_TIMEOUT_S = 3.0
#: how long a step that failed on the driver waits to learn whether an actor died (seconds)
DEATH_PROBE_S = 3.0
#: the environment the actors get from the driver (Ray's workers have their node's environment)
ENV_PREFIXES = ("KVSERVE_",)
ENV_NAMES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


class RayClusterError(ValueError, ConnectionError):
    """The Ray cluster named by ``RAY_ADDRESS`` cannot be reached (or is no Ray cluster)."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError(f"distributed_executor_backend='ray' needs the ray package ({e}): "
                         f"pip install 'ray==2.60.0', or use distributed_executor_backend='mp'") from None
    return ray


def _where() -> str:
    return "(distributed_executor_backend='ray'; unset RAY_ADDRESS to have kvserve start a local Ray instance)"


# The GCS check, run in a child Python so that no gRPC thread is left in this process (Ray
# forks its own processes later). It calls NodeInfoGcsService.GetClusterId, the first call
# ray.init makes, with an empty request (an empty protobuf message is b"").
_GCS_PROBE = r"""
import sys
try:
    import grpc
except ImportError:
    print("nogrpc"); sys.exit()
address, timeout = sys.argv[1], float(sys.argv[2])
channel = grpc.insecure_channel(address)
call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId",
                           request_serializer=lambda _: b"", response_deserializer=lambda b: b)
try:
    call(None, timeout=timeout)
    print("ok")
except grpc.RpcError as e:
    print(e.code().name, (e.details() or "").replace("\n", " ")[:200])
channel.close()
"""


def check_ray_address(address: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> str:
    """The GCS address ``host:port`` that ``address`` (``RAY_ADDRESS``'s value) names, once a
    TCP connection to it opened and a Ray GCS answered a gRPC call there, each within
    ``timeout_s`` (``ray.init`` of an address where no GCS answers waits minutes).

    Raises:
        RayClusterError: a ``ray://`` address, no running cluster for ``auto``, an address that
            does not parse, nothing listening, or a server that is no Ray GCS.
    """
    _import_ray()
    from ray._private.services import canonicalize_bootstrap_address

    what = f"RAY_ADDRESS={address!r}"
    if "://" in address:
        raise RayClusterError(f"{what}: Ray Client addresses are not supported; the driver rank runs in kvserve's "
                              f"process, which must be a node of the cluster: give the head's GCS address "
                              f"host:port (`ray start --head --port PORT`) {_where()}")
    try:
        resolved = canonicalize_bootstrap_address(address)
    except Exception as e:  # noqa: BLE001 - ConnectionError for "auto" without a cluster, ValueError for junk
        raise RayClusterError(f"cannot reach the Ray cluster at {what}: {e} {_where()}") from None
    if not resolved:
        raise RayClusterError(f"{what} names no Ray cluster {_where()}")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RayClusterError(f"cannot reach the Ray cluster at {what} ({resolved}: {e}); is it running "
                              f"(`ray start --head`)? {_where()}") from None
    try:
        reply = subprocess.run([sys.executable, "-c", _GCS_PROBE, resolved, str(timeout_s)], capture_output=True,
                               text=True, timeout=timeout_s + 30).stdout.strip()
    except subprocess.TimeoutExpired:
        reply = "DEADLINE_EXCEEDED the check did not finish"
    # ok, or a GCS that wants the cluster's token (ray.init reads it); without grpc: unchecked
    if reply in ("ok", "nogrpc") or reply.startswith("UNAUTHENTICATED"):
        return resolved
    code, _, details = reply.partition(" ")
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        raise RayClusterError(f"cannot reach the Ray cluster at {what} ({resolved}): no Ray GCS answered within "
                              f"{timeout_s:g} s ({code}: {details}) {_where()}")
    raise RayClusterError(f"the server at {what} ({resolved}) is not a Ray cluster's GCS ({code or 'no answer'}: "
                          f"{details}) {_where()}")


def connect_ray(world_size: int, device: torch.device, num_cpus: Optional[int] = None,
                object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES) -> bool:
    """Connect this process to Ray unless it is already: join the cluster of ``RAY_ADDRESS``, or
    start a local instance (``num_cpus`` logical CPUs, default this machine's cores; an object
    store of ``object_store_bytes``); returns whether a local instance was started here.

    Raises:
        RayClusterError: ``RAY_ADDRESS`` cannot be reached (nothing was started).
        ValueError: no ``ray`` package; for a local instance, more ranks than this machine's
            cores (CUDA devices) (nothing was started).
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # (no usage report, no prompt)
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        resolved = check_ray_address(address, RAY_PROBE_TIMEOUT_S)
        try:
            ray.init(address=resolved, **quiet)
        except Exception as e:  # noqa: BLE001 - e.g. a token the cluster requires
            raise RayClusterError(f"joining the Ray cluster at RAY_ADDRESS={address!r} ({resolved}) failed: "
                                  f"{type(e).__name__}: {e} {_where()}") from None
        logger.info("joined the Ray cluster at %s", resolved)
        return False
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size ({world_size}) exceeds the {torch.cuda.device_count()} CUDA devices "
                         f"of this machine (a local Ray instance; set RAY_ADDRESS to use a cluster)")
    cores = available_cores()
    if device.type == "cpu" and world_size > cores:
        raise ValueError(f"tensor_parallel_size ({world_size}) exceeds the {cores} CPU cores this process may run "
                         f"on: each rank needs a core of its own (a local Ray instance; set RAY_ADDRESS to use a "
                         f"cluster)")
    num_cpus = max(cores, num_cpus or 0)
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_bytes,
             include_dashboard=False, **quiet)
    logger.info("started a local Ray instance (%d CPUs)", num_cpus)
    return True


def _actor_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayWorkerActor:
    """A tensor-parallel rank other than the driver, as a Ray actor (the class is made remote
    by :class:`RayExecutor`): a :class:`Worker` built by :meth:`init_worker` once the driver
    knows where every actor runs; then the driver's calls. A method's exception is raised
    (in a form that pickles) to the driver."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Optional[Worker] = None

    def node_info(self) -> tuple[str, str, list]:
        """``(node id, node IP, the GPU ids Ray gave this actor)``."""
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def init_worker(self, world_size: int, dtype: torch.dtype, device: str, init_method: str,
                    timeout_s: Optional[float]) -> None:
        """Build the rank's :class:`Worker` (joins the group: returns once every rank joined)."""
        try:
            self.worker = Worker(dtype, torch.device(device), self.rank, world_size, init_method,
                                 distributed_timeout_s=timeout_s, logits_dst=0)
        except BaseException as e:  # noqa: BLE001 - raised to the driver
            raise _picklable_error(e, self.rank) from None

    def rpc(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``worker.method(*args, **kwargs)``, without the tensors of its result."""
        try:
            return _portable(getattr(self.worker, method)(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised to the driver
            raise _picklable_error(e, self.rank) from None

    def execute_forward(self, kv_ops, input_ids, positions, meta, logits_indices, residual=None) -> None:
        """:meth:`Worker.execute_forward` on the driver's batch."""
        try:
            self.worker.execute_forward(kv_ops, input_ids, positions, meta, logits_indices, residual)
        except BaseException as e:  # noqa: BLE001 - raised to the driver
            raise _picklable_error(e, self.rank) from None

    def shutdown(self) -> None:
        """Leave the group."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RayExecutor(Executor):
    """``world_size`` tensor-parallel ranks: the driver (rank 0) here, the others Ray actors.

    Args:
        world_size: tensor_parallel_size, at least 2.
        dtype: weights and activations dtype.
        device: the device (``"cpu"``, ``"cuda"``).
        distributed_timeout_s: how long a collective, a reply of an actor, or the reservation of
            the placement group may take (seconds).

    Raises at construction: see the module's docstring (nothing of ours is left running).
    """

    def __init__(self, world_size: int, dtype: torch.dtype, device: torch.device,
                 distributed_timeout_s: float = 120.0) -> None:
        if world_size < 2:
            raise ValueError(f"RayExecutor needs tensor_parallel_size >= 2, got {world_size}")
        self.world_size = world_size
        self.timeout_s = distributed_timeout_s
        self.device = torch.device(device)
        self._dead: Optional[str] = None
        self._lock = threading.Lock()
        self.actors: list = []
        self.placement_group = None
        self.driver_worker: Optional[Worker] = None
        self._ray = _import_ray()
        self.started_ray = connect_ray(world_size, self.device)
        try:
            self._start(dtype)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start
    @property
    def _resource(self) -> str:
        return "GPU" if self.device.type == "cuda" else "CPU"

    def _start(self, dtype: torch.dtype) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        key, n = self._resource, self.world_size
        total = ray.cluster_resources().get(key, 0)
        if total < n:
            raise ValueError(f"tensor_parallel_size ({n}) exceeds the {total:g} {key}s of the Ray cluster "
                             f"(distributed_executor_backend='ray'): each rank needs one (`ray status`)")
        driver_ip = ray.util.get_node_ip_address()
        bundles = [{key: 1.0} for _ in range(n)]
        bundles[0][f"node:{driver_ip}"] = 0.001  # (the driver's bundle, on the driver's node)
        self.placement_group = pg = placement_group(bundles, strategy="PACK",
                                                    name=f"kvserve-tp-{os.getpid()}-{id(self):x}")
        if not pg.wait(timeout_seconds=self.timeout_s):
            free = ray.available_resources().get(key, 0)
            raise ValueError(f"the Ray cluster could not reserve {n} bundles of one {key} (the driver's on its node "
                             f"{driver_ip}) within {self.timeout_s:g} s: {free:g} of its {total:g} {key}s are free "
                             f"(distributed_executor_backend='ray'; others hold them: `ray status`)")
        nodes = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
        if len(nodes) > 1:
            logger.warning("the %d tensor-parallel ranks span %d Ray nodes: each step's all-reduces cross the "
                           "network", n, len(nodes))
        cls = ray.remote(RayWorkerActor)
        env = _actor_env()
        opts = dict(num_cpus=1) if key == "CPU" else dict(num_cpus=0, num_gpus=1)
        if env:
            opts["runtime_env"] = {"env_vars": env}
        for rank in range(1, n):
            self.actors.append(cls.options(
                name=f"kvserve-tp-rank{rank}-{os.getpid()}-{id(self):x}", max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True), **opts).remote(rank))
        infos = self._get([a.node_info.remote() for a in self.actors], "start")
        driver_device = self.device
        if key == "GPU" and self.device.index is None:
            my_node = ray.get_runtime_context().get_node_id()
            taken = {int(g) for node, _, gpus in infos if node == my_node for g in gpus if str(g).isdigit()}
            free_gpus = [i for i in range(torch.cuda.device_count()) if i not in taken]
            driver_device = torch.device("cuda", free_gpus[0] if free_gpus else 0)
        init_method = f"tcp://{driver_ip}:{_free_port(driver_ip)}"
        # (an actor sees only the GPU Ray gave it: "cuda" is that one)
        refs = [a.init_worker.remote(n, dtype, self.device.type, init_method, self.timeout_s) for a in self.actors]
        self.driver_worker = self._build_driver(dtype, driver_device, init_method, refs)
        self._get(refs, "start")

    def _build_driver(self, dtype, device, init_method, refs) -> Worker:
        """The driver's Worker, built while watching the actors' ``init_worker``: an actor that
        fails or dies while starting fails the construction instead of leaving the driver
        waiting in the rendezvous."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs, start=1)}
        pending = list(refs)

        def watch() -> None:
            nonlocal pending
            if pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                if done:  # (raises for an actor that failed or died)
                    self._get(done, "start", ranks=[rank_of[r] for r in done])

        return build_driver_worker(dtype, device, self.world_size, init_method, self.timeout_s, watch)

    # ------------------------------------------------------------------ calls
    def _get(self, refs: list, what: str, ranks: Optional[list[int]] = None,
             timeout_s: Optional[float] = None) -> list[Any]:
        """Every ref's value (``refs[i]`` is rank ``ranks[i]``'s, by default rank ``i + 1``'s),
        waiting at most ``timeout_s`` (``distributed_timeout_s``) in all.

        Raises:
            WorkerDiedError: an actor died (or Ray could not run it), or did not answer within
                the time-out.
            The rank's exception: the actor raised (the lowest rank's, if several did).
        """
        ray = self._ray
        exc = ray.exceptions
        ranks = ranks or list(range(1, len(refs) + 1))
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        values: list[Any] = [None] * len(refs)
        errors: dict[int, BaseException] = {}
        for i, (ref, rank) in enumerate(zip(refs, ranks)):
            try:
                values[i] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except exc.GetTimeoutError as e:
                self._dead = self._dead or f"tensor-parallel ranks {ranks[i:]} did not answer {what} within " \
                                           f"{limit:.0f} s"
                raise WorkerDiedError(self._dead) from e
            except exc.RayTaskError as e:  # (the actor's method raised: the actor lives)
                errors[rank] = e
            except exc.RayError as e:  # RayActorError: it died; or Ray could not run it (its runtime env)
                self._dead = self._dead or f"tensor-parallel rank {rank} (a Ray actor) died during {what}: " \
                                           f"{_summary(e)}"
                raise WorkerDiedError(self._dead) from e
        if errors:
            raise errors[min(errors)]
        return values

    @property
    def is_alive(self) -> bool:
        """Whether every actor runs (False for good once one died; asks Ray's GCS)."""
        if self._dead is None:
            try:
                from ray._private.state import actors as actor_table

                for rank, a in enumerate(self.actors, start=1):
                    info = actor_table(a._actor_id.hex())
                    if info and info.get("State") == "DEAD":
                        self._dead = f"tensor-parallel rank {rank} (a Ray actor) died"
                        break
            except Exception:  # noqa: BLE001 - Ray's state API moved: the steps find out instead
                logger.debug("the Ray actors' state could not be read", exc_info=True)
        return self._dead is None

    @property
    def death(self) -> Optional[str]:
        """Why the ranks cannot run steps any more (which rank died), or None while they can."""
        return None if self.is_alive else self._dead

    def _check(self) -> None:
        if self._dead is not None:  # (cheap: a dead actor fails the call that reaches it)
            raise WorkerDiedError(self._dead)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        """Call ``method`` on every rank at once; the driver's result, then the actors' (tensors
        stay in their rank: None)."""
        kwargs = kwargs or {}
        with self._lock:
            self._check()
            refs = [a.rpc.remote(method, args, kwargs) for a in self.actors]
            try:
                mine = getattr(self.driver_worker, method)(*args, **kwargs)
            except BaseException as e:
                # (the actors ran the same call: a collective in it may now wait for the driver)
                self._dead = self._dead or f"{method} failed on the driver ({type(e).__name__}: {e})"
                self._kill_actors()
                raise
            return [mine] + self._get(refs, method)

    def _send_forward(self, kv_ops, inputs: tuple) -> list:
        """Send one step's block ops and batch tensors to every actor; the replies' refs."""
        return [a.execute_forward.remote(kv_ops, *inputs) for a in self.actors]

    def execute_model(self, scheduler_output):
        """One step: the driver builds the batch, sends it to the actors, and every rank runs
        the forward; the driver samples (:meth:`Worker.execute_model`)."""
        with self._lock:
            self._check()
            sent: list = []

            def broadcast(kv_ops, inputs) -> None:
                sent.extend(self._send_forward(kv_ops, inputs))

            try:
                out = self.driver_worker.execute_model(scheduler_output, broadcast=broadcast)
                if sent:
                    self._get(sent, "forward")
            except WorkerDiedError:
                self._kill_actors()
                raise
            except BaseException as e:
                if not sent:  # (the driver failed building the batch: the actors saw nothing)
                    raise
                self._find_dead(sent)
                if self.is_alive:  # (else the actor that died is named)
                    self._dead = f"a tensor-parallel step failed once its batch went to the ranks " \
                                 f"({type(e).__name__}: {e}); the ranks may be out of step"
                self._kill_actors()
                raise WorkerDiedError(self._dead) from e
            return out

    def _find_dead(self, refs: list) -> None:
        """After a step failed on the driver: give the actors' replies :data:`DEATH_PROBE_S` to
        show an actor's death (a rank that died broke the collective), and name it in ``_dead``."""
        ray = self._ray
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=DEATH_PROBE_S)
        for rank, ref in enumerate(refs, start=1):
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as e:
                    self._dead = self._dead or f"tensor-parallel rank {rank} (a Ray actor) died during forward: " \
                                               f"{_summary(e)}"
                except Exception:  # noqa: BLE001 - it raised, or answered: alive
                    pass

    # ------------------------------------------------------------------ stop
    def _kill_actors(self) -> None:
        """Kill the actors of a broken executor (one may sit in a collective that never completes)."""
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        """Stop the actors (leave the group, then ``ray.kill``), remove the placement group,
        leave the group here, and stop Ray if this executor started it; idempotent."""
        ray = self._ray
        if self.actors:
            if self._dead is None and ray.is_initialized():
                try:
                    ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=5.0)
                except Exception:  # noqa: BLE001 - killed below anyway
                    pass
            self._kill_actors()
            self.actors = []
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - Ray is gone already
                logger.debug("removing the placement group failed", exc_info=True)
            self.placement_group = None
        self._dead = self._dead or "the executor was shut down"
        if self.driver_worker is not None:
            try:
                self.driver_worker.shutdown()
            except Exception:  # noqa: BLE001 - leaving a group that is already broken
                logger.debug("leaving the tensor-parallel group failed", exc_info=True)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False


def _summary(e: BaseException) -> str:
    """The first and last lines of a Ray error (what happened, and why: "killed by `ray.kill`")."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
