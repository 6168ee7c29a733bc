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
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import EngineConfig, PrefillConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestOutput, SamplingParams, TokenLogprob
from pdserve.errors import (
    DecodeUnavailableError,
    InstanceUnavailableError,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from pdserve.instance.convert import endpoints_from_proto, generate_request, logprob_to_proto
from pdserve.instance.runtime import InstanceRuntime
from pdserve.instance.streams import OutputStream
from pdserve.kvcache.hashing import PromptHashes
from pdserve.observability import logs, tracing
from pdserve.rpc.clients import (
    DEFAULT_DEADLINES,
    Deadlines,
    DecodeClient,
    InstanceClient,
    Metadata,
)
from pdserve.rpc.tls import TlsFiles
from pdserve.transfer.base import KVEndpoints, KVTarget, PrefixSource
from pdserve.transfer.cuda_ipc import CudaIpcKVTransport
from pdserve.transfer.select import TransportSelector
from pdserve.v1 import common_pb2, decode_pb2

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillTimings:
    reserve_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    handoff_s: float = 0.0


@dataclass(slots=True)
class PrefillOutcome:
    """Filled in as one request's prefill and handoff progress (by its handler thread only)."""

    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens prefill did not compute (device + storage hits)
    num_decode_cached_tokens: int  # prompt tokens decode already held
    blocks_sent: int
    bytes_sent: int
    timings: PrefillTimings = field(default_factory=PrefillTimings)
    transport: str = ""  # how the KV went to decode (empty: decode held every block)
    device_hit_tokens: int = 0  # of num_cached_tokens: in this instance's device prefix cache
    storage_hit_tokens: int = 0  # of num_cached_tokens: loaded from the storage tier
    pulled_tokens: int = 0  # of num_cached_tokens: pulled from a decode instance (`source`)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # when the request asked for them


@dataclass(frozen=True, slots=True)
class DecodeReservation:
    num_cached_tokens: int
    num_blocks: int
    block_ids: tuple[int, ...] = ()
    block_bytes: int = 0
    endpoints: KVEndpoints = field(default_factory=KVEndpoints)
    deadline: float = float("inf")  # time.monotonic() when direct writes must have ended


class PrefillInstance:
    """Threads: one gRPC handler thread per request runs `prefill`; the runtime's engine thread
    computes. Shared state: the runtime (thread-safe) and the transport selector (thread-safe)."""

    ROLE = "prefill"

    def __init__(
        self,
        runtime: InstanceRuntime,
        config: PrefillConfig,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
        deadlines: Deadlines = DEFAULT_DEADLINES,
    ) -> None:
        """The prefill role on `runtime` (new, or another role's: `ServedRole.change`)."""
        self.config = config
        self.runtime = runtime
        self.channels = runtime.channels
        self.deadlines = deadlines
        self.transfer = transfer or TransferConfig()
        self.transports = TransportSelector(
            self.transfer,
            self.channels,
            config.transfer_chunk_bytes,
            runtime.start_mooncake(self.transfer, host, sender=True)
            if transfer is not None
            else None,
            cuda_ipc=CudaIpcKVTransport(
                self.channels, runtime.stager.device, stall_timeout_s=self.transfer.stall_timeout_s
            ),
        )

    @classmethod
    def create(
        cls,
        engine_config: EngineConfig,
        config: PrefillConfig,
        storage: StorageConfig | None = None,
        transfer: TransferConfig | None = None,
        host: str = "127.0.0.1",
        deadlines: Deadlines = DEFAULT_DEADLINES,
        *,
        secret: str,
        tls: TlsFiles | None = None,
    ) -> "PrefillInstance":
        """A prefill instance on a runtime of its own (an engine for `engine_config`)."""
        runtime = InstanceRuntime.create(
            "prefill", engine_config, secret=secret, tls=tls, storage=storage
        )
        return cls(runtime, config, transfer, host, deadlines)

    def start(self) -> None:
        self.runtime.start()

    def stop(self) -> None:
        self.transports.close()
        self.runtime.stop()

    def on_tick(self, engine: LLMEngine) -> None:
        pass

    def reserved(self) -> tuple[int, int]:
        return 0, 0

    def leave(self, error: PdserveError) -> None:
        for request_id in self.runtime.request_ids():
            self.abort(request_id, error)
        self.transports.close()

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode_address: str,
        hashes: PromptHashes | None = None,
        attempt: str = "",
        subscriber: str = "",
        trace_parent: tracing.Context | None = None,
        route_seq: int = 0,
        source: PrefixSource | None = None,
    ) -> PrefillOutcome:
        """Run one request's prefill and handoff (`attempt`, `subscriber` and `route_seq`: the
        router's attempt, output subscription and number of the attempt, sent to decode with
        the reservation), traced under `trace_parent` (the router's attempt) while tracing is
        on. `source`: a decode instance holding more of the prompt than this one, whose
        blocks are pulled rather than computed.

        Raises InvalidRequestError (bad input, here or on decode), ResourceExhaustedError
        (decode refused until the backoff ran out), KVTransferError, InstanceUnavailableError,
        StepFailedError or RequestAbortedError; blocks are released on every path.
        """
        outcome = PrefillOutcome(0, len(prompt_token_ids), 0, 0, 0, 0)
        start = time.perf_counter()
        span = tracing.start("prefill", trace_parent, {"pdserve.request_id": request_id,
                             "pdserve.decode": decode_address}, at=start, server=True)  # fmt: skip
        with logs.request_context(request_id, tracing.trace_id(span)):
            try:
                self._prefill(
                    outcome, prompt_token_ids, params, request_id, decode_address, hashes,
                    attempt, subscriber, tracing.metadata(span), route_seq, source,
                )  # fmt: skip
            except BaseException as e:
                _record(span, start, outcome, e)
                raise
        self._observe(outcome)
        _record(span, start, outcome)
        return outcome

    def _prefill(
        self,
        outcome: PrefillOutcome,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        decode_address: str,
        hashes: PromptHashes | None,
        attempt: str,
        subscriber: str,
        metadata: Metadata,
        route_seq: int = 0,
        source: PrefixSource | None = None,
    ) -> None:
        """`prefill`'s steps, filling in `outcome` (`metadata`: of the calls to decode)."""
        start = time.perf_counter()
        request = self.runtime.make_request(
            prompt_token_ids, params, request_id, prefill_only=True, block_hashes=hashes
        )
        stream = self.runtime.open_stream(request_id)
        decode = DecodeClient(decode_address, self.channels, self.deadlines)
        decode_reserved = False
        try:
            try:
                reservation = self.preallocate_resource_in_p(
                    request, decode, attempt, subscriber, metadata, route_seq, source
                )
            except InstanceUnavailableError:  # decode may still grant it: release it there
                self._abort_on_decode(request_id, decode)
                raise
            decode_reserved = True
            outcome.num_decode_cached_tokens = reservation.num_cached_tokens
            outcome.timings.reserve_s = time.perf_counter() - start
            _check_not_aborted(stream)
            output = self._compute(request, stream, outcome)
            self._send_kv(request, output.block_ids, reservation, decode_address, outcome)
            _check_not_aborted(stream)  # aborted while sending: its blocks were kept until now
            self._hand_off(request_id, decode, output, outcome, metadata)
            decode_reserved = False
        finally:
            self.runtime.close_stream(request_id, stream=stream)
            self.runtime.loop.submit(lambda engine: engine.release(request_id))  # not awaited
            if decode_reserved:
                self._abort_on_decode(request_id, decode)

    def _observe(self, outcome: PrefillOutcome) -> None:
        """The request's stages into this instance's histograms."""
        t, metrics = outcome.timings, self.runtime.stage_metrics
        metrics.observe("reservation_wait", t.reserve_s)
        metrics.observe("queue", t.queue_s)
        metrics.observe("prefill", t.compute_s)
        if outcome.transport:
            metrics.observe_transfer(outcome.transport, t.transfer_s, outcome.bytes_sent)

    def _hand_off(
        self,
        request_id: str,
        decode: DecodeClient,
        first: RequestOutput,
        outcome: PrefillOutcome,
        metadata: Metadata = (),
    ) -> None:
        """The KV is on decode: give it the first token (and its logprob, when asked for),
        which starts the request there."""
        start = time.perf_counter()
        first_token_id = first.new_token_ids[0]
        logprob = logprob_to_proto(first.new_logprobs[0]) if first.new_logprobs else None
        try:
            decode.start_decode(request_id, first_token_id, logprob, metadata)
        except (InvalidRequestError, InstanceUnavailableError) as e:
            raise _from_decode(e, decode.address) from e
        except RequestNotFoundError as e:  # decode's reservation expired before the handoff
            raise KVTransferError(f"decode {decode.address} lost request {request_id}: {e}") from e
        outcome.timings.handoff_s = time.perf_counter() - start
        outcome.first_token_id = first_token_id

    def preallocate_resource_in_p(
        self,
        request: Request,
        decode: DecodeClient,
        router_attempt: str = "",
        subscriber: str = "",
        metadata: Metadata = (),
        route_seq: int = 0,
        source: PrefixSource | None = None,
    ) -> DecodeReservation:
        """Admit the prompt here (device prefix hit, the blocks pulled from `source` and
        those of the storage tier staged after it, blocks for the rest; when the pool is short
        the scheduler admits it later) and ask the decode instance to reserve blocks for it
        (retrying, bounded, while it refuses)."""
        self.runtime.read_ahead(request, source)
        self.runtime.loop.call(lambda engine: engine.preallocate(request))
        self.runtime.acknowledge(subscriber, route_seq)  # counted in this instance's load now
        message = decode_pb2.ReserveRequest(
            request=generate_request(
                request.request_id,
                list(request.prompt_token_ids),
                request.sampling_params,
                request.prompt_hashes(),  # decode takes them after a check: no second hashing
                router_attempt,
                subscriber,
                route_seq,
            )
        )
        attempts = self.config.reserve_max_attempts
        for attempt in range(1, attempts + 1):
            asked = time.monotonic()
            try:
                reply = decode.reserve(message, metadata)
            except (InvalidRequestError, InstanceUnavailableError) as e:
                raise _from_decode(e, decode.address) from e
            except ResourceExhaustedError as refusal:
                logger.info(
                    "decode %s refused request %s (attempt %d): %s",
                    decode.address, request.request_id, attempt, refusal,
                )  # fmt: skip
                if attempt == attempts:
                    raise ResourceExhaustedError(
                        f"decode instance {decode.address} refused request "
                        f"{request.request_id} {attempts} times: {refusal}",
                        refusal.retry_after_ms,
                    ) from refusal
                time.sleep(min(refusal.retry_after_ms / 1000, self.config.reserve_max_backoff_s))
                continue
            if reply.kv_layout and reply.kv_layout != self.runtime.kv_tag:
                raise KVTransferError(
                    f"decode {decode.address} holds KV blocks of layout {reply.kv_layout!r}, this "
                    f"prefill {self.runtime.kv_tag!r}: every role must share engine.model, "
                    "dtype, block_size, kv_cache_dtype and tensor_parallel_size (and FP8 scales)"
                )
            lease_s = reply.lease_ms / 1000 if reply.lease_ms else float("inf")
            return DecodeReservation(
                reply.num_cached_tokens,
                reply.num_blocks,
                tuple(reply.block_ids),
                reply.block_bytes,
                endpoints_from_proto(reply.endpoints),
                asked + lease_s - self.transfer.lease_margin_s,
            )
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _compute(
        self, request: Request, stream: OutputStream, outcome: PrefillOutcome
    ) -> RequestOutput:
        """Queue the prompt and wait until its KV is computed (the first token sampled)."""
        queued = time.perf_counter()
        self.runtime.loop.call(lambda engine: engine.submit(request))
        try:
            output = stream.get(timeout_s=self.config.kv_ready_timeout_s)
        except queue.Empty:
            raise InstanceUnavailableError(
                f"request {request.request_id} was not prefilled within "
                f"{self.config.kv_ready_timeout_s:g} s (prefill.kv_ready_timeout_s)",
                1000,
            ) from None
        if not output.kv_ready:
            raise RequestAbortedError(f"request {request.request_id} was aborted")
        outcome.num_cached_tokens = output.num_cached_tokens
        outcome.device_hit_tokens = request.device_hit_tokens or 0  # set before kv_ready
        outcome.storage_hit_tokens = request.storage_hit_tokens
        outcome.pulled_tokens = request.peer_hit_tokens
        outcome.prompt_logprobs = output.prompt_logprobs
        done = time.perf_counter()
        scheduled = request.first_scheduled_at or queued
        outcome.timings.queue_s = max(0.0, scheduled - queued)
        outcome.timings.compute_s = done - max(scheduled, queued)
        return output

    def _send_kv(
        self,
        request: Request,
        table: Sequence[int],
        reservation: DecodeReservation,
        decode_address: str,
        outcome: PrefillOutcome,
    ) -> None:
        """Send the prompt's blocks (`table`, from the KV-ready output) that decode lacks."""
        started = time.perf_counter()
        first_block = reservation.num_cached_tokens // self.runtime.block_size
        block_ids = list(table[first_block : reservation.num_blocks])
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
                result = transport.send_blocks(target, self.runtime.stager, block_ids)
            except KVTransferError:
                self.runtime.counters.failed(transport.name)
                raise
            outcome.transport = transport.name
            outcome.blocks_sent, outcome.bytes_sent = result.num_blocks, result.num_bytes
            self.runtime.counters.sent(transport.name, result)
        outcome.timings.transfer_s = time.perf_counter() - started

    def abort(self, request_id: str, error: PdserveError | None = None) -> bool:
        """Abort a request being prefilled: its handler raises `error` (default
        RequestAbortedError) at its next step and releases everything. Its computation stops
        now; the blocks of a request whose KV is being sent are freed by the handler once the
        send ended (never under it)."""
        try:
            stream = self.runtime.stream(request_id)
        except RequestNotFoundError:
            return False
        if stream.ended:
            return False
        stream.fail(error or RequestAbortedError(f"request {request_id} was aborted"))
        self.runtime.loop.call(lambda engine: engine.stop_computing(request_id))
        return True

    def _abort_on_decode(self, request_id: str, decode: DecodeClient) -> None:
        try:
            InstanceClient(decode.address, self.channels, self.deadlines).abort(request_id)
        except PdserveError as e:  # decode gone: its lease frees the reservation
            logger.warning("could not abort request %s on %s: %s", request_id, decode.address, e,
                           extra={"request_id": request_id})  # fmt: skip

    def stats(self) -> common_pb2.InstanceStats:
        return self.runtime.stats()

    def check_integrity(self) -> None:
        self.runtime.check_integrity()


