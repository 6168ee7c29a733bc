"""Eviction policies: which unreferenced block an allocation reuses.

`BlockPool` is the mechanism (reference counts); a policy keeps the free blocks and picks the
victim. Every policy keeps two invariants:
  * free blocks that hold no published KV are handed out before any cached one;
  * a cached block with a published child is never the victim (it would leave the child
    unreachable: lookups walk the hash chain from the root) — unless every free cached block has
    one, which only happens while a request holds its own duplicate of a published block; then
    the lowest-keyed block goes anyway, so that `num_free` stays true.

Policies differ only in the key they order evictable blocks by (lowest goes first):
  * `lru`: the time the block was last released (least recently used first);
  * `lrfu`: LRFU over the prefix tree. Each request adds `2^((t - epoch) / H)` to the score of
    every block hash of its chain (hits and new blocks alike) when it is admitted, and also when
    it is queued if it waits for its blocks (`KVCacheManager.arrived`); scores are keyed by hash,
    so they outlive eviction (capped at `G x num_blocks` entries, longest-evicted dropped first).
    Key: (score, last release, -depth).

A lazy min-heap holds the evictable blocks: a block's key changes only while it is referenced
(released blocks are pushed with their key), or when an admission scores a free block, which is
then pushed again; stale entries are skipped by version. O(log n) per operation.
"""

import heapq
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import assert_never

from pdserve.choices import EvictionPolicyName
from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
EVICTION_POLICIES = tuple(name.value for name in EvictionPolicyName)  # make_eviction_policy's


