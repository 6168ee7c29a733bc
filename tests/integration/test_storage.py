"""The storage tier against a real Redis: index scripts, stores, verified reads, write-back on
preemption and eviction, read-ahead, concurrency and faults."""

import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, StorageConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvcache.hashing import BlockHash
from pdserve.storage import CacheIndex, DirectoryStore, IndexEntry, StorageTier
from pdserve.storage.index import redis_client
from pdserve.storage.redis_server import EmbeddedRedis
from pdserve.storage.tier import make_store
from services.decode.servicer import serve_decode
from services.mixed.servicer import serve_mixed
from services.prefill.servicer import serve_prefill
from services.router.pd_client import PDClient, TokenDelta

BLOCK = 100  # bytes of a test block (index and tier tests)


def block_hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "big"))


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
    tier = StorageTier(config, tag, make_store(config, None, Path(config.directory)))
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
    index = CacheIndex(redis_client(redis_url), "t")
    for n in (0, 1, 3):
        entry = IndexEntry("s", f"k{n}", BLOCK, n)
        assert index.publish(block_hash(n), entry, 10 * BLOCK, 0.0).published
    found = index.lookup([block_hash(n) for n in range(4)])
    assert [e.key for e in found] == ["k0", "k1"]  # stops at the gap, never skips it
    assert index.lookup([block_hash(2), block_hash(3)]) == []
    assert index.check_integrity("s").keys() == {block_hash(n).hex() for n in (0, 1, 3)}


def test_capacity_evicts_the_least_recently_used_and_frees_bytes_after_grace(
    redis_url: str,
) -> None:
    index = CacheIndex(redis_client(redis_url), "t")
    for n in range(3):
        index.publish(block_hash(n), IndexEntry("s", f"k{n}", BLOCK, n), 3 * BLOCK, 60.0)
    index.lookup([block_hash(0)])  # 0 is used again: 1 is now the least recently used
    result = index.publish(block_hash(3), IndexEntry("s", "k3", BLOCK, 3), 3 * BLOCK, 60.0)
    assert (result.published, result.evicted) == (True, 1)
    assert index.contains([block_hash(n) for n in range(4)]) == [True, False, True, True]
    assert index.used_bytes("s") == 3 * BLOCK
    assert index.take_garbage("s") == []  # still within its grace period
    assert index.pending_garbage("s") == {"k1"}
    index.publish(block_hash(4), IndexEntry("s", "k4", BLOCK, 4), 3 * BLOCK, 0.0)
    assert set(index.take_garbage("s")) == {"k2"}  # evicted with no grace: deletable now
    index.check_integrity("s")


def test_a_block_is_claimed_by_one_writer_and_published_once(redis_url: str) -> None:
    index = CacheIndex(redis_client(redis_url), "t")
    assert index.claim(block_hash(7))
    assert not index.claim(block_hash(7))  # another writer is on it
    first = index.publish(block_hash(7), IndexEntry("s", "a", BLOCK, 1), 10 * BLOCK, 0.0)
    second = index.publish(block_hash(7), IndexEntry("s", "b", BLOCK, 2), 10 * BLOCK, 0.0)
    assert first.published and not second.published
    assert not index.claim(block_hash(7))  # stored: nobody writes it again
    assert [e.key for e in index.lookup([block_hash(7)])] == ["a"]
    assert index.used_bytes("s") == BLOCK


def test_index_tags_keep_layouts_apart(redis_url: str) -> None:
    client = redis_client(redis_url)
    CacheIndex(client, "model-a").publish(block_hash(1), IndexEntry("s", "k", 1, 0), 10, 0.0)
    assert CacheIndex(client, "model-b").lookup([block_hash(1)]) == []


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
    assert tier.index.contains([h for h, _ in items]) == [True, False, True]
    missing = store.root / entries[0].key[:2] / entries[0].key
    missing.unlink()
    assert tier.read_chain([h for h, _ in items]) == []
    assert tier.counters.read_errors == 2
    assert tier.index.contains([items[0][0]]) == [False]


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


def tight_engine(tiny_model_dir: Path, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks)
    )


def storage_engine(
    tiny_model_dir: Path, config: StorageConfig, num_kv_blocks: int, tiers: list[StorageTier]
) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks),
        storage=lambda tag: make_tier(config, tiers, tag),
    )


