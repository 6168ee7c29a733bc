"""MixedService servicer: convert -> delegate to MixedInstance -> convert."""

import logging
from typing import Any

import grpc

from pdserve.config import EngineConfig, StorageConfig
from pdserve.errors import PdserveError
from pdserve.instance.convert import hashes_from_proto, sampling_from_proto
from pdserve.instance.roles import ServedRole
from pdserve.observability import tracing
from pdserve.rpc.server import AioServer, blocking
from pdserve.rpc.status import abort_with_async
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2, mixed_pb2, mixed_pb2_grpc
from services.mixed.instance import MixedInstance

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.MixedService"


class MixedServicer(mixed_pb2_grpc.MixedServiceServicer):
    """Thin: a coroutine on the server's event loop; the request is built and queued on the
    server's executor. Its outputs go to the subscription it names (SubscribeOutputs)."""

    def __init__(self, served: ServedRole) -> None:
        self.served = served

    async def Submit(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> mixed_pb2.SubmitReply:
        try:
            params = sampling_from_proto(request.sampling)
            instance = self.served.get(MixedInstance)
            await blocking(
                instance.submit, request.request_id, list(request.prompt_token_ids),
                params, hashes_from_proto(request), request.attempt, request.subscriber,
                tracing.extract(context.invocation_metadata() or ()),
            )  # fmt: skip
            instance.runtime.acknowledge(request.subscriber, request.route_seq)
        except PdserveError as e:
            await abort_with_async(context, e)
        return mixed_pb2.SubmitReply()


def add_mixed_servicer(served: ServedRole, server: grpc.aio.Server) -> None:
    mixed_pb2_grpc.add_MixedServiceServicer_to_server(MixedServicer(served), server)


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
    instance = MixedInstance.create(engine_config, storage, secret=secret, tls=tls)
    instance.start()
    served = ServedRole(instance)
    server, bound = instance.runtime.serve(
        lambda s: add_mixed_servicer(served, s), [SERVICE_NAME], served, host, port
    )
    return instance, server, bound
