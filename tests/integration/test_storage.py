"""The storage tier against a real Redis: index scripts, stores, verified reads, write-back on
preemption and eviction, read-ahead, concurrency and faults."""

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from credentials import SECRET
from redis_replicas import ReplicatedRedis, wait_for_failover
from stacks import Stack
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, StorageConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import InstanceUnavailableError, IntegrityError
from pdserve.kvcache.hashing import BlockHash
from pdserve.storage import CacheIndex, DirectoryStore, IndexEntry, StorageTier, checksum
from pdserve.storage.index import InvalidEntry, redis_client
from pdserve.storage.keys import key_binding, new_key
from pdserve.storage.redis_server import EmbeddedRedis
from pdserve.storage.tier import make_store
from services.mixed.instance import MixedInstance
from services.mixed.servicer import serve_mixed

MakeStack = Callable[..., Stack]
BLOCK = 100  # bytes of a test block (index and tier tests)


def block_hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "big"))


def stored(index: CacheIndex, hashes: list[BlockHash]) -> list[bool]:
    """Whether each block has an entry in the index: EXISTS on its key, as a reader sees it
    (no recency touch, no signature check)."""
    return [bool(index.client.exists(f"{index.prefix}b:{h.hex()}")) for h in hashes]


def index_entry(n: int, tag: str = "t", store: str = "dir:s") -> IndexEntry:
    """An entry of block `n` under `tag`, as a writer publishes it (CRC `n`)."""
    return IndexEntry(store, new_key(tag, block_hash(n)), BLOCK, n, tag)


def storage_config(redis_url: str, root: Path, **overrides: object) -> StorageConfig:
    settings: dict[str, object] = {
        "redis_url": redis_url,
        "directory": str(root),
        "fsync": False,
        "grace_period_s": 0.0,
        "reconnect_interval_s": 0.2,
        **overrides,
    }
    return StorageConfig(**settings)  # type: ignore[arg-type]


def make_tier(config: StorageConfig, made: list[StorageTier], tag: str = "test") -> StorageTier:
    """A tier, recorded in `made` (the `tiers` fixture, which checks and closes it)."""
    assert config.directory is not None
    tier = StorageTier(config, tag, make_store(config, None, Path(config.directory)), secret=SECRET)
    made.append(tier)
    return tier


@pytest.fixture
def tiers() -> Iterator[list[StorageTier]]:
    """Tiers made by a test; flushed, integrity-checked and closed at its end."""
    made: list[StorageTier] = []
    yield made
    for tier in made:
        tier.flush()
        tier.check_integrity()
        tier.close()


# -- the index ----------------------------------------------------------------------------------


def test_lookup_returns_the_longest_stored_prefix_of_the_chain(redis_url: str) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    entries = {n: index_entry(n) for n in (0, 1, 3)}
    for n, entry in entries.items():
        assert index.publish(block_hash(n), entry, 10 * BLOCK, 0.0).published
    found = index.lookup([block_hash(n) for n in range(4)])
    assert found == [entries[0], entries[1]]  # stops at the gap, never skips it
    assert index.lookup([block_hash(2), block_hash(3)]) == []
    assert index.check_integrity("dir:s").keys() == {block_hash(n).hex() for n in (0, 1, 3)}


def test_capacity_evicts_the_least_recently_used_and_frees_bytes_after_grace(
    redis_url: str,
) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    entries = [index_entry(n) for n in range(5)]
    for n in range(3):
        index.publish(block_hash(n), entries[n], 3 * BLOCK, 60.0)
    index.lookup([block_hash(0)])  # 0 is used again: 1 is now the least recently used
    result = index.publish(block_hash(3), entries[3], 3 * BLOCK, 60.0)
    assert (result.published, result.evicted) == (True, 1)
    assert stored(index, [block_hash(n) for n in range(4)]) == [True, False, True, True]
    assert index.used_bytes("dir:s") == 3 * BLOCK
    assert index.take_garbage("dir:s") == []  # still within its grace period
    assert index.pending_garbage("dir:s") == {entries[1].key}
    index.publish(block_hash(4), entries[4], 3 * BLOCK, 0.0)
    assert index.take_garbage("dir:s") == [entries[2].key]  # evicted with no grace: deletable
    index.check_integrity("dir:s")


