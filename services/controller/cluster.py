"""Cluster: places prefill and decode instances as Ray actors, watches them, stops them.

Ray is used for placement and lifecycle only. `up` joins the Ray cluster at `ray_address` (or
starts a local one), reserves a placement group with one bundle per instance (a
tensor-parallel instance: a group of its own, a bundle per rank, STRICT_PACK), creates named
actors in the configured namespace, and waits until every instance's gRPC server answers.
"""

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import platformdirs
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import ClusterConfig, DecodeConfig, MixedConfig, PrefillConfig
from pdserve.errors import ClusterError
from pdserve.rpc.auth import secret_file
from pdserve.rpc.server import advertised_host
from pdserve.storage.redis_server import EmbeddedRedis
from services.controller.actors import (
    InstanceActor,
    WorkerPlacement,
    actor_runtime_env,
)
from services.controller.state import state_path

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0  # for every instance to stop cleanly at shutdown, all at once
WAIT_SLICE_S = 0.5  # how often a wait for Ray looks whether `up` is stopping


def ready_timeout_s(config: ClusterConfig) -> float:
    """How long an instance may take to serve: 10 minutes, or a tensor-parallel instance's two
    start phases (its ranks start, then load; `engine.tp_start_timeout_s` each) if longer."""
    return max(READY_TIMEOUT_S, 2 * config.engine.tp_start_timeout_s)


# a tensor-parallel instance's ranks (a bundle each) on one node: rank 0 maps every rank's KV
# cache (shared memory, CUDA IPC), and each layer all-reduces across them
TP_PLACEMENT_STRATEGY = "STRICT_PACK"


class StartStopped(ClusterError):
    """`up` was asked to stop while it waited for Ray to place or start an instance."""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    name: str
    role: str
    address: str
    metrics_address: str = ""
    pid: int = 0  # of its actor's process
    restarts: int = 0  # times the controller recreated it after it died
    node: str = ""  # the Ray node id of its actor


