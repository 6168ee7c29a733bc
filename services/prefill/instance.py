"""PrefillInstance: preallocate_resource_in_p, chunked prefill, KV handoff to decode.

One request's journey (on a gRPC handler thread; engine work is delegated to the engine thread):
  1. preallocate_resource_in_p: match the device prefix cache and allocate blocks for the rest of
     the prompt, then ask the decode instance to reserve (bounded backoff when it refuses);
  2. queue the prompt: the scheduler prefills it in chunks, publishing blocks as they complete;
     the first token is sampled and the request is held (blocks pinned);
  3. send the blocks decode lacks through the KV transport, then hand over the first token;
  4. release: the blocks stay in the prefix cache, unreferenced.
Any failure releases the blocks here and the reservation there.
"""

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from pdserve.config import EngineConfig, PrefillConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import RequestOutput
from pdserve.engine.request import Request, SamplingParams
from pdserve.errors import PdserveError
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.convert import ResourceExhaustedError, endpoints_from_proto, generate_request
from pdserve.rpc.instance import InstanceCore
from pdserve.transfer.base import KVEndpoints, KVTarget, KVTransferError
from pdserve.transfer.select import TransportSelector
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class RequestAbortedError(PdserveError):
    """The request was aborted while it was being prefilled."""


@dataclass(slots=True)
class PrefillTimings:
    reserve_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    handoff_s: float = 0.0


@dataclass(slots=True)
class PrefillOutcome:
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_decode_cached_tokens: int
    blocks_sent: int
    bytes_sent: int
    timings: PrefillTimings = field(default_factory=PrefillTimings)
    transport: str = ""  # how the KV went to decode (empty: decode held every block)


@dataclass(frozen=True, slots=True)
class DecodeReservation:
    num_cached_tokens: int
    num_blocks: int
    block_ids: tuple[int, ...] = ()
    block_bytes: int = 0
    endpoints: KVEndpoints = field(default_factory=KVEndpoints)
    deadline: float = float("inf")  # time.monotonic() when direct writes must have ended


