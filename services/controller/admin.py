"""The admin gRPC API (proto/pdserve/v1/admin.proto), served by `pdserve up` next to the router.

Every call needs `authorization: Bearer <token>`; only health answers without it. The
token comes from `admin.token` (or `PDSERVE_ADMIN_TOKEN`); unset, one is generated and written
with mode 0600 next to cluster.json, where `pdserve admin` finds it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import ray

from pdserve.config import AdminConfig
from pdserve.errors import (
    ConfigError,
    InstanceUnavailableError,
    PdserveError,
    RequestNotFoundError,
)
from pdserve.rpc.auth import BearerTokenInterceptor, secret_file
from pdserve.rpc.server import create_server
from pdserve.rpc.status import abort_with
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from services.controller.cluster import InstanceInfo
from services.controller.topology import Refused, Topology
from services.planner.loop import PlannerLoop

T = TypeVar("T")

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.AdminService"


def admin_token(config: AdminConfig, state_dir: Path) -> str:
    """The configured token, or a new one written (0600) to `state_dir/admin_token`."""
    configured = config.token or os.environ.get("PDSERVE_ADMIN_TOKEN")
    path = state_dir / "admin_token"
    if not configured:
        path.unlink(missing_ok=True)  # a new cluster gets a new token
    return secret_file(path, configured)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Runs on the admin server's handler threads; changes to the instance set go through the
    `Topology` (one at a time, shared with the planner)."""

    def __init__(self, topology: Topology, planner: PlannerLoop | None = None) -> None:
        self.topology = topology
        self.cluster = topology.cluster
        self.router = topology.router
        self.planner = planner

    def _find(self, name: str, context: grpc.ServicerContext) -> InstanceInfo:
        try:
            return self.topology.find(name)
        except Refused as e:
            context.abort(e.code, str(e))
            raise AssertionError("unreachable") from e  # context.abort raises

    def ListInstances(
        self, request: admin_pb2.ListInstancesRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        history = self.topology.router.history
        routers = [
            admin_pb2.RouterReplica(name=r.name, pid=r.pid, alive=r.alive, restarts=r.restarts,
                                    metrics_address=r.metrics_address)
            for r in self.topology.routers()
        ]  # fmt: skip
        return admin_pb2.ListInstancesReply(
            instances=self.topology.describe_all(),
            message_s=history.message_s() or 0.0,
            message_quantiles=history.message_quantiles(),
            routers=routers,
        )

    def DrainInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        info = self._find(request.name, context)
        self.router.membership.set_drained(info.address, True)
        logger.warning("instance %s drained: no new requests", info.name)
        return self.topology.describe(info)

    def ResumeInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        info = self._find(request.name, context)
        self.router.membership.set_drained(info.address, False)
        logger.warning("instance %s resumed", info.name)
        return self.topology.describe(info)

    def RemoveInstance(
        self, request: admin_pb2.InstanceRef, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        self._change(context, lambda: self.topology.retire(request.name))
        return self.ListInstances(admin_pb2.ListInstancesRequest(), context)

    def ScaleRole(
        self, request: admin_pb2.ScaleRoleRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListInstancesReply:
        self._change(context, lambda: self.topology.scale(request.role, request.replicas))
        return self.ListInstances(admin_pb2.ListInstancesRequest(), context)

    def ChangeRole(
        self, request: admin_pb2.ChangeRoleRequest, context: grpc.ServicerContext
    ) -> admin_pb2.InstanceInfo:
        topology = self.topology
        changed = self._change(context, lambda: topology.change_role(request.name, request.role))
        return topology.describe(changed)

    def _change(self, context: grpc.ServicerContext, change: Callable[[], T]) -> T:
        """Run a topology change; its refusal or failure becomes the call's status."""
        try:
            return change()
        except Refused as e:
            context.abort(e.code, str(e))
        except PdserveError as e:
            abort_with(context, e)
        raise AssertionError("unreachable")  # both abort

    def GetPlannerStatus(
        self, request: admin_pb2.PlannerStatusRequest, context: grpc.ServicerContext
    ) -> admin_pb2.PlannerStatus:
        if self.planner is None:
            return admin_pb2.PlannerStatus(enabled=False)
        return self.planner.status()

    def SetPlannerTargets(
        self, request: admin_pb2.PlannerTargets, context: grpc.ServicerContext
    ) -> admin_pb2.PlannerStatus:
        if self.planner is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the planner is off "
                          "(planner.enabled: false)")  # fmt: skip
        try:
            self.planner.planner.set_targets(request.ttft_p90_s, request.itl_p90_s)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.warning("planner targets: TTFT p90 %.3f s, ITL p90 %.4f s", request.ttft_p90_s,
                       request.itl_p90_s)  # fmt: skip
        return self.planner.status()

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
            found = s.device_hit_tokens + s.peer_hit_tokens + s.storage.storage_hit_tokens
            reply.instances.append(
                admin_pb2.InstanceCacheStats(
                    name=described.name,
                    queries=s.prefix_cache_queries,
                    device_hits=s.device_hit_tokens,
                    storage_hits=s.storage.storage_hit_tokens,
                    peer_hits=s.peer_hit_tokens,
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
    config: AdminConfig, token: str, topology: Topology, planner: PlannerLoop | None = None
) -> tuple[grpc.Server, int]:
    """Start the admin server (TLS when `tls_cert`/`tls_key` are set); returns (server, port)."""
    credentials = None
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise ConfigError("admin.tls_cert and admin.tls_key go together")
        pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
        credentials = grpc.ssl_server_credentials([pair])
    servicer = AdminServicer(topology, planner)
    return create_server(
        lambda s: admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        interceptors=[BearerTokenInterceptor(token)],
        credentials=credentials,
    )