class EvictionPolicy:
    """The free blocks of one pool and the order they are reused in. Not thread-safe (the
    cache manager's owner serialises calls)."""

    name = "lru"

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: set[int] = set()  # free blocks that hold published KV
        self._hash: dict[int, BlockHash] = {}  # published blocks
        self._block_of: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._depth: dict[int, int] = {}
        self._children: dict[BlockHash, int] = {}  # hash -> its published children (if any)
        self._released_at = [0] * num_blocks
        self._clock_seq = 0
        self._version = [0] * num_blocks
        self._heap: list[tuple[tuple[float, ...], int, int]] = []
        self.forced_evictions = 0  # victims that had a published child (see the module doc)

    # -- what the pool tells the policy -------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._free_cached)

    def free_blocks(self) -> Iterable[int]:
        """Every unreferenced block: uncached ones first (in reuse order), then cached ones."""
        yield from self._plain
        yield from sorted(self._free_cached)

    def released(self, block_ids: Iterable[int]) -> None:
        """`block_ids` lost their last reference (in this order)."""
        published, plain = self._hash, self._plain
        for block_id in block_ids:
            if block_id in published:
                self._clock_seq += 1
                self._released_at[block_id] = self._clock_seq
                self._free_cached.add(block_id)
                self._push(block_id)
            else:
                plain[block_id] = None

    def acquired(self, block_id: int) -> None:
        """An unreferenced `block_id` gained a reference (a prefix hit revived it). Its heap
        entries go stale: it is no longer free, and a later release pushes a newer version."""
        self._plain.pop(block_id, None)
        self._free_cached.discard(block_id)

    def take(self, count: int) -> list[int]:
        """The next `count` blocks to reuse (taken out of the free set). Cached victims are
        forgotten here; the caller unpublishes them (`unpublished` is then a no-op)."""
        plain = self._plain
        taken = [plain.popitem(last=False)[0] for _ in range(min(count, len(plain)))]
        while len(taken) < count:
            block_id = self._victim()
            self._free_cached.discard(block_id)
            self._forget(block_id)
            taken.append(block_id)
        return taken

    def evict(self, max_blocks: int | None) -> list[int]:
        """Cached free blocks to unpublish in place (they stay free), victims first."""
        victims: list[int] = []
        while self._free_cached and (max_blocks is None or len(victims) < max_blocks):
            block_id = self._victim()
            self._free_cached.discard(block_id)
            self._forget(block_id)
            self._plain[block_id] = None
            victims.append(block_id)
        return victims

    # -- what the cache manager tells the policy ----------------------------------------------

    def published(
        self, block_id: int, block_hash: BlockHash, parent: BlockHash | None, depth: int
    ) -> None:
        self._hash[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._parent[block_hash] = parent
        self._depth[block_id] = depth
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._on_published(block_hash)

    def unpublished(self, block_id: int) -> None:
        if block_id in self._hash:
            self._forget(block_id)
            if block_id in self._free_cached:
                self._free_cached.discard(block_id)
                self._plain[block_id] = None

    def admitted(self, block_hashes: Sequence[BlockHash]) -> None:
        """A request with this hash chain was admitted, or queued (LRFU scores it)."""

    # -- internals ----------------------------------------------------------------------------

    def key(self, block_id: int) -> tuple[float, ...]:
        return (self._released_at[block_id],)

    def _on_published(self, block_hash: BlockHash) -> None:
        pass

    def _on_forgotten(self, block_hash: BlockHash) -> None:
        pass

    def _push(self, block_id: int) -> None:
        self._version[block_id] += 1
        heapq.heappush(self._heap, (self.key(block_id), self._version[block_id], block_id))
        if len(self._heap) > 4 * self.num_blocks + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = []
        for block_id in self._free_cached:
            self._version[block_id] += 1
            self._heap.append((self.key(block_id), self._version[block_id], block_id))
        heapq.heapify(self._heap)

    def _evictable(self, block_id: int) -> bool:
        return block_id in self._free_cached and self._hash[block_id] not in self._children

    def _victim(self) -> int:
        heap = self._heap
        while heap:
            _, version, block_id = heapq.heappop(heap)
            if version == self._version[block_id] and self._evictable(block_id):
                return block_id
        if not self._free_cached:
            raise IntegrityError("no free block to evict")
        # every free cached block has a published child (held as a duplicate): take the lowest
        victim = min(self._free_cached, key=self.key)
        self.forced_evictions += 1
        logger.debug(
            "block %d evicted although a published block follows it (%d such evictions): "
            "its followers are unreachable until they are evicted too",
            victim, self.forced_evictions,
        )  # fmt: skip
        self._rebuild()
        return victim

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash.pop(block_id)
        del self._block_of[block_hash]
        del self._depth[block_id]
        parent = self._parent.pop(block_hash)
        if parent is not None:
            self._children[parent] -= 1
            if not self._children[parent]:
                del self._children[parent]
                parent_block = self._block_of.get(parent)
                if parent_block in self._free_cached:
                    self._push(parent_block)  # now a leaf: evictable
        self._on_forgotten(block_hash)

    def check_integrity(self, unreferenced: set[int]) -> None:
        free = set(self._plain) | self._free_cached
        if free != unreferenced or len(self._plain) + len(self._free_cached) != len(free):
            raise IntegrityError(
                f"eviction policy holds {len(free)} free blocks, the pool {len(unreferenced)}"
            )
        if not self._free_cached <= set(self._hash):
            raise IntegrityError("a free cached block is not published")
        counts: dict[BlockHash, int] = {}
        for parent in self._parent.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        if counts != self._children:
            raise IntegrityError("published-children counts disagree with the parents")


class LRFUPolicy(EvictionPolicy):
    """LRFU over the prefix tree (module docstring)."""

    name = "lrfu"

    def __init__(
        self,
        num_blocks: int,
        *,
        half_life_s: float = 300.0,
        score_capacity: int = 8,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(num_blocks)
        self.half_life_s = half_life_s
        self.max_scores = score_capacity * num_blocks
        self._clock = clock
        self._epoch = clock()
        self._scores: dict[BlockHash, float] = {}
        self._retired: OrderedDict[BlockHash, None] = OrderedDict()  # scored, not published

    def admitted(self, block_hashes: Sequence[BlockHash]) -> None:
        now = self._clock()
        exponent = (now - self._epoch) / self.half_life_s
        if exponent > 512:  # keep scores far from overflow: rescale them all
            self._renormalise(now, exponent)
            exponent = 0.0
        weight = 2.0**exponent
        scores = self._scores
        for block_hash in block_hashes:
            scores[block_hash] = scores.get(block_hash, 0.0) + weight
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                self._retired[block_hash] = None
                self._retired.move_to_end(block_hash)
            elif block_id in self._free_cached:
                self._push(block_id)  # its key changed while free
        while len(scores) > self.max_scores and self._retired:
            dropped, _ = self._retired.popitem(last=False)
            del scores[dropped]

    def key(self, block_id: int) -> tuple[float, ...]:
        score = self._scores.get(self._hash[block_id], 0.0)
        return (score, self._released_at[block_id], -self._depth[block_id])

    def _renormalise(self, now: float, exponent: float) -> None:
        factor = 2.0**-exponent
        self._scores = {h: s * factor for h, s in self._scores.items()}
        self._epoch = now
        self._rebuild()

    def _on_published(self, block_hash: BlockHash) -> None:
        self._retired.pop(block_hash, None)

    def _on_forgotten(self, block_hash: BlockHash) -> None:
        if block_hash in self._scores:
            self._retired[block_hash] = None


def make_eviction_policy(
    name: str,
    num_blocks: int,
    *,
    half_life_s: float = 300.0,
    score_capacity: int = 8,
    clock: Clock = time.monotonic,
) -> EvictionPolicy:
    """The policy called `name` (an `EvictionPolicyName`: `lru` or `lrfu`). Raises ValueError
    for another name."""
    try:
        policy = EvictionPolicyName(name)
    except ValueError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {EVICTION_POLICIES}"
        ) from None
    match policy:
        case EvictionPolicyName.LRU:
            return EvictionPolicy(num_blocks)
        case EvictionPolicyName.LRFU:
            if not (half_life_s > 0 and math.isfinite(half_life_s)) or score_capacity < 1:
                raise ValueError("lrfu needs half_life_s > 0 and score_capacity >= 1")
            return LRFUPolicy(
                num_blocks, half_life_s=half_life_s, score_capacity=score_capacity, clock=clock
            )
        case _:
            assert_never(policy)
