"""The admin gRPC API (proto/pdserve/v1/admin.proto), served by `pdserve up` next to the router.

Every call needs `authorization: Bearer <token>`; only health answers without it. The
token comes from `admin.token` (or `PDSERVE_ADMIN_TOKEN`); unset, one is generated and written
with mode 0600 next to cluster.json, where `pdserve admin` finds it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import ray

from pdserve.config import AdminConfig
from pdserve.errors import (
    ClusterError,
    ConfigError,
    InstanceUnavailableError,
    PdserveError,
    RequestNotFoundError,
)
from pdserve.rpc.auth import BearerTokenInterceptor, secret_file
from pdserve.rpc.server import create_server
from pdserve.rpc.status import abort_with
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from services.controller.cluster import Cluster, InstanceInfo, role_change_refusal
from services.router.router import Router

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.AdminService"
ROLES = ("prefill", "decode", "mixed")


def admin_token(config: AdminConfig, state_dir: Path) -> str:
    """The configured token, or a new one written (0600) to `state_dir/admin_token`."""
    configured = config.token or os.environ.get("PDSERVE_ADMIN_TOKEN")
    path = state_dir / "admin_token"
    if not configured:
        path.unlink(missing_ok=True)  # a new cluster gets a new token
    return secret_file(path, configured)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Runs on the admin server's handler threads; scaling and draining change the router's
    membership (its own lock) through the router.
    """

    def __init__(
        self, cluster: Cluster, router: Router, on_change: Callable[[], None] = lambda: None
    ) -> None:
        self.cluster = cluster
        self.router = router
        self._on_change = on_change  # the instance set changed (scrape targets follow)
        self._lock = threading.Lock()  # scaling and draining change the topology one at a time

    def _find(self, name: str, context: grpc.ServicerContext) -> InstanceInfo:
        for info in self.cluster.instances:
            if info.name == name:
                return info
        names = ", ".join(i.name for i in self.cluster.instances)
        context.abort(grpc.StatusCode.NOT_FOUND, f"no instance {name!r}; instances: {names}")
        raise AssertionError("unreachable")  # context.abort raises

    def _describe(self, info: InstanceInfo) -> admin_pb2.InstanceInfo:
        message = admin_pb2.InstanceInfo(
            name=info.name,
            role=info.role,
            address=info.address,
            metrics_address=info.metrics_address,
            drained=self.router.membership.is_drained(info.address),
            restarts=info.restarts,
            pid=info.pid,
        )
        try:
            message.stats.CopyFrom(self.router.client.instance(info.address).stats())
            message.alive = True
        except PdserveError:  # unreachable, or no answer within the deadline
            message.alive = False
        return message

    def ListInstances(
        self, request: admin_pb2.ListInstancesRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        return admin_pb2.ListInstancesReply(
            instances=[self._describe(i) for i in self.cluster.instances]
        )

    def DrainInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        info = self._find(request.name, context)
        self.router.membership.set_drained(info.address, True)
        logger.warning("instance %s drained: no new requests", info.name)
        return self._describe(info)

    def ResumeInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        info = self._find(request.name, context)
        self.router.membership.set_drained(info.address, False)
        logger.warning("instance %s resumed", info.name)
        return self._describe(info)

    def RemoveInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        info = self._find(request.name, context)
        with self._lock:
            self._retire(info)
            self._on_change()
        return self.ListInstances(admin_pb2.ListInstancesRequest(), context)

    def _retire(self, info: InstanceInfo) -> None:
        """Drain `info`, wait up to `cluster.drain_timeout_s` until the router holds no request
        on it, then take it out of routing and stop it (a stream still on it migrates)."""
        self.router.membership.set_drained(info.address, True)
        idle = self.router.wait_idle(info.address, self.cluster.config.drain_timeout_s)
        self.router.remove_instance(info.address)
        self.cluster.remove_instance(info.name)
        logger.warning("instance %s removed%s", info.name, "" if idle else " (drain timed out)")

    def ScaleRole(
        self, request: admin_pb2.ScaleRoleRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        role, target = request.role, request.replicas
        if role not in ROLES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {ROLES}")
        with self._lock:
            current = [i for i in self.cluster.instances if i.role == role]
            try:
                for _ in range(target - len(current)):
                    info = self.cluster.add_instance(role)
                    self.router.add_instance(role, info.address)
                    logger.warning("instance %s added at %s", info.name, info.address)
            except ClusterError as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            finally:
                self._on_change()
            for info in current[target:][::-1] if target < len(current) else []:
                self._retire(info)
            self._on_change()
        return self.ListInstances(admin_pb2.ListInstancesRequest(), context)

    def ChangeRole(
        self, request: admin_pb2.ChangeRoleRequest, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        info = self._find(request.name, context)
        if request.role not in ROLES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {ROLES}")
        if request.role == info.role:
            return self._describe(info)
        refusal = role_change_refusal(self.cluster.config, info.role, request.role)
        if refusal is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        with self._lock:
            info = self._find(request.name, context)  # as it is now, under the lock
            peers = [i for i in self.cluster.instances if i.role == info.role and i != info]
            if not peers:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{info.name} is the only {info.role} instance: add one first",
                )
            if not self._describe(info).alive:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{info.name} is not serving (dead or restarting): its role cannot change",
                )
            try:
                changed = self._change_role(info, request.role)
            except PdserveError as e:
                abort_with(context, e)
            finally:
                self._on_change()
        return self._describe(changed)

    def _change_role(self, info: InstanceInfo, role: str) -> InstanceInfo:
        """Drain `info` (up to `cluster.drain_timeout_s`), take it out of routing, switch its
        actor to `role` and route to it in that role. A failed switch (the actor died) leaves
        the instance to the supervisor, which restarts it in its old role."""
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

    def SetRoutingPolicy(
        self, request: admin_pb2.SetRoutingPolicyRequest, context: grpc.ServicerContext
    ) -> admin_pb2.SetRoutingPolicyReply:
        try:
            previous = self.router.set_policy(request.policy)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return admin_pb2.SetRoutingPolicyReply(previous=previous)

    def GetCacheStats(
        self, request: admin_pb2.CacheStatsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.CacheStatsReply:
        reply = admin_pb2.CacheStatsReply()
        queries = hits = 0
        for described in self.ListInstances(admin_pb2.ListInstancesRequest(), context).instances:
            if described.role == "decode" or not described.alive:
                continue  # decode instances receive prompts' KV: their hits are not routing's
            s = described.stats
            found = s.device_hit_tokens + s.storage.storage_hit_tokens
            reply.instances.append(
                admin_pb2.InstanceCacheStats(
                    name=described.name,
                    queries=s.prefix_cache_queries,
                    device_hits=s.device_hit_tokens,
                    storage_hits=s.storage.storage_hit_tokens,
                    hit_rate=found / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
                )
            )
            queries += s.prefix_cache_queries
            hits += found
        reply.hit_rate = hits / queries if queries else 0.0
        return reply

    def FlushCache(
        self, request: admin_pb2.FlushCacheRequest, context: grpc.ServicerContext
    ) -> admin_pb2.FlushCacheReply:
        if request.tier not in ("device", "storage"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tier must be device or storage")
        targets = (
            [self._find(request.name, context)] if request.name else list(self.cluster.instances)
        )
        if request.tier == "storage":
            targets = targets[:1]  # one index for the whole cluster
        flushed = 0
        for info in targets:
            try:
                flushed += int(
                    ray.get(
                        self.cluster.actor(info.name).flush_cache.remote(request.tier), timeout=60
                    )
                )
            except ray.exceptions.RayTaskError as e:  # the instance raised: pass its error on
                cause = e.cause if isinstance(e.cause, PdserveError) else None
                abort_with(context, cause or InstanceUnavailableError(f"{info.name} failed: {e}"))
            except (ray.exceptions.RayError, TimeoutError):
                abort_with(context, InstanceUnavailableError(f"{info.name} did not answer"))
        return admin_pb2.FlushCacheReply(blocks=flushed)

    def AbortRequest(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortReply:
        found = request.request_id in self.router.active_requests()
        self.router.abort(request.request_id)
        return common_pb2.AbortReply(found=found)

    def GetRequestTrace(
        self, request: admin_pb2.RequestTraceRequest, context: grpc.ServicerContext
    ) -> admin_pb2.RequestTrace:
        record = self.router.recent.get(request.request_id)
        if record is None:
            kept = self.router.recent.capacity
            abort_with(
                context,
                RequestNotFoundError(
                    f"no request {request.request_id!r} on this router: it keeps the running "
                    f"requests and the last {kept} finished ones (observability.recent_requests)"
                ),
            )
        return record.to_proto()


def serve_admin(
    config: AdminConfig,
    token: str,
    cluster: Cluster,
    router: Router,
    on_change: Callable[[], None] = lambda: None,
) -> tuple[grpc.Server, int]:
    """Start the admin server (TLS when `tls_cert`/`tls_key` are set); returns (server, port)."""
    credentials = None
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise ConfigError("admin.tls_cert and admin.tls_key go together")
        pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
        credentials = grpc.ssl_server_credentials([pair])
    servicer = AdminServicer(cluster, router, on_change)
    return create_server(
        lambda s: admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        interceptors=[BearerTokenInterceptor(token)],
        credentials=credentials,
    )