class Cluster:
    """Owned by `pdserve up`'s main thread; the admin handlers and the supervisor change the
    instance set (add, remove, restart) holding `lock`, one change at a time.
    """

    def __init__(self, config: ClusterConfig, secret: str) -> None:
        self.config = config
        self.secret = secret  # the cluster secret every instance requires (`cluster_secret`)
        self.instances: list[InstanceInfo] = []
        self.embedded_redis: EmbeddedRedis | None = None
        self._run_store: Path | None = None
        self._actors: dict[str, Any] = {}
        self._bundles: dict[str, int | None] = {}  # placement-group bundle of each instance
        # a tensor-parallel instance's own group: a bundle per rank, packed on one node
        self._instance_groups: dict[str, PlacementGroup] = {}
        self.lock = threading.RLock()
        self._placement_group: PlacementGroup | None = None
        self._started_ray = False
        # set when `up` is asked to stop: a wait for Ray gives up at once (StartStopped)
        self.stopping = threading.Event()

    def up(self) -> list[InstanceInfo]:
        """Place every instance and wait until all serve. Raises ClusterError."""
        self.connect()
        self._start_storage()
        config = self.config
        roles = (
            ["prefill"] * config.prefill.replicas
            + ["decode"] * config.decode.replicas
            + ["mixed"] * config.mixed.replicas
        )
        if not roles:
            raise ClusterError("no instances configured: set prefill/decode or mixed replicas")
        counters = dict.fromkeys(("prefill", "decode", "mixed"), 0)
        if self._ranks() == 1:  # else each instance reserves its own group (`_launch`)
            self._placement_group = self._reserve([self.bundle(role) for role in roles])
        pending = []
        try:
            for bundle, role in enumerate(roles):
                name = f"{role}-{counters[role]}"
                counters[role] += 1
                pending.append(self._launch(name, role, bundle))
            for launched in pending:
                self.instances.append(self._ready(*launched))
        except ClusterError:
            self.down()
            raise
        except (ray.exceptions.RayError, TimeoutError) as e:
            self.down()
            raise ClusterError(f"an instance failed to start: {e}") from e
        return self.instances

    def _launch(self, name: str, role: str, bundle: int | None) -> tuple[str, str, Any]:
        """Create the actor of instance `name` (it starts serving in the background); a
        tensor-parallel instance first gets its placement group (kept across restarts)."""
        if self._ranks() > 1 and name not in self._instance_groups:
            bundles = [self.bundle(role)] * self._ranks()
            self._instance_groups[name] = self._reserve(bundles, TP_PLACEMENT_STRATEGY)
        self._actors[name] = self._create_actor(name, role, bundle)
        self._bundles[name] = bundle
        return name, role, self._actors[name]

    def _ready(self, name: str, role: str, actor: Any, restarts: int = 0) -> InstanceInfo:
        """Wait until the actor serves (`ready_timeout_s`); raises RayError, TimeoutError or
        StartStopped."""
        refs = [actor.address.remote(), actor.metrics_address.remote(), actor.pid.remote(),
                actor.node.remote()]  # fmt: skip
        address, metrics, pid, node = self._get(refs, ready_timeout_s(self.config))
        return InstanceInfo(name, role, address, metrics, pid, restarts, node)

    def _start_storage(self) -> None:
        """Without a Redis URL, start the embedded Redis (on this node) for the storage tier;
        its index lives as long as this process, so a default directory store does too."""
        storage = self.config.storage
        if not storage.enabled or storage.redis_url:
            return
        self.embedded_redis = EmbeddedRedis(
            self.config.host, advertise=advertised_host(self.config.host)
        ).start()
        storage = replace(storage, redis_url=self.embedded_redis.url)
        if storage.store == "directory" and storage.directory is None:
            self._run_store = Path(platformdirs.user_cache_dir("pdserve")) / (
                f"kv-store-{os.getpid()}-{self.config.namespace}"
            )
            storage = replace(storage, directory=str(self._run_store))
        self.config = replace(self.config, storage=storage)

    def supervise_storage(self) -> bool:
        """Restart the embedded Redis if it died (same port and password: the instances
        reconnect by themselves; its index is lost, and they treat storage as empty). Returns
        whether it was restarted. Raises PdserveError when it cannot start again."""
        redis_server = self.embedded_redis
        if redis_server is None or redis_server.alive:
            return False
        redis_server.stop()  # reap the dead process
        redis_server.start()
        return True

    def connect(self) -> None:
        """Join Ray at `cluster.ray_address` (or RAY_ADDRESS), or start a local Ray; once."""
        if ray.is_initialized():
            return
        # Ray starts its workers at niceness 15 (batch jobs yield to the node); an instance's
        # engine is the node's main work. A Ray started here (no address) starts them at 0;
        # a cluster joined must have been started so (deploy/ray/cluster.yaml does).
        os.environ.setdefault("RAY_worker_niceness", "0")
        joining = self.config.ray_address or os.environ.get("RAY_ADDRESS")
        ray.init(  # "local": without an address, Ray would join the last `ray start` cluster
            address=joining or "local",  # on this machine instead of starting one
            namespace=self.config.namespace,
            include_dashboard=False,
            log_to_driver=True,
        )
        self._started_ray = not joining

    def _ranks(self) -> int:
        """Ranks of every instance (`tensor_parallel_size` is the same for every role)."""
        return self.config.engine.tensor_parallel_size

    def _reserve(self, bundles: list[dict[str, float]], strategy: str = "") -> PlacementGroup:
        """A placement group of `bundles` (the cluster's instances with
        `cluster.placement_strategy`, or one tensor-parallel instance's ranks)."""
        strategy = strategy or self.config.placement_strategy
        group: PlacementGroup = placement_group(bundles, strategy=strategy)
        try:
            self._get([group.ready()], READY_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as e:
            remove_placement_group(group)
            available = ray.available_resources()  # type: ignore[no-untyped-call]
            raise ClusterError(
                f"Ray cannot place {len(bundles)} bundles ({bundles}) with strategy "
                f"{strategy}: {available} available; lower replicas/num_cpus/num_gpus "
                "(or tensor_parallel_size) or add nodes"
            ) from e
        except BaseException:  # stopped while waiting: nothing stays reserved
            remove_placement_group(group)
            raise
        return group

    def _get(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """`ray.get(refs)` within `timeout_s`, given up as soon as `stopping` is set. Raises
        RayError, TimeoutError or StartStopped."""
        deadline = time.monotonic() + timeout_s
        pending = refs
        while pending:
            if self.stopping.is_set():
                raise StartStopped("pdserve up is stopping: it no longer waits for Ray")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Ray did not answer within {timeout_s:g} s")
            slice_s = min(WAIT_SLICE_S, left)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=slice_s)
        return ray.get(refs)

    def bundle(self, role: str) -> dict[str, float]:
        """The Ray resources of one rank of a `role` instance."""
        settings = self._settings(role)
        bundle = {"CPU": settings.num_cpus}
        if settings.num_gpus:
            bundle["GPU"] = settings.num_gpus
        return bundle

    def _settings(self, role: str) -> PrefillConfig | DecodeConfig | MixedConfig:
        if role == "prefill":
            return self.config.prefill
        return self.config.decode if role == "decode" else self.config.mixed

    def _create_actor(self, name: str, role: str, bundle: int | None) -> Any:
        """An instance actor, in bundle `bundle` of the placement group (None: scheduled on
        its resources alone, for instances added by scaling)."""
        settings = self._settings(role)
        strategy: Any = "DEFAULT"
        group, index = self._placement(name, bundle)
        if group is not None and index is not None:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            )
        remote_class = ray.remote(InstanceActor)
        return remote_class.options(
            name=f"pdserve-{name}",
            namespace=self.config.namespace,
            num_cpus=settings.num_cpus,
            num_gpus=settings.num_gpus,
            max_concurrency=8,
            lifetime=None if self._started_ray else "detached",
            scheduling_strategy=strategy,
            runtime_env=actor_runtime_env(settings.num_gpus),
        ).remote(role, self.config, self.secret, self._worker_placement(name, role, bundle))

    def _placement(self, name: str, bundle: int | None) -> tuple[PlacementGroup | None, int | None]:
        """(group, bundle) of instance `name`'s actor: rank 0's bundle of its own group (tensor
        parallel), else its bundle of the cluster's (None: scheduled on its resources)."""
        own = self._instance_groups.get(name)
        if own is not None:
            return own, 0
        return (self._placement_group, bundle) if bundle is not None else (None, None)

    def _worker_placement(self, name: str, role: str, bundle: int | None) -> WorkerPlacement | None:
        """Where a tensor-parallel instance's workers go: the bundles after rank 0's."""
        if self._ranks() == 1:
            return None
        settings = self._settings(role)
        group, first = self._placement(name, bundle)
        return WorkerPlacement(group, first, settings.num_cpus, settings.num_gpus)

    def add_instance(self, role: str) -> InstanceInfo:
        """Start one more instance of `role` and wait until it serves. Raises ClusterError."""
        with self.lock:
            taken = {i.name for i in self.instances}
            number = next(n for n in range(len(taken) + 1) if f"{role}-{n}" not in taken)
            launched = self._launch(f"{role}-{number}", role, None)
            info = self._wait_or_kill(launched)
            self.instances.append(info)
            return info

    def restart_instance(self, name: str) -> InstanceInfo:
        """Recreate a dead instance: same name, role and placement, new endpoints. Raises
        ClusterError (the instance stays listed, dead, for another try)."""
        with self.lock:
            old = self.info(name)
            if old is None:
                raise ClusterError(f"instance {name} was removed")
            _kill_quietly(self._actors[name])
            launched = self._launch(name, old.role, self._bundles[name])
            info = self._wait_or_kill(launched, old.restarts + 1)
            self.instances = [info if i.name == name else i for i in self.instances]
            return info

    def _wait_or_kill(self, launched: tuple[str, str, Any], restarts: int = 0) -> InstanceInfo:
        name, role, actor = launched
        try:
            return self._ready(name, role, actor, restarts)
        except BaseException as e:  # StartStopped too: nothing half-started stays
            _kill_quietly(actor)
            if isinstance(e, (ray.exceptions.RayError, TimeoutError)):
                raise ClusterError(f"instance {name} failed to start: {e}") from e
            raise

    def set_role(self, name: str, role: str) -> InstanceInfo:
        """Record that instance `name` serves `role` now (`InstanceActor.change_role`): a
        restart recreates it in that role."""
        with self.lock:
            info = self.info(name)
            if info is None:
                raise ClusterError(f"instance {name} was removed")
            changed = replace(info, role=role)
            self.instances = [changed if i.name == name else i for i in self.instances]
            return changed

    def remove_instance(self, name: str) -> None:
        """Stop one instance (its requests should have been drained first)."""
        with self.lock:
            actor = self._actors.pop(name)
            self._bundles.pop(name, None)
            self.instances = [i for i in self.instances if i.name != name]
            _stop_all({name: actor})
            own = self._instance_groups.pop(name, None)
            if own is not None:
                remove_placement_group(own)

    def info(self, name: str) -> InstanceInfo | None:
        """The listed instance called `name` (None: not listed, e.g. removed by scaling)."""
        return next((i for i in self.instances if i.name == name), None)

    def actor(self, name: str) -> Any:
        return self._actors[name]

    def dead_instances(self, timeout_s: float = 10.0) -> list[str]:
        """Names of instances whose actor does not answer a ping within `timeout_s` (all are
        pinged at once)."""
        pings = {name: actor.ping.remote() for name, actor in list(self._actors.items())}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        dead = []
        for name, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                dead.append(name)
        return dead

    def down(self) -> None:
        """Stop every instance, release the placement group, and stop Ray if `up` started it.
        Instances that served stop cleanly, all at once; those that never did (a start that
        failed or was stopped) are killed."""
        served = {i.name for i in self.instances}
        _stop_all({name: a for name, a in self._actors.items() if name in served})
        for name, actor in self._actors.items():
            if name not in served:
                _kill_quietly(actor)
        self._actors.clear()
        self.instances.clear()
        groups = [self._placement_group, *self._instance_groups.values()]
        for group in groups:
            if group is not None:
                remove_placement_group(group)
        self._placement_group = None
        self._instance_groups.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self.embedded_redis is not None:
            self.embedded_redis.close()
            self.embedded_redis = None
        if self._run_store is not None:
            shutil.rmtree(self._run_store, ignore_errors=True)
            self._run_store = None

    def write_state(
        self, path: Path, router_url: str | None = None, admin_address: str | None = None
    ) -> None:
        state = {
            "router_url": router_url,
            "admin_address": admin_address,
            "pid": os.getpid(),
            "namespace": self.config.namespace,
            "ray_address": ray.get_runtime_context().gcs_address,  # the one joined or started
            "started_at": time.time(),
            "instances": [asdict(i) for i in self.instances],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)


