"""PrefillService servicer: convert -> delegate to PrefillInstance -> convert."""

import logging
from collections.abc import Iterator

import grpc

from pdserve.config import EngineConfig, PrefillConfig, StorageConfig, TransferConfig
from pdserve.errors import PdserveError
from pdserve.rpc.convert import error_proto, sampling_from_proto
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.prefill.instance import PrefillInstance, PrefillOutcome

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.PrefillService"
STAGES = {
    "reserved": prefill_pb2.PREFILL_STAGE_RESERVED,
    "computed": prefill_pb2.PREFILL_STAGE_COMPUTED,
    "transferred": prefill_pb2.PREFILL_STAGE_TRANSFERRED,
}


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, instance: PrefillInstance) -> None:
        self.instance = instance

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[prefill_pb2.PrefillReply]:
        generate = request.request

        def abort_on_exit() -> None:  # runs when the RPC ends; a no-op after a handoff
            self.instance.abort(generate.request_id)

        context.add_callback(abort_on_exit)
        if not request.decode_address:
            yield _error(PdserveError("decode_address is required"), context)
            return
        try:
            params = sampling_from_proto(generate.sampling)
            steps = self.instance.prefill(
                generate.request_id, list(generate.prompt_token_ids), params, request.decode_address
            )
            for step in steps:
                if isinstance(step, PrefillOutcome):
                    yield prefill_pb2.PrefillReply(final=_result(step))
                elif isinstance(step, str):
                    yield prefill_pb2.PrefillReply(
                        chunk=prefill_pb2.PrefillProgress(stage=STAGES[step])
                    )
        except PdserveError as e:
            logger.info("prefill of request %s failed: %s", generate.request_id, e)
            yield _error(e, context)

    def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortReply:
        return common_pb2.AbortReply(found=self.instance.abort(request.request_id))

    def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> common_pb2.InstanceStats:
        return self.instance.stats()

    def SubscribeKVEvents(
        self, request: common_pb2.KVEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.KVEvent]:
        return self.instance.core.kv_event_stream(context)


def _error(error: Exception, context: grpc.ServicerContext) -> prefill_pb2.PrefillReply:
    return prefill_pb2.PrefillReply(error=error_proto(error))


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
        timings=prefill_pb2.PrefillTimings(
            reserve_s=t.reserve_s,
            queue_s=t.queue_s,
            compute_s=t.compute_s,
            transfer_s=t.transfer_s,
            handoff_s=t.handoff_s,
        ),
    )


def serve_prefill(
    engine_config: EngineConfig,
    config: PrefillConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    storage: StorageConfig | None = None,
    transfer: TransferConfig | None = None,
) -> tuple[PrefillInstance, grpc.Server, int]:
    """Start a prefill instance and its gRPC server; returns (instance, server, port)."""
    instance = PrefillInstance(engine_config, config, storage, transfer, host)
    instance.start()
    servicer = PrefillServicer(instance)
    server, bound = instance.core.serve(
        lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
        SERVICE_NAME,
        host,
        port,
        instance.stats,
    )
    return instance, server, bound
