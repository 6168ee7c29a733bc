"""KV cache bookkeeping: block hashing, block pool, prefix cache and the KVCacheManager in front."""

from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.events import BlockRemoved, BlockStored, KVEvent, KVEventSink
from pdserve.kvcache.hashing import BlockHash, BlockHasher
from pdserve.kvcache.manager import CacheRequest, KVCacheManager, PrefixMatch
from pdserve.kvcache.prefix_cache import PrefixCache

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "KVCacheManager",
    "KVEvent",
    "KVEventSink",
    "PrefixCache",
    "PrefixMatch",
]