def _record(
    span: tracing.Span | None,
    start: float,
    outcome: PrefillOutcome,
    error: BaseException | None = None,
) -> None:
    """End the request's prefill span with its stages (they follow each other from `start`)
    and what it found cached and sent."""
    if span is None:
        return
    t = outcome.timings
    reserve: tracing.Attributes = {"pdserve.decode_cached_tokens": outcome.num_decode_cached_tokens}
    compute: tracing.Attributes = {
        "pdserve.device_hit_tokens": outcome.device_hit_tokens,
        "pdserve.storage_hit_tokens": outcome.storage_hit_tokens,
        "pdserve.pulled_tokens": outcome.pulled_tokens,
    }
    transfer: tracing.Attributes = {
        "pdserve.transport": outcome.transport,
        "pdserve.kv_bytes": outcome.bytes_sent,
        "pdserve.kv_blocks": outcome.blocks_sent,
    }
    stages: tuple[tuple[str, float, tracing.Attributes], ...] = (
        ("prefill.reserve", t.reserve_s, reserve),
        ("prefill.queue", t.queue_s, {}),
        ("prefill.compute", t.compute_s, compute),
        ("kv.transfer", t.transfer_s, transfer),
        ("prefill.handoff", t.handoff_s, {}),
    )
    at = start
    for name, duration, attributes in stages:
        if duration > 0:
            tracing.record(name, span, at, at + duration, attributes)
        at += duration
    span.set_attribute("pdserve.cached_tokens", outcome.num_cached_tokens)
    tracing.end(span, error=error)


def _check_not_aborted(stream: OutputStream) -> None:
    """Raise RequestAbortedError when the request was aborted meanwhile (`abort` fails its
    stream; a live prefill stream never ends otherwise before the handler closes it)."""
    if stream.ended:
        raise RequestAbortedError(f"request {stream.request_id} was aborted")


def _from_decode(
    error: InvalidRequestError | InstanceUnavailableError, decode_address: str
) -> PdserveError:
    """What decode's refusal of (or absence for) a request this instance accepted means for the
    caller. Decode unreachable: DecodeUnavailableError, so the router blames decode, not us. A
    prompt too long for decode's context is the caller's to shorten (PromptTooLongError, a
    400); any other refusal (an id decode still holds, a first token it rejects) is a
    disagreement between instances, not the caller's mistake: KVTransferError, which the
    router retries elsewhere."""
    if isinstance(error, DecodeUnavailableError | PromptTooLongError):
        return error
    if isinstance(error, InstanceUnavailableError):
        return DecodeUnavailableError(str(error), error.retry_after_ms)
    return KVTransferError(f"decode {decode_address} refused the request: {error}")
