"""InstanceActor: one prefill or decode instance inside a Ray actor process; TPWorkerActor:
one more rank of a tensor-parallel instance (started by the instance's actor, in the bundles the
controller reserved after the instance's own).

A plain class: the controller applies `ray.remote(...)` with the resources from config, so the
same class runs in a unit test without Ray. Ray carries only lifecycle calls; KV bytes and tokens
go over the instance's own gRPC server.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import ROLES, ClusterConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.tensor_parallel import Rendezvous, serve_worker, use_launcher
from pdserve.errors import InstanceUnavailableError
from pdserve.instance.roles import Role, ServedRole
from pdserve.instance.runtime import InstanceRuntime
from pdserve.observability import logs, tracing
from pdserve.rpc.server import advertised_host, host_port
from services.controller.state import tls_files
from services.decode import servicer as decode_servicer
from services.decode.instance import DecodeInstance
from services.mixed import servicer as mixed_servicer
from services.mixed.instance import MixedInstance
from services.prefill import servicer as prefill_servicer
from services.prefill.instance import PrefillInstance

logger = logging.getLogger(__name__)

# each role's gRPC service: its name and how it is registered on an instance's server
ROLE_SERVICES: dict[str, tuple[str, Callable[[ServedRole, Any], None]]] = {
    "prefill": (prefill_servicer.SERVICE_NAME, prefill_servicer.add_prefill_servicer),
    "decode": (decode_servicer.SERVICE_NAME, decode_servicer.add_decode_servicer),
    "mixed": (mixed_servicer.SERVICE_NAME, mixed_servicer.add_mixed_servicer),
}
# Set by the controller for GPU actors (`Cluster._create_actor`): Ray then leaves the actor's
# CUDA_VISIBLE_DEVICES alone, and the actor sets it itself (`claim_gpus`).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# A leaving instance exits once it has held nothing for this long: a stream that moved off it
# reads its context back from here within that time (the router holds it until then).
LEAVE_QUIET_S = 2.0
LEAVE_POLL_S = 0.1


def visible_devices(
    gpu_ids: Callable[[], Sequence[int | str]],
    inherited: str | None,
    node_gpus: Callable[[], int],
) -> str | None:
    """CUDA_VISIBLE_DEVICES of a GPU actor: the GPU Ray assigned it (`gpu_ids`, i.e.
    `ray.get_gpu_ids()`) first, so that `cuda` (device 0, in every thread) is its own GPU, as
    under Ray's isolation; then the node's other GPUs, so that it can map a peer's KV cache
    over CUDA IPC. The node's GPUs are the entries of the CUDA_VISIBLE_DEVICES the actor
    inherited from its raylet (Ray's ids are then those entries), else 0..n-1 (`node_gpus`:
    the node's GPU resource). None when Ray assigned no GPU."""
    own = [str(gpu) for gpu in gpu_ids()]
    if not own:
        return None
    if inherited is not None:
        node = [gpu.strip() for gpu in inherited.split(",") if gpu.strip()]
    else:
        node = [str(i) for i in range(node_gpus())]
    return ",".join([*own, *(gpu for gpu in node if gpu not in own)])


def _node_gpu_count() -> int:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    node = next((n for n in nodes if n["NodeID"] == node_id), None)
    return int(node["Resources"].get("GPU", 0)) if node is not None else 0


def claim_gpus() -> None:
    """In a GPU actor the controller asked to (NOSET_CUDA_VISIBLE_DEVICES), before anything
    starts CUDA: set CUDA_VISIBLE_DEVICES (`visible_devices`). Elsewhere (CPU actors, tests
    without Ray) nothing happens."""
    if os.environ.get(NOSET_CUDA_VISIBLE_DEVICES, "").lower() not in ("1", "true"):
        return
    import ray

    value = visible_devices(
        ray.get_gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), _node_gpu_count
    )
    if value is None:
        return
    # too late once CUDA started: it read the variable then
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        logger.warning("CUDA started before the actor set CUDA_VISIBLE_DEVICES=%s", value)
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    logger.info("CUDA_VISIBLE_DEVICES=%s (its own GPU first)", value)


