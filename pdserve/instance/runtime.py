"""InstanceRuntime: what every engine-backed instance (prefill, decode, mixed) is built on.

It owns the engine loop, one OutputStream per request, the KV-event fan-out (snapshot + live
events), stats snapshots, the gRPC server (the role's service plus InstanceService) and the
narrow operations callers need (KV endpoints, a request's block table, cache flushes). Roles
compose it and add their own RPCs; they never reach into the engine's collaborators.

Threads: the engine loop thread owns the engine; the gRPC server's executor threads call
`loop.call` for engine work; its event loop reads the output subscriptions (an open one holds
no thread); `deliver` runs on the loop's output thread and only puts into streams and pushes to
subscriptions.
"""

import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import platformdirs
import redis

from pdserve.config import EngineConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import LLMEngine, StorageTierFactory
from pdserve.engine.loop import EngineLoop, Mailbox
from pdserve.engine.perf_model import ERROR_BUCKETS, StepShape, StepTimeModel
from pdserve.engine.profiling import seed_step_time
from pdserve.engine.request import Request, RequestOutput, SamplingParams, StageTimes
from pdserve.engine.staged_reads import StagedBlocks
from pdserve.engine.tensor_parallel import RankZero
from pdserve.errors import (
    DuplicateRequestError,
    InstanceUnavailableError,
    IntegrityError,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    RequestNotFoundError,
)
from pdserve.instance.convert import load_to_proto, step_outputs
from pdserve.instance.streams import (
    Item,
    OutputStream,
    StreamTrace,
    Subscription,
    aborted_output,
)
from pdserve.kvcache.events import (
    BlockStored,
    KVDigest,
    KVEventBroadcaster,
    LoadReport,
    Numbered,
)
from pdserve.kvcache.hashing import BlockHash, PromptHashes
from pdserve.metrics import InstanceCollector, StageMetrics, serve_metrics
from pdserve.model.staging import KVStager
from pdserve.observability import tracing
from pdserve.rpc.auth import AioBearerTokenInterceptor
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.server import (
    AioServer,
    advertised_host,
    blocking,
    create_aio_server,
    host_port,
    instance_workers,
    is_loopback,
    post,
)
from pdserve.rpc.status import abort_with_async
from pdserve.rpc.tls import TlsFiles
from pdserve.storage.remote import SERVICE_NAME as STORAGE_SERVICE
from pdserve.storage.remote import StorageServicer
from pdserve.storage.stores import HostMemoryStore
from pdserve.storage.tier import StorageTier, make_store
from pdserve.transfer.base import PrefixSource, TransferResult
from pdserve.transfer.grpc import DEFAULT_CHUNK_BYTES, kv_chunks
from pdserve.transfer.wire import parse_kv_chunk
from pdserve.v1 import common_pb2, common_pb2_grpc, decode_pb2, storage_pb2_grpc

if TYPE_CHECKING:
    from pdserve.transfer.mooncake import MooncakeEngine

logger = logging.getLogger(__name__)

INSTANCE_SERVICE = "pdserve.v1.InstanceService"
READ_KV_METHOD = "/pdserve.v1.DecodeService/ReadKV"
PULL_KV_TIMEOUT_S = 30.0  # a pull that takes longer is cut, and the rest computed
# a channel to a peer unused this long is closed (a peer's calls take seconds; a dead one's
# channel would hold memory for good)
FORGET_PEER_CHANNELS_AFTER_S = 900.0


@dataclass(slots=True)
class TransferCounters:
    """KV bytes an instance sent and received. Thread-safe: handler threads update them while
    a stats snapshot reads them."""

    bytes_sent: int = 0
    blocks_sent: int = 0
    bytes_received: int = 0
    blocks_received: int = 0
    blocks_sent_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_sent_by_transport: dict[str, int] = field(default_factory=dict)
    seconds_by_transport: dict[str, float] = field(default_factory=dict)
    failures_by_transport: dict[str, int] = field(default_factory=dict)
    blocks_served: int = 0  # read by peers (ReadKV)
    pull_failures: int = 0  # pulls from a peer that failed or came back short
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sent(self, transport: str, result: TransferResult) -> None:
        with self._lock:
            self.blocks_sent += result.num_blocks
            self.bytes_sent += result.num_bytes
            for table, value in (
                (self.blocks_sent_by_transport, result.num_blocks),
                (self.bytes_sent_by_transport, result.num_bytes),
            ):
                table[transport] = table.get(transport, 0) + value
            seconds = self.seconds_by_transport
            seconds[transport] = seconds.get(transport, 0.0) + result.seconds

    def received(self, num_blocks: int, num_bytes: int) -> None:
        with self._lock:
            self.blocks_received += num_blocks
            self.bytes_received += num_bytes

    def failed(self, transport: str) -> None:
        with self._lock:
            failures = self.failures_by_transport
            failures[transport] = failures.get(transport, 0) + 1

    def served(self, num_blocks: int) -> None:
        with self._lock:
            self.blocks_served += num_blocks

    def pull_failed(self) -> None:
        with self._lock:
            self.pull_failures += 1

    def fill(self, stats: common_pb2.InstanceStats) -> None:
        """Copy the counters into a stats message (one consistent read) whose transfer fields
        are unset."""
        with self._lock:
            counters = common_pb2.InstanceStats(
                kv_bytes_sent=self.bytes_sent,
                kv_blocks_sent=self.blocks_sent,
                kv_bytes_received=self.bytes_received,
                kv_blocks_received=self.blocks_received,
                kv_blocks_sent_by_transport=self.blocks_sent_by_transport,
                kv_bytes_sent_by_transport=self.bytes_sent_by_transport,
                kv_transfer_seconds_by_transport=self.seconds_by_transport,
                kv_transfer_failures_by_transport=self.failures_by_transport,
                kv_blocks_served=self.blocks_served,
                kv_pull_failures=self.pull_failures,
            )
        stats.MergeFrom(counters)


