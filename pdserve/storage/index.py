"""CacheIndex: where every stored KV block lives, in Redis.

Keys, all under `pds:{tag}:` (`tag` names the model, dtype, block size and KV layout, so blocks of
different layouts never meet):
  b:{hash}        HASH  store, key, size, crc, tag, atime (ms)  one entry per stored block
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

Whoever can write to Redis can write any entry, so `lookup` checks each one before it is used
(`pdserve.storage.keys`): every field present and well-formed, the tag it was written under equal
to ours, its key bound to its block hash and our tag, its store id well-formed. An entry that
fails is returned as an `InvalidEntry`, never as something to follow; `discard` drops it without
queueing the bytes its key names (they may be another block's).
"""

import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.sentinel import Sentinel

from pdserve.config import SENTINEL_SCHEMES, SentinelURL
from pdserve.errors import BlockStoreError, IntegrityError
from pdserve.kvcache.hashing import BlockHash
from pdserve.storage.keys import HASH_BYTES, check_key, check_store_id

# ARGV: prefix, now_ms, hash... -> entries {store, key, size, crc, tag, mac} (as stored:
# unchecked) of the longest stored prefix of the chain; touches them (LRU: a counter, not the
# clock, orders accesses; XX: only published entries are in an LRU set, a forged one is not added)
_LOOKUP = """
local prefix, now = ARGV[1], ARGV[2]
local found = {}
local tick = redis.call('INCRBY', prefix .. 'clock', #ARGV - 2)
for i = 3, #ARGV do
  local key = prefix .. 'b:' .. ARGV[i]
  local entry = redis.call('HMGET', key, 'store', 'key', 'size', 'crc', 'tag', 'mac')
  if not entry[1] then break end
  redis.call('HSET', key, 'atime', now)
  -- deeper blocks of a chain get older ticks: a chain is evicted from its tail
  redis.call('ZADD', prefix .. 'lru:' .. entry[1], 'XX', tick - (i - 3), ARGV[i])
  found[#found + 1] = entry
end
return found
"""

# ARGV: prefix, hash, claim_ms -> 1 when the caller may write the block (no entry, no live claim)
_CLAIM = """
if redis.call('EXISTS', ARGV[1] .. 'b:' .. ARGV[2]) == 1 then return 0 end
if redis.call('SET', ARGV[1] .. 'w:' .. ARGV[2], '1', 'NX', 'PX', ARGV[3]) then return 1 end
return 0
"""

# ARGV: prefix, hash, store, key, size, crc, now_ms, capacity, delete_after_ms, tag, mac
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
           'crc', ARGV[6], 'tag', ARGV[10], 'mac', ARGV[11], 'atime', ARGV[7])
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
    -- a published entry is in its store's LRU set and counted; one written by hand may not be
    if redis.call('ZREM', prefix .. 'lru:' .. entry[1], ARGV[i]) == 1
       and string.match(entry[3] or '', '^%d+$') then
      redis.call('DECRBY', prefix .. 'used:' .. entry[1], entry[3])
    end
    if entry[2] then redis.call('ZADD', prefix .. 'gc:' .. entry[1], ARGV[2], entry[2]) end
    removed = removed + 1
  end
end
return removed
"""

# ARGV: prefix, hash, key -> 1 when the entry of `hash` still had key `key` ('' for none) and was
# dropped, else 0. Its bytes are not queued for deletion: the entry failed its checks, so its key
# may name bytes it does not own. Compare-and-delete: an entry published since stays.
_DISCARD = """
local prefix, hash = ARGV[1], ARGV[2]
local name = prefix .. 'b:' .. hash
local entry = redis.call('HMGET', name, 'store', 'key', 'size')
if (entry[2] or '') ~= ARGV[3] or redis.call('DEL', name) == 0 then return 0 end
if entry[1] and redis.call('ZREM', prefix .. 'lru:' .. entry[1], hash) == 1
   and string.match(entry[3] or '', '^%d+$') then
  redis.call('DECRBY', prefix .. 'used:' .. entry[1], entry[3])
end
return 1
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
    """Where a block's bytes are: `key` in store `store`, `size` bytes of CRC-32 `crc`, written
    under layout tag `tag`."""

    store: str
    key: str
    size: int
    crc: int
    tag: str


@dataclass(frozen=True, slots=True)
class InvalidEntry:
    """An index entry that failed its checks (`reason` says which): never followed.
    `key` is its key field as stored (None when absent), for `CacheIndex.discard`."""

    key: bytes | None
    reason: str


