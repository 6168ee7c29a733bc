"""DecodeService servicer: convert -> delegate to DecodeInstance -> convert."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.config import DecodeConfig, EngineConfig, StorageConfig, TransferConfig
from pdserve.errors import KVTransferError, PdserveError
from pdserve.instance.convert import (
    endpoints_to_proto,
    hashes_from_proto,
    logprob_from_proto,
    sampling_from_proto,
)
from pdserve.instance.roles import ServedRole
from pdserve.observability import tracing
from pdserve.rpc.server import AioServer, blocking
from pdserve.rpc.status import abort_with, abort_with_async
from pdserve.rpc.tls import TlsFiles
from pdserve.transfer.wire import KVChunkView, parse_kv_chunk
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.instance import DecodeInstance

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.DecodeService"


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Thin: delegates to the thread-safe DecodeInstance. Reserve, CommitKV and StartDecode
    are plain functions (the server runs them on its executor); PushKV is a coroutine on the
    server's event loop, which must see a broken stream at once. The outputs go out on the
    router's subscription (InstanceService.SubscribeOutputs)."""

    def __init__(self, served: ServedRole) -> None:
        self.served = served

    def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> decode_pb2.ReserveReply:
        generate = request.request
        try:
            instance = self.served.get(DecodeInstance)
            grant = instance.preallocate_resource_in_d(
                generate.request_id,
                list(generate.prompt_token_ids),
                sampling_from_proto(generate.sampling),
                hashes_from_proto(generate),
                generate.attempt,
                generate.subscriber,
                tracing.extract(context.invocation_metadata() or ()),
            )
            instance.runtime.acknowledge(generate.subscriber, generate.route_seq)
        except Exception as e:  # a refusal is RESOURCE_EXHAUSTED with decode's retry-after
            _log_unexpected(e, "Reserve", generate.request_id)
            abort_with(context, e)
        return decode_pb2.ReserveReply(
            num_cached_tokens=grant.num_cached_tokens,
            num_blocks=grant.num_blocks,
            block_bytes=grant.block_bytes,
            block_ids=grant.block_ids,
            lease_ms=int(instance.config.reservation_timeout_s * 1000),
            endpoints=endpoints_to_proto(instance.endpoints),
            kv_layout=instance.runtime.kv_tag,
        )

    def CommitKV(
        self, request: decode_pb2.CommitKVRequest, context: grpc.ServicerContext
    ) -> decode_pb2.CommitKVReply:
        try:
            instance = self.served.get(DecodeInstance)
            instance.commit_blocks(request.request_id, request.first_block, request.num_blocks)
        except Exception as e:
            _log_unexpected(e, "CommitKV", request.request_id)
            abort_with(context, e)
        return decode_pb2.CommitKVReply()

    async def PushKV(
        self,
        request_iterator: AsyncIterator[decode_pb2.KVChunk | KVChunkView],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> decode_pb2.PushKVReply:
        """Write each chunk into its reservation (on the executor: a copy into the KV cache).
        A stream that breaks — the sender cancels, its deadline passes, it ends without its
        `last` chunk, a write fails — releases its reservations at once, not at lease expiry
        (a write still running when the handler is cancelled defers the release to its end)."""
        try:
            instance = self.served.get(DecodeInstance)
        except PdserveError as e:
            await abort_with_async(context, e)
        blocks = received = 0
        request_ids: set[str] = set()
        completed = saw_last = False

        def settle_if_broken() -> None:  # idempotent
            if not completed:
                for request_id in request_ids:
                    instance.transfer_failed(request_id)

        try:
            async for chunk in request_iterator:
                request_ids.add(chunk.request_id)
                saw_last = saw_last or chunk.last
                data = memoryview(chunk.data)  # a view when parsed by parse_kv_chunk
                blocks += await blocking(
                    instance.receive_blocks, chunk.request_id, chunk.first_block, data
                )
                received += len(data)
            completed = saw_last
        except KVTransferError as e:
            settle_if_broken()  # before the sender sees the error (`abort` sends it)
            await abort_with_async(context, e)
        finally:
            settle_if_broken()
        return decode_pb2.PushKVReply(blocks_received=blocks, bytes_received=received)

    async def ReadKV(  # type: ignore[override]  # bytes: chunks serialized already
        self,
        request: decode_pb2.ReadKVRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        """The blocks a prefill instance pulls (serialized `KVChunk`s: the handler's
        serializer passes bytes through)."""
        try:
            instance = self.served.get(DecodeInstance)
            async for chunk in instance.runtime.serve_kv(request):
                yield chunk
        except PdserveError as e:
            await abort_with_async(context, e)

    def StartDecode(
        self, request: decode_pb2.StartDecodeRequest, context: grpc.ServicerContext
    ) -> decode_pb2.StartDecodeReply:
        try:
            logprob = (
                logprob_from_proto(request.first_logprob)
                if request.HasField("first_logprob")
                else None
            )
            instance = self.served.get(DecodeInstance)
            instance.start_decode(request.request_id, request.first_token_id, logprob)
        except Exception as e:
            _log_unexpected(e, "StartDecode", request.request_id)
            abort_with(context, e)
        return decode_pb2.StartDecodeReply()

    def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> decode_pb2.GenerateReply:
        try:
            instance = self.served.get(DecodeInstance)
            instance.generate(
                request.request_id,
                list(request.prompt_token_ids),
                sampling_from_proto(request.sampling),
                hashes_from_proto(request),
                request.attempt,
                request.subscriber,
                tracing.extract(context.invocation_metadata() or ()),
            )
            instance.runtime.acknowledge(request.subscriber, request.route_seq)
        except Exception as e:
            _log_unexpected(e, "Generate", request.request_id)
            abort_with(context, e)
        return decode_pb2.GenerateReply()


def _log_unexpected(error: Exception, method: str, request_id: str) -> None:
    """A PdserveError is the caller's business (its status says it); anything else is a bug."""
    if not isinstance(error, PdserveError):
        logger.exception("%s of request %s failed", method, request_id,
                         extra={"request_id": request_id})  # fmt: skip


class _HandlerRecorder:
    """Stands in for a server to capture the generated method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.handlers = dict(handlers)


def add_decode_servicer(served: ServedRole, server: grpc.aio.Server) -> None:
    """Register the generated DecodeService handlers, with PushKV parsing KV chunks without
    copying their data (`parse_kv_chunk`) and ReadKV sending chunks serialized already."""
    recorder = _HandlerRecorder()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(served), recorder)  # type: ignore[arg-type]
    handlers = recorder.handlers
    handlers["PushKV"] = handlers["PushKV"]._replace(request_deserializer=parse_kv_chunk)  # type: ignore[attr-defined]
    handlers["ReadKV"] = handlers["ReadKV"]._replace(response_serializer=None)  # type: ignore[attr-defined]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def serve_decode(
    engine_config: EngineConfig,
    config: DecodeConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    storage: StorageConfig | None = None,
    transfer: TransferConfig | None = None,
    *,
    secret: str,
    tls: TlsFiles | None = None,
) -> tuple[DecodeInstance, AioServer, int]:
    """Start a decode instance and its gRPC server (every call must carry `secret`); returns
    (instance, server, port)."""
    instance = DecodeInstance.create(
        engine_config, config, storage, transfer, host, secret=secret, tls=tls
    )
    instance.start()
    served = ServedRole(instance)
    server, bound = instance.runtime.serve(
        lambda s: add_decode_servicer(served, s), [SERVICE_NAME], served, host, port
    )
    return instance, server, bound
