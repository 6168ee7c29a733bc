"""MixedService servicer: convert -> delegate to MixedInstance -> convert."""

import logging
from collections.abc import Iterator

import grpc

from pdserve.config import EngineConfig, StorageConfig
from pdserve.errors import PdserveError
from pdserve.instance.convert import hashes_from_proto, sampling_from_proto, token_replies
from pdserve.rpc.status import error_reply
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2, mixed_pb2_grpc
from services.mixed.instance import MixedInstance

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.MixedService"


class MixedServicer(mixed_pb2_grpc.MixedServiceServicer):
    """Thin: runs on gRPC handler threads, delegates to the thread-safe MixedInstance."""

    def __init__(self, instance: MixedInstance) -> None:
        self.instance = instance

    def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TokenReply]:
        def abort_on_exit() -> None:  # runs when the RPC ends; a no-op once finished
            self.instance.abort(request.request_id)

        context.add_callback(abort_on_exit)
        try:
            params = sampling_from_proto(request.sampling)
            outputs = self.instance.generate(
                request.request_id, list(request.prompt_token_ids), params,
                hashes_from_proto(request),
            )  # fmt: skip
            for output in outputs:
                yield from token_replies(output)
        except PdserveError as e:
            yield common_pb2.TokenReply(error=error_reply(e))


def serve_mixed(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    storage: StorageConfig | None = None,
    *,
    secret: str,
    tls: TlsFiles | None = None,
) -> tuple[MixedInstance, grpc.Server, int]:
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