def test_a_block_is_claimed_by_one_writer_and_published_once(redis_url: str) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    assert index.claim(block_hash(7))
    assert not index.claim(block_hash(7))  # another writer is on it
    first_entry, second_entry = index_entry(7), index_entry(7)
    first = index.publish(block_hash(7), first_entry, 10 * BLOCK, 0.0)
    second = index.publish(block_hash(7), second_entry, 10 * BLOCK, 0.0)
    assert first.published and not second.published
    assert not index.claim(block_hash(7))  # stored: nobody writes it again
    assert index.lookup([block_hash(7)]) == [first_entry]
    assert index.used_bytes("dir:s") == BLOCK


def test_index_tags_keep_layouts_apart(redis_url: str) -> None:
    client = redis_client(redis_url)
    entry = index_entry(1, tag="model-a")
    CacheIndex(client, "model-a", SECRET).publish(block_hash(1), entry, 10 * BLOCK, 0.0)
    assert CacheIndex(client, "model-b", SECRET).lookup([block_hash(1)]) == []


def test_an_entry_not_signed_with_the_cluster_secret_is_never_followed(redis_url: str) -> None:
    """Redis writers without the cluster secret cannot forge an entry, however well-formed:
    here one that names a peer's memory store (where the secret would be sent) and matches
    everything else a reader checks."""
    client = redis_client(redis_url)
    ours, theirs = CacheIndex(client, "t", SECRET), CacheIndex(client, "t", "another-secret")
    forged = dataclasses.replace(index_entry(3), store="mem:127.0.0.1:9")
    theirs.publish(block_hash(3), forged, 10 * BLOCK, 0.0)  # signed, with the wrong secret
    [found] = ours.lookup([block_hash(3)])
    assert isinstance(found, InvalidEntry) and "not signed" in found.reason
    client.hdel(f"{ours.prefix}b:{block_hash(3).hex()}", "mac")  # no signature at all
    [found] = ours.lookup([block_hash(3)])
    assert isinstance(found, InvalidEntry) and "not signed" in found.reason
    genuine = index_entry(4)
    ours.publish(block_hash(4), genuine, 10 * BLOCK, 0.0)
    assert ours.lookup([block_hash(4)]) == [genuine]


# -- entries read from Redis are checked before use -----------------------------------------------


def forge(index: CacheIndex, block_hash: BlockHash, fields: dict[str, object]) -> None:
    """Write an entry straight into Redis, as anyone with access to it can."""
    index.client.hset(f"{index.prefix}b:{block_hash.hex()}", mapping=fields)  # type: ignore[arg-type]


def entry_fields(entry: IndexEntry) -> dict[str, object]:
    return dataclasses.asdict(entry)