LookupEntry = IndexEntry | InvalidEntry


@dataclass(frozen=True, slots=True)
class PublishResult:
    published: bool  # False: already present, or larger than the store
    evicted: int  # entries evicted to make room


def _now_ms() -> int:
    return int(time.time() * 1000)


_DIGITS = re.compile(r"[0-9]{1,19}")
_HASH_HEX = re.compile(rb"[0-9a-f]{%d}" % (2 * HASH_BYTES))
_FIELDS = ("store", "key", "size", "crc", "tag")
MAX_SIZE = 1 << 62
MAX_CRC = 1 << 32


def _parse_entry(row: Sequence[bytes | None]) -> IndexEntry:
    """An entry from its stored fields (`_FIELDS` order). Pure. Raises BlockStoreError when a
    field is missing or malformed."""
    fields = [None if value is None else value.decode(errors="replace") for value in row]
    missing = [name for name, value in zip(_FIELDS, fields, strict=False) if value is None]
    if len(fields) != len(_FIELDS) or missing:
        raise BlockStoreError(f"fields missing: {', '.join(missing) or 'all'}")
    store, key, size, crc, tag = (str(value) for value in fields)
    return IndexEntry(store, key, _uint("size", size, MAX_SIZE), _uint("crc", crc, MAX_CRC), tag)


def _uint(name: str, text: str, limit: int) -> int:
    if _DIGITS.fullmatch(text) is None or int(text) >= limit:
        raise BlockStoreError(f"{name} {text!r} is not an integer in [0, {limit})")
    return int(text)


