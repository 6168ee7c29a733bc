"""gRPC server factories: message limits, health and reflection services. `create_server`: a
thread-pool server (the admin service); `create_aio_server`: an asyncio server on a loop thread
of its own (instances: open streams hold no thread)."""

import asyncio
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.rpc.channels import SERVER_OPTIONS

T = TypeVar("T")
logger = logging.getLogger(__name__)


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
    bound = _reflect_and_bind(server, service_names, f"{host}:{port}", credentials)
    server.start()
    return server, bound


def _reflect_and_bind(
    server: grpc.Server | grpc.aio.Server,
    service_names: Sequence[str],
    address: str,
    credentials: grpc.ServerCredentials | None,
) -> int:
    """Enable reflection (of the services, health and reflection) and bind `address`, over
    TLS with `credentials`; returns the bound port. Raises OSError when it cannot bind."""
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return bound


class AioServer:
    """An instance's gRPC server: `grpc.aio` on an event loop thread of its own, so that an
    open stream (SubscribeOutputs, SubscribeKVEvents: async handlers) holds no
    thread, while the blocking work of a call (a Prefill, a reservation, a KV write) runs on
    `executor` — which also serves the handlers that are plain functions (the loop's default
    executor and the server's migration pool).

    Driven from blocking code, as `grpc.Server` is: `stop(grace)` returns an Event set once
    the server and its loop are down.
    """

    def __init__(self, executor: futures.ThreadPoolExecutor) -> None:
        self.executor = executor
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(executor)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the server's loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def serve(
        self,
        register: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str],
        address: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        credentials: grpc.ServerCredentials | None,
    ) -> int:
        """On the loop: build, bind and start the server; returns the bound port."""
        server = grpc.aio.server(
            migration_thread_pool=self.executor,
            options=SERVER_OPTIONS,
            interceptors=list(interceptors),
        )
        register(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", *service_names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        bound = _reflect_and_bind(server, service_names, address, credentials)
        await server.start()
        self._server, self._health = server, health_servicer
        return bound

    def set_serving(self, service_name: str, serving: bool) -> None:
        """What the health service answers for `service_name` from now on (from another
        thread): an instance that changed role serves its old role's service no more."""
        health_servicer = self._health
        if health_servicer is None:
            raise RuntimeError("the server is not serving")
        status = health_pb2.HealthCheckResponse
        value = status.SERVING if serving else status.NOT_SERVING
        self.run(health_servicer.set(service_name, value))

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls still running get `grace` seconds), then the loop and the
        executor. Idempotent; returns an Event set when all is down."""
        if not self._stopped.is_set() and self._thread.is_alive():
            if self._server is not None:
                self.run(self._server.stop(grace))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()
        return self._stopped


def create_aio_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[AioServer, int]:
    """`create_server` for instances: an AioServer whose executor has `max_workers` threads
    for blocking work. Returns (server, bound port)."""
    executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-work")
    server = AioServer(executor)
    try:
        bound = server.run(
            server.serve(register, service_names, f"{host}:{port}", interceptors, credentials)
        )
    except BaseException:
        server.stop(0)
        raise
    return server, bound


async def blocking(function: Callable[..., T], *args: Any) -> T:
    """Run a blocking `function(*args)` on the server's executor (the running loop's default
    one) and await its result. A cancelled caller stops waiting; the call runs to its end."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def post(
    function: Callable[..., object], *args: Any, after: "asyncio.Future[Any] | None" = None
) -> None:
    """Run a blocking `function(*args)` on the executor without waiting for it (the clean-up a
    handler leaves behind), once `after` (a call it stopped waiting for) is done when given.
    A failure is logged, never lost."""
    loop = asyncio.get_running_loop()

    def run(_: object = None) -> None:
        try:
            loop.run_in_executor(None, function, *args).add_done_callback(_log_failure)
        except RuntimeError:  # the server is stopping: its executor takes no more work
            logger.info("clean-up %s skipped: the server is stopping", function.__name__)

    if after is None or after.done():
        run()
    else:
        after.add_done_callback(run)


def _log_failure(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("clean-up after an RPC failed", exc_info=future.exception())


def instance_workers(max_num_seqs: int) -> int:
    """Executor threads of an instance's server (`AioServer`) for blocking work. Open token
    streams hold none; every Prefill in flight holds one (its wait for the KV), and KV-event
    subscriptions one each while they wait, so the pool is sized from the engine's batch —
    twice `max_num_seqs` (requests queued behind the running ones) plus control calls — so
    that the engine's limits, not the pool, bound what an instance runs."""
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