FORGERIES: dict[str, dict[str, object]] = {
    "a traversal key": {"key": "../../../victim"},
    "an absolute key": {"key": "/etc/passwd"},
    "another block's key": {"key": new_key("t", block_hash(2))},
    "another layout's key of the block": {"key": new_key("other", block_hash(1))},
    "another tag": {"tag": "other"},
    "a malformed size": {"size": "1e3"},
    "a negative crc": {"crc": "-1"},
    "a gRPC resolver for a peer": {"store": "mem:unix:/tmp/pdserve.sock"},
    "a peer without a port": {"store": "mem:10.0.0.1"},
    "an unknown kind of store": {"store": "s3:bucket"},
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_entry_is_returned_invalid_and_discarded_without_freeing_bytes(
    redis_url: str, forgery: str
) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    genuine = index_entry(0)
    assert index.publish(block_hash(0), genuine, 10 * BLOCK, 0.0).published
    forge(index, block_hash(1), {**entry_fields(index_entry(1)), **FORGERIES[forgery]})
    found = index.lookup([block_hash(0), block_hash(1)])
    assert found[0] == genuine and isinstance(found[1], InvalidEntry)  # the chain ends there
    assert index.discard(block_hash(1), found[1])
    assert stored(index, [block_hash(1)]) == [False]
    assert index.pending_garbage("dir:s") == set()  # what it named is not queued for deletion
    assert index.check_integrity("dir:s").keys() == {block_hash(0).hex()}


def test_an_entry_without_its_tag_is_invalid(redis_url: str) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    fields = entry_fields(index_entry(1))
    del fields["tag"]  # as written before entries carried their tag
    forge(index, block_hash(1), fields)
    [found] = index.lookup([block_hash(1)])
    assert isinstance(found, InvalidEntry) and "tag" in found.reason


def test_discard_keeps_an_entry_published_since_the_lookup(redis_url: str) -> None:
    index = CacheIndex(redis_client(redis_url), "t", SECRET)
    forge(index, block_hash(1), {**entry_fields(index_entry(1)), "tag": "other"})
    [found] = index.lookup([block_hash(1)])
    assert isinstance(found, InvalidEntry)
    index.client.delete(f"{index.prefix}b:{block_hash(1).hex()}")
    index.publish(block_hash(1), index_entry(1), 10 * BLOCK, 0.0)
    assert not index.discard(block_hash(1), found)
    assert stored(index, [block_hash(1)]) == [True]


def victim_outside(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """(store root, a file outside it, the file's bytes); `../../../victim` from the root's shard
    folder is that file."""
    root = tmp_path / "a" / "b" / "c" / "store"
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not delete" * 10)
    assert (root / ".." / "../../../victim").resolve() == victim.resolve()
    return root, victim, victim.read_bytes()


@pytest.mark.parametrize("relative", [True, False], ids=["traversal", "absolute"])
def test_an_index_entry_naming_a_file_outside_the_store_is_refused_counted_never_read(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier], relative: bool
) -> None:
    root, victim, content = victim_outside(tmp_path)
    tier = make_tier(storage_config(redis_url, root), tiers)
    key = "../../../victim" if relative else str(victim)
    entry = IndexEntry(tier.store.store_id, key, len(content), checksum(content), tier.index.tag)
    forge(tier.index, block_hash(5), entry_fields(entry))
    assert tier.read_chain([block_hash(5)]) == []  # not the victim's bytes
    assert (tier.counters.invalid_entries, tier.counters.read_errors) == (1, 0)
    assert stored(tier.index, [block_hash(5)]) == [False]
    tier.flush()  # a garbage collection has had its chance
    assert victim.read_bytes() == content


def test_garbage_keys_naming_files_outside_the_store_are_refused_and_counted(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    root, victim, content = victim_outside(tmp_path)
    tier = make_tier(storage_config(redis_url, root, grace_period_s=0.05), tiers)
    items = blocks(1)
    tier.write(items)
    tier.flush()
    [genuine] = tier.store.keys()
    assert genuine.startswith(key_binding(tier.index.tag, items[0][0]))
    tier.index.remove([items[0][0]], tier.config.grace_period_s)  # genuine garbage, to be freed
    queue = f"{tier.index.prefix}gc:{tier.store.store_id}"
    tier.index.client.zadd(queue, {"../../../victim": 0, str(victim): 0})
    # the collection ran (the genuine garbage is gone) and refused both keys
    wait_for(lambda: tier.store.keys() == set() and tier.counters.invalid_entries == 2)
    assert victim.read_bytes() == content  # and deleted nothing outside the store
    assert tier.index.pending_garbage(tier.store.store_id) == set()


def test_a_peer_address_from_a_forged_entry_is_never_dialled(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    tier = make_tier(storage_config(redis_url, tmp_path), tiers)
    store = "mem:unix:/tmp/pdserve.sock"  # a gRPC resolver prefix, not host:port
    forge(tier.index, block_hash(6), {**entry_fields(index_entry(6, "test")), "store": store})
    assert tier.read_chain([block_hash(6)]) == []
    assert tier.counters.invalid_entries == 1
    assert tier._peers == {}  # no channel was made for it


# -- the tier -----------------------------------------------------------------------------------


def blocks(count: int, seed: int = 0) -> list[tuple[BlockHash, bytes]]:
    return [(block_hash(seed + n), bytes([(seed + n) % 251]) * BLOCK) for n in range(count)]


def test_written_blocks_read_back_verified(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    tier = make_tier(storage_config(redis_url, tmp_path), tiers)
    items = blocks(4)
    assert tier.write(items) == 4
    tier.flush()
    assert tier.read_chain([h for h, _ in items]) == [d for _, d in items]
    assert tier.write(items) == 0  # known to be stored: not copied or written again
    assert (tier.counters.blocks_written, tier.counters.blocks_read) == (4, 4)


def test_a_copy_still_under_way_is_written_and_published_only_once_it_is_ready(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    tier = make_tier(storage_config(redis_url, tmp_path), tiers)
    items = blocks(2)
    staging = bytearray(BLOCK * 2)  # where a device copy lands (pinned rows on a GPU)
    views = [memoryview(staging)[i * BLOCK : (i + 1) * BLOCK] for i in range(2)]
    events: list[str] = []

    def ready() -> None:  # the copy lands now: before it, the rows hold zeros
        assert tier.index.lookup([items[0][0]]) == []  # nothing published yet
        staging[:] = b"".join(d for _, d in items)
        events.append("ready")

    staged = [(h, v) for (h, _), v in zip(items, views, strict=True)]
    assert tier.write(staged, ready, lambda: events.append("released")) == 2
    tier.flush()
    assert events == ["ready", "released"]
    assert tier.read_chain([h for h, _ in items]) == [d for _, d in items]
    dropped: list[str] = []
    assert tier.write(items, release=lambda: dropped.append("released")) == 0  # known: none
    assert dropped == ["released"]  # the caller's rows come back even then


def test_corrupt_or_missing_bytes_are_detected_dropped_and_recomputed(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    tier = make_tier(storage_config(redis_url, tmp_path), tiers)
    items = blocks(3)
    tier.write(items)
    tier.flush()
    store = tier.store
    assert isinstance(store, DirectoryStore)
    entries = tier.index.lookup([h for h, _ in items])
    corrupt = store.root / entries[1].key[:2] / entries[1].key
    corrupt.write_bytes(b"\x00" * BLOCK)  # same size, wrong bytes
    assert tier.read_chain([h for h, _ in items]) == [items[0][1]]
    assert tier.counters.read_errors == 1
    assert stored(tier.index, [h for h, _ in items]) == [True, False, True]
    missing = store.root / entries[0].key[:2] / entries[0].key
    missing.unlink()
    assert tier.read_chain([h for h, _ in items]) == []
    assert tier.counters.read_errors == 2
    assert stored(tier.index, [items[0][0]]) == [False]


@pytest.mark.parametrize("target", ["another block", "another layout"])
def test_a_forged_entry_for_a_prompt_is_refused_and_the_prompt_recomputed_with_identical_output(
    redis_url: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    reference: LLMEngine,
    tiers: list[StorageTier],
    target: str,
) -> None:
    """The forged entry carries our tag and a checksum matching the bytes it names: only the
    key's binding to (tag, block hash) gives it away."""
    config = storage_config(redis_url, tmp_path, device_write_policy="write_through")
    engine = storage_engine(tiny_model_dir, config, 64, tiers)
    prompt, other_prompt = prompts(2, 64, seed=50)
    params = SamplingParams(max_tokens=8)
    engine.generate([prompt, other_prompt], params)
    assert engine.storage_connector is not None
    tier = engine.storage_connector.tier
    tier.flush()
    first, other = engine.hasher.hash_tokens(prompt)[0], engine.hasher.hash_tokens(other_prompt)[0]
    [genuine, other_entry] = [tier.index.lookup([h])[0] for h in (first, other)]
    assert isinstance(genuine, IndexEntry) and isinstance(other_entry, IndexEntry)
    planted: list[str] = []
    if target == "another block":
        forged = dataclasses.replace(other_entry)  # real KV bytes, of another prefix
    else:
        data = bytes((n * 37) % 251 for n in range(genuine.size))  # another layout's block
        planted.append(new_key("another/layout", first))
        tier.store.put(planted[0], memoryview(data))
        forged = dataclasses.replace(genuine, key=planted[0], crc=checksum(data))
    tier.index.remove([first])  # the genuine bytes go to the garbage queue
    forge(tier.index, first, entry_fields(forged))
    assert engine.kv_cache.evict_cached_blocks() > 0
    before = dataclasses.replace(engine.scheduler.stats)

    [result] = engine.generate([prompt], params)
    assert result.token_ids == reference.generate([prompt], params)[0].token_ids
    assert tier.counters.invalid_entries == 1 and tier.counters.read_errors == 0
    assert engine.scheduler.stats.storage_hit_tokens == before.storage_hit_tokens
    assert tier.index.lookup([other]) == [other_entry]  # the block it pointed at is untouched
    tier.store.delete(planted)
    engine.check_integrity()


def test_writes_beyond_the_pending_limit_are_dropped_not_queued(
    redis_url: str, tmp_path: Path, tiers: list[StorageTier]
) -> None:
    tier = make_tier(storage_config(redis_url, tmp_path, max_pending_bytes=2 * BLOCK), tiers)
    release = threading.Event()
    tier.prefetch([], lambda _: release.wait(10))  # holds the worker
    assert tier.write(blocks(2)) == 2
    assert tier.write(blocks(1, seed=10)) == 0
    assert tier.counters.writes_dropped == 1
    release.set()
    tier.flush()
    assert tier.counters.blocks_written == 2


# -- the engine ---------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[32 + (seed * 131 + p * 977 + 7 * i) % 90 for i in range(length)] for p in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    """No pressure, no storage: the outputs every other configuration must equal."""
    return LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512))


def tight_engine(tiny_model_dir: Path, num_kv_blocks: int, **settings: Any) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks, **settings)
    )


def storage_engine(
    tiny_model_dir: Path,
    config: StorageConfig,
    num_kv_blocks: int,
    tiers: list[StorageTier],
    **settings: Any,
) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks, **settings),
        storage_tier=lambda tag: make_tier(config, tiers, tag),
    )