class InstanceRole(Protocol):
    """What InstanceService asks of a role (prefill, decode, mixed)."""

    def abort(self, request_id: str) -> bool:
        """Stop a live request (or release its reservation); False when there is none."""
        ...

    def stats(self) -> common_pb2.InstanceStats: ...


class InstanceRuntime:
    def __init__(
        self,
        role: str,
        engine: LLMEngine,
        events: KVEventBroadcaster,
        mailbox: Mailbox,
        secret: str,
        channels: ChannelPool,
        tls: TlsFiles | None = None,
    ) -> None:
        self.role = role  # the role served now (`ServedRole` changes it)
        self.engine = engine
        self.secret = secret  # the cluster secret: required of callers, sent to peers
        self.channels = channels  # to peers (decode instances, storage peers); carries `secret`
        self.tls = tls  # mutual TLS of its server and channels, when the plane uses it
        self.events = events
        self.stager: KVStager = engine.runner.stager
        self.counters = TransferCounters()
        self.leaving = False  # shutting down: load reports ask the routers to drain it
        self.stage_metrics = StageMetrics(role)
        connector = engine.storage_connector
        self.storage_tier: StorageTier | None = connector.tier if connector is not None else None
        self.mooncake: MooncakeEngine | None = None
        self.metrics_address = ""  # host:port of /metrics once `serve` started it
        self._metrics_server: Any = None
        self._streams: dict[str, OutputStream] = {}
        self._subscriptions: dict[str, Subscription] = {}  # by subscriber
        self._streams_lock = threading.Lock()  # guards both
        # the role's housekeeping between steps (decode: expiring reservations); engine thread
        self.on_tick: Callable[[LLMEngine], None] = _nothing
        # the role's reservations and their blocks (decode's), for its load reports
        self.reserved: Callable[[], tuple[int, int]] = lambda: (0, 0)
        # tests only: each KV-event stream message passes through it (drop, repeat, hold back)
        self.kv_event_fault: KVEventFault | None = None
        self._reports = _Reports()
        self._received: dict[str, int] = {}  # per router: the highest route_seq admitted
        self._received_lock = threading.Lock()
        self.loop = EngineLoop(engine, self.deliver, mailbox, on_tick=self._tick)

    @classmethod
    def create(
        cls,
        role: str,
        config: EngineConfig,
        *,
        secret: str,
        tls: TlsFiles | None = None,
        storage: StorageConfig | None = None,
        shared_kv_cache: bool = False,
    ) -> "InstanceRuntime":
        """An engine for `config`, with the storage tier when `storage` is given and enabled,
        its KV cache in shared memory with `shared_kv_cache` (CPU). Every RPC it serves must
        carry `secret` (health and reflection excepted); with `tls`, it serves and calls peers
        over mutual TLS."""
        events = KVEventBroadcaster()
        mailbox = Mailbox()
        # peers come and go (a restarted one at a new address); every call to one is short
        channels = ChannelPool(secret, tls, forget_unused_after_s=FORGET_PEER_CHANNELS_AFTER_S)
        engine = LLMEngine.from_config(
            config,
            event_sink=events.publish,
            shared_kv_cache=shared_kv_cache,
            storage_tier=_tier_factory(storage, channels, secret),
            wake=mailbox.wake,
        )
        logger.info("%s instance: %s", role, seed_step_time(engine, config))  # before serving
        return cls(role, engine, events, mailbox, secret, channels, tls)

    # -- serving --------------------------------------------------------------------------------

    def serve(
        self,
        register: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str],
        role: InstanceRole,
        host: str,
        port: int,
    ) -> tuple[AioServer, int]:
        """Start the instance's gRPC server with its role services (`register`, named
        `service_names`) and InstanceService (answered by `role`) on an asyncio server
        (`AioServer`), plus the storage service when its storage tier keeps blocks in host
        memory (then named after the server's address), and its Prometheus endpoint
        (`/metrics` on a port of its own). Returns (server, bound port)."""
        store = self.storage_tier.store if self.storage_tier is not None else None
        memory = store if isinstance(store, HostMemoryStore) else None
        services = [*service_names, INSTANCE_SERVICE] + ([STORAGE_SERVICE] if memory else [])

        def register_all(server: grpc.aio.Server) -> None:
            register(server)
            common_pb2_grpc.add_InstanceServiceServicer_to_server(
                InstanceServicer(role, self), server
            )
            if memory is not None:
                storage_pb2_grpc.add_StorageServiceServicer_to_server(
                    StorageServicer(memory), server
                )

        server, bound = create_aio_server(
            register_all,
            services,
            host,
            port,
            max_workers=instance_workers(self.engine.scheduler.config.max_num_seqs),
            interceptors=[AioBearerTokenInterceptor(self.secret)],
            credentials=self.tls.server_credentials() if self.tls is not None else None,
        )
        if memory is not None:
            memory.bind(host_port(advertised_host(host), bound))
        self._metrics_server, metrics_port = serve_metrics(
            InstanceCollector(role.stats), self.stage_metrics.registry, host=host
        )
        self.metrics_address = host_port(advertised_host(host), metrics_port)
        logger.info(
            "%s instance serving on %s:%d (metrics on :%d)", self.role, host, bound, metrics_port
        )
        return server, bound

    def start_mooncake(
        self, config: TransferConfig, host: str, sender: bool = False
    ) -> "MooncakeEngine | None":
        """This instance's Mooncake transfer engines with its KV cache registered (a `sender`
        runs `sender_engines(config)` of them, a receiver one), when `transfer.mooncake` is on
        and the package loads; None otherwise. Once started they stay, whatever role the
        instance serves next (a receiver's one engine also sends)."""
        if self.mooncake is not None:
            return self.mooncake
        if not (config.mooncake or config.transport == "mooncake"):
            return None
        if is_loopback(host) and config.transport != "mooncake":
            logger.info(
                "Mooncake transfer engine not started: it listens on every interface and "
                "cluster.host is %s (KV goes over shared memory or gRPC; transfer.transport: "
                "mooncake forces it)",
                host,
            )
            return None
        from pdserve.transfer.mooncake import (
            MooncakeEngine,
            check_memory_kind,
            mooncake_available,
            sender_engines,
        )

        if not mooncake_available():
            logger.info("Mooncake transfer engine not installed: KV goes over shm or gRPC")
            return None
        check_memory_kind(self.stager.device.type)
        count = sender_engines(config) if sender else 1
        engine = MooncakeEngine(config, advertised_host(host), count)
        logger.info("Mooncake transfer engines: %d (%s)", count, config.mooncake_protocol)
        for rank in self.stager.slices:  # a tensor-parallel cache: each rank's, mapped here
            engine.register(rank.base_address, rank.total_bytes)
        self.mooncake = engine
        return engine

    # -- narrow views of the engine --------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def kv_tag(self) -> str:
        """What the KV blocks hold (`LLMEngine.kv_tag`): peers whose tags differ exchange none."""
        return self.engine.kv_tag

    @property
    def kv_base_address(self) -> int:
        """Address of the KV cache's first byte (direct-write transports)."""
        return self.stager.base_address

    @property
    def shm_name(self) -> str:
        """The KV cache's shared-memory segment; empty when it is private."""
        segment = self.engine.runner.segment
        return segment.name if segment is not None else ""

    @property
    def rank_shm_names(self) -> list[str]:
        """A tensor-parallel instance: each rank's KV cache segment, rank 0 first (rank 0's
        empty when it is private); one rank: []."""
        others = self.engine.runner.rank_segments
        return [self.shm_name, *others] if others else []

    @property
    def vocab_size(self) -> int:
        return self.engine.loaded.config.vocab_size

    def flush_device_cache(self) -> int:
        """Unpublish every unreferenced block of the device prefix cache; returns how many."""
        return self.loop.call(lambda engine: engine.kv_cache.evict_cached_blocks())

    def flush_storage(self) -> int:
        """Drop every entry of the storage tier's index (shared by every instance); returns
        how many went (0 without a storage tier). Raises InstanceUnavailableError when its
        Redis does not answer."""
        if self.storage_tier is None:
            return 0
        try:
            return self.storage_tier.index.clear()
        except redis.RedisError as e:
            raise InstanceUnavailableError(
                f"the storage tier's Redis did not answer ({type(e).__name__}): nothing was "
                "flushed; retry when it is back (the instances serve without storage meanwhile)"
            ) from e

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        *,
        prefill_only: bool = False,
        block_hashes: PromptHashes | None = None,
    ) -> Request:
        """Validate and build a request (`LLMEngine.make_request`; `block_hashes`: the chain
        the request came with, checked there); raises InvalidRequestError
        and PromptTooLongError (this instance's context window). On the caller's thread: it
        reads only what never changes (tokenizer, hasher, limits, the thread-safe grammar
        cache), so it costs no engine-thread round trip."""
        return self.engine.make_request(
            prompt_token_ids, params, request_id, prefill_only=prefill_only,
            block_hashes=block_hashes,
        )  # fmt: skip

    def read_ahead(self, request: Request, source: PrefixSource | None = None) -> None:
        """Stage the blocks the device prefix cache lacks, before the request is admitted
        outside the scheduler (prefill preallocation, decode reservation): first those a
        decode instance holds (`source`, from the router's index), then the storage tier's.
        Blocking I/O: on the caller's (handler) thread, never the engine's."""
        engine = self.engine
        connector = engine.storage_connector
        if connector is None and source is None:
            return
        device_blocks = self.loop.call(lambda engine: engine.device_hit_blocks(request))
        pulled: Sequence[bytes] = ()
        # prompt logprobs need every prompt position computed: nothing cached is used
        if source is not None and request.sampling_params.prompt_logprobs is None:
            pulled = self.pull_kv(request, device_blocks, source)
        staged = engine.admission.staged  # an engine's admission always has it
        if connector is not None:
            connector.read_ahead(request, device_blocks, pulled)
        elif pulled and staged is not None:
            staged.put(StagedBlocks(request, device_blocks, tuple(pulled), len(pulled)))

    def pull_kv(self, request: Request, first_block: int, source: PrefixSource) -> list[bytes]:
        """Blocks [first_block, source.num_blocks) of the request's prompt, read from the
        decode instance that holds them (`DecodeService.ReadKV`), as many as arrived whole and
        in order: a failed or short read is logged and counted, and the rest is computed."""
        end = min(source.num_blocks, (request.num_tokens - 1) // self.block_size)
        if end <= first_block:
            return []
        hashes = request.block_hashes[:end]
        message = decode_pb2.ReadKVRequest(
            request_id=request.request_id,
            block_hashes=[bytes(h) for h in hashes],
            first_block=first_block,
            kv_layout=self.kv_tag,
        )
        read = self.channels.get(source.address).unary_stream(
            READ_KV_METHOD,
            request_serializer=decode_pb2.ReadKVRequest.SerializeToString,
            response_deserializer=parse_kv_chunk,
        )
        blocks: list[bytes] = []
        size, complete = self.stager.block_bytes, False
        try:
            for chunk in read(message, timeout=PULL_KV_TIMEOUT_S):
                if chunk.first_block != first_block + len(blocks):
                    raise KVTransferError(f"chunk at block {chunk.first_block} out of order")
                data = chunk.data
                if len(data) != chunk.num_blocks * size:
                    raise KVTransferError(f"chunk of {len(data)} bytes for {chunk.num_blocks} "
                                          f"blocks of {size}")  # fmt: skip
                blocks += [bytes(data[i : i + size]) for i in range(0, len(data), size)]
                complete = chunk.last
        except (grpc.RpcError, KVTransferError) as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            logger.warning("request %s: pulling KV from %s failed (%s); computing the rest",
                           request.request_id, source.address, detail,
                           extra={"request_id": request.request_id})  # fmt: skip
            self.counters.pull_failed()
            return blocks
        if not complete or len(blocks) < end - first_block:
            logger.info("request %s: %s held %d of %d blocks asked for; computing the rest",
                        request.request_id, source.address, len(blocks), end - first_block,
                        extra={"request_id": request.request_id})  # fmt: skip
            self.counters.pull_failed()
        return blocks

    async def serve_kv(self, request: decode_pb2.ReadKVRequest) -> AsyncIterator[bytes]:
        """`ReadKV`: the requested blocks of the longest prefix of the chain this instance
        holds, as serialized `KVChunk`s; the blocks stay referenced (`LLMEngine.pin_prefix`)
        until the stream ends, however it ends. On a GPU the staging copy runs on the event
        loop (one device-to-host copy of the blocks)."""
        if request.kv_layout != self.kv_tag:
            raise KVTransferError(f"KV layout {request.kv_layout!r} is not this instance's "
                                  f"{self.kv_tag!r}: its blocks cannot be read")  # fmt: skip
        hashes = [BlockHash(h) for h in request.block_hashes]
        holder = f"read-kv:{request.request_id}:{uuid.uuid4().hex[:12]}"
        block_ids = await blocking(self.loop.call, lambda engine: engine.pin_prefix(holder, hashes))
        first = request.first_block
        try:
            ids = block_ids[first:]
            if not ids:
                return
            with self.stager.staged(ids) as views:
                for chunk in kv_chunks(request.request_id, first, views, DEFAULT_CHUNK_BYTES):
                    yield chunk
            self.counters.served(len(ids))
        finally:  # not awaited: the stream may be cancelled
            self.loop.submit(lambda engine: engine.unpin(holder))

    # -- output streams ---------------------------------------------------------------------------

    def open_stream(
        self,
        request_id: str,
        attempt: str = "",
        subscriber: str = "",
        trace_parent: tracing.Context | None = None,
        prefills: bool = False,
    ) -> OutputStream:
        """Register the stream that will carry the request's outputs: to the `subscriber`'s
        subscription when given (which must be open here), else to its own reader. A stream
        to a subscription is traced (a span of this instance's role under `trace_parent`;
        `prefills`: the prompt is computed here, not received) while tracing is on. Raises
        DuplicateRequestError when one is open, InstanceUnavailableError when the subscription
        is not."""
        with self._streams_lock:
            if request_id in self._streams:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            subscription = self._subscriptions.get(subscriber) if subscriber else None
            if subscriber and subscription is None:
                raise InstanceUnavailableError(
                    f"no output subscription {subscriber!r} is open on this {self.role} "
                    "instance (its router lost it): retry",
                    100,
                )
            traced = subscription is not None and tracing.enabled()
            trace = StreamTrace(self.role, prefills, trace_parent, request_id) if traced else None
            stream = OutputStream(request_id, attempt, subscription, trace)
            self._streams[request_id] = stream
        return stream

    def submit_generation(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None,
        attempt: str,
        subscriber: str,
        trace_parent: tracing.Context | None = None,
        admit: Callable[[LLMEngine, Request], None] = LLMEngine.submit,
    ) -> None:
        """Build a whole generation (prefill and decode here) and queue it with `admit` (on the
        engine thread; it may refuse by raising); its outputs go to the router's `subscriber`
        subscription, tagged with its `attempt`, traced under `trace_parent`. Raises
        InvalidRequestError / PromptTooLongError, DuplicateRequestError,
        InstanceUnavailableError (the subscription is not open), or what `admit` raised.
        Blocking: one engine-thread round trip."""
        if not subscriber:
            raise InvalidRequestError(
                f"subscriber is required: a {self.role} instance sends a request's outputs to "
                "its router's subscription (InstanceService.SubscribeOutputs)"
            )
        stream = self.open_stream(request_id, attempt, subscriber, trace_parent, prefills=True)
        try:
            request = self.make_request(prompt_token_ids, params, request_id, block_hashes=hashes)
            self.loop.call(lambda engine: admit(engine, request))
        except BaseException:
            self.close_stream(request_id, stream=stream)
            raise

    def subscribe(self, subscriber: str) -> Subscription:
        """Open `subscriber`'s output subscription (a newer one replaces it: the older one
        ends, see `unsubscribe`)."""
        subscription = Subscription(subscriber)
        with self._streams_lock:
            older = self._subscriptions.get(subscriber)
            self._subscriptions[subscriber] = subscription
        if older is not None:
            older.close()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> list[str]:
        """Close `subscription`; returns the ids of its requests that had not ended (their
        outputs have nowhere to go: the caller aborts them)."""
        subscription.close()
        with self._streams_lock:
            if self._subscriptions.get(subscription.subscriber) is subscription:
                del self._subscriptions[subscription.subscriber]
            return [
                request_id
                for request_id, stream in self._streams.items()
                if stream.subscription is subscription and not stream.ended
            ]

    def serves(self, request_id: str, attempt: str) -> bool:
        """Whether the request's open stream carries the outputs of the router's `attempt`."""
        with self._streams_lock:
            stream = self._streams.get(request_id)
        return stream is not None and stream.attempt == attempt

    def stream(self, request_id: str) -> OutputStream:
        """The open stream of a request; raises RequestNotFoundError."""
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise RequestNotFoundError(f"no request {request_id!r} on this {self.role} instance")
        return stream

    def close_stream(
        self,
        request_id: str,
        final: RequestOutput | None = None,
        stream: OutputStream | None = None,
    ) -> None:
        """Unregister a request's stream (its reader is done with it, or it is aborted),
        ending it with `final` first when given. With `stream`, only that very stream is
        unregistered (not a newer one of a request that reuses the id). Idempotent."""
        with self._streams_lock:
            current = self._streams.get(request_id)
            if current is None or (stream is not None and current is not stream):
                return
            del self._streams[request_id]
        if final is not None:
            current.put(final)

    def deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """Hand each output to its request's stream (never blocks); a subscription gets one
        step's outputs of its requests at once. A stream stays registered until it is closed
        (`close_stream`: by its reader, or once a subscription sent its end)."""
        batches: dict[Subscription, list[tuple[OutputStream, Item]]] = {}
        with self._streams_lock:
            streams = [(self._streams.get(output.request_id), output) for output in outputs]
        for stream, output in streams:
            if output.stage_times is not None:
                self._observe(output.stage_times)
            if stream is None:
                continue
            if stream.subscription is None:
                stream.put(output)
                continue
            item = stream.accept(output)
            if item is not None:
                batches.setdefault(stream.subscription, []).append((stream, item))
        for subscription, items in batches.items():
            subscription.push(items)

    def _observe(self, times: StageTimes) -> None:
        """A finished request's stages on this decode or mixed instance (a prefill instance
        observes its own after each handoff)."""
        if self.role == "prefill":
            return
        metrics = self.stage_metrics
        received = times.prefill_s == 0  # its KV came from prefill (see StageTimes)
        metrics.observe("kv_wait" if received else "queue", times.wait_s)
        if not received:
            metrics.observe("prefill", times.prefill_s)
        if times.first_step_s > 0:  # it made a second token
            metrics.observe("admission", times.admission_s)
            metrics.observe("first_step", times.first_step_s)

    def abort(self, request_id: str) -> bool:
        """Abort a live request on the engine thread and end its stream with an `abort` output;
        False when the engine does not hold it."""

        def abort(engine: LLMEngine) -> bool:
            try:
                engine.abort_request(request_id)
            except RequestNotFoundError:
                return False
            return True

        found = self.loop.call(abort)
        if found:
            self.close_stream(request_id, aborted_output(request_id))
        return found

    # -- stats and events -------------------------------------------------------------------------

    def stats(self, **extra: Any) -> common_pb2.InstanceStats:
        def snapshot(engine: LLMEngine) -> common_pb2.InstanceStats:
            kv, scheduler = engine.kv_cache, engine.scheduler
            stats = common_pb2.InstanceStats(
                role=self.role,
                block_size=kv.block_size,
                num_blocks=kv.num_blocks,
                num_free_blocks=kv.num_free_blocks,
                num_cached_blocks=kv.num_cached_blocks,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting) + len(scheduler.prefilled),
                num_preemptions=scheduler.stats.num_preemptions,
                prefix_cache_queries=scheduler.stats.prefix_cache_queries,
                device_hit_tokens=scheduler.stats.device_hit_tokens,
                peer_hit_tokens=scheduler.stats.peer_hit_tokens,
                num_computed_tokens=scheduler.stats.num_computed_tokens,
                num_steps=scheduler.stats.num_steps,
                step_seconds=scheduler.stats.step_seconds,
                tensor_parallel_size=engine.loaded.model.shard.size,
                max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
                max_num_seqs=scheduler.config.max_num_seqs,
                step_gaps=scheduler.stats.step_gaps,
                step_gap_seconds=scheduler.stats.step_gap_seconds,
                kv_block_bytes=self.stager.block_bytes,
                **extra,
            )
            group = engine.runner.tp.group if isinstance(engine.runner.tp, RankZero) else None
            if group is not None:  # the engine thread's own counters: read on it
                collectives = common_pb2.InstanceStats(
                    tp_collective_seconds=group.stats.seconds, tp_collectives=group.stats.calls
                )
                stats.MergeFrom(collectives)
            storage = self._storage_stats(engine)
            if storage is not None:
                stats.storage.CopyFrom(storage)
            _fill_step_time(engine.step_time, stats.step_time)
            return stats

        stats = self.loop.call(snapshot)
        self.counters.fill(stats)
        return stats

    def _storage_stats(self, engine: LLMEngine) -> common_pb2.StorageStats | None:
        connector = engine.storage_connector
        if connector is None:
            return None
        tier, c = connector.tier, connector.tier.counters.snapshot()
        return common_pb2.StorageStats(
            available=tier.available,
            storage_hit_tokens=engine.scheduler.stats.storage_hit_tokens,
            loaded_tokens=connector.staged.loaded_tokens,
            blocks_written=c.blocks_written,
            bytes_written=c.bytes_written,
            blocks_read=c.blocks_read,
            bytes_read=c.bytes_read,
            writes_skipped=c.writes_skipped,
            writes_dropped=c.writes_dropped,
            write_errors=c.write_errors,
            read_errors=c.read_errors,
            invalid_entries=c.invalid_entries,
            redis_errors=c.redis_errors,
            evictions=c.evictions,
            queue_depth=tier.queue_depth,
        )

    def acknowledge(self, subscriber: str, route_seq: int) -> None:
        """A request of router `subscriber` numbered `route_seq` is counted in this instance's
        load now (admitted or reserved): the next load report says so. Any thread."""
        if not subscriber or not route_seq:
            return
        with self._received_lock:
            received = self._received
            previous = received.pop(subscriber, 0)  # re-inserted last: heard most recently
            received[subscriber] = max(previous, route_seq)
            while len(received) > MAX_ROUTERS:  # the least recently heard router goes
                del received[next(iter(received))]

    def load_report(self, engine: LLMEngine) -> LoadReport:
        """The instance's load now (engine thread)."""
        scheduler, kv = engine.scheduler, engine.kv_cache
        queued = scheduler.queued_prompt_tokens()
        reservations, reserved_blocks = self.reserved()
        with self._received_lock:
            received = dict(self._received)
        return LoadReport(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.prefilled),
            num_reservations=reservations,
            queued_prefill_tokens=queued,
            num_free_blocks=kv.num_free_blocks,
            num_reserved_blocks=reserved_blocks,
            num_blocks=kv.num_blocks,
            predicted_queue_s=_queue_seconds(engine, queued),
            received=received,
            leaving=self.leaving,
        )

    def subscribe_kv_events(
        self, epoch: int = 0, after_seq: int = 0
    ) -> "tuple[list[common_pb2.KVEvent], queue.Queue[Numbered | None]]":
        """The messages a subscription starts with and a subscription to every later item,
        taken together on the engine thread (which publishes events): nothing is lost or seen
        twice. It starts with the events after `after_seq` of `epoch` when they can be
        replayed, else with a snapshot; then the current load."""

        def subscribe(
            engine: LLMEngine,
        ) -> "tuple[list[common_pb2.KVEvent], queue.Queue[Numbered | None]]":
            events = self.events
            replay, subscriber = events.subscribe(epoch, after_seq)
            if replay is None:
                snapshot = common_pb2.BlocksStored(block_hashes=engine.published_hashes())
                first = [common_pb2.KVEvent(snapshot=snapshot, epoch=events.epoch, seq=events.seq)]
            else:
                first = [_event_message(events.epoch, numbered) for numbered in replay]
            load = Numbered(events.seq, self.load_report(engine))
            return [*first, _event_message(events.epoch, load)], subscriber

        return self.loop.call(subscribe)

    async def kv_event_stream(
        self, epoch: int = 0, after_seq: int = 0
    ) -> AsyncIterator[common_pb2.KVEvent]:
        """A snapshot of the published blocks (or the events after `after_seq` of `epoch`),
        then every KV event, digest and load report, until the client goes away (its call is
        cancelled) or the instance stops. Each wait for the next item holds an executor thread
        for at most `KV_EVENT_POLL_S` (subscribers are few: the routers)."""
        first, subscriber = await blocking(self.subscribe_kv_events, epoch, after_seq)
        try:
            for message in first:
                for sent in self._faulted(message):
                    yield sent
            while True:
                numbered = await blocking(_next_event, subscriber)
                if numbered is None:  # disconnected: the instance stops (or it fell behind)
                    return
                if numbered is _NO_EVENT:
                    continue
                for sent in self._faulted(_event_message(self.events.epoch, numbered)):
                    yield sent
        finally:
            self.events.unsubscribe(subscriber)

    def _faulted(self, message: common_pb2.KVEvent) -> list[common_pb2.KVEvent]:
        fault = self.kv_event_fault
        return [message] if fault is None else fault(message)

    def _tick(self, engine: LLMEngine) -> None:
        """Engine thread, between steps: the role's housekeeping, then the digest and load
        reports the KV-event streams carry."""
        self.on_tick(engine)
        if self.events.has_subscribers():
            self._reports.send(self, engine)

    # -- lifecycle --------------------------------------------------------------------------------

    def check_integrity(self, reserved: Sequence[str] = ()) -> None:
        """Raise IntegrityError unless the engine (tables owned by live requests or the
        `reserved` ids), its KV events (their digest is the published set's) and the storage
        tier are consistent. Call when idle."""

        def check(engine: LLMEngine) -> None:
            engine.check_integrity(reserved)
            published = KVDigest.of(engine.published_hashes())
            if published != self.events.digest:
                raise IntegrityError(
                    f"the KV events describe {self.events.digest}, the cache publishes {published}"
                )

        self.loop.call(check)
        if self.storage_tier is not None:
            self.storage_tier.flush()
            self.storage_tier.check_integrity()

    def check_ranks(self) -> None:
        """Raise TensorParallelError when a tensor-parallel rank of this instance failed (its
        requests fail until the instance is restarted). Any thread: it reads the ranks' state,
        not the engine's."""
        self.engine.check_ranks()

    def start(self) -> None:
        self.loop.start()

    def request_ids(self) -> list[str]:
        """The requests whose streams are open here."""
        with self._streams_lock:
            return list(self._streams)

    def end_requests(self, error: PdserveError) -> None:
        """End every request held here: its stream fails with `error` first (the router,
        reading it, continues the request elsewhere), then the engine drops it."""
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.fail(error)
            self.abort(stream.request_id)

    def stop(self) -> None:
        self.events.disconnect_all()  # KV-event streams end now, not at their next poll
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:  # their readers are gone: ended, their spans close
            stream.fail(InstanceUnavailableError(f"this {self.role} instance stopped"))
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.loop.stop()
        if self.storage_tier is not None:
            self.storage_tier.close()
        if self.mooncake is not None:
            self.mooncake.close()
        self.channels.close()
        self.engine.close()


