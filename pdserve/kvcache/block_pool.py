"""BlockPool: the fixed set of KV blocks and their reference counts.

Mechanism only: it knows nothing of hashes or requests. Which unreferenced block an allocation
reuses is the eviction policy's choice (`pdserve.kvcache.eviction`): blocks reaching zero
references are handed to it, allocation asks it for victims.
"""

from collections.abc import Iterable

from pdserve.errors import IntegrityError, OutOfBlocksError
from pdserve.kvcache.eviction import EvictionPolicy


class BlockPool:
    """Reference-counted blocks; allocate, touch and free cost O(log n) each. Not thread-safe."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy = policy or EvictionPolicy(num_blocks)
        if self.policy.num_blocks != num_blocks:
            raise ValueError("the eviction policy is sized for another pool")
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached or not): what `allocate` can hand out."""
        return self.policy.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def free_blocks(self) -> Iterable[int]:
        """Every unreferenced block (uncached ones first, in the order they are reused)."""
        return self.policy.free_blocks()

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` victims of the eviction policy, each with one reference, in
        ascending order: which blocks are taken is the policy's choice, their order in a block
        table is free, and ascending ids make runs that a KV transfer or a storage copy moves in
        one piece.

        The caller must unpublish any hash the blocks still carry. Raises OutOfBlocksError (and
        changes nothing) when fewer blocks are free.
        """
        if num_blocks > self.policy.num_free:
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {self.policy.num_free} free")
        block_ids = sorted(self.policy.take(num_blocks))
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking unreferenced ones out of the free set."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                self.policy.acquired(block_id)
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the policy."""
        ref_counts = self._ref_counts
        released: list[int] = []
        for block_id in block_ids:
            count = ref_counts[block_id]
            if count <= 0:
                self.policy.released(released)  # what was freed before the error stays freed
                raise IntegrityError(f"block {block_id} freed more often than referenced")
            ref_counts[block_id] = count - 1
            if count == 1:
                released.append(block_id)
        self.policy.released(released)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the policy holds exactly the unreferenced blocks."""
        if any(ref < 0 for ref in self._ref_counts):
            raise IntegrityError("negative reference count in block pool")
        unreferenced = {b for b, ref in enumerate(self._ref_counts) if ref == 0}
        self.policy.check_integrity(unreferenced)