@pytest.mark.parametrize(
    ("family", "kv_cache_dtype"),
    [
        ("llama", "auto"),
        ("qwen3-moe", "auto"),
        ("mixtral", "auto"),
        ("deepseek-v3", "auto"),
        ("llama", "fp8_e4m3"),
        ("deepseek-v3", "fp8_e4m3"),
    ],
)
def test_a_preempted_request_resumes_from_storage_with_identical_output(
    redis_url: str,
    tmp_path: Path,
    family: str,
    kv_cache_dtype: str,
    family_dirs: Callable[[str], Path],
    tiers: list[StorageTier],
) -> None:
    """Every family, and the FP8 cache (whose stored blocks are its 8-bit ones): preempted
    requests restored from the storage tier end as the unpressed engine's."""
    model_dir, dtype = family_dirs(family), {"kv_cache_dtype": kv_cache_dtype}
    batch = prompts(3, 90)
    roomy = tight_engine(model_dir, 512, **dtype)  # no pressure: what every other must equal
    expected = [c.token_ids for c in roomy.generate(batch, GREEDY)]
    roomy.close()
    plain = tight_engine(model_dir, 20, **dtype)  # 320 tokens for 3 x 138: preemption
    assert [c.token_ids for c in plain.generate(batch, GREEDY)] == expected
    engine = storage_engine(model_dir, storage_config(redis_url, tmp_path), 20, tiers, **dtype)

    assert [c.token_ids for c in engine.generate(batch, GREEDY)] == expected
    stats, connector = engine.scheduler.stats, engine.storage_connector
    assert connector is not None
    tier = connector.tier
    assert (
        stats.num_preemptions > 0 and stats.num_preemptions == plain.scheduler.stats.num_preemptions
    )
    counters = tier.counters
    assert counters.blocks_written > 0 and counters.blocks_read > 0
    block_bytes = engine.loaded.model.kv_layout(engine.loaded.dtype).block_bytes(16)
    assert engine.runner.kv_cache.element_size() == (1 if kv_cache_dtype == "fp8_e4m3" else 4)
    assert counters.bytes_written == counters.blocks_written * block_bytes
    assert counters.bytes_read == counters.blocks_read * block_bytes
    assert connector.staged.loaded_tokens > 0
    # the loaded tokens were not computed again
    assert stats.num_computed_tokens + connector.staged.loaded_tokens <= (
        plain.scheduler.stats.num_computed_tokens
    )
    engine.check_integrity()