class CacheIndex:
    """The Redis side of the storage tier. Raises redis.RedisError when Redis is unreachable;
    the caller (StorageTier) decides what that means.

    Thread-safe: the tier's worker and handler threads share it (redis-py's client pools
    connections).
    """

    def __init__(self, client: redis.Redis, tag: str, secret: str) -> None:
        """`secret` (the cluster secret) signs every entry this index publishes; entries
        without a valid signature are never followed: whoever can write to Redis but does not
        hold the secret cannot point an instance at bytes, or at a peer, of their choosing."""
        self.client = client
        self.tag = tag
        self.prefix = f"pds:{tag}:"
        self._mac_key = hashlib.sha256(b"pdserve-index-entry-mac-v1\0" + secret.encode()).digest()
        self._lookup = client.register_script(_LOOKUP)
        self._claim = client.register_script(_CLAIM)
        self._publish = client.register_script(_PUBLISH)
        self._remove = client.register_script(_REMOVE)
        self._discard = client.register_script(_DISCARD)
        self._take_garbage = client.register_script(_TAKE_GARBAGE)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[LookupEntry]:
        """Entries of the longest prefix of `hashes` present in the index (one round trip),
        each checked (`_check`): an entry that fails comes back as an InvalidEntry. Touches the
        entries' LRU order."""
        if not hashes:
            return []
        rows: list[list[bytes | None]] = self._lookup(
            args=[self.prefix, _now_ms(), *map(_hex, hashes)]
        )
        return [self._check(row, block_hash) for row, block_hash in zip(rows, hashes, strict=False)]

    def _check(self, row: Sequence[bytes | None], block_hash: BlockHash) -> LookupEntry:
        """The entry stored for `block_hash` as `row` (its fields, as `_LOOKUP` returns them), if
        it may be followed: well-formed, written under this index's tag, its key bound to
        `block_hash` and the tag, its store id well-formed. Pure."""
        stored_key = row[1] if len(row) > 1 else None
        try:
            entry = _parse_entry(row[: len(_FIELDS)])
        except BlockStoreError as e:
            return InvalidEntry(stored_key, str(e))
        mac = row[len(_FIELDS)] if len(row) > len(_FIELDS) else None
        try:
            if mac is None or not hmac.compare_digest(mac, self._mac(block_hash, entry)):
                raise BlockStoreError("not signed with this cluster's secret")
            if entry.tag != self.tag:
                raise BlockStoreError(f"written under tag {entry.tag!r}, not {self.tag!r}")
            check_key(entry.key, self.tag, block_hash)
            check_store_id(entry.store)
        except BlockStoreError as e:
            return InvalidEntry(stored_key, str(e))
        return entry

    def discard(self, block_hash: BlockHash, entry: InvalidEntry) -> bool:
        """Drop `block_hash`'s entry if it is still `entry` (same key field), without queueing
        the bytes it names for deletion. Returns whether it was dropped."""
        return bool(self._discard(args=[self.prefix, _hex(block_hash), entry.key or b""]))

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
        """Make a durable block visible, evicting LRU entries of its store to fit its capacity.
        Raises IntegrityError when `entry.tag` is not this index's tag (a caller's bug)."""
        if entry.tag != self.tag:
            raise IntegrityError(f"an entry of tag {entry.tag} published under {self.tag}")
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
                self.tag,
                self._mac(block_hash, entry),
            ]
        )
        return PublishResult(int(status) == 1, int(evicted))

    def _mac(self, block_hash: BlockHash, entry: IndexEntry) -> bytes:
        """HMAC-SHA256 (hex) of every field a reader follows, keyed by the cluster secret."""
        fields = (
            self.tag,
            block_hash.hex(),
            entry.store,
            entry.key,
            str(entry.size),
            str(entry.crc),
        )
        message = b"\0".join(field.encode() for field in fields)
        return hmac.new(self._mac_key, message, hashlib.sha256).hexdigest().encode()

    def remove(self, hashes: Sequence[BlockHash], grace_s: float = 0.0) -> int:
        """Drop entries (their bytes are deleted after `grace_s`). Returns how many existed."""
        if not hashes:
            return 0
        delete_after = _now_ms() + int(grace_s * 1000)
        return int(self._remove(args=[self.prefix, delete_after, *map(_hex, hashes)]))

    def take_garbage(self, store: str, limit: int = 1000) -> list[str]:
        """Keys of `store` whose entries are gone and whose grace period is over (dequeued); the
        caller deletes their bytes. As stored, unchecked: check each (`keys.is_store_key`)."""
        keys: list[bytes] = self._take_garbage(args=[self.prefix, store, _now_ms(), limit])
        return [k.decode(errors="replace") for k in keys]

    def used_bytes(self, store: str) -> int:
        return int(self.client.get(f"{self.prefix}used:{store}") or 0)

    def entries(self) -> dict[str, IndexEntry]:
        """Every well-formed entry, by hash (hex); malformed ones are left out, unchecked ones
        are not. SCANs the whole index: for tests and tools."""
        out = {}
        for key in self.client.scan_iter(match=f"{self.prefix}b:*", count=1000):
            fields = cast(dict[bytes, bytes], self.client.hgetall(key))
            try:
                entry = _parse_entry([fields.get(name.encode()) for name in _FIELDS])
            except BlockStoreError:
                continue
            out[key.decode(errors="replace").removeprefix(f"{self.prefix}b:")] = entry
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
        entry_prefix = f"{self.prefix}b:".encode()
        hashes: list[BlockHash] = []
        for key in self.client.scan_iter(match=f"{self.prefix}b:*", count=1000):
            name = cast(bytes, key).removeprefix(entry_prefix)
            if _HASH_HEX.fullmatch(name):
                hashes.append(BlockHash(bytes.fromhex(name.decode())))
            else:  # not named by a block hash, so not ours: dropped, nothing queued
                self.client.delete(key)
        removed = 0
        for start in range(0, len(hashes), 500):
            batch = hashes[start : start + 500]
            removed += self.remove(batch)
        return removed


def _hex(block_hash: BlockHash) -> str:
    return block_hash.hex()


def redis_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    """A client for `url` (redis://, rediss:// for TLS, unix://, or a primary through its
    Sentinels: redis+sentinel://, rediss+sentinel://) that fails fast: a dead Redis must not
    stall the instance. Through Sentinels, every new connection asks them for the current
    primary, and one to a primary demoted since fails: after a failover the client follows the
    promoted replica on its next call."""
    if urlsplit(url).scheme in SENTINEL_SCHEMES:
        return _primary_through_sentinels(SentinelURL.parse(url), timeout_s)
    client: redis.Redis = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    return client


def _primary_through_sentinels(url: SentinelURL, timeout_s: float) -> redis.Redis:
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        **dict(url.tls_options),
    }
    if url.tls:
        common["ssl"] = True
    sentinels = Sentinel(  # type: ignore[no-untyped-call]
        list(url.sentinels),
        sentinel_kwargs={
            **common,
            "username": url.sentinel_username,
            "password": url.sentinel_password,
        },
    )
    client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call]
        url.primary, db=url.db, username=url.username, password=url.password, **common
    )
    return client


__all__ = [
    "CacheIndex",
    "IndexEntry",
    "InvalidEntry",
    "LookupEntry",
    "PublishResult",
    "redis_client",
]