class PrefillInstance:
    def __init__(
        self,
        engine_config: EngineConfig,
        config: PrefillConfig,
        storage: StorageConfig | None = None,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.core = InstanceCore.create(
            "prefill", engine_config, on_tick=lambda: None, storage=storage
        )
        self.channels = ChannelPool()
        self.transfer = transfer or TransferConfig()
        self.transports = TransportSelector(
            self.transfer,
            self.channels,
            config.transfer_chunk_bytes,
            self.core.start_mooncake(self.transfer, host, sender=True)
            if transfer is not None
            else None,
        )
        self._kv_ready: dict[str, Future[RequestOutput]] = {}

    def start(self) -> None:
        self.core.start()

    def stop(self) -> None:
        self.core.stop()
        self.transports.close()
        self.channels.close()

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode_address: str,
    ) -> Iterator[common_pb2.Error | str | PrefillOutcome]:
        """Run one request's prefill and handoff, yielding progress stages then the outcome.

        Raises InvalidRequestError, ResourceExhaustedError (decode refused until the backoff ran
        out), KVTransferError or RequestAbortedError; blocks are released on every path.
        """
        outcome = PrefillOutcome(0, len(prompt_token_ids), 0, 0, 0, 0)
        start = time.perf_counter()
        request = self.core.loop.call(
            lambda engine: engine.make_request(
                prompt_token_ids, params, request_id, prefill_only=True
            )
        )
        ready: Future[RequestOutput] = Future()
        self._kv_ready[request_id] = ready
        self.core.set_sink(request_id, ready.set_result)
        decode_reserved = False
        try:
            reservation = self.preallocate_resource_in_p(request, decode_address)
            decode_reserved = True
            outcome.num_decode_cached_tokens = reservation.num_cached_tokens
            outcome.timings.reserve_s = time.perf_counter() - start
            yield "reserved"
            output = self._compute(request, ready, outcome)
            yield "computed"
            self._send_kv(request, reservation, decode_address, outcome)
            yield "transferred"
            self._hand_off(request_id, decode_address, output.new_token_ids[0], outcome)
            decode_reserved = False
        except grpc.RpcError as e:
            raise KVTransferError(
                f"handoff of request {request_id} to {decode_address} failed: {e.details()}"
            ) from e
        finally:
            self._kv_ready.pop(request_id, None)
            self.core.drop_sink(request_id)
            self.core.loop.call(lambda engine: engine.release(request_id))
            if decode_reserved:
                self._abort_on_decode(request_id, decode_address)
        yield outcome

    def _hand_off(
        self, request_id: str, decode_address: str, first_token_id: int, outcome: PrefillOutcome
    ) -> None:
        """The KV is on decode: give it the first token, which starts the request there."""
        start = time.perf_counter()
        self._decode_stub(decode_address).StartDecode(
            decode_pb2.StartDecodeRequest(request_id=request_id, first_token_id=first_token_id)
        )
        outcome.timings.handoff_s = time.perf_counter() - start
        outcome.first_token_id = first_token_id

    def preallocate_resource_in_p(self, request: Request, decode_address: str) -> DecodeReservation:
        """Match the device prefix cache (extended by the storage tier), allocate blocks for the
        rest of the prompt, and ask the decode instance to reserve blocks for it (retrying,
        bounded, while it refuses)."""
        self.core.read_ahead(request)
        self.core.loop.call(lambda engine: engine.preallocate(request))
        stub = self._decode_stub(decode_address)
        message = decode_pb2.ReserveRequest(
            request=generate_request(
                request.request_id, list(request.prompt_token_ids), request.sampling_params
            )
        )
        for attempt in range(1, self.config.reserve_max_attempts + 1):
            asked = time.monotonic()
            reply = stub.Reserve(message, timeout=30)
            if reply.granted:
                lease_s = reply.lease_ms / 1000 if reply.lease_ms else float("inf")
                return DecodeReservation(
                    reply.num_cached_tokens,
                    reply.num_blocks,
                    tuple(reply.block_ids),
                    reply.block_bytes,
                    endpoints_from_proto(reply.endpoints),
                    asked + lease_s - self.transfer.lease_margin_s,
                )
            logger.info(
                "decode %s refused request %s (attempt %d): %s",
                decode_address,
                request.request_id,
                attempt,
                reply.reason,
            )
            if attempt < self.config.reserve_max_attempts:
                time.sleep(min(reply.retry_after_ms / 1000, self.config.reserve_max_backoff_s))
        raise ResourceExhaustedError(
            f"decode instance {decode_address} refused request {request.request_id} "
            f"{self.config.reserve_max_attempts} times: {reply.reason}",
            reply.retry_after_ms,
        )

    def _compute(
        self, request: Request, ready: "Future[RequestOutput]", outcome: PrefillOutcome
    ) -> RequestOutput:
        queued = time.perf_counter()
        self.core.loop.call(lambda engine: engine.submit(request))
        output = ready.result(timeout=self.config.kv_ready_timeout_s)
        outcome.num_cached_tokens = output.num_cached_tokens
        outcome.timings.compute_s = time.perf_counter() - queued
        return output

    def _send_kv(
        self,
        request: Request,
        reservation: DecodeReservation,
        decode_address: str,
        outcome: PrefillOutcome,
    ) -> None:
        started = time.perf_counter()
        first_block = reservation.num_cached_tokens // self.core.engine.kv_cache.block_size
        table = self.core.loop.call(
            lambda engine: list(engine.kv_cache.block_table(request.request_id))
        )
        block_ids = table[first_block : reservation.num_blocks]
        if block_ids:
            target = KVTarget(
                decode_address,
                request.request_id,
                first_block,
                reservation.block_ids[first_block : reservation.num_blocks],
                reservation.block_bytes,
                reservation.endpoints,
                reservation.deadline,
            )
            transport = self.transports.choose(target)
            try:
                result = transport.send(target, self.core.block_io.read(block_ids))
            except KVTransferError:
                self.core.counters.failed(transport.name)
                raise
            outcome.transport = transport.name
            outcome.blocks_sent, outcome.bytes_sent = result.num_blocks, result.num_bytes
            self.core.counters.sent(transport.name, result)
        outcome.timings.transfer_s = time.perf_counter() - started

    def abort(self, request_id: str) -> bool:
        ready = self._kv_ready.get(request_id)
        found = self.core.abort(request_id)
        if ready is not None and not ready.done():
            ready.set_exception(RequestAbortedError(f"request {request_id} was aborted"))
            found = True
        return found

    def _abort_on_decode(self, request_id: str, decode_address: str) -> None:
        try:
            self._decode_stub(decode_address).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=5
            )
        except grpc.RpcError as e:  # decode gone: its lease expiry frees the reservation
            logger.warning(
                "could not abort request %s on %s: %s", request_id, decode_address, e.details()
            )

    def _decode_stub(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        return decode_pb2_grpc.DecodeServiceStub(self.channels.get(address))

    def stats(self) -> common_pb2.InstanceStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()