def test_a_prefix_evicted_from_the_device_is_served_from_storage(
    redis_url: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    reference: LLMEngine,
    tiers: list[StorageTier],
) -> None:
    engine = storage_engine(tiny_model_dir, storage_config(redis_url, tmp_path), 64, tiers)
    shared = prompts(1, 160, seed=3)[0]
    first, second = [*shared, 40, 41, 42], [*shared, 50, 51]
    params = SamplingParams(max_tokens=8)
    engine.generate([first], params)
    assert engine.kv_cache.evict_cached_blocks() > 0  # written back on eviction
    assert engine.storage_connector is not None
    engine.storage_connector.tier.flush()
    before = dataclasses.replace(engine.scheduler.stats)
    [result] = engine.generate([second], params)
    [expected] = reference.generate([second], params)
    assert result.token_ids == expected.token_ids
    stats = engine.scheduler.stats
    assert stats.storage_hit_tokens - before.storage_hit_tokens == 160  # 10 whole blocks
    assert stats.device_hit_tokens == before.device_hit_tokens  # none from the device tier
    assert result.num_cached_tokens == 160


def test_write_through_publishes_blocks_as_they_are_computed(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path, tiers: list[StorageTier]
) -> None:
    config = storage_config(redis_url, tmp_path, device_write_policy="write_through")
    engine = storage_engine(tiny_model_dir, config, 64, tiers)
    engine.generate(prompts(1, 64, seed=5), SamplingParams(max_tokens=1))
    assert engine.storage_connector is not None
    engine.storage_connector.tier.flush()
    assert (
        engine.storage_connector.tier.counters.blocks_written == 4
    )  # the 64-token prompt: 4 full blocks


