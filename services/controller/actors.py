"""InstanceActor: one prefill or decode instance inside a Ray actor process; TPWorkerActor:
one more rank of a tensor-parallel instance (started by the instance's actor, in the bundles the
controller reserved after the instance's own).

A plain class: the controller applies `ray.remote(...)` with the resources from config, so the
same class runs in a unit test without Ray. Ray carries only lifecycle calls; KV bytes and tokens
go over the instance's own gRPC server.
"""

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.tensor_parallel import Rendezvous, serve_worker, use_launcher
from pdserve.observability import logs, tracing
from pdserve.rpc.server import AioServer, advertised_host, host_port
from services.controller.state import tls_files
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.mixed.instance import MixedInstance
from services.mixed.servicer import serve_mixed
from services.prefill.instance import PrefillInstance
from services.prefill.servicer import serve_prefill

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
# Set by the controller for GPU actors (`Cluster._create_actor`): Ray then leaves the actor's
# CUDA_VISIBLE_DEVICES alone, and the actor sets it itself (`claim_gpus`).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


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
    threads.
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
        tls = tls_files(config)
        if engine.torch_threads is not None:
            torch.set_num_threads(engine.torch_threads)
        self.role = role
        self.instance: PrefillInstance | DecodeInstance | MixedInstance
        self.server: AioServer
        if role == "prefill":
            self.instance, self.server, port = serve_prefill(
                engine,
                config.prefill,
                config.host,
                storage=config.storage,
                transfer=config.transfer,
                secret=secret,
                tls=tls,
            )
        elif role == "decode":
            self.instance, self.server, port = serve_decode(
                engine,
                config.decode,
                config.host,
                storage=config.storage,
                transfer=config.transfer,
                secret=secret,
                tls=tls,
            )
        else:
            self.instance, self.server, port = serve_mixed(
                engine, config.host, storage=config.storage, secret=secret, tls=tls
            )
        self._address = host_port(advertised_host(config.host), port)
        tracing.configure(
            tracing.trace_endpoint(observability.otlp_endpoint),
            observability.trace_sample_ratio,
            f"pdserve-{role}",
            {"service.instance.id": self._address},
        )

    def address(self) -> str:
        """host:port of this instance's gRPC server."""
        return self._address

    def metrics_address(self) -> str:
        """host:port of this instance's Prometheus endpoint (`/metrics`)."""
        return self.instance.runtime.metrics_address

    def pid(self) -> int:
        """The actor's process id (operators kill or inspect it; tests do)."""
        return os.getpid()

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
        self.instance.stop()
        tracing.shutdown()  # its last spans
