"""DecodeInstance: reserves blocks for incoming prompts, receives their KV and generates.

Threads: gRPC handlers validate, reserve (on the engine thread), write KV bytes (on their own
thread, into blocks the reservation owns exclusively) and stream outputs from per-request queues;
the engine thread decodes, expires leases and frees blocks.
"""

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

from pdserve.config import DecodeConfig, EngineConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.request import Request, SamplingParams
from pdserve.errors import InvalidRequestError, RequestNotFoundError
from pdserve.rpc.convert import ResourceExhaustedError
from pdserve.rpc.instance import InstanceCore, aborted_output
from pdserve.transfer.base import KVEndpoints, KVTransferError, host_id
from pdserve.v1 import common_pb2
from services.decode.reservations import Reservation, ReservationTable

logger = logging.getLogger(__name__)

_FINISHED = None  # marks the end of a request's output queue


@dataclass(frozen=True, slots=True)
class ReservationGrant:
    num_cached_tokens: int
    num_blocks: int
    block_bytes: int
    block_ids: tuple[int, ...] = ()


class DecodeInstance:
    def __init__(
        self,
        engine_config: EngineConfig,
        config: DecodeConfig,
        storage: StorageConfig | None = None,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.reservations = ReservationTable()
        self.core = InstanceCore.create(
            "decode",
            engine_config,
            on_tick=self._expire_leases,
            storage=storage,
            shared_kv_cache=transfer is not None and transfer.shared_memory,
        )
        self.endpoints = KVEndpoints(host_id=host_id(), kv_bytes=self.core.block_io.total_bytes)
        segment = self.core.engine.runner.segment
        if segment is not None:
            self.endpoints = replace(self.endpoints, shm_name=segment.name)
        mooncake = self.core.start_mooncake(transfer, host) if transfer is not None else None
        if mooncake is not None:
            base = self.core.engine.runner.kv_cache.data_ptr()
            self.endpoints = replace(
                self.endpoints, mooncake_session=mooncake.session, mooncake_base=base
            )
        self.num_expired = 0
        self._outputs: dict[str, queue.SimpleQueue[RequestOutput | None]] = {}
        self._outputs_lock = threading.Lock()

    def start(self) -> None:
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    # -- reservation (preallocate_resource_in_d) ------------------------------------------------

    def preallocate_resource_in_d(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> ReservationGrant:
        """Reserve blocks for the prompt if the reserve of the running requests survives it.

        Raises ResourceExhaustedError (with a retry-after) when it would not, and
        InvalidRequestError for a bad request.
        """
        request = self.core.loop.call(
            lambda engine: engine.make_request(prompt_token_ids, params, request_id)
        )
        self.core.read_ahead(request)  # blocks this instance lacks but the storage tier has
        grant = self.core.loop.call(lambda engine: self._reserve(engine, request))
        with self._outputs_lock:
            self._outputs[request_id] = queue.SimpleQueue()
        return grant

    def _reserve(self, engine: LLMEngine, request: Request) -> ReservationGrant:
        request_id = request.request_id
        if request_id in engine.scheduler.requests or any(
            r.request_id == request_id for r in self.reservations.requests()
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight here")
        kv = engine.kv_cache
        prefix = kv.match_prefix(request)
        reserve = self.reserve_blocks(engine)
        if not kv.can_allocate(request, request.num_prompt_tokens, prefix, reserve_blocks=reserve):
            needed = kv.num_blocks_to_allocate(request, request.num_prompt_tokens, prefix)
            raise ResourceExhaustedError(
                f"decode instance cannot take {needed} blocks: {kv.num_free_blocks} free, "
                f"{reserve} reserved for running requests",
                self.config.retry_after_ms,
            )
        kv.allocate(request, request.num_prompt_tokens, prefix)
        num_cached_blocks = len(prefix.block_ids) + engine.load_staged(
            request, len(prefix.block_ids)
        )
        request.num_cached_tokens = num_cached_blocks * kv.block_size
        block_ids = tuple(kv.block_table(request_id))
        self.reservations.add(
            request, block_ids, num_cached_blocks, self.config.reservation_timeout_s
        )
        return ReservationGrant(
            request.num_cached_tokens, len(block_ids), self.core.block_io.block_bytes, block_ids
        )

    def reserve_blocks(self, engine: LLMEngine) -> int:
        """Free blocks the running and reserved requests may still need: each may grow by
        min(remaining max_tokens, reserve_horizon_tokens) tokens, up to the context window."""
        horizon = self.config.reserve_horizon_tokens
        block_size = engine.kv_cache.block_size
        total = 0
        for request in [*engine.scheduler.running, *self.reservations.requests()]:
            remaining = request.sampling_params.max_tokens - request.num_output_tokens
            growth = remaining if horizon is None else min(remaining, horizon)
            target = min(request.num_tokens + growth, engine.max_model_len)
            held = len(engine.kv_cache.block_table(request.request_id))
            total += max(0, -(-target // block_size) - held)
        return total

    # -- KV reception -----------------------------------------------------------------------------

    def receive_blocks(self, request_id: str, first_block: int, data: memoryview) -> int:
        """Write whole blocks into the request's reservation (the KVReceiver contract).
        Raises KVTransferError."""
        block_bytes = self.core.block_io.block_bytes
        if len(data) == 0 or len(data) % block_bytes:
            raise KVTransferError(
                f"{len(data)} bytes is not a whole number of {block_bytes}-byte blocks"
            )
        num_blocks = len(data) // block_bytes
        block_ids = self.reservations.begin_write(request_id, first_block, num_blocks)
        ok = False
        try:
            self.core.block_io.write(block_ids, data)
            ok = True
        finally:
            release = self.reservations.end_write(request_id, first_block, num_blocks, ok)
            if release is not None:
                self._release(release, "KV write failed or was cancelled")
        self.core.counters.bytes_received += len(data)
        self.core.counters.blocks_received += num_blocks
        return num_blocks

    def commit_blocks(self, request_id: str, first_block: int, num_blocks: int) -> None:
        """A direct-write transport wrote blocks [first_block, + num_blocks) of the request's
        reservation: count them as received. Raises KVTransferError."""
        self.reservations.begin_write(request_id, first_block, num_blocks)
        self.reservations.end_write(request_id, first_block, num_blocks, True)
        self.core.counters.bytes_received += num_blocks * self.core.block_io.block_bytes
        self.core.counters.blocks_received += num_blocks

    def transfer_failed(self, request_id: str) -> None:
        """The KV stream broke: release the reservation now rather than at lease expiry."""
        reservation = self.reservations.pop(request_id)
        if reservation is not None:
            self._release(reservation, "KV stream broke")

    # -- first token and streaming ---------------------------------------------------------------

    def start_decode(self, request_id: str, first_token_id: int) -> None:
        """First-token handoff: the KV is complete, the request joins the running batch."""
        self.core.loop.call(lambda engine: self._start(engine, request_id, first_token_id))

    def _start(self, engine: LLMEngine, request_id: str, first_token_id: int) -> None:
        reservation = self.reservations.pop(request_id)
        if reservation is None:
            raise RequestNotFoundError(f"no reservation for request {request_id} (expired?)")
        if not reservation.complete:
            missing = (
                len(reservation.block_ids)
                - reservation.num_cached_blocks
                - len(reservation.received)
            )
            engine.kv_cache.free(request_id)
            self._close_stream(request_id)
            raise KVTransferError(f"request {request_id} started with {missing} KV blocks missing")
        if not 0 <= first_token_id < engine.loaded.config.vocab_size:
            engine.kv_cache.free(request_id)
            self._close_stream(request_id)
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        self.core.set_sink(request_id, self._push_output)
        self._push_output(engine.admit_prefilled(reservation.request, first_token_id))

    def _push_output(self, output: RequestOutput) -> None:
        with self._outputs_lock:
            outputs = self._outputs.get(output.request_id)
        if outputs is not None:
            outputs.put(output)
            if output.finished:
                outputs.put(_FINISHED)
                self.core.drop_sink(output.request_id)

    def stream_outputs(self, request_id: str) -> Iterator[RequestOutput]:
        """Every output of the request from its first token on; ends when it finishes."""
        with self._outputs_lock:
            outputs = self._outputs.get(request_id)
        if outputs is None:
            raise RequestNotFoundError(f"no request {request_id!r} on this decode instance")
        try:
            while (output := outputs.get()) is not _FINISHED:
                yield output
        finally:
            with self._outputs_lock:
                self._outputs.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        reservation = self.reservations.pop(request_id)
        if reservation is not None:
            self._release(reservation, "aborted")
            return True
        return self.core.abort(request_id)  # its sink receives the final `abort` output

    # -- housekeeping ----------------------------------------------------------------------------

    def _release(self, reservation: Reservation, why: str) -> None:
        request_id = reservation.request.request_id
        logger.info("releasing reservation of request %s: %s", request_id, why)
        self.core.loop.submit(lambda engine: engine.kv_cache.free(request_id))
        self._close_stream(request_id)

    def _close_stream(self, request_id: str) -> None:
        with self._outputs_lock:
            outputs = self._outputs.get(request_id)
        if outputs is not None:
            outputs.put(aborted_output(request_id))
            outputs.put(_FINISHED)
        self.core.drop_sink(request_id)

    def _expire_leases(self) -> None:
        """Engine thread, between steps: free reservations whose KV never completed."""
        for reservation in self.reservations.pop_expired():
            self.num_expired += 1
            request_id = reservation.request.request_id
            logger.warning("reservation of request %s expired before its KV arrived", request_id)
            self.core.engine.kv_cache.free(request_id)
            self._close_stream(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.core.stats(
            num_reservations=len(self.reservations),
            num_reserved_blocks=self.reservations.num_blocks(),
            num_expired_reservations=self.num_expired,
        )

    def check_integrity(self) -> None:
        self.core.check_integrity()
