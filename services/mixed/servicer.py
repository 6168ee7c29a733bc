"""MixedService servicer: convert -> delegate to MixedInstance -> convert."""

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.config import EngineConfig, StorageConfig
from pdserve.errors import PdserveError
from pdserve.instance.convert import hashes_from_proto, sampling_from_proto, token_replies
from pdserve.instance.streams import OutputStream
from pdserve.rpc.server import AioServer, post
from pdserve.rpc.status import error_reply
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2, mixed_pb2_grpc
from services.mixed.instance import MixedInstance

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.MixedService"


class MixedServicer(mixed_pb2_grpc.MixedServiceServicer):
    """Thin: a coroutine on the server's event loop; the request is built and queued on the
    server's executor, its outputs are read on the loop (an open stream holds no thread)."""

    def __init__(self, instance: MixedInstance) -> None:
        self.instance = instance

    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.TokenReply]:
        request_id = request.request_id
        stream: OutputStream | None = None
        submitted: asyncio.Future[None] | None = None
        finished = False
        try:
            params = sampling_from_proto(request.sampling)
            stream = self.instance.runtime.open_stream(request_id)
            submitted = asyncio.get_running_loop().run_in_executor(
                None, self.instance.submit, request_id, list(request.prompt_token_ids), params,
                hashes_from_proto(request),
            )  # fmt: skip
            await asyncio.shield(submitted)  # cancelled, the clean-up waits for it to be queued
            async for output in stream:
                finished = output.finished
                for reply in token_replies(output):
                    yield reply
        except PdserveError as e:
            yield common_pb2.TokenReply(error=error_reply(e))
        finally:
            if stream is not None:  # aborted unless finished, once it was queued (or refused)
                post(self.instance.end, request_id, stream, finished, after=submitted)


def serve_mixed(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    storage: StorageConfig | None = None,
    *,
    secret: str,
    tls: TlsFiles | None = None,
) -> tuple[MixedInstance, AioServer, int]:
    """Start a mixed instance and its gRPC server (every call must carry `secret`); returns
    (instance, server, port)."""
    instance = MixedInstance(engine_config, storage, secret=secret, tls=tls)
    instance.start()
    servicer = MixedServicer(instance)
    server, bound = instance.runtime.serve(
        lambda s: mixed_pb2_grpc.add_MixedServiceServicer_to_server(servicer, s),
        SERVICE_NAME,
        instance,
        host,
        port,
    )
    return instance, server, bound
