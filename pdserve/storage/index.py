"""CacheIndex: where every stored KV block lives, in Redis.

Keys, all under `pds:{tag}:` (`tag` names the model, dtype, block size and KV layout, so blocks of
different layouts never meet):
  b:{hash}        HASH  store, key, size, crc, atime (ms)       one entry per stored block
  lru:{store}     ZSET  hash -> access tick                     eviction order of a store
  clock           INT   the access tick (ordering, not time)
  used:{store}    INT   bytes the store's entries account for   capacity accounting
  gc:{store}      ZSET  key -> delete-after (ms)                bytes to delete after a grace period
  w:{hash}        STR   a writer's claim (expires)              one writer per block

Every state change is one Lua script, so publish, evict and capacity accounting are atomic; a chain
lookup is one round trip. Deleting never frees bytes at once: the entry goes first, the bytes join
`gc:{store}` and are deleted by the store's owner once the grace period has passed, so a reader
that looked a block up just before cannot read freed bytes (it verifies checksums anyway).
Scripts build key names themselves: one Redis server (or a primary with replicas), not a Redis
Cluster.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis

from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash

# ARGV: prefix, now_ms, hash... -> entries {store, key, size, crc} of the longest stored prefix of
# the chain; touches them (LRU: a counter, not the clock, orders accesses)
_LOOKUP = """
local prefix, now = ARGV[1], ARGV[2]
local found = {}
local tick = redis.call('INCRBY', prefix .. 'clock', #ARGV - 2)
for i = 3, #ARGV do
  local key = prefix .. 'b:' .. ARGV[i]
  local entry = redis.call('HMGET', key, 'store', 'key', 'size', 'crc')
  if not entry[1] then break end
  redis.call('HSET', key, 'atime', now)
  -- deeper blocks of a chain get older ticks: a chain is evicted from its tail
  redis.call('ZADD', prefix .. 'lru:' .. entry[1], tick - (i - 3), ARGV[i])
  found[#found + 1] = entry
end
return found
"""

# ARGV: prefix, hash... -> 1 per hash with an entry, else 0 (no touch)
_CONTAINS = """
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = redis.call('EXISTS', ARGV[1] .. 'b:' .. ARGV[i])
end
return out
"""

# ARGV: prefix, hash, claim_ms -> 1 when the caller may write the block (no entry, no live claim)
_CLAIM = """
if redis.call('EXISTS', ARGV[1] .. 'b:' .. ARGV[2]) == 1 then return 0 end
if redis.call('SET', ARGV[1] .. 'w:' .. ARGV[2], '1', 'NX', 'PX', ARGV[3]) then return 1 end
return 0
"""

# ARGV: prefix, hash, store, key, size, crc, now_ms, capacity, delete_after_ms
# -> {status, evicted}: status 1 published, 0 already present (the caller deletes its bytes),
# -1 larger than the store's capacity. Evicts the store's least recently used entries to fit.
_PUBLISH = """
local prefix, hash, store, key = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local size, capacity = tonumber(ARGV[5]), tonumber(ARGV[8])
redis.call('DEL', prefix .. 'w:' .. hash)
if redis.call('EXISTS', prefix .. 'b:' .. hash) == 1 then return {0, 0} end
if size > capacity then return {-1, 0} end
local used = tonumber(redis.call('GET', prefix .. 'used:' .. store) or '0')
local evicted = 0
while used + size > capacity do
  local victim = redis.call('ZPOPMIN', prefix .. 'lru:' .. store)
  if #victim == 0 then break end
  local entry = redis.call('HMGET', prefix .. 'b:' .. victim[1], 'key', 'size')
  redis.call('DEL', prefix .. 'b:' .. victim[1])
  if entry[1] then
    used = used - tonumber(entry[2])
    redis.call('ZADD', prefix .. 'gc:' .. store, ARGV[9], entry[1])
  end
  evicted = evicted + 1
end
redis.call('HSET', prefix .. 'b:' .. hash, 'store', store, 'key', key, 'size', size,
           'crc', ARGV[6], 'atime', ARGV[7])
redis.call('ZADD', prefix .. 'lru:' .. store, redis.call('INCR', prefix .. 'clock'), hash)
redis.call('SET', prefix .. 'used:' .. store, used + size)
return {1, evicted}
"""

# ARGV: prefix, delete_after_ms, hash... -> how many entries were removed (their bytes go to gc)
_REMOVE = """
local prefix, removed = ARGV[1], 0
for i = 3, #ARGV do
  local entry = redis.call('HMGET', prefix .. 'b:' .. ARGV[i], 'store', 'key', 'size')
  if entry[1] then
    redis.call('DEL', prefix .. 'b:' .. ARGV[i])
    redis.call('ZREM', prefix .. 'lru:' .. entry[1], ARGV[i])
    redis.call('DECRBY', prefix .. 'used:' .. entry[1], entry[3])
    redis.call('ZADD', prefix .. 'gc:' .. entry[1], ARGV[2], entry[2])
    removed = removed + 1
  end
end
return removed
"""

# ARGV: prefix, store, now_ms, limit -> keys of the store whose grace period is over (dequeued)
_TAKE_GARBAGE = """
local queue = ARGV[1] .. 'gc:' .. ARGV[2]
local keys = redis.call('ZRANGEBYSCORE', queue, '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
if #keys > 0 then redis.call('ZREM', queue, unpack(keys)) end
return keys
"""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    store: str
    key: str
    size: int
    crc: int


@dataclass(frozen=True, slots=True)
class PublishResult:
    published: bool  # False: already present, or larger than the store
    evicted: int  # entries evicted to make room


def _now_ms() -> int:
    return int(time.time() * 1000)


class CacheIndex:
    """The Redis side of the storage tier. Raises redis.RedisError when Redis is unreachable;
    the caller (StorageTier) decides what that means.

    Thread-safe: the tier's worker and handler threads share it (redis-py's client pools
    connections).
    """

    def __init__(self, client: redis.Redis, tag: str) -> None:
        self.client = client
        self.tag = tag
        self.prefix = f"pds:{tag}:"
        self._lookup = client.register_script(_LOOKUP)
        self._contains = client.register_script(_CONTAINS)
        self._claim = client.register_script(_CLAIM)
        self._publish = client.register_script(_PUBLISH)
        self._remove = client.register_script(_REMOVE)
        self._take_garbage = client.register_script(_TAKE_GARBAGE)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[IndexEntry]:
        """Entries of the longest prefix of `hashes` present in the index (one round trip)."""
        if not hashes:
            return []
        rows: list[list[bytes]] = self._lookup(args=[self.prefix, _now_ms(), *map(_hex, hashes)])
        return [IndexEntry(s.decode(), k.decode(), int(n), int(c)) for s, k, n, c in rows]

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        if not hashes:
            return []
        return [bool(x) for x in self._contains(args=[self.prefix, *map(_hex, hashes)])]

    def claim(self, block_hash: BlockHash, claim_s: float = 30.0) -> bool:
        """Whether the caller should write this block: not stored, nobody else writing it."""
        return bool(self._claim(args=[self.prefix, _hex(block_hash), int(claim_s * 1000)]))

    def publish(
        self,
        block_hash: BlockHash,
        entry: IndexEntry,
        capacity_bytes: int,
        grace_s: float,
    ) -> PublishResult:
        """Make a durable block visible, evicting LRU entries of its store to fit its capacity."""
        now = _now_ms()
        status, evicted = self._publish(
            args=[
                self.prefix,
                _hex(block_hash),
                entry.store,
                entry.key,
                entry.size,
                entry.crc,
                now,
                capacity_bytes,
                now + int(grace_s * 1000),
            ]
        )
        return PublishResult(int(status) == 1, int(evicted))

    def remove(self, hashes: Sequence[BlockHash], grace_s: float = 0.0) -> int:
        """Drop entries (their bytes are deleted after `grace_s`). Returns how many existed."""
        if not hashes:
            return 0
        delete_after = _now_ms() + int(grace_s * 1000)
        return int(self._remove(args=[self.prefix, delete_after, *map(_hex, hashes)]))

    def take_garbage(self, store: str, limit: int = 1000) -> list[str]:
        """Keys of `store` whose entries are gone and whose grace period is over; the caller
        deletes their bytes."""
        keys: list[bytes] = self._take_garbage(args=[self.prefix, store, _now_ms(), limit])
        return [k.decode() for k in keys]

    def used_bytes(self, store: str) -> int:
        return int(self.client.get(f"{self.prefix}used:{store}") or 0)

    def entries(self) -> dict[str, IndexEntry]:
        """Every entry, by hash (hex). SCANs the whole index: for tests and tools."""
        out = {}
        for key in self.client.scan_iter(match=f"{self.prefix}b:*", count=1000):
            fields = cast(dict[bytes, bytes], self.client.hgetall(key))
            if fields:
                name = key.decode().removeprefix(f"{self.prefix}b:")
                out[name] = IndexEntry(
                    fields[b"store"].decode(),
                    fields[b"key"].decode(),
                    int(fields[b"size"]),
                    int(fields[b"crc"]),
                )
        return out

    def pending_garbage(self, store: str) -> set[str]:
        keys = cast(list[bytes], self.client.zrange(f"{self.prefix}gc:{store}", 0, -1))
        return {k.decode() for k in keys}

    def check_integrity(self, store: str) -> dict[str, IndexEntry]:
        """Raise IntegrityError unless `store`'s LRU set, byte count and entries agree. Returns the
        store's entries by hash."""
        entries = {h: e for h, e in self.entries().items() if e.store == store}
        members = cast(list[bytes], self.client.zrange(f"{self.prefix}lru:{store}", 0, -1))
        in_lru = {m.decode() for m in members}
        if in_lru != set(entries):
            raise IntegrityError(
                f"store {store}: {len(in_lru)} hashes in the LRU set, {len(entries)} entries"
            )
        used = self.used_bytes(store)
        if used != sum(e.size for e in entries.values()):
            raise IntegrityError(f"store {store}: used bytes {used} differ from its entries")
        return entries

    def clear(self) -> int:
        """Drop every entry of this tag (`pdserve admin flush storage`); their bytes go to the
        garbage queues, deleted by their stores' owners. Returns how many entries went."""
        hashes = [
            key.decode().removeprefix(f"{self.prefix}b:")
            for key in self.client.scan_iter(match=f"{self.prefix}b:*", count=1000)
        ]
        removed = 0
        for start in range(0, len(hashes), 500):
            batch = [BlockHash(bytes.fromhex(h)) for h in hashes[start : start + 500]]
            removed += self.remove(batch)
        return removed


def _hex(block_hash: BlockHash) -> str:
    return block_hash.hex()


def redis_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    """A client for `url` (redis://, rediss:// for TLS, unix://; password in the URL) that fails
    fast: a dead Redis must not stall the instance."""
    client: redis.Redis = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    return client


__all__ = ["CacheIndex", "IndexEntry", "PublishResult", "redis_client"]
