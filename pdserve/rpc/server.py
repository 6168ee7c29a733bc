"""gRPC server factory: thread pool, message limits, health and reflection services."""

import ipaddress
import socket
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.rpc.channels import SERVER_OPTIONS


def create_server(
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """Build and start a server; `register` adds the servicers. Returns (server, bound port).

    Port 0 picks a free port (tests). Health reports SERVING for every name in
    `service_names` and for the empty name (the whole server).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        interceptors=list(interceptors),
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    server.start()
    return server, bound


def instance_workers(max_num_seqs: int) -> int:
    """Handler threads of an instance's server. Every open token stream (StreamTokens,
    Generate) and every Prefill in flight holds one, so the pool is sized from the engine's batch
    — twice `max_num_seqs` (requests queued behind the running ones keep their streams open
    too) plus control calls and KV-event subscriptions — so that the engine's limits, not the
    pool, bound what an instance runs."""
    return 2 * max_num_seqs + 32


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a listener on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def host_port(host: str, port: int) -> str:
    """`host:port` as a gRPC target or URL authority: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def advertised_host(bind_host: str) -> str:
    """The address peers should dial: the bind address, or this node's IP for 0.0.0.0."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # not in Ray: best effort
        return socket.gethostbyname(socket.gethostname())