def test_two_engines_sharing_a_store_under_pressure_never_corrupt_kv(
    redis_url: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    reference: LLMEngine,
    tiers: list[StorageTier],
) -> None:
    """Both engines preempt, evict, write back and read ahead the same hashes at once."""
    config = storage_config(redis_url, tmp_path, shared_directory=True)
    batch = prompts(4, 70, seed=9)
    shared_prefix = prompts(1, 48, seed=11)[0]
    batch += [shared_prefix + p[:30] for p in prompts(4, 30, seed=12)]
    expected = [c.token_ids for c in reference.generate(batch, GREEDY)]
    engines = [storage_engine(tiny_model_dir, config, 24, tiers) for _ in range(2)]
    results: dict[int, list[tuple[int, ...]]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            for _ in range(2):  # the second round reads what both wrote in the first
                results[index] = [c.token_ids for c in engines[index].generate(batch, GREEDY)]
        except BaseException as e:  # reported on the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not errors
    assert results == {0: expected, 1: expected}
    for engine in engines:
        assert engine.storage_connector is not None
        assert engine.storage_connector.tier.counters.read_errors == 0
        engine.check_integrity()
    assert (
        sum(e.storage_connector.tier.counters.blocks_read for e in engines if e.storage_connector)
        > 0
    )


def test_serving_survives_redis_dying_and_uses_storage_again_when_it_returns(
    tmp_path: Path, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    server = EmbeddedRedis().start()
    own: list[StorageTier] = []  # not integrity-checked: the restarted Redis starts empty
    try:
        config = storage_config(server.url, tmp_path, device_write_policy="write_through")
        engine = storage_engine(tiny_model_dir, config, 64, own)
        tier = engine.storage_connector.tier if engine.storage_connector else None
        assert tier is not None
        params = SamplingParams(max_tokens=6)
        batch = prompts(3, 40, seed=21)
        engine.generate(batch[:1], params)
        tier.flush()
        written = tier.counters.blocks_written
        assert written > 0

        server.stop()
        [result] = engine.generate(batch[1:2], params)  # served without the storage tier
        assert result.token_ids == reference.generate(batch[1:2], params)[0].token_ids
        tier.flush()
        assert tier.counters.redis_errors > 0 and tier.counters.blocks_written == written

        server.start()
        wait_for(lambda: tier.available, 10)
        engine.generate(batch[2:], params)
        tier.flush()
        assert tier.counters.blocks_written > written  # in use again
    finally:
        for tier in own:
            tier.close()
        server.close()


# -- prefill and decode instances ---------------------------------------------------------------


def test_pd_instances_resume_and_serve_prefixes_from_storage(
    redis_url: str, tmp_path: Path, make_stack: MakeStack, reference: LLMEngine
) -> None:
    """Decode preempts under pressure and resumes from storage; a prefix evicted from the
    prefill device cache is served from storage (counted in the storage tier's hits). Through
    the router, as production runs them."""
    stack = make_stack(
        engine={"num_kv_blocks": 128},
        decode_engine={"num_kv_blocks": 20},
        decode_config=DecodeConfig(reserve_horizon_tokens=0),  # accept all: running ones preempt
        storage=storage_config(redis_url, tmp_path, shared_directory=True),
        router={"kv_pull_min_tokens": None},  # else the follow-up's prefix comes from decode
    )
    prefill, decode = stack.prefill[0].instance, stack.decode[0].instance
    batch = prompts(3, 90, seed=30)
    expected = [list(c.token_ids) for c in reference.generate(batch, GREEDY)]
    with ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(lambda p: stack.generate(p, GREEDY).tokens, batch))
    assert outputs == expected
    decode_stats = decode.stats()
    assert decode_stats.num_preemptions > 0
    assert decode_stats.storage.loaded_tokens > 0 and decode_stats.storage.blocks_read > 0

    assert prefill.runtime.flush_device_cache() > 0
    assert prefill.runtime.storage_tier is not None
    prefill.runtime.storage_tier.flush()
    follow_up = [*batch[0][:80], 33, 34, 35]
    before = prefill.stats()
    assert stack.generate(follow_up, GREEDY).tokens == list(
        reference.generate([follow_up], GREEDY)[0].token_ids
    )
    after = prefill.stats()
    assert (
        after.storage.storage_hit_tokens - before.storage.storage_hit_tokens == 80
    )  # 5 whole blocks
    assert after.device_hit_tokens == before.device_hit_tokens
    for instance in (prefill, decode):  # no write in flight anywhere, then check
        assert instance.runtime.storage_tier is not None
        instance.runtime.storage_tier.flush()
    for instance in (prefill, decode):
        instance.check_integrity()


def test_host_memory_blocks_are_read_by_a_peer_over_grpc(
    redis_url: str, make_stack: Callable[..., Stack], reference: LLMEngine
) -> None:
    storage = StorageConfig(
        redis_url=redis_url, store="memory", device_write_policy="write_through"
    )
    stack = make_stack(mixed=2, engine={"num_kv_blocks": 64}, storage=storage)
    owner, peer = stack.mixed
    drain = stack.router.membership.set_drained
    shared = prompts(1, 96, seed=40)[0]
    params = SamplingParams(max_tokens=4)
    drain(peer.address, True)  # the first request runs on the owner
    stack.generate([*shared, 1, 2], params)
    tier = owner.instance.runtime.storage_tier
    assert tier is not None
    tier.flush()
    assert tier.store.store_id == f"mem:{owner.address}"

    drain(peer.address, False)
    drain(owner.address, True)  # the second on the peer, which holds none of it
    second = [*shared, 3, 4]
    assert stack.generate(second, params).tokens == list(
        reference.generate([second], params)[0].token_ids
    )
    stats = peer.instance.stats().storage
    assert stats.storage_hit_tokens == 96 and stats.blocks_read == 6  # from the owner's memory


def test_blocks_held_by_a_lost_instance_are_misses_and_recomputed(
    redis_url: str, make_stack: Callable[..., Stack], reference: LLMEngine
) -> None:
    """The instance whose host memory held the blocks is gone (its node lost): the index still
    names its store; a peer's read fails, is counted and dropped from the index, and the prompt
    is computed, with the same tokens."""
    storage = StorageConfig(
        redis_url=redis_url, store="memory", device_write_policy="write_through"
    )
    stack = make_stack(mixed=2, engine={"num_kv_blocks": 64}, storage=storage)
    owner, peer = stack.mixed
    stack.router.membership.set_drained(peer.address, True)  # the first request on the owner
    shared = prompts(1, 96, seed=41)[0]
    params = SamplingParams(max_tokens=4)
    stack.generate([*shared, 1, 2], params)
    tier = owner.instance.runtime.storage_tier
    assert tier is not None
    tier.flush()
    owner.stop()  # gone, with its host memory
    stack.router.remove_instance(owner.address)
    stack.router.membership.set_drained(peer.address, False)
    second = [*shared, 3, 4]
    assert stack.generate(second, params).tokens == list(
        reference.generate([second], params)[0].token_ids
    )
    stats = peer.instance.stats().storage
    assert stats.storage_hit_tokens == 0 and stats.read_errors == 1  # one miss ends the chain
    assert peer.instance.stats().device_hit_tokens == 0


def test_flushing_storage_while_redis_is_down_is_a_clear_unavailable_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    server = EmbeddedRedis().start()
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32)
    instance, grpc_server, _ = serve_mixed(
        engine, storage=storage_config(server.url, tmp_path), secret=SECRET
    )
    try:
        assert instance.runtime.flush_storage() == 0
        server.stop()
        with pytest.raises(InstanceUnavailableError, match="did not answer"):
            instance.runtime.flush_storage()
        server.start()  # same port: the tier reconnects
        wait_for(lambda: _flushes(instance))
    finally:
        grpc_server.stop(0)
        instance.stop()
        server.close()


