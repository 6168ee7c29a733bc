"""InstanceCore: what every engine-backed instance (prefill, decode, mixed) shares.

It owns the engine loop, routes engine outputs to per-request sinks, fans out KV events and
builds stats snapshots. Services compose it; they add their role's RPCs on top.
"""

import logging
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.loop import EngineLoop
from pdserve.errors import RequestNotFoundError
from pdserve.kvcache.events import BlockStored, KVEventBroadcaster
from pdserve.model.runner import BlockIO
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class TransferCounters:
    bytes_sent: int = 0
    blocks_sent: int = 0
    bytes_received: int = 0
    blocks_received: int = 0


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
        self, role: str, engine: LLMEngine, events: KVEventBroadcaster, on_tick: Callable[[], None]
    ) -> None:
        self.role = role
        self.engine = engine
        self.events = events
        self.block_io = BlockIO(engine.runner.kv_cache)
        self.counters = TransferCounters()
        self._sinks: dict[str, OutputSink] = {}
        self.loop = EngineLoop(engine, self._dispatch, on_tick=on_tick)

    @classmethod
    def create(cls, role: str, config: EngineConfig, on_tick: Callable[[], None]) -> "InstanceCore":
        events = KVEventBroadcaster()
        engine = LLMEngine.from_config(config, event_sink=events.publish)
        return cls(role, engine, events, on_tick)

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
                **extra,
            )

        return self.loop.call(snapshot)

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

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
