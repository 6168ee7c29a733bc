"""KVCacheManager: per-request block tables over a BlockPool and a PrefixCache.

The scheduler talks only to this class. Contracts:
  * `match_prefix` and `can_allocate` have no side effects;
  * `allocate` grows a request's block table (and takes references on its prefix hit);
  * `update_cache_blocks` publishes only full blocks whose KV has been computed, so a block becomes
    matchable strictly after the forward pass that wrote it completed;
  * `free` releases every reference the request holds.
A hit never covers a request's last token: at least one token is always computed, because its
logits are needed. Not thread-safe: the owner (the scheduler) serialises calls.
"""

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import IntegrityError, OutOfBlocksError
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.events import BlockRemoved, BlockStored, KVEventSink
from pdserve.kvcache.eviction import EvictionPolicy
from pdserve.kvcache.hashing import BlockHash
from pdserve.kvcache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class CacheRequest(Protocol):
    """What the cache manager needs to know of a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Hash chain of every full block of the request's tokens."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached blocks that cover the first `num_tokens` tokens of a request."""

    block_ids: tuple[int, ...] = ()
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


NO_MATCH = PrefixMatch()


class WriteBack(Protocol):
    """Where published blocks are copied out while their bytes are intact (the storage tier's
    connector), and when: blocks about to be overwritten (`write_on_evict`), blocks as they are
    published (`write_through`), a preempted request's (`write_on_preempt`)."""

    @property
    def write_on_evict(self) -> bool: ...

    @property
    def write_through(self) -> bool: ...

    @property
    def write_on_preempt(self) -> bool: ...

    def write_back(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Take (block id, hash) pairs; copy their bytes now, never block on I/O."""
        ...


class KVCacheManager:
    """Block tables, prefix matching and publication for one instance's KV cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        event_sink: KVEventSink | None = None,
        write_back: WriteBack | None = None,
        eviction: EvictionPolicy | None = None,
        on_free: Callable[[str], None] | None = None,
    ) -> None:
        """`on_free(request_id)` is called when a request's block table is freed (the model
        runner drops the table's persistent row)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, eviction)
        self.eviction = self.pool.policy
        self.prefix_cache = PrefixCache()
        self._event_sink = event_sink
        self._tables: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}
        self._write_back = write_back
        self._on_free = on_free

    # -- queries (no side effects) ------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_cache)

    def block_table(self, request_id: str) -> Sequence[int]:
        return self._tables.get(request_id, ())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def request_ids(self) -> list[str]:
        """Ids of the requests that hold a block table."""
        return list(self._tables)

    def match_prefix(self, request: CacheRequest) -> PrefixMatch:
        """Longest published prefix of `request`, never covering its last token."""
        if not self.enable_prefix_caching:
            return NO_MATCH
        max_blocks = max(0, request.num_tokens - 1) // self.block_size
        block_ids = self.prefix_cache.lookup(request.block_hashes[:max_blocks])
        return PrefixMatch(tuple(block_ids), self.block_size)

    def num_blocks_to_allocate(
        self, request: CacheRequest, num_tokens: int, prefix: PrefixMatch = NO_MATCH
    ) -> int:
        """Free blocks consumed by `allocate(request, num_tokens, prefix)`."""
        table = self._tables.get(request.request_id)
        if table is None:
            have = len(prefix.block_ids)
            revived = sum(1 for b in prefix.block_ids if self.pool.is_free(b))
        else:
            have, revived = len(table), 0
        return max(0, -(-num_tokens // self.block_size) - have) + revived

    def can_allocate(
        self,
        request: CacheRequest,
        num_tokens: int,
        prefix: PrefixMatch = NO_MATCH,
        *,
        keep_free_blocks: int = 0,
    ) -> bool:
        """Whether `allocate` would succeed and still leave `keep_free_blocks` free."""
        needed = self.num_blocks_to_allocate(request, num_tokens, prefix)
        return needed + keep_free_blocks <= self.pool.num_free

    # -- state changes ------------------------------------------------------------------------

    def arrived(self, request: CacheRequest) -> None:
        """A request was queued here: the eviction policy counts its prefix now, as demand,
        and again at its admission, as a use. Under a backlog admission comes long after
        arrival; counted only then, the prefixes the queue is waiting for were valued as of
        their last use meanwhile. A request given its blocks already (preallocated) was
        counted then."""
        if request.request_id not in self._tables:
            self.eviction.admitted(request.block_hashes)

    def allocate(
        self, request: CacheRequest, num_tokens: int, prefix: PrefixMatch = NO_MATCH
    ) -> list[int]:
        """Make the request's block table cover its first `num_tokens` tokens.

        On the first call the table starts with `prefix` (from `match_prefix` in the same
        scheduling step), whose blocks gain a reference. Returns the newly allocated block ids.
        Raises OutOfBlocksError and changes nothing when the pool is short.
        """
        if not self.can_allocate(request, num_tokens, prefix):
            raise OutOfBlocksError(
                f"request {request.request_id}: cannot cover {num_tokens} tokens with "
                f"{self.pool.num_free} free KV blocks"
            )
        table = self._tables.get(request.request_id)
        if table is None:
            table = self._start_table(request, prefix)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.pool.allocate(num_new)
        self._unpublish(new_blocks)
        table.extend(new_blocks)
        return new_blocks

    def update_cache_blocks(self, request: CacheRequest, num_computed_tokens: int) -> int:
        """Publish the request's full blocks among its first `num_computed_tokens` tokens.

        Call only after the forward pass that computed those tokens has completed. Returns how many
        blocks became newly matchable.
        """
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_published[request.request_id]
        if num_full <= start or not self.enable_prefix_caching:
            return 0
        hashes = request.block_hashes
        if len(hashes) < num_full:
            raise IntegrityError(
                f"request {request.request_id} has {len(hashes)} block hashes, needs {num_full}"
            )
        stored: list[tuple[int, BlockHash]] = []
        if start and hashes[start - 1] not in self.prefix_cache:
            stored += self._republish(hashes, table, start)
        for i in range(start, num_full):
            if self._publish(hashes, table, i):
                stored.append((table[i], hashes[i]))
        self._num_published[request.request_id] = num_full
        if stored and self._event_sink is not None:
            self._event_sink(BlockStored(tuple(h for _, h in stored)))
        if stored and self._write_back is not None and self._write_back.write_through:
            self._write_back.write_back(stored)
        return len(stored)

    def free(self, request_id: str, preempted: bool = False) -> None:
        """Release every block reference held by the request (tail blocks first, so they are
        evicted before the shared prefix). A preempted request's published blocks go to the write
        sink first when `write_on_preempt` is set. Unknown ids are ignored: free is idempotent."""
        table = self._tables.pop(request_id, None)
        num_published = self._num_published.pop(request_id, 0)
        if table is None:
            return
        if self._on_free is not None:
            self._on_free(request_id)
        sink = self._write_back
        if preempted and sink is not None and sink.write_on_preempt:
            published = [(b, self.prefix_cache.hash_of(b)) for b in table[:num_published]]
            sink.write_back([(b, h) for b, h in published if h is not None])
        self.pool.free(reversed(table))

    def evict_cached_blocks(self, max_blocks: int | None = None) -> int:
        """Unpublish up to `max_blocks` unreferenced cached blocks, the eviction policy's victims
        first.

        Blocks held by live requests stay published. Returns how many were unpublished.
        """
        victims = self.eviction.evict(max_blocks)
        self._unpublish(victims)
        return len(victims)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless references, tables and the prefix cache agree."""
        self.pool.check_integrity()
        self.prefix_cache.check_integrity()
        refs: Counter[int] = Counter()
        for table in self._tables.values():
            refs.update(table)
        for block_id in range(self.pool.num_blocks):
            if refs[block_id] != self.pool.ref_count(block_id):
                raise IntegrityError(
                    f"block {block_id}: {self.pool.ref_count(block_id)} references counted, "
                    f"{refs[block_id]} held by requests"
                )
            if refs[block_id] > 1 and self.prefix_cache.hash_of(block_id) is None:
                raise IntegrityError(f"unpublished block {block_id} is shared by requests")

    # -- internals ----------------------------------------------------------------------------

    def _start_table(self, request: CacheRequest, prefix: PrefixMatch) -> list[int]:
        hashes = request.block_hashes
        if len(prefix.block_ids) > len(hashes):
            raise IntegrityError(f"prefix of {len(prefix.block_ids)} blocks exceeds the request")
        for block_id, block_hash in zip(prefix.block_ids, hashes, strict=False):
            if self.prefix_cache.hash_of(block_id) != block_hash:
                raise IntegrityError(f"prefix block {block_id} was evicted since it was matched")
        self.eviction.admitted(hashes)
        self.pool.touch(prefix.block_ids)
        table = list(prefix.block_ids)
        self._tables[request.request_id] = table
        self._num_published[request.request_id] = len(table)
        return table

    def _publish(self, hashes: Sequence[BlockHash], table: Sequence[int], index: int) -> bool:
        """Publish block `index` of a table; False when another block holds its hash."""
        if not self.prefix_cache.insert(hashes[index], table[index]):
            return False
        parent = hashes[index - 1] if index else None
        self.eviction.published(table[index], hashes[index], parent, index)
        return True

    def _republish(
        self, hashes: Sequence[BlockHash], table: Sequence[int], end: int
    ) -> list[tuple[int, BlockHash]]:
        """Publish the request's own copies of its blocks before `end` whose hashes are no
        longer published. They were duplicates when computed (another block held the hash, and
        has been evicted since); without them the blocks published next would hang under an
        unpublished parent, unreachable by any lookup. The request holds them, so their bytes
        are intact."""
        first = end
        while first > 0 and hashes[first - 1] not in self.prefix_cache:
            first -= 1
        return [(table[i], hashes[i]) for i in range(first, end) if self._publish(hashes, table, i)]

    def _unpublish(self, block_ids: Sequence[int]) -> None:
        if self._write_back is not None and self._write_back.write_on_evict:
            cached = [(b, self.prefix_cache.hash_of(b)) for b in block_ids]
            evicted = [(b, h) for b, h in cached if h is not None]
            if evicted:
                self._write_back.write_back(evicted)
        removed = []
        for block_id in block_ids:
            block_hash = self.prefix_cache.drop_block(block_id)
            if block_hash is not None:
                self.eviction.unpublished(block_id)
                removed.append(block_hash)
        if removed and self._event_sink is not None:
            self._event_sink(BlockRemoved(tuple(removed)))