def _nothing(engine: LLMEngine) -> None:
    pass


KV_EVENT_POLL_S = 0.5
_NO_EVENT: Any = object()  # no event within KV_EVENT_POLL_S
LOAD_REPORT_S = 0.005  # a changed load is reported at most this often (coalesced)
DIGEST_REPORT_S = 1.0  # a changed published set's digest is reported at most this often
MAX_ROUTERS = 64  # routers whose acknowledged route numbers a load report carries

KVEventFault = Callable[[common_pb2.KVEvent], list[common_pb2.KVEvent]]
"""Tests only: what a KV-event stream sends in place of one message (none: dropped; two: a
repeat; a message held back and sent later: reordered)."""


class _Reports:
    """When the engine thread last sent a digest and a load report, and what they said."""

    def __init__(self) -> None:
        self.load: LoadReport | None = None
        self.load_at = 0.0
        self.digest_seq = 0
        self.digest_at = 0.0

    def send(self, runtime: "InstanceRuntime", engine: LLMEngine) -> None:
        """A digest when events were published since the last one (at most every
        DIGEST_REPORT_S); the load when it changed (at most every LOAD_REPORT_S)."""
        events, now = runtime.events, time.monotonic()
        if events.seq != self.digest_seq and now - self.digest_at >= DIGEST_REPORT_S:
            self.digest_seq, self.digest_at = events.seq, now
            events.report(events.digest)
        if now - self.load_at < LOAD_REPORT_S:
            return
        load = runtime.load_report(engine)
        if load != self.load:
            self.load, self.load_at = load, now
            events.report(load)


