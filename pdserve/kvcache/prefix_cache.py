"""PrefixCache: block hash -> block id for blocks whose KV is complete.

Mechanism only. Entries are added by `KVCacheManager.update_cache_blocks` (publish after compute)
and dropped lazily when the block pool hands an unreferenced cached block out again (the eviction
policy chooses which).
"""

from collections.abc import Sequence

from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash


class PrefixCache:
    """Two-way map between published block hashes and block ids. Not thread-safe."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._block_of)

    def hashes(self) -> list[BlockHash]:
        """Every matchable hash, in publication order (parents before their children)."""
        return list(self._block_of)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` that is cached. No side effects."""
        block_ids: list[int] = []
        block_of = self._block_of
        for block_hash in block_hashes:
            block_id = block_of.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Publish `block_id` under `block_hash`.

        Returns False (and changes nothing) when the hash is already published by another block:
        two requests computed the same block concurrently and the first one wins.
        """
        if block_hash in self._block_of:
            return False
        if block_id in self._hash_of:
            raise IntegrityError(f"block {block_id} is already published under another hash")
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def drop_block(self, block_id: int) -> BlockHash | None:
        """Unpublish `block_id`; returns its hash, or None when it was not cached."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
        return block_hash

    def check_integrity(self) -> None:
        if len(self._block_of) != len(self._hash_of):
            raise IntegrityError("prefix cache maps differ in size")
        for block_hash, block_id in self._block_of.items():
            if self._hash_of.get(block_id) != block_hash:
                raise IntegrityError(f"prefix cache maps disagree on block {block_id}")
