"""BlockPool: the fixed set of KV blocks, their reference counts and the free queue.

Mechanism only: it knows nothing of hashes or requests. Freed blocks join the tail of the free
queue and allocation takes from the head, so the queue order is least-recently-freed first; cached
blocks that nobody references stay in the queue (and matchable) until allocation reuses them.
"""

from collections import OrderedDict
from collections.abc import Iterable

from pdserve.errors import IntegrityError, OutOfBlocksError


class BlockPool:
    """Reference-counted blocks with O(1) allocate, touch and free. Not thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached or not): what `allocate` can hand out."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def free_blocks_lru(self) -> Iterable[int]:
        """Unreferenced blocks, least recently freed first (the eviction order)."""
        return iter(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the head of the free queue, each with one reference, in
        ascending order: which blocks are taken is the eviction order's choice, their order in a
        block table is free, and ascending ids make runs that a KV transfer or a storage copy
        moves in one piece (blocks are freed tail first, which would reverse them).

        The caller must drop any hash the blocks still carry. Raises OutOfBlocksError (and changes
        nothing) when fewer blocks are free.
        """
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        block_ids = sorted(self._free.popitem(last=False)[0] for _ in range(num_blocks))
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking unreferenced ones out of the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise IntegrityError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the free queue holds exactly the unreferenced blocks."""
        unreferenced = {b for b, ref in enumerate(self._ref_counts) if ref == 0}
        if any(ref < 0 for ref in self._ref_counts):
            raise IntegrityError("negative reference count in block pool")
        if unreferenced != set(self._free) or len(self._free) != len(unreferenced):
            raise IntegrityError(
                f"free queue ({len(self._free)} blocks) differs from the "
                f"{len(unreferenced)} unreferenced blocks"
            )
