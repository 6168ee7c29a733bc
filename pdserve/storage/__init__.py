"""The shared KV storage tier: a Redis index (`CacheIndex`) over block stores, used by every
instance through its `StorageTier`."""

from pdserve.errors import BlockStoreError
from pdserve.storage.index import CacheIndex, IndexEntry, InvalidEntry
from pdserve.storage.stores import BlockStore, DirectoryStore, HostMemoryStore
from pdserve.storage.tier import StorageTier, checksum

__all__ = [
    "BlockStore",
    "BlockStoreError",
    "CacheIndex",
    "DirectoryStore",
    "HostMemoryStore",
    "IndexEntry",
    "InvalidEntry",
    "StorageTier",
    "checksum",
]