SCHEDULER_LIMITS = ("max_num_seqs", "max_num_batched_tokens")


def role_change_refusal(config: ClusterConfig, current: str, role: str) -> str | None:
    """Why an instance serving `current` cannot serve `role` in place; None when it can. Pure.

    Instances switch between prefill and decode; they keep their process, resources and
    engine, so the two roles' resources and engine settings must agree, except the
    scheduler's limits, which the change applies (on a GPU they may not grow: CUDA graphs
    and activation memory were sized for the old ones)."""
    roles = ("prefill", "decode")
    if current not in roles or role not in roles:
        return (
            f"an instance changes between prefill and decode only, not {current} -> {role} (a "
            "disaggregated cluster's decode instances prefill short prompts themselves with "
            "router.disaggregation: auto)"
        )
    old, new = config.engine_for(current), config.engine_for(role)
    differ = [
        f.name
        for f in fields(old)
        if f.name not in SCHEDULER_LIMITS and getattr(old, f.name) != getattr(new, f.name)
    ]
    old_section, new_section = getattr(config, current), getattr(config, role)
    differ += [
        f"{resource} (Ray resources)"
        for resource in ("num_cpus", "num_gpus")
        if getattr(old_section, resource) != getattr(new_section, resource)
    ]
    if differ:
        return (
            f"the {current} and {role} roles' settings differ in {', '.join(differ)}; an "
            "instance keeps its engine and resources when it changes role: make them equal, "
            "or scale the roles instead (`pdserve admin scale`)"
        )
    grown = [name for name in SCHEDULER_LIMITS if getattr(new, name) > getattr(old, name)]
    if old.device != "cpu" and grown:
        return (
            f"{role}'s {', '.join(grown)} exceed {current}'s on {old.device}: the engine's "
            "memory and CUDA graphs were sized for the smaller limits"
        )
    return None


