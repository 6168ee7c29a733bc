"""PrefillService servicer: convert -> delegate to PrefillInstance -> convert."""

import logging
from typing import Any

import grpc

from pdserve.config import EngineConfig, PrefillConfig, StorageConfig, TransferConfig
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.instance.convert import hashes_from_proto, logprob_to_proto, sampling_from_proto
from pdserve.instance.roles import ServedRole
from pdserve.observability import tracing
from pdserve.rpc.server import AioServer, blocking, post
from pdserve.rpc.status import abort_with_async
from pdserve.rpc.tls import TlsFiles
from pdserve.transfer.base import PrefixSource
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.instance import PrefillInstance, PrefillOutcome

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.PrefillService"


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Thin: a coroutine on the server's event loop that runs the blocking PrefillInstance
    (thread-safe) on the server's executor."""

    def __init__(self, served: ServedRole) -> None:
        self.served = served

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> prefill_pb2.PrefillResult:
        generate = request.request
        try:
            instance = self.served.get(PrefillInstance)
        except PdserveError as e:
            await abort_with_async(context, e)
        try:
            if not request.decode_address:
                raise InvalidRequestError("decode_address is required")
            params = sampling_from_proto(generate.sampling)
            outcome = await blocking(
                instance.prefill, generate.request_id, list(generate.prompt_token_ids),
                params, request.decode_address, hashes_from_proto(generate), generate.attempt,
                generate.subscriber, tracing.extract(context.invocation_metadata() or ()),
                generate.route_seq, _source(request),
            )  # fmt: skip
        except PdserveError as e:
            logger.info(
                "prefill of request %s for %s failed: %s",
                generate.request_id, request.decode_address, e,
                extra={"request_id": generate.request_id},
            )  # fmt: skip
            await abort_with_async(context, e)
        except Exception as e:
            logger.exception("prefill of request %s failed", generate.request_id,
                             extra={"request_id": generate.request_id})  # fmt: skip
            await abort_with_async(context, e)
        finally:
            # at once, also when the caller went away mid-prefill (its wait for the KV then
            # ends); a no-op after a handoff
            post(instance.abort, generate.request_id)
        return _result(outcome)


def _source(request: prefill_pb2.PrefillRequest) -> PrefixSource | None:
    source = request.kv_source
    return PrefixSource(source.address, source.num_blocks) if source.address else None


def _result(outcome: PrefillOutcome) -> prefill_pb2.PrefillResult:
    t = outcome.timings
    return prefill_pb2.PrefillResult(
        first_token_id=outcome.first_token_id,
        num_prompt_tokens=outcome.num_prompt_tokens,
        num_cached_tokens=outcome.num_cached_tokens,
        num_decode_cached_tokens=outcome.num_decode_cached_tokens,
        kv_blocks_sent=outcome.blocks_sent,
        kv_bytes_sent=outcome.bytes_sent,
        transport=outcome.transport,
        prompt_logprobs=[logprob_to_proto(lp) for lp in outcome.prompt_logprobs],
        num_device_hit_tokens=outcome.device_hit_tokens,
        num_storage_hit_tokens=outcome.storage_hit_tokens,
        num_pulled_tokens=outcome.pulled_tokens,
        timings=prefill_pb2.PrefillTimings(
            reserve_s=t.reserve_s,
            queue_s=t.queue_s,
            compute_s=t.compute_s,
            transfer_s=t.transfer_s,
            handoff_s=t.handoff_s,
        ),
    )


def add_prefill_servicer(served: ServedRole, server: grpc.aio.Server) -> None:
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(served), server)


def serve_prefill(
    engine_config: EngineConfig,
    config: PrefillConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    storage: StorageConfig | None = None,
    transfer: TransferConfig | None = None,
    *,
    secret: str,
    tls: TlsFiles | None = None,
) -> tuple[PrefillInstance, AioServer, int]:
    """Start a prefill instance and its gRPC server (every call must carry `secret`); returns
    (instance, server, port)."""
    instance = PrefillInstance.create(
        engine_config, config, storage, transfer, host, secret=secret, tls=tls
    )
    instance.start()
    served = ServedRole(instance)
    server, bound = instance.runtime.serve(
        lambda s: add_prefill_servicer(served, s), [SERVICE_NAME], served, host, port
    )
    return instance, server, bound