def actor_runtime_env(num_gpus: float) -> dict[str, Any] | None:
    """A GPU actor's runtime environment: Ray must not narrow its CUDA_VISIBLE_DEVICES to its
    own GPU (the actor puts that one first itself, then the node's others, so that prefill can
    map a decode instance's KV cache over CUDA IPC: `claim_gpus`). CPU actors: none (Ray's
    default; env_vars of a job's runtime environment are merged into this one)."""
    if num_gpus <= 0:
        return None
    return {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """Where a tensor-parallel instance's workers go (from the controller): bundles
    `first_bundle + rank` of `group` (None: scheduled on their resources alone), each with the
    role's resources."""

    group: PlacementGroup | None
    first_bundle: int | None
    num_cpus: float
    num_gpus: float

    def launch(self, config: EngineConfig, rendezvous: Rendezvous) -> "RayWorkers":
        """Start ranks 1..size-1 as actors owned by this (rank 0's) actor: they die with it."""
        actors = []
        for rank in range(1, rendezvous.size):
            strategy: Any = "DEFAULT"
            if self.group is not None and self.first_bundle is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.group,
                    placement_group_bundle_index=self.first_bundle + rank,
                )
            actor = (
                ray.remote(TPWorkerActor)
                .options(
                    num_cpus=self.num_cpus,
                    num_gpus=self.num_gpus,
                    scheduling_strategy=strategy,
                    runtime_env=actor_runtime_env(self.num_gpus),
                )
                .remote(config, rank, rendezvous)
            )
            actors.append(actor)
        return RayWorkers(actors)


class RayWorkers:
    """The worker actors of one tensor-parallel instance (`tensor_parallel.Workers`)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def alive(self) -> bool:
        """False once a worker actor died or its rank's thread ended; one that does not answer
        within 10 s (not placed yet, still importing, busy) counts as alive: a hung rank is the
        collectives' timeout to find."""
        pings = [actor.ping.remote() for actor in self.actors]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=10)
        try:
            return all(ray.get(answered))
        except ray.exceptions.RayError:
            return False

    def stop(self, timeout_s: float) -> None:
        done = [actor.wait.remote(timeout_s) for actor in self.actors]
        ray.wait(done, num_returns=len(done), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)