def _stop_all(actors: dict[str, Any]) -> None:
    """Ask every instance in `actors` (name -> actor) to stop, wait up to STOP_TIMEOUT_S for
    all of them together, then kill each actor (the ones that stopped too: the process goes)."""
    if not actors:
        return
    stops = {name: actor.stop.remote() for name, actor in actors.items()}
    ray.wait(list(stops.values()), num_returns=len(stops), timeout=STOP_TIMEOUT_S)
    for name, ref in stops.items():
        try:
            ray.get(ref, timeout=0)
        except (ray.exceptions.RayError, TimeoutError):
            logger.warning("instance %s did not stop cleanly", name)
        _kill_quietly(actors[name])


def _kill_quietly(actor: Any) -> None:
    """Kill an actor that may already be dead."""
    with contextlib.suppress(ValueError):  # not an actor handle Ray still knows
        ray.kill(actor, no_restart=True)


def cluster_secret(state_dir: Path, create: bool = False) -> str:
    """The secret of the instance plane, kept (0600) in `state_dir/cluster_secret`. `pdserve up`
    makes it on first use (`create`) and keeps it across restarts: it also signs the storage
    tier's index entries, which a new secret would invalidate. Delete the file to rotate it.
    Clients of the running cluster read it."""
    path = state_dir / "cluster_secret"
    if not create and not path.exists():
        raise ClusterError(
            f"no cluster secret at {path}: is `pdserve up` running with this state dir?"
        )
    return secret_file(path)


def read_state(config: ClusterConfig) -> dict[str, Any]:
    """The running cluster's state file; raises ClusterError when there is none."""
    path = state_path(config)
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ClusterError(
            f"no running cluster: {path} does not exist (is `pdserve up` running?)"
        ) from e
    return state
