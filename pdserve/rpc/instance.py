"""InstanceCore: what every engine-backed instance (prefill, decode, mixed) shares.

It owns the engine loop, routes engine outputs to per-request sinks, fans out KV events and
builds stats snapshots. Services compose it; they add their role's RPCs on top.
"""

import logging
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import platformdirs

from pdserve.config import EngineConfig, StorageConfig, TransferConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerStats
from pdserve.errors import RequestNotFoundError
from pdserve.kvcache.events import BlockStored, KVEventBroadcaster
from pdserve.metrics import InstanceCollector, serve_metrics
from pdserve.rpc.server import advertised_host, create_server
from pdserve.storage.remote import SERVICE_NAME as STORAGE_SERVICE
from pdserve.storage.remote import StorageServicer
from pdserve.storage.stores import HostMemoryStore
from pdserve.storage.tier import StorageTier, make_store
from pdserve.transfer.base import TransferResult
from pdserve.v1 import common_pb2, storage_pb2_grpc

if TYPE_CHECKING:
    from pdserve.transfer.mooncake import MooncakeEngine

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class TransferCounters:
    bytes_sent: int = 0
    blocks_sent: int = 0
    bytes_received: int = 0
    blocks_received: int = 0
    blocks_sent_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_sent_by_transport: dict[str, int] = field(default_factory=dict)
    seconds_by_transport: dict[str, float] = field(default_factory=dict)
    failures_by_transport: dict[str, int] = field(default_factory=dict)

    def sent(self, transport: str, result: TransferResult) -> None:
        self.blocks_sent += result.num_blocks
        self.bytes_sent += result.num_bytes
        for table, value in (
            (self.blocks_sent_by_transport, result.num_blocks),
            (self.bytes_sent_by_transport, result.num_bytes),
        ):
            table[transport] = table.get(transport, 0) + value
        seconds = self.seconds_by_transport
        seconds[transport] = seconds.get(transport, 0.0) + result.seconds

    def failed(self, transport: str) -> None:
        failures = self.failures_by_transport
        failures[transport] = failures.get(transport, 0) + 1