class TPWorkerActor:
    """Rank `rank` of a tensor-parallel instance: `serve_worker` on a thread of its own (the
    actor answers `ping` and `wait` meanwhile)."""

    def __init__(self, config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
        claim_gpus()
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self._thread = threading.Thread(
            target=serve_worker, args=(config, rank, rendezvous), name=f"tp-rank{rank}"
        )
        self._thread.start()

    def ping(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Whether the rank stopped within `timeout_s`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class InstanceActor:
    """Ray calls its methods one at a time (a synchronous actor); the instance it holds runs its own
    threads. Its gRPC server registers every role's service: the one of the role it serves
    now answers (`ServedRole`), the others refuse as UNAVAILABLE, so that `change_role`
    switches roles without a new process, engine or port.
    """

    def __init__(
        self,
        role: str,
        config: ClusterConfig,
        secret: str,
        workers: WorkerPlacement | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        observability = config.observability
        logs.configure_logging(observability.log_format, logging.INFO)
        claim_gpus()
        engine = config.engine_for(role)
        if workers is not None:  # this process holds one instance: its launcher is the default
            use_launcher(workers.launch, advertised_host(config.host))
        if engine.torch_threads is not None:
            torch.set_num_threads(engine.torch_threads)
        self.config = config
        runtime = InstanceRuntime.create(
            role,
            engine,
            secret=secret,
            tls=tls_files(config),
            storage=config.storage,
            # a prefill instance may become a decode instance, whose cache prefill peers
            # on this host write into
            shared_kv_cache=role != "mixed" and config.transfer.shared_memory,
        )
        self.served = ServedRole(self._role(role, runtime))
        runtime.start()

        def register(server: Any) -> None:
            for _, add in ROLE_SERVICES.values():
                add(self.served, server)

        self.server, port = runtime.serve(
            register,
            [name for name, _ in ROLE_SERVICES.values()],
            self.served,
            config.host,
            0,
        )
        for other in ROLES:
            if other != role:
                self.server.set_serving(ROLE_SERVICES[other][0], False)
        self._address = host_port(advertised_host(config.host), port)
        if threading.current_thread() is threading.main_thread():  # Ray runs __init__ there
            signal.signal(signal.SIGTERM, self._on_sigterm)
        tracing.configure(
            tracing.trace_endpoint(observability.otlp_endpoint),
            observability.trace_sample_ratio,
            f"pdserve-{role}",
            {"service.instance.id": self._address},
        )

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        """SIGTERM (a node shutting down, an operator's `kill`): leave as a drain does. The
        load reports ask every router to drain this instance (its streams move elsewhere with
        their KV read back from here); the process exits once it has been idle for
        LEAVE_QUIET_S, or after `cluster.drain_timeout_s` (what is left then migrates by
        recomputing). The supervisor restarts it as any instance that exited."""
        runtime = self.instance.runtime
        if runtime.leaving:
            return
        runtime.leaving = True
        logger.warning(
            "SIGTERM: leaving; the routers drain this instance, which exits once idle "
            "(at most %.0f s)",
            self.config.drain_timeout_s,
        )
        threading.Thread(target=self._leave, name="leave", daemon=True).start()

    def _leave(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        idle_since: float | None = None
        while (now := time.monotonic()) < deadline:
            if not _busy(self.instance.stats()):
                idle_since = idle_since or now
                if now - idle_since >= LEAVE_QUIET_S:
                    break
            else:
                idle_since = None
            time.sleep(LEAVE_POLL_S)
        logger.warning("leaving now")
        self.stop()
        os._exit(0)

    def _role(self, role: str, runtime: InstanceRuntime) -> Role:
        config = self.config
        if role == "prefill":
            return PrefillInstance(runtime, config.prefill, config.transfer, config.host)
        if role == "decode":
            return DecodeInstance(runtime, config.decode, config.transfer, config.host)
        return MixedInstance(runtime)

    @property
    def instance(self) -> Role:
        return self.served.current

    def change_role(self, role: str) -> None:
        """Serve `role` from now on, on the same engine (weights, KV cache, prefix cache), gRPC
        server and address, with the role's scheduler limits. Call once the router holds no
        request here (`pdserve admin role` drains first): a request the old role still holds
        fails over to another instance (its stream ends as UNAVAILABLE: the router migrates
        it). The controller checked that the two roles' engine settings allow it
        (`role_change_refusal`)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        if role == self.served.name:
            return
        runtime = self.served.runtime
        limits = self.config.engine_for(role)
        scheduler = SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens)

        def set_limits(engine: LLMEngine) -> None:
            engine.scheduler.config = scheduler

        runtime.loop.call(set_limits)
        previous = self.served.change(self._role(role, runtime))
        self.server.set_serving(ROLE_SERVICES[role][0], True)
        self.server.set_serving(ROLE_SERVICES[previous.ROLE][0], False)
        # what outlived the drain continues elsewhere, as when an instance is removed
        previous.leave(InstanceUnavailableError(f"this instance left the {previous.ROLE} role"))
        logger.warning("this instance serves the %s role now (was %s)", role, previous.ROLE)

    def address(self) -> str:
        """host:port of this instance's gRPC server."""
        return self._address

    def metrics_address(self) -> str:
        """host:port of this instance's Prometheus endpoint (`/metrics`)."""
        return self.instance.runtime.metrics_address

    def pid(self) -> int:
        """The actor's process id (operators kill or inspect it; tests do)."""
        return os.getpid()

    def node(self) -> str:
        """The Ray node the actor runs on (its id, hex)."""
        node_id: str = ray.get_runtime_context().get_node_id()
        return node_id

    def ping(self) -> bool:
        """Raises (the controller then restarts the instance) when a tensor-parallel rank of
        it failed: its requests fail until then."""
        self.instance.runtime.check_ranks()
        return True

    def flush_cache(self, tier: str) -> int:
        """Unpublish every unreferenced block of the device prefix cache (`device`), or drop
        every entry of the storage tier's index (`storage`; shared by all instances). Returns
        how many blocks or entries went."""
        runtime = self.instance.runtime
        return runtime.flush_device_cache() if tier == "device" else runtime.flush_storage()

    def check_integrity(self) -> None:
        self.instance.check_integrity()

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
        self.instance.stop()  # the runtime, with the role's own
        tracing.shutdown()  # its last spans


def _busy(stats: Any) -> bool:
    """Whether an instance holds a request, a reservation or a referenced block (a peer's read
    pins the blocks it reads)."""
    return bool(
        stats.num_running
        or stats.num_waiting
        or stats.num_reservations
        or stats.num_free_blocks != stats.num_blocks
    )
