"""Run the router: model metadata from the engine config, uvicorn on its own thread."""

import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from pdserve.config import EngineConfig, RouterConfig
from pdserve.kvcache.hashing import BlockHasher
from pdserve.model.config import ModelConfig
from pdserve.model.loader import model_tag
from pdserve.model.tiny import default_model_dir
from pdserve.model.tokenizer import Tokenizer
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.tls import TlsFiles
from services.router.app import create_app
from services.router.pd_client import PDClient
from services.router.router import ModelInfo, Router

logger = logging.getLogger(__name__)


def model_info(engine: EngineConfig, served_name: str | None) -> ModelInfo:
    """What the router must know of the model: tokenizer, the instances' block hashing, limits."""
    path = Path(engine.model) if engine.model else default_model_dir()
    config = ModelConfig.from_dir(path)
    context = min(
        engine.max_model_len or config.max_position_embeddings, config.max_position_embeddings
    )
    return ModelInfo(
        model_id=served_name or path.name,
        tokenizer=Tokenizer.from_dir(path),
        hasher=BlockHasher.for_model(engine.block_size, model_tag(path, engine.dtype)),
        max_model_len=context,
        vocab_size=config.vocab_size,
    )


@dataclass
class RunningRouter:
    router: Router
    server: uvicorn.Server
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
) -> RunningRouter:
    """Start the HTTP router for PD pairs (or for mixed instances), calling them with the
    cluster `secret`; returns once it accepts connections."""
    model = model_info(engine, config.model_name)
    client = PDClient(ChannelPool(secret, tls))
    router = Router(config, model, prefill, decode, client, mixed=mixed or ())
    router.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    app = create_app(router, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app, loop="uvloop", http="httptools", log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started and thread.is_alive():
        started.wait(0.02)
    port = sock.getsockname()[1]
    logger.info("router serving on http://%s:%d", config.host, port)
    return RunningRouter(router, server, thread, config.host, port)
