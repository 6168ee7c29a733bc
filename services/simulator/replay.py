"""Replay a trace through real `KVCacheManager`s (one per instance), a model of the storage tier
and the router's real routing policies and load tracker. No model, no sockets.

Time is the trace's. A request arriving at t is routed (policy over exact prefix overlaps and the
tracker's loads), matched against its instance's device cache, then the storage tier (the chain
continues there), and holds blocks for its prompt and output until it ends: its prefill takes
`uncached tokens / prefill_tokens_per_s`, then each output token `time_per_output_token_s`. A
request that does not fit waits on its instance until blocks free. Published blocks evicted from
a device go to the storage tier (an LRU of `storage_blocks`), as `device_write_policy:
on_eviction` does.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.kvcache.eviction import make_eviction_policy
from pdserve.kvcache.hashing import BlockHash
from pdserve.kvcache.manager import KVCacheManager
from services.router.load import Lease, LoadTracker
from services.router.policies import PolicyConfig, RouteRequest, make_policy
from services.simulator.events import EventQueue
from services.simulator.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class SimConfig:
    device_blocks: int
    storage_blocks: int = 0
    instances: int = 1
    eviction: str = "lrfu"
    routing: str = "cache_aware"
    load_weight: float = 0.1
    block_tokens: int = 512
    prefill_tokens_per_s: float = 20_000.0
    time_per_output_token_s: float = 0.02
    half_life_s: float = 300.0


@dataclass(slots=True)
class Tally:
    """Hits of one scope (the cluster, or one instance)."""

    requests: int = 0
    blocks: int = 0
    device_blocks: int = 0
    storage_blocks: int = 0
    device_fraction_sum: float = 0.0  # of per-request hit fractions (request-weighted)
    storage_fraction_sum: float = 0.0

    def add(self, blocks: int, device: int, storage: int) -> None:
        self.requests += 1
        self.blocks += blocks
        self.device_blocks += device
        self.storage_blocks += storage
        if blocks:
            self.device_fraction_sum += device / blocks
            self.storage_fraction_sum += storage / blocks

    def rates(self) -> dict[str, float]:
        blocks, requests = max(self.blocks, 1), max(self.requests, 1)
        return {
            "device": self.device_blocks / blocks,
            "storage": self.storage_blocks / blocks,
            "total": (self.device_blocks + self.storage_blocks) / blocks,
            "device_per_request": self.device_fraction_sum / requests,
            "total_per_request": (self.device_fraction_sum + self.storage_fraction_sum) / requests,
        }


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    cluster: Tally = field(default_factory=Tally)
    per_instance: list[Tally] = field(default_factory=list)
    too_large: int = 0  # requests bigger than a whole device cache (not replayed)
    waited: int = 0  # requests that waited for blocks


class StorageModel:
    """The storage tier as an LRU of block hashes (the manager's WriteBack on eviction)."""

    write_on_evict = True
    write_through = False
    write_on_preempt = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def write_back(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        for _, block_hash in blocks:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def hits(self, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of `chain` stored (each one read is touched)."""
        count = 0
        for block_hash in chain:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            count += 1
        return count


@dataclass(slots=True, eq=False)
class _Request:
    """The `CacheRequest` a trace record becomes."""

    request_id: str
    num_tokens: int
    block_hashes: list[BlockHash]
    record: TraceRecord


def block_hash(hash_id: int) -> BlockHash:
    return BlockHash(hash_id.to_bytes(8, "little", signed=True))


def full_chain(record: TraceRecord, block_tokens: int) -> list[BlockHash]:
    """Hashes of the record's full prompt blocks."""
    return [block_hash(h) for h in record.hash_ids[: record.input_length // block_tokens]]


class Simulation:
    """One replay of one configuration. Use `run`."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.events = EventQueue()
        self.storage = StorageModel(config.storage_blocks) if config.storage_blocks else None
        self.managers = [
            KVCacheManager(
                config.device_blocks,
                config.block_tokens,
                write_back=self.storage,
                eviction=make_eviction_policy(
                    config.eviction,
                    config.device_blocks,
                    half_life_s=config.half_life_s,
                    clock=lambda: self.events.now,
                ),
            )
            for _ in range(config.instances)
        ]
        self.names = [f"i{n}" for n in range(config.instances)]
        self.policy = make_policy(config.routing, PolicyConfig(load_weight=config.load_weight))
        self.load = LoadTracker()
        self.result = SimResult(config, per_instance=[Tally() for _ in self.names])
        self._waiting: list[deque[_Request]] = [deque() for _ in self.names]

    def run(
        self, records: Sequence[TraceRecord], progress: Callable[[], object] = lambda: None
    ) -> SimResult:
        for n, record in enumerate(records):
            self.events.advance(record.timestamp_ms / 1000)
            chain = full_chain(record, self.config.block_tokens)
            request = _Request(f"r{n}", record.input_length, chain, record)
            self._arrive(request)
            progress()
        self.events.advance(float("inf"))
        for manager in self.managers:
            manager.check_integrity()
        return self.result

    @property
    def now(self) -> float:
        return self.events.now

    # -- a request's life ---------------------------------------------------------------------

    def _arrive(self, request: _Request) -> None:
        config = self.config
        total = request.num_tokens + request.record.output_length
        if -(-total // config.block_tokens) > config.device_blocks:
            self.result.too_large += 1
            return
        overlaps = {
            name: len(manager.match_prefix(request).block_ids)
            for name, manager in zip(self.names, self.managers, strict=True)
        }
        route = RouteRequest(request.request_id, request.num_tokens, config.block_tokens)
        decision = self.policy.choose(self.names, route, self.load.snapshot(), overlaps)
        index = self.names.index(decision.instance_id)
        if self._waiting[index] or not self._admit(index, request):
            self.result.waited += 1
            self._waiting[index].append(request)

    def _admit(self, index: int, request: _Request) -> bool:
        manager, config = self.managers[index], self.config
        prefix = manager.match_prefix(request)
        total = request.num_tokens + request.record.output_length
        if not manager.can_allocate(request, total, prefix):
            return False
        device = len(prefix.block_ids)
        hittable = max(0, request.num_tokens - 1) // config.block_tokens
        chain = request.block_hashes[:hittable]
        storage = self.storage.hits(chain[device:]) if self.storage else 0
        manager.allocate(request, total, prefix)
        manager.update_cache_blocks(request, request.num_tokens)
        self.result.cluster.add(len(request.block_hashes), device, storage)
        self.result.per_instance[index].add(len(request.block_hashes), device, storage)
        uncached = request.num_tokens - (device + storage) * config.block_tokens
        lease = self.load.acquire(self.names[index], max(1, uncached))
        prefill_end = self.now + max(uncached, 1) / config.prefill_tokens_per_s
        end = prefill_end + request.record.output_length * config.time_per_output_token_s
        self.events.at(prefill_end, lease.finish_prefill)
        self.events.at(end, lambda: self._finish(index, request, lease))
        return True

    def _finish(self, index: int, request: _Request, lease: Lease) -> None:
        self.managers[index].free(request.request_id)
        lease.release()
        waiting = self._waiting[index]
        while waiting and self._admit(index, waiting[0]):
            waiting.popleft()
