"""Run the router: model metadata from the engine config, uvicorn on its own thread and event
loop (the loop every request of the router runs on)."""

import asyncio
import gc
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
import uvloop

from pdserve.config import EngineConfig, ObservabilityConfig, RouterConfig
from pdserve.errors import ConfigError
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.tls import TlsFiles
from services.router.app import ScrapeTargets, create_app
from services.router.membership import Membership
from services.router.model_info import model_info
from services.router.pd_client import PDClient
from services.router.router import Router

logger = logging.getLogger(__name__)


@dataclass
class RunningRouter:
    router: Router
    server: uvicorn.Server
    loop: asyncio.AbstractEventLoop  # the server's: `router.generate` runs on it
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.router.stop()


def serve_router(
    config: RouterConfig,
    engine: EngineConfig,
    prefill: list[str],
    decode: list[str],
    mixed: list[str] | None = None,
    *,
    secret: str,
    tls: TlsFiles | None = None,
    scrape_targets: ScrapeTargets | None = None,
    on_unreachable: Callable[[], None] = lambda: None,
    observability: ObservabilityConfig | None = None,
) -> RunningRouter:
    """Start the HTTP router for PD pairs (or for mixed instances), calling them with the
    cluster `secret`; returns once it accepts connections. `scrape_targets(router_address)`
    answers Prometheus HTTP service discovery (None: the router alone); `on_unreachable` is
    called when an instance could not be reached (`Router`)."""
    if mixed and (prefill or decode):
        raise ConfigError("a router serves either mixed instances or prefill + decode pairs")
    model = model_info(engine, config.model_name)
    membership = Membership(mixed or prefill, decode, mixed=bool(mixed))
    client = PDClient(ChannelPool(secret, tls))
    router = Router(
        config,
        model,
        membership,
        client,
        on_unreachable=on_unreachable,
        observability=observability,
    )
    router.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if config.replicas > 1:  # every replica listens on the port: the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    address = f"{config.host}:{sock.getsockname()[1]}"
    app = create_app(router, config, lambda: (scrape_targets or _alone)(address))
    server = uvicorn.Server(
        uvicorn.Config(
            app, loop="none", http="httptools", log_level="warning", timeout_graceful_shutdown=5
        )
    )
    _settle_gc()
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=_serve, args=(loop, server, sock), daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started and thread.is_alive():
        started.wait(0.02)
    port = sock.getsockname()[1]
    logger.info("router serving on http://%s:%d", config.host, port)
    return RunningRouter(router, server, loop, thread, config.host, port)


def _settle_gc() -> None:
    """Fewer, cheaper garbage collections while streaming: what exists at startup (modules,
    the app, the tokenizer) is never scanned again, and the youngest generation is collected
    after 20,000 allocations instead of 700. Every token allocates a few short-lived objects;
    with CPython's defaults the collector took ~11 % of the router's CPU at 1,000 streams."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(max(gc.get_threshold()[0], 20_000), older, oldest)


def _serve(loop: asyncio.AbstractEventLoop, server: uvicorn.Server, sock: socket.socket) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(server.serve(sockets=[sock]))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _alone(router_address: str) -> list[dict[str, object]]:
    return [{"targets": [router_address], "labels": {"role": "router", "name": "router"}}]