def _queue_seconds(engine: LLMEngine, queued_tokens: int) -> float:
    """The step time model's time for `queued_tokens` prompt tokens in chunks of the step
    budget: their per-token cost and each chunk's constant (attention left out)."""
    model = engine.step_time
    if not queued_tokens or not model.fitted:
        return 0.0
    budget = max(1, engine.scheduler.config.max_num_batched_tokens)
    constant = model.predict(StepShape(0, 0.0, 0, 0))
    tokens = model.predict(StepShape(queued_tokens, 0.0, 0, 0)) - constant
    return max(0.0, tokens + -(-queued_tokens // budget) * constant)


def _event_message(epoch: int, numbered: Numbered) -> common_pb2.KVEvent:
    """A stream item as its KVEvent message."""
    message = common_pb2.KVEvent(epoch=epoch, seq=numbered.seq)
    item = numbered.item
    if isinstance(item, BlockStored):
        message.stored.block_hashes.extend(item.block_hashes)
    elif isinstance(item, KVDigest):
        message.digest.num_blocks = item.num_blocks
        message.digest.hash_sum = item.hash_sum
    elif isinstance(item, LoadReport):
        message.load.CopyFrom(load_to_proto(item))
    else:
        message.removed.block_hashes.extend(item.block_hashes)
    return message


def _fill_step_time(model: StepTimeModel, message: common_pb2.StepTimeFit) -> None:
    message.coefficients.update(model.named_coefficients())
    message.samples = model.samples
    message.median_error = model.median_error()
    message.error_bounds.extend(ERROR_BUCKETS)
    message.error_counts.extend(model.error_counts)
    message.error_sum = model.error_sum
    message.ratio_quantiles.extend(model.ratio_quantiles())


def _next_event(subscriber: "queue.Queue[Numbered | None]") -> Any:
    """The subscriber's next item, None when it was disconnected, or _NO_EVENT after
    KV_EVENT_POLL_S (so that a cancelled stream frees its thread soon)."""
    try:
        return subscriber.get(timeout=KV_EVENT_POLL_S)
    except queue.Empty:
        return _NO_EVENT


def _tier_factory(
    config: StorageConfig | None, channels: ChannelPool, secret: str
) -> StorageTierFactory | None:
    """How the engine builds its storage tier (None: the tier is off); it reads peers' memory
    stores over `channels` (which carry the cluster secret)."""
    if config is None or not config.enabled:
        return None
    default_root = Path(platformdirs.user_cache_dir("pdserve")) / "kv-store"
    return lambda tag: StorageTier(
        config, tag, make_store(config, None, default_root), channels=channels, secret=secret
    )


class InstanceServicer(common_pb2_grpc.InstanceServiceServicer):
    """InstanceService: convert -> delegate to the role / runtime -> convert."""

    def __init__(self, role: InstanceRole, runtime: InstanceRuntime) -> None:
        self.role = role
        self.runtime = runtime

    def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortReply:
        if request.attempt and not self.runtime.serves(request.request_id, request.attempt):
            return common_pb2.AbortReply(found=False)
        return common_pb2.AbortReply(found=self.role.abort(request.request_id))

    def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> common_pb2.InstanceStats:
        return self.role.stats()

    async def SubscribeKVEvents(
        self, request: common_pb2.KVEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.KVEvent]:
        stream = self.runtime.kv_event_stream(request.epoch, request.after_seq)
        async for event in stream:  # an async generator, for grpc.aio
            yield event

    async def SubscribeOutputs(
        self, request: common_pb2.OutputsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.StepOutputs]:
        """An empty message once open, then one per batch of outputs (a step's, or several
        steps' when this reader lags). An ended request's stream is closed once its end is
        sent; when the subscription ends (the router went away, or a newer one replaced it)
        its unfinished requests are aborted."""
        if not request.subscriber:
            await abort_with_async(context, InvalidRequestError("subscriber is required"))
        subscription = self.runtime.subscribe(request.subscriber)
        try:
            yield common_pb2.StepOutputs()
            async for batch in subscription.batches():
                yield step_outputs(batch)
                for stream, item in batch:
                    if isinstance(item, PdserveError) or item.finished:
                        self.runtime.close_stream(stream.request_id, stream=stream)
        finally:
            for request_id in self.runtime.unsubscribe(subscription):
                post(self.role.abort, request_id)