def test_a_preempted_request_resumes_from_storage_with_identical_output(
    redis_url: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    reference: LLMEngine,
    tiers: list[StorageTier],
) -> None:
    batch = prompts(3, 90)
    expected = [c.token_ids for c in reference.generate(batch, GREEDY)]
    plain = tight_engine(tiny_model_dir, 20)  # 320 tokens for 3 x 138: preemption
    assert [c.token_ids for c in plain.generate(batch, GREEDY)] == expected
    engine = storage_engine(tiny_model_dir, storage_config(redis_url, tmp_path), 20, tiers)

    assert [c.token_ids for c in engine.generate(batch, GREEDY)] == expected
    stats, connector = engine.scheduler.stats, engine.storage
    assert connector is not None
    tier = connector.tier
    assert (
        stats.num_preemptions > 0 and stats.num_preemptions == plain.scheduler.stats.num_preemptions
    )
    assert tier.counters.blocks_written > 0 and tier.counters.blocks_read > 0
    assert connector.loaded_tokens > 0
    # the loaded tokens were not computed again
    assert stats.num_computed_tokens + connector.loaded_tokens <= (
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
    assert engine.storage is not None
    engine.storage.tier.flush()
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
    assert engine.storage is not None
    engine.storage.tier.flush()
    assert engine.storage.tier.counters.blocks_written == 4  # the 64-token prompt: 4 full blocks


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
        assert engine.storage is not None
        assert engine.storage.tier.counters.read_errors == 0
        engine.check_integrity()
    assert sum(e.storage.tier.counters.blocks_read for e in engines if e.storage) > 0


def test_serving_survives_redis_dying_and_uses_storage_again_when_it_returns(
    tmp_path: Path, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    server = EmbeddedRedis().start()
    own: list[StorageTier] = []  # not integrity-checked: the restarted Redis starts empty
    try:
        config = storage_config(server.url, tmp_path, device_write_policy="write_through")
        engine = storage_engine(tiny_model_dir, config, 64, own)
        tier = engine.storage.tier if engine.storage else None
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


def pd_tokens(client: PDClient, prefill: str, decode: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    for event in client.generate(prefill, decode, prompt, GREEDY):
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
    return tokens


def test_pd_instances_resume_and_serve_prefixes_from_storage(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    """Decode preempts under pressure and resumes from storage; a prefix evicted from the
    prefill device cache is served from storage (counted in the storage tier's hits)."""
    storage = storage_config(redis_url, tmp_path, shared_directory=True)
    model = str(tiny_model_dir)
    prefill, prefill_server, prefill_port = serve_prefill(
        EngineConfig(model=model, num_kv_blocks=128), PrefillConfig(), storage=storage
    )
    decode, decode_server, decode_port = serve_decode(
        EngineConfig(model=model, num_kv_blocks=20),
        DecodeConfig(reserve_horizon_tokens=0),  # accept all: running requests must preempt
        storage=storage,
    )
    client = PDClient()
    addresses = (f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}")
    try:
        batch = prompts(3, 90, seed=30)
        expected = [list(c.token_ids) for c in reference.generate(batch, GREEDY)]
        with ThreadPoolExecutor(3) as pool:
            outputs = list(pool.map(lambda p: pd_tokens(client, *addresses, p), batch))
        assert outputs == expected
        decode_stats = decode.stats()
        assert decode_stats.num_preemptions > 0
        assert decode_stats.storage.loaded_tokens > 0 and decode_stats.storage.blocks_read > 0

        assert prefill.runtime.flush_device_cache() > 0
        assert prefill.runtime.storage is not None
        prefill.runtime.storage.flush()
        follow_up = [*batch[0][:80], 33, 34, 35]
        before = prefill.stats()
        assert pd_tokens(client, *addresses, follow_up) == list(
            reference.generate([follow_up], GREEDY)[0].token_ids
        )
        after = prefill.stats()
        assert (
            after.storage.storage_hit_tokens - before.storage.storage_hit_tokens == 80
        )  # 5 whole blocks
        assert after.device_hit_tokens == before.device_hit_tokens
        for instance in (prefill, decode):  # no write in flight anywhere, then check
            assert instance.runtime.storage is not None
            instance.runtime.storage.flush()
        for instance in (prefill, decode):
            instance.check_integrity()
    finally:
        client.close()
        for server in (prefill_server, decode_server):
            server.stop(0).wait()
        prefill.stop()
        decode.stop()


def test_host_memory_blocks_are_read_by_a_peer_over_grpc(
    redis_url: str, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    storage = StorageConfig(
        redis_url=redis_url, store="memory", device_write_policy="write_through"
    )
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)
    served = [serve_mixed(engine, storage=storage) for _ in range(2)]
    (owner, _, owner_port), (peer, _, _) = served
    try:
        shared = prompts(1, 96, seed=40)[0]
        params = SamplingParams(max_tokens=4)
        list(owner.generate("first", [*shared, 1, 2], params))
        assert owner.runtime.storage is not None
        owner.runtime.storage.flush()
        assert owner.runtime.storage.store.store_id == f"mem:127.0.0.1:{owner_port}"

        second = [*shared, 3, 4]
        tokens = [t for out in peer.generate("second", second, params) for t in out.new_token_ids]
        assert tokens == list(reference.generate([second], params)[0].token_ids)
        stats = peer.stats().storage
        assert (
            stats.storage_hit_tokens == 96 and stats.blocks_read == 6
        )  # read from the owner's memory
        for instance, _, _ in served:
            instance.runtime.check_integrity()
    finally:
        for instance, server, _ in served:
            server.stop(0).wait()
            instance.stop()
