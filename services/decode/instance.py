"""DecodeInstance: reserves blocks for incoming prompts, receives their KV and generates.

Threads: gRPC handlers validate, reserve (on the engine thread) and write KV bytes (on the
server's executor, into blocks the reservation owns exclusively); the outputs go to the router's
subscription, read on the server's event loop; the engine thread decodes, expires leases and
frees blocks. The
reservation table is thread-safe.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.config import DecodeConfig, EngineConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, SamplingParams, TokenLogprob
from pdserve.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from pdserve.instance.runtime import InstanceRuntime
from pdserve.instance.streams import aborted_output
from pdserve.kvcache.hashing import PromptHashes
from pdserve.observability import tracing
from pdserve.rpc.tls import TlsFiles
from pdserve.transfer.base import KVEndpoints, host_id
from pdserve.transfer.cuda_ipc import export_kv_cache
from pdserve.v1 import common_pb2
from services.decode.reservations import Reservation, ReservationTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReservationGrant:
    num_cached_tokens: int  # prompt tokens decode already holds (device + storage hits)
    num_blocks: int
    block_bytes: int
    block_ids: tuple[int, ...] = ()


class DecodeInstance:
    ROLE = "decode"

    def __init__(
        self,
        runtime: InstanceRuntime,
        config: DecodeConfig,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """The decode role on `runtime` (new, or another role's: `ServedRole.change`); prefill
        instances on this host write into its KV cache directly when the runtime's cache is in
        shared memory (`transfer.shared_memory`)."""
        self.config = config
        self.runtime = runtime
        self.reservations = ReservationTable()
        mooncake = runtime.start_mooncake(transfer, host) if transfer is not None else None
        stager = runtime.stager
        # a GPU cache is shared over CUDA IPC (prefill instances of this host copy into it);
        # the export holds the shared view while this role serves
        if not stager.direct_writes:  # tensor parallel: each rank's cache, written by rank
            self.cuda_ipc = None
            self.endpoints = KVEndpoints(
                host_id=host_id(), kv_bytes=stager.total_bytes, ranks=self._rank_endpoints()
            )
        else:
            self.cuda_ipc = export_kv_cache(stager.cache) if transfer is not None else None
            self.endpoints = KVEndpoints(
                host_id=host_id(),
                shm_name=runtime.shm_name,
                mooncake_session=mooncake.session if mooncake is not None else "",
                mooncake_base=runtime.kv_base_address if mooncake is not None else 0,
                kv_bytes=stager.total_bytes,
                cuda_ipc_handle=self.cuda_ipc.handle if self.cuda_ipc is not None else b"",
                gpu_uuid=self.cuda_ipc.gpu_uuid if self.cuda_ipc is not None else "",
            )
        self.num_expired = 0  # engine thread only
        # tests only: called with (request id, first block) before each received chunk or
        # direct-write commit is applied: it may stall (sleep) or drop it (raise)
        self.kv_write_fault: Callable[[str, int], None] | None = None

    @classmethod
    def create(
        cls,
        engine_config: EngineConfig,
        config: DecodeConfig,
        storage: StorageConfig | None = None,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
        *,
        secret: str,
        tls: TlsFiles | None = None,
    ) -> "DecodeInstance":
        """A decode instance on a runtime of its own (an engine for `engine_config`, its KV
        cache in shared memory with `transfer.shared_memory`)."""
        runtime = InstanceRuntime.create(
            "decode",
            engine_config,
            secret=secret,
            tls=tls,
            storage=storage,
            shared_kv_cache=transfer is not None and transfer.shared_memory,
        )
        return cls(runtime, config, transfer, host)

    def _rank_endpoints(self) -> tuple[KVEndpoints, ...]:
        """Each rank's cache of a tensor-parallel instance: its segment (shared memory; rank
        0's only with `transfer.shared_memory`) and its address in this process's Mooncake
        engine, which registered every rank's (mapped here)."""
        runtime, mooncake = self.runtime, self.runtime.mooncake
        names = runtime.rank_shm_names
        return tuple(
            KVEndpoints(
                host_id=host_id(),
                shm_name=name,
                mooncake_session=mooncake.session if mooncake is not None else "",
                mooncake_base=rank.base_address if mooncake is not None else 0,
                kv_bytes=rank.total_bytes,
            )
            for name, rank in zip(names, runtime.stager.slices, strict=True)
        )

    def start(self) -> None:
        self.runtime.start()

    def stop(self) -> None:
        self.runtime.stop()

    def on_tick(self, engine: LLMEngine) -> None:
        self._expire_leases(engine)

    def reserved(self) -> tuple[int, int]:
        return len(self.reservations), self.reservations.num_blocks()

    def leave(self, error: PdserveError) -> None:
        for request in self.reservations.requests():
            self.abort(request.request_id)  # its prefill instance's push or handoff fails
        self.runtime.end_requests(error)

    # -- reservation (preallocate_resource_in_d) ------------------------------------------------

    def preallocate_resource_in_d(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None = None,
        attempt: str = "",
        subscriber: str = "",
        trace_parent: tracing.Context | None = None,
    ) -> ReservationGrant:
        """Reserve blocks for the prompt if the growth headroom of the running requests
        survives it. Its output stream opens with it, to the router's `subscriber` (empty:
        read here), its outputs tagged with the router's `attempt`, traced under
        `trace_parent` (the prefill span that asked).

        Raises ResourceExhaustedError (with a retry-after) when it would not,
        InvalidRequestError / PromptTooLongError for a bad request and DuplicateRequestError
        for an id in flight here.
        """
        if not subscriber:
            raise InvalidRequestError(
                "subscriber is required: a decode instance sends a request's outputs to its "
                "router's subscription (InstanceService.SubscribeOutputs)"
            )
        request = self.runtime.make_request(
            prompt_token_ids, params, request_id, block_hashes=hashes
        )
        stream = self.runtime.open_stream(request_id, attempt, subscriber, trace_parent)
        try:
            self.runtime.read_ahead(request)  # blocks this instance lacks but storage has
            return self.runtime.loop.call(lambda engine: self._reserve(engine, request))
        except BaseException as e:
            self.runtime.close_stream(request_id, stream=stream)
            if not isinstance(e, PdserveError):  # e.g. timed out: `_reserve` may still run
                self.runtime.loop.submit(lambda engine: self._undo(engine, request))
            raise

    def _reserve(self, engine: LLMEngine, request: Request) -> ReservationGrant:
        """Engine thread. Raises DuplicateRequestError, ResourceExhaustedError (refused: the
        bytes staged for the request are dropped)."""
        request_id = request.request_id
        if (
            engine.has_request(request_id)
            or engine.holds_blocks(request_id)
            or self.reservations.holds(request_id)
        ):
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight here")
        # the running and reserved requests may each grow by min(remaining max_tokens,
        # reserve_horizon_tokens) tokens: those blocks stay free
        headroom = engine.growth_headroom_blocks(
            self.config.reserve_horizon_tokens, self.reservations.requests()
        )
        admission = engine.preallocate(request, growth_headroom_blocks=headroom)
        if admission is None:
            engine.release(request_id)  # it holds no blocks: drops its staged bytes
            raise ResourceExhaustedError(
                f"decode instance cannot take {engine.num_blocks_needed(request)} "
                f"blocks: {engine.num_free_blocks} free, {headroom} kept for the "
                "growth of running requests",
                self.config.retry_after_ms,
            )
        num_cached_blocks = admission.num_computed_tokens // engine.block_size
        self.reservations.add(
            request, admission.block_ids, num_cached_blocks, self.config.reservation_timeout_s
        )
        return ReservationGrant(
            admission.num_computed_tokens,
            len(admission.block_ids),
            self.runtime.stager.block_bytes,
            admission.block_ids,
        )

    def _undo(self, engine: LLMEngine, request: Request) -> None:
        """Engine thread: release what a reservation whose caller gave up left (its
        reservation, if `_reserve` ran after all, its blocks and staged bytes)."""
        if self.reservations.pop_if(request) is not None or (
            not engine.has_request(request.request_id)
            and not self.reservations.holds(request.request_id)
        ):
            engine.release(request.request_id)

    # -- local prefill ----------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None = None,
        attempt: str = "",
        subscriber: str = "",
        trace_parent: tracing.Context | None = None,
    ) -> None:
        """A whole generation here, its prompt computed by this engine (the router chose
        local prefill); queued only if the growth headroom of the running and reserved
        requests survives its blocks, else ResourceExhaustedError. Its outputs go to the
        router's `subscriber` subscription."""
        self.runtime.submit_generation(
            request_id, prompt_token_ids, params, hashes, attempt, subscriber, trace_parent,
            admit=self._admit_local,
        )  # fmt: skip

    def _admit_local(self, engine: LLMEngine, request: Request) -> None:
        """Engine thread: queue `request` if its blocks leave the running requests' growth
        headroom free (the check `_reserve` makes)."""
        if self.reservations.holds(request.request_id):
            raise DuplicateRequestError(f"request id {request.request_id!r} is reserved here")
        headroom = engine.growth_headroom_blocks(
            self.config.reserve_horizon_tokens, self.reservations.requests()
        )
        if not engine.admission.fits(request, headroom):  # its device prefix hit excluded
            raise ResourceExhaustedError(
                f"decode instance cannot prefill {engine.num_blocks_needed(request)} blocks here: "
                f"{engine.num_free_blocks} free, {headroom} kept for the growth of running "
                "requests",
                self.config.retry_after_ms,
            )
        engine.submit(request)

    # -- KV reception -----------------------------------------------------------------------------

    def receive_blocks(self, request_id: str, first_block: int, data: memoryview) -> int:
        """Write whole blocks into the request's reservation (the KVReceiver contract).
        Raises KVTransferError."""
        block_bytes = self.runtime.stager.block_bytes
        if len(data) == 0 or len(data) % block_bytes:
            raise KVTransferError(
                f"{len(data)} bytes is not a whole number of {block_bytes}-byte blocks"
            )
        num_blocks = len(data) // block_bytes
        if self.kv_write_fault is not None:
            self.kv_write_fault(request_id, first_block)
        block_ids = self.reservations.begin_write(request_id, first_block, num_blocks)
        ok = False
        try:
            self.runtime.stager.write(block_ids, data)
            ok = True
        finally:
            release = self.reservations.end_write(request_id, first_block, num_blocks, ok)
            if release is not None:
                self._release(release, "KV write failed or was cancelled")
        self.runtime.counters.received(num_blocks, len(data))
        return num_blocks

    def commit_blocks(self, request_id: str, first_block: int, num_blocks: int) -> None:
        """A direct-write transport wrote blocks [first_block, + num_blocks) of the request's
        reservation: count them as received. Raises KVTransferError."""
        if self.kv_write_fault is not None:
            self.kv_write_fault(request_id, first_block)
        self.reservations.begin_write(request_id, first_block, num_blocks)
        self.reservations.end_write(request_id, first_block, num_blocks, True)
        self.runtime.counters.received(num_blocks, num_blocks * self.runtime.stager.block_bytes)

    def transfer_failed(self, request_id: str) -> None:
        """The KV stream broke: release the reservation now rather than at lease expiry."""
        reservation = self.reservations.pop(request_id)
        if reservation is not None:
            self._release(reservation, "KV stream broke")

    # -- first token and streaming ---------------------------------------------------------------

    def start_decode(
        self, request_id: str, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> None:
        """First-token handoff: the KV is complete, the request joins the running batch."""
        self.runtime.loop.call(
            lambda engine: self._start(engine, request_id, first_token_id, first_logprob)
        )

    def _start(
        self,
        engine: LLMEngine,
        request_id: str,
        first_token_id: int,
        first_logprob: TokenLogprob | None,
    ) -> None:
        reservation = self.reservations.pop(request_id)
        if reservation is None:
            raise RequestNotFoundError(f"no reservation for request {request_id} (expired?)")
        if not reservation.complete:
            missing = (
                len(reservation.block_ids)
                - reservation.num_cached_blocks
                - len(reservation.received)
            )
            self._end(engine, request_id)
            raise KVTransferError(f"request {request_id} started with {missing} KV blocks missing")
        if not 0 <= first_token_id < self.runtime.vocab_size:
            self._end(engine, request_id)
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        output = engine.admit_prefilled(reservation.request, first_token_id, first_logprob)
        self.runtime.loop.emit([output])  # its text is added on the loop's output thread

    def abort(self, request_id: str) -> bool:
        reservation = self.reservations.pop(request_id)
        if reservation is not None:
            self._release(reservation, "aborted")
            return True
        return self.runtime.abort(request_id)  # its stream receives the final `abort` output

    # -- housekeeping ----------------------------------------------------------------------------

    def _release(self, reservation: Reservation, why: str) -> None:
        request_id = reservation.request.request_id
        logger.info("releasing reservation of request %s: %s", request_id, why,
                    extra={"request_id": request_id})  # fmt: skip
        self.runtime.loop.submit(lambda engine: engine.release(request_id))
        self.runtime.close_stream(request_id, aborted_output(request_id))

    def _end(self, engine: LLMEngine, request_id: str) -> None:
        """Engine thread: free a reservation's blocks and end its stream."""
        engine.release(request_id)
        self.runtime.close_stream(request_id, aborted_output(request_id))

    def _expire_leases(self, engine: LLMEngine) -> None:
        """Engine thread, between steps: free reservations whose KV never completed."""
        for reservation in self.reservations.pop_expired():
            self.num_expired += 1
            request_id = reservation.request.request_id
            logger.warning("reservation of request %s expired before its KV arrived", request_id,
                           extra={"request_id": request_id})  # fmt: skip
            self._end(engine, request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.runtime.stats(
            num_reservations=len(self.reservations),
            num_reserved_blocks=self.reservations.num_blocks(),
            num_expired_reservations=self.num_expired,
        )

    def check_integrity(self) -> None:
        """Call when idle: every block table belongs to a live request or a reservation."""
        self.reservations.check_integrity()
        reserved = [r.request_id for r in self.reservations.requests()]
        self.runtime.check_integrity(reserved)
