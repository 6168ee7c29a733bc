"""KV events: what a cache published or dropped, for the router's prefix index."""

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kvcache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks whose KV is fully computed and now matchable, in chain order."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that are no longer matchable on this instance."""

    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved
KVEventSink = Callable[[KVEvent], None]
"""Called synchronously by the cache manager; must not block (enqueue and return)."""
