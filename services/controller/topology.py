"""Topology: the changes to the instance set that the admin API and the planner make — an
instance changing role, instances added and retired — one at a time, each keeping the router's
membership and the cluster's record in step.

Ray autoscaling: before instances are added, the resources of the whole target instance set
are asked of Ray's autoscaler (`request_resources`), so that on a cluster that has one new
nodes start while the actors wait to be placed; without one the request is inert.
"""

import logging
import threading
import time
from collections.abc import Callable

import grpc
import ray

from pdserve.config import ROLES
from pdserve.errors import ClusterError, InstanceUnavailableError, PdserveError
from pdserve.v1 import admin_pb2
from services.controller.cluster import Cluster, InstanceInfo, role_change_refusal
from services.router.replicas import ReplicaInfo
from services.router.router import Router

logger = logging.getLogger(__name__)


class Refused(Exception):
    """A change the cluster cannot make now (its gRPC status says why)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Topology:
    """Thread-safe: the admin handlers and the planner's thread call it; `lock` makes changes
    one at a time."""

    def __init__(
        self, cluster: Cluster, router: Router, on_change: Callable[[], None] = lambda: None
    ) -> None:
        self.cluster = cluster
        self.router = router
        self._on_change = on_change  # the instance set changed (scrape targets follow)
        # the router processes, up's own first (`pdserve up` sets it when it runs replicas)
        self.routers: Callable[[], list[ReplicaInfo]] = list
        self.lock = threading.Lock()

    # -- reading --------------------------------------------------------------------------------

    def find(self, name: str) -> InstanceInfo:
        """The instance called `name`; raises Refused(NOT_FOUND) naming the others."""
        info = self.cluster.info(name)
        if info is None:
            names = ", ".join(i.name for i in self.cluster.instances)
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no instance {name!r}; instances: {names}")
        return info

    def describe(self, info: InstanceInfo) -> admin_pb2.InstanceInfo:
        """The instance as `pdserve admin list` shows it: its stats when it answers."""
        message = admin_pb2.InstanceInfo(
            name=info.name,
            role=info.role,
            address=info.address,
            metrics_address=info.metrics_address,
            drained=self.router.membership.is_drained(info.address),
            restarts=info.restarts,
            pid=info.pid,
            node=info.node,
        )
        try:
            message.stats.CopyFrom(self.router.client.instance(info.address).stats())
            message.alive = True
        except PdserveError:  # unreachable, or no answer within the deadline
            message.alive = False
        return message

    def describe_all(self) -> list[admin_pb2.InstanceInfo]:
        return [self.describe(i) for i in list(self.cluster.instances)]

    # -- changing -------------------------------------------------------------------------------

    def change_role(self, name: str, role: str) -> InstanceInfo:
        """Switch instance `name` to `role` in place (`InstanceActor.change_role`): drained as
        by `retire`, out of routing, switched, routed to in its new role. Raises Refused
        (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION) before touching anything, or
        InstanceUnavailableError when the actor failed to switch (the supervisor then
        restarts it in its old role)."""
        if role not in ROLES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {ROLES}")
        with self.lock:
            info = self.find(name)
            if role == info.role:
                return info
            refusal = role_change_refusal(self.cluster.config, info.role, role)
            if refusal is not None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, refusal)
            if not any(i.role == info.role and i.name != name for i in self.cluster.instances):
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{name} is the only {info.role} instance: add one first",
                )
            if not self.describe(info).alive:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{name} is not serving (dead or restarting): its role cannot change",
                )
            try:
                return self._switch(info, role)
            finally:
                self._on_change()

    def _switch(self, info: InstanceInfo, role: str) -> InstanceInfo:
        started = time.monotonic()
        router = self.router
        router.membership.set_drained(info.address, True)
        idle = router.wait_idle(info.address, self.cluster.config.drain_timeout_s)
        router.remove_instance(info.address)
        try:
            ray.get(self.cluster.actor(info.name).change_role.remote(role), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as e:
            router.add_instance(info.role, info.address)
            raise InstanceUnavailableError(f"{info.name} failed to change role: {e}") from e
        changed = self.cluster.set_role(info.name, role)
        router.add_instance(role, changed.address)
        logger.warning(
            "instance %s serves the %s role now (was %s; %.2f s%s)", info.name, role, info.role,
            time.monotonic() - started, "" if idle else ", drain timed out: streams migrated",
        )  # fmt: skip
        return changed

    def scale(self, role: str, replicas: int) -> None:
        """Add instances of `role` (each waited for until it serves) or retire the newest until
        `replicas` run. Raises Refused (INVALID_ARGUMENT; RESOURCE_EXHAUSTED when Ray cannot
        place another)."""
        if role not in ROLES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {ROLES}")
        with self.lock:
            current = [i for i in self.cluster.instances if i.role == role]
            try:
                if replicas > len(current):
                    self._request_resources({role: replicas - len(current)})
                for _ in range(replicas - len(current)):
                    info = self.cluster.add_instance(role)
                    self.router.add_instance(role, info.address)
                    logger.warning("instance %s added at %s", info.name, info.address)
            except ClusterError as e:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
            finally:
                self._on_change()
            for info in current[replicas:][::-1] if replicas < len(current) else []:
                self._retire(info)
            self._on_change()

    def retire(self, name: str) -> None:
        """Drain instance `name`, wait for the router's requests on it (at most
        `cluster.drain_timeout_s`), take it out of routing and stop it."""
        with self.lock:
            self._retire(self.find(name))
            self._on_change()

    def _retire(self, info: InstanceInfo) -> None:
        self.router.membership.set_drained(info.address, True)
        idle = self.router.wait_idle(info.address, self.cluster.config.drain_timeout_s)
        self.router.remove_instance(info.address)
        self.cluster.remove_instance(info.name)
        logger.warning("instance %s removed%s", info.name, "" if idle else " (drain timed out)")

    def _request_resources(self, more: dict[str, int]) -> None:
        """Ask Ray's autoscaler for the bundles of every instance there will be: those running
        and `more` of each role (a request states the whole demand; it replaces the last)."""
        from ray.autoscaler.sdk import request_resources

        cluster = self.cluster
        roles = [i.role for i in cluster.instances]
        roles += [role for role, count in more.items() for _ in range(count)]
        ranks = cluster.config.engine.tensor_parallel_size
        request_resources(bundles=[cluster.bundle(role) for role in roles for _ in range(ranks)])