def aborted_output(request_id: str) -> RequestOutput:
    """The final output of a request that was aborted (it produced no tokens in this step)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=(),
        new_text="",
        finished=True,
        kv_ready=False,
        finish_reason="abort",
        stop_reason=None,
        num_prompt_tokens=0,
        num_output_tokens=0,
        num_cached_tokens=0,
    )


class InstanceCore:
    def __init__(
        self,
        role: str,
        engine: LLMEngine,
        events: KVEventBroadcaster,
        on_tick: Callable[[], None],
        storage: StorageTier | None = None,
    ) -> None:
        self.role = role
        self.engine = engine
        self.events = events
        self.block_io = engine.block_io
        self.counters = TransferCounters()
        self.storage = storage
        self.mooncake: MooncakeEngine | None = None
        self.metrics_address = ""  # host:port of /metrics once `serve` started it
        self._metrics_server: Any = None
        if storage is not None:
            engine.attach_storage(storage)
        self._sinks: dict[str, OutputSink] = {}
        self.loop = EngineLoop(engine, self._dispatch, on_tick=on_tick)

    @classmethod
    def create(
        cls,
        role: str,
        config: EngineConfig,
        on_tick: Callable[[], None],
        storage: StorageConfig | None = None,
        shared_kv_cache: bool = False,
    ) -> "InstanceCore":
        """An engine for `config`, with the storage tier when `storage` is given and enabled,
        its KV cache in shared memory with `shared_kv_cache` (CPU)."""
        events = KVEventBroadcaster()
        engine = LLMEngine.from_config(
            config, event_sink=events.publish, shared_kv_cache=shared_kv_cache
        )
        tier = None
        if storage is not None and storage.enabled:
            default_root = Path(platformdirs.user_cache_dir("pdserve")) / "kv-store"
            store = make_store(storage, None, default_root)
            tier = StorageTier(storage, engine.storage_tag(), store)
        return cls(role, engine, events, on_tick, tier)

    def serve(
        self,
        register: Callable[[grpc.Server], None],
        service_name: str,
        host: str,
        port: int,
        stats: Callable[[], common_pb2.InstanceStats],
    ) -> tuple[grpc.Server, int]:
        """Start the instance's gRPC server with its role's service (`register`), plus the
        storage service when its storage tier keeps blocks in host memory (then named after the
        server's address), and its Prometheus endpoint (`/metrics` on a port of its own, from
        `stats`). Returns (server, bound port)."""
        store = self.storage.store if self.storage is not None else None
        memory = store if isinstance(store, HostMemoryStore) else None
        services = [service_name] if memory is None else [service_name, STORAGE_SERVICE]

        def register_all(server: grpc.Server) -> None:
            register(server)
            if memory is not None:
                storage_pb2_grpc.add_StorageServiceServicer_to_server(
                    StorageServicer(memory), server
                )

        server, bound = create_server(register_all, services, host, port)
        if memory is not None:
            memory.bind(f"{advertised_host(host)}:{bound}")
        self._metrics_server, metrics_port = serve_metrics(InstanceCollector(stats), host)
        self.metrics_address = f"{advertised_host(host)}:{metrics_port}"
        logger.info(
            "%s instance serving on %s:%d (metrics on :%d)", self.role, host, bound, metrics_port
        )
        return server, bound

    def start_mooncake(
        self, config: TransferConfig, host: str, sender: bool = False
    ) -> "MooncakeEngine | None":
        """This instance's Mooncake transfer engines with its KV cache registered (a `sender`
        runs `sender_engines(config)` of them, a receiver one), when `transfer.mooncake` is on
        and the package loads; None otherwise."""
        if not (config.mooncake or config.transport == "mooncake"):
            return None
        from pdserve.transfer.mooncake import MooncakeEngine, mooncake_available, sender_engines

        if not mooncake_available():
            logger.info("Mooncake transfer engine not installed: KV goes over shm or gRPC")
            return None
        count = sender_engines(config) if sender else 1
        engine = MooncakeEngine(config, advertised_host(host), count)
        logger.info("Mooncake transfer engines: %d (%s)", count, config.mooncake_protocol)
        kv = self.engine.runner.kv_cache
        engine.register(kv.data_ptr(), self.block_io.total_bytes)
        self.mooncake = engine
        return engine

    def read_ahead(self, request: Request) -> None:
        """Stage from the storage tier the blocks the device prefix cache lacks, before the
        request is given its blocks (`LLMEngine.preallocate` or a decode reservation loads them).
        Blocking I/O: on the caller's (handler) thread, never the engine's."""
        if self.storage is None:
            return

        def device_blocks(engine: LLMEngine) -> int:
            return len(engine.kv_cache.match_prefix(request).block_ids)

        first = self.loop.call(device_blocks)
        last = (request.num_tokens - 1) // self.engine.kv_cache.block_size
        if first < last:
            request.stage(first, self.storage.read_chain(request.block_hashes[first:last]))

    def set_sink(self, request_id: str, sink: OutputSink) -> None:
        """Route the request's outputs to `sink` (called on the engine thread; must not block)."""
        self._sinks[request_id] = sink

    def drop_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)

    def abort(self, request_id: str) -> bool:
        """Abort a live request on the engine thread and send its sink a final `abort` output;
        False when it is not live."""

        def abort(engine: LLMEngine) -> bool:
            try:
                engine.abort_request(request_id)
            except RequestNotFoundError:
                return False
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(aborted_output(request_id))
            return True

        return self.loop.call(abort)

    def stats(self, **extra: int) -> common_pb2.InstanceStats:
        def snapshot(engine: LLMEngine) -> common_pb2.InstanceStats:
            kv, scheduler = engine.kv_cache, engine.scheduler
            return common_pb2.InstanceStats(
                role=self.role,
                block_size=kv.block_size,
                num_blocks=kv.num_blocks,
                num_free_blocks=kv.num_free_blocks,
                num_cached_blocks=kv.num_cached_blocks,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_preemptions=scheduler.stats.num_preemptions,
                prefix_cache_queries=scheduler.stats.prefix_cache_queries,
                prefix_cache_hits=scheduler.stats.prefix_cache_hits,
                kv_bytes_sent=self.counters.bytes_sent,
                kv_blocks_sent=self.counters.blocks_sent,
                kv_bytes_received=self.counters.bytes_received,
                kv_blocks_received=self.counters.blocks_received,
                kv_blocks_sent_by_transport=self.counters.blocks_sent_by_transport,
                kv_bytes_sent_by_transport=self.counters.bytes_sent_by_transport,
                kv_transfer_seconds_by_transport=self.counters.seconds_by_transport,
                kv_transfer_failures_by_transport=self.counters.failures_by_transport,
                num_computed_tokens=scheduler.stats.num_computed_tokens,
                storage=self._storage_stats(scheduler.stats),
                **extra,
            )

        return self.loop.call(snapshot)

    def _storage_stats(self, stats: SchedulerStats) -> common_pb2.StorageStats | None:
        tier = self.storage
        if tier is None:
            return None
        c = tier.counters
        return common_pb2.StorageStats(
            available=tier.available,
            cache_hits=stats.storage_cache_hits,
            loaded_tokens=stats.storage_loaded_tokens,
            blocks_written=c.blocks_written,
            bytes_written=c.bytes_written,
            blocks_read=c.blocks_read,
            bytes_read=c.bytes_read,
            writes_skipped=c.writes_skipped,
            writes_dropped=c.writes_dropped,
            write_errors=c.write_errors,
            read_errors=c.read_errors,
            redis_errors=c.redis_errors,
            evictions=c.evictions,
            queue_depth=tier.queue_depth,
        )

    def kv_event_stream(self, context: grpc.ServicerContext) -> Iterator[common_pb2.KVEvent]:
        """Every KV event from now on, until the client goes away (or falls too far behind)."""
        subscriber = self.events.subscribe()
        try:
            while context.is_active():
                try:
                    event = subscriber.get(timeout=0.5)
                except queue.Empty:  # poll the context again
                    continue
                if event is None:
                    return
                hashes = list(event.block_hashes)
                if isinstance(event, BlockStored):
                    yield common_pb2.KVEvent(stored=common_pb2.BlocksStored(block_hashes=hashes))
                else:
                    yield common_pb2.KVEvent(removed=common_pb2.BlocksRemoved(block_hashes=hashes))
        finally:
            self.events.unsubscribe(subscriber)

    def check_integrity(self) -> None:
        self.loop.call(lambda engine: engine.check_integrity())
        if self.storage is not None:
            self.storage.flush()
            self.storage.check_integrity()

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.loop.stop()
        if self.storage is not None:
            self.storage.close()
        if self.mooncake is not None:
            self.mooncake.close()
        self.engine.runner.close()