def _flushes(instance: MixedInstance) -> bool:
    try:
        instance.runtime.flush_storage()
    except InstanceUnavailableError:
        return False
    return True


# -- a replicated Redis ------------------------------------------------------------------------


def unpublish(client: Any, tier: StorageTier, items: list[tuple[BlockHash, bytes]]) -> None:
    """Undo the index writes of `items`' publication, as if they had never reached `client`'s
    server."""
    prefix, store = tier.index.prefix, tier.store.store_id
    with client.pipeline() as pipe:
        for block_hash, data in items:
            pipe.delete(f"{prefix}b:{block_hash.hex()}")
            pipe.zrem(f"{prefix}lru:{store}", block_hash.hex())
            pipe.decrby(f"{prefix}used:{store}", len(data))
        pipe.execute()


def test_a_tier_behind_sentinels_follows_a_failover_and_lost_entries_only_cost_misses(
    tmp_path: Path,
) -> None:
    """TLS to every server and to the Sentinel, an ACL user, a Sentinel with its own password:
    the primary is killed, the Sentinel promotes the replica, the tier follows it; entries the
    replica never received read as misses and are written again."""
    with ReplicatedRedis(tmp_path, tls=True) as group:
        assert redis_client(group.direct_url("primary")).ping()  # rediss:// with a user
        config = storage_config(group.url, tmp_path / "store")
        tier = StorageTier(config, "test", make_store(config, None, tmp_path), secret=SECRET)
        try:
            kept, lost = blocks(3), blocks(2, seed=3)
            assert tier.write(kept + lost) == 5
            tier.flush()
            replica, primary = group.client("replica"), group.client("primary")
            wait_for(lambda: replica.dbsize() == primary.dbsize(), 10)

            old = group.primary_port()
            group.kill("primary")
            assert tier.read_chain([h for h, _ in kept]) == []  # Redis unreachable: a miss
            wait_for_failover(group, old)
            unpublish(replica, tier, lost)  # writes the replica never received, as may happen

            chain = [h for h, _ in kept + lost]
            wait_for(lambda: tier.read_chain(chain) != [], 30)  # followed the promoted replica
            assert tier.read_chain(chain) == [d for _, d in kept]
            assert tier.write(lost) == 2  # a lost entry is not taken as stored any more
            tier.flush()
            assert tier.read_chain(chain) == [d for _, d in kept + lost]
            assert tier.counters.read_errors == 0 and tier.counters.redis_errors > 0
            # the lost entries' first copies are on disk, indexed by nobody: left to an operator
            with pytest.raises(IntegrityError, match="2 stored blocks are neither indexed"):
                tier.check_integrity()
        finally:
            tier.close()
