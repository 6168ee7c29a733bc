"""BlockPool, PrefixCache and KVCacheManager behaviours: allocation, publication, eviction."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from pdserve.errors import IntegrityError, OutOfBlocksError
from pdserve.kvcache import (
    BlockHash,
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    KVEvent,
    PrefixCache,
    PrefixMatch,
)

BLOCK_SIZE = 16


@dataclass
class FakeRequest:
    """Implements the `CacheRequest` protocol; hashes follow the tokens as they grow."""

    request_id: str
    token_ids: list[int]
    block_size: int = BLOCK_SIZE
    block_hashes: list[BlockHash] = field(init=False)

    def __post_init__(self) -> None:
        self._hasher = BlockHasher.for_model(self.block_size, "test")
        self.block_hashes = self._hasher.hash_tokens(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        self._hasher.extend(self.block_hashes, self.token_ids)


def tokens(num: int, start: int = 0) -> list[int]:
    return list(range(start, start + num))


ManagerFactory = Callable[..., KVCacheManager]


@pytest.fixture
def make_manager() -> Iterator[ManagerFactory]:
    """Managers built here are integrity-checked at teardown."""
    managers: list[KVCacheManager] = []

    def make(num_blocks: int = 8, **kwargs: object) -> KVCacheManager:
        manager = KVCacheManager(num_blocks, BLOCK_SIZE, **kwargs)  # type: ignore[arg-type]
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.check_integrity()


@pytest.fixture
def events() -> list[KVEvent]:
    return []


def snapshot(manager: KVCacheManager, request_ids: Sequence[str] = ()) -> object:
    """Everything observable about the manager's state, for before/after comparisons."""
    num = manager.num_blocks
    return (
        list(manager.pool.free_blocks()),
        manager.num_free_blocks,
        manager.num_cached_blocks,
        [manager.pool.ref_count(b) for b in range(num)],
        [manager.prefix_cache.hash_of(b) for b in range(num)],
        {rid: (manager.has_request(rid), list(manager.block_table(rid))) for rid in request_ids},
    )


def run_prefill(manager: KVCacheManager, request: FakeRequest) -> list[int]:
    """Match, allocate and compute the whole prompt; returns the block table."""
    prefix = manager.match_prefix(request)
    manager.allocate(request, request.num_tokens, prefix)
    manager.update_cache_blocks(request, request.num_tokens)
    return list(manager.block_table(request.request_id))


def replay(events: Sequence[KVEvent]) -> set[BlockHash]:
    cached: set[BlockHash] = set()
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        else:
            cached.difference_update(event.block_hashes)
    return cached


# -- BlockPool ---------------------------------------------------------------------------------


def test_pool_init_raises_value_error_when_num_blocks_not_positive() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_allocate_takes_from_free_queue_head_when_fresh() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free == 2
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert list(pool.free_blocks()) == [2, 3]
    pool.check_integrity()


def test_pool_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([2, 0])
    pool.free([3])
    assert list(pool.free_blocks()) == [2, 0, 3]
    assert pool.allocate(2) == [0, 2]  # the two at the head, in ascending order
    assert list(pool.free_blocks()) == [3]
    pool.check_integrity()


def test_pool_touch_removes_unreferenced_block_from_free_queue() -> None:
    pool = BlockPool(4)
    pool.touch([2])
    assert pool.ref_count(2) == 1
    assert not pool.is_free(2)
    assert list(pool.free_blocks()) == [0, 1, 3]
    assert pool.allocate(3) == [0, 1, 3]
    pool.check_integrity()


def test_pool_touch_adds_reference_when_block_already_referenced() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert block not in set(pool.free_blocks())
    pool.free([block])
    assert list(pool.free_blocks())[-1] == block
    pool.check_integrity()


def test_pool_free_raises_integrity_error_when_double_freed() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(IntegrityError):
        pool.free([block])
    pool.check_integrity()


def test_pool_free_raises_integrity_error_when_never_allocated() -> None:
    pool = BlockPool(2)
    with pytest.raises(IntegrityError):
        pool.free([1])
    assert pool.ref_count(1) == 0
    pool.check_integrity()


def test_pool_allocate_raises_out_of_blocks_and_keeps_state_when_short() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    before = (list(pool.free_blocks()), [pool.ref_count(b) for b in range(4)])
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert (list(pool.free_blocks()), [pool.ref_count(b) for b in range(4)]) == before
    assert pool.allocate(1) == [3]
    pool.check_integrity()


def test_pool_check_integrity_raises_when_ref_count_corrupted() -> None:
    pool = BlockPool(3)
    pool._ref_counts[1] = 1  # referenced, yet still in the free queue
    with pytest.raises(IntegrityError):
        pool.check_integrity()


# -- PrefixCache -------------------------------------------------------------------------------


def _hashes(num: int, start: int = 0) -> list[BlockHash]:
    return BlockHasher.for_model(1, "test").hash_tokens(tokens(num, start))


def test_prefix_lookup_stops_at_first_miss() -> None:
    cache = PrefixCache()
    h = _hashes(4)
    cache.insert(h[0], 10)
    cache.insert(h[1], 11)
    cache.insert(h[3], 13)
    assert cache.lookup(h) == [10, 11]
    assert cache.lookup(h[1:]) == [11]
    assert cache.lookup(h[2:]) == []
    assert cache.lookup([]) == []


def test_prefix_insert_returns_false_and_keeps_first_when_hash_duplicate() -> None:
    cache = PrefixCache()
    (h,) = _hashes(1)
    assert cache.insert(h, 1) is True
    assert cache.insert(h, 2) is False
    assert cache.lookup([h]) == [1]
    assert cache.hash_of(2) is None
    assert len(cache) == 1
    cache.check_integrity()


def test_prefix_insert_raises_integrity_error_when_block_published_under_other_hash() -> None:
    cache = PrefixCache()
    h0, h1 = _hashes(2)
    cache.insert(h0, 1)
    with pytest.raises(IntegrityError):
        cache.insert(h1, 1)
    assert cache.lookup([h1]) == []
    cache.check_integrity()


def test_prefix_drop_block_unpublishes_and_returns_hash() -> None:
    cache = PrefixCache()
    h0, h1 = _hashes(2)
    cache.insert(h0, 5)
    cache.insert(h1, 6)
    assert cache.drop_block(5) == h0
    assert cache.drop_block(5) is None
    assert cache.drop_block(7) is None
    assert cache.lookup([h0, h1]) == []
    assert cache.hash_of(6) == h1
    assert len(cache) == 1
    assert cache.insert(h0, 7) is True
    cache.check_integrity()


def test_prefix_check_integrity_raises_when_maps_disagree() -> None:
    cache = PrefixCache()
    h0, h1 = _hashes(2)
    cache.insert(h0, 1)
    cache._hash_of[1] = h1
    with pytest.raises(IntegrityError):
        cache.check_integrity()


# -- KVCacheManager: matching ------------------------------------------------------------------


def test_match_prefix_excludes_last_token_when_prompt_is_whole_blocks(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager()
    run_prefill(manager, FakeRequest("a", tokens(3 * BLOCK_SIZE)))
    exact_two = FakeRequest("b", tokens(2 * BLOCK_SIZE))
    assert len(exact_two.block_hashes) == 2
    match = manager.match_prefix(exact_two)
    assert len(match.block_ids) == 1
    assert match.num_tokens == BLOCK_SIZE
    one_more = FakeRequest("c", tokens(2 * BLOCK_SIZE + 1))
    assert len(manager.match_prefix(one_more).block_ids) == 2
    single = FakeRequest("d", tokens(BLOCK_SIZE))
    assert manager.match_prefix(single).block_ids == ()


def test_match_prefix_returns_table_blocks_in_chain_order_when_cached(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager()
    table = run_prefill(manager, FakeRequest("a", tokens(3 * BLOCK_SIZE + 3)))
    match = manager.match_prefix(FakeRequest("b", tokens(4 * BLOCK_SIZE)))
    assert match == PrefixMatch(tuple(table[:3]), BLOCK_SIZE)


def test_match_prefix_stops_at_first_differing_block(make_manager: ManagerFactory) -> None:
    manager = make_manager()
    table = run_prefill(manager, FakeRequest("a", tokens(3 * BLOCK_SIZE + 1)))
    diverging = tokens(3 * BLOCK_SIZE + 1)
    diverging[BLOCK_SIZE + 2] = 999
    assert manager.match_prefix(FakeRequest("b", diverging)).block_ids == (table[0],)


def test_match_prefix_returns_nothing_when_prefix_caching_disabled(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(enable_prefix_caching=False)
    request = FakeRequest("a", tokens(2 * BLOCK_SIZE + 1))
    run_prefill(manager, request)
    assert manager.num_cached_blocks == 0
    assert manager.match_prefix(FakeRequest("b", tokens(2 * BLOCK_SIZE + 1))).block_ids == ()


# -- KVCacheManager: check, then act -----------------------------------------------------------


def test_can_allocate_has_no_side_effects_when_prefix_blocks_are_free(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(num_blocks=6)
    run_prefill(manager, FakeRequest("a", tokens(2 * BLOCK_SIZE + 1)))
    manager.free("a")
    request = FakeRequest("b", tokens(3 * BLOCK_SIZE))
    prefix = manager.match_prefix(request)
    assert len(prefix.block_ids) == 2
    before = snapshot(manager, ["a", "b"])
    assert manager.can_allocate(request, request.num_tokens, prefix)
    assert manager.can_allocate(request, request.num_tokens, prefix, keep_free_blocks=3)
    assert not manager.can_allocate(request, request.num_tokens, prefix, keep_free_blocks=4)
    assert manager.num_blocks_to_allocate(request, request.num_tokens, prefix) == 3
    assert snapshot(manager, ["a", "b"]) == before
    assert manager.match_prefix(request) == prefix


def test_can_allocate_false_when_prefix_revival_needs_free_blocks(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(num_blocks=4)
    run_prefill(manager, FakeRequest("a", tokens(2 * BLOCK_SIZE + 1)))
    manager.free("a")
    filler = FakeRequest("f", tokens(BLOCK_SIZE, start=500))
    manager.allocate(filler, filler.num_tokens)
    request = FakeRequest("b", tokens(4 * BLOCK_SIZE))
    prefix = manager.match_prefix(request)
    assert len(prefix.block_ids) == 2
    # 2 revived prefix blocks + 2 new blocks, but only 3 blocks are free
    assert manager.num_free_blocks == 3
    assert not manager.can_allocate(request, request.num_tokens, prefix)
    assert manager.can_allocate(request, 3 * BLOCK_SIZE, prefix)


def test_allocate_raises_out_of_blocks_and_changes_nothing_when_short(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=4, event_sink=events.append)
    run_prefill(manager, FakeRequest("a", tokens(2 * BLOCK_SIZE + 1)))
    manager.free("a")
    request = FakeRequest("b", tokens(5 * BLOCK_SIZE))
    prefix = manager.match_prefix(request)
    assert len(prefix.block_ids) == 2
    before = snapshot(manager, ["a", "b"])
    events_before = list(events)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(request, request.num_tokens, prefix)
    assert snapshot(manager, ["a", "b"]) == before
    assert events == events_before
    assert not manager.has_request("b")


def test_allocate_raises_out_of_blocks_and_keeps_table_when_growing(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(num_blocks=3)
    request = FakeRequest("a", tokens(2 * BLOCK_SIZE))
    manager.allocate(request, request.num_tokens)
    request.append(tokens(2 * BLOCK_SIZE, start=100))
    before = snapshot(manager, ["a"])
    assert not manager.can_allocate(request, request.num_tokens)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(request, request.num_tokens)
    assert snapshot(manager, ["a"]) == before
    assert len(manager.allocate(request, 3 * BLOCK_SIZE)) == 1


def test_allocate_returns_only_new_blocks_when_table_exists(make_manager: ManagerFactory) -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(BLOCK_SIZE - 1))
    first = manager.allocate(request, request.num_tokens)
    assert len(first) == 1
    request.append([1])
    assert manager.allocate(request, request.num_tokens) == []
    request.append([2])
    second = manager.allocate(request, request.num_tokens)
    assert len(second) == 1
    assert list(manager.block_table("a")) == first + second


def test_allocate_raises_integrity_error_when_matched_prefix_was_evicted(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager()
    run_prefill(manager, FakeRequest("a", tokens(2 * BLOCK_SIZE + 1)))
    manager.free("a")
    request = FakeRequest("b", tokens(2 * BLOCK_SIZE + 1))
    prefix = manager.match_prefix(request)
    manager.evict_cached_blocks()
    with pytest.raises(IntegrityError):
        manager.allocate(request, request.num_tokens, prefix)
    assert not manager.has_request("b")


# -- KVCacheManager: publication ---------------------------------------------------------------


def test_update_cache_blocks_publishes_only_full_block_when_20_tokens_computed(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(event_sink=events.append)
    request = FakeRequest("a", tokens(2 * BLOCK_SIZE + 5))
    manager.allocate(request, request.num_tokens)
    assert manager.update_cache_blocks(request, 20) == 1
    assert manager.num_cached_blocks == 1
    assert events == [BlockStored((request.block_hashes[0],))]
    assert manager.update_cache_blocks(request, 20) == 0
    assert manager.num_cached_blocks == 1


def test_update_cache_blocks_never_publishes_partial_block_when_prompt_computed(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager()
    request = FakeRequest("a", tokens(2 * BLOCK_SIZE + 5))
    table = manager.allocate(request, request.num_tokens)
    assert len(table) == 3
    assert manager.update_cache_blocks(request, request.num_tokens) == 2
    assert manager.prefix_cache.hash_of(table[2]) is None
    assert manager.num_cached_blocks == 2


def test_update_cache_blocks_publishes_nothing_when_less_than_a_block_computed(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(event_sink=events.append)
    request = FakeRequest("a", tokens(2 * BLOCK_SIZE))
    manager.allocate(request, request.num_tokens)
    assert manager.update_cache_blocks(request, BLOCK_SIZE - 1) == 0
    assert manager.num_cached_blocks == 0
    assert events == []


def test_match_prefix_misses_when_prefill_not_completed(make_manager: ManagerFactory) -> None:
    manager = make_manager(num_blocks=10)
    prompt = tokens(4 * BLOCK_SIZE + 1)
    first = FakeRequest("a", list(prompt))
    second = FakeRequest("b", list(prompt))
    manager.allocate(first, first.num_tokens, manager.match_prefix(first))
    assert manager.match_prefix(second).block_ids == ()
    manager.update_cache_blocks(first, 2 * BLOCK_SIZE)
    table = list(manager.block_table("a"))
    assert manager.match_prefix(second).block_ids == tuple(table[:2])
    manager.update_cache_blocks(first, first.num_tokens)
    assert manager.match_prefix(second).block_ids == tuple(table[:4])
    manager.check_integrity()


def test_a_duplicate_computed_while_its_twin_was_evicted_is_published_before_its_children(
    make_manager: ManagerFactory,
) -> None:
    """Two requests compute the same blocks; the second's copies lose to the first's. The first
    is freed and its blocks evicted; when the second publishes its next block, its own copies
    of the earlier ones are published first, so the whole chain stays reachable (found by the
    stateful test: a published block under an unpublished parent)."""
    manager = make_manager(num_blocks=8)
    prompt = tokens(3 * BLOCK_SIZE)
    first, second = FakeRequest("a", list(prompt)), FakeRequest("b", list(prompt))
    manager.allocate(first, first.num_tokens)
    manager.allocate(second, second.num_tokens)
    assert manager.update_cache_blocks(first, 2 * BLOCK_SIZE) == 2
    assert manager.update_cache_blocks(second, 2 * BLOCK_SIZE) == 0  # both duplicates
    manager.free("a")
    assert manager.evict_cached_blocks() == 2
    assert manager.update_cache_blocks(second, 3 * BLOCK_SIZE) == 3  # two republished
    probe = FakeRequest("probe", [*prompt, 7])
    assert manager.match_prefix(probe).block_ids == tuple(manager.block_table("b"))
    manager.check_integrity()


def test_update_cache_blocks_emits_block_stored_in_chain_order(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(event_sink=events.append)
    request = FakeRequest("a", tokens(4 * BLOCK_SIZE + 1))
    manager.allocate(request, request.num_tokens)
    manager.update_cache_blocks(request, BLOCK_SIZE)
    manager.update_cache_blocks(request, request.num_tokens)
    hashes = request.block_hashes
    assert events == [BlockStored((hashes[0],)), BlockStored(tuple(hashes[1:4]))]
    assert replay(events) == set(hashes[:4])


def test_update_cache_blocks_keeps_first_block_when_duplicate_computed_concurrently(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(event_sink=events.append)
    prompt = tokens(2 * BLOCK_SIZE + 1)
    first, second = FakeRequest("a", list(prompt)), FakeRequest("b", list(prompt))
    manager.allocate(first, first.num_tokens)
    manager.allocate(second, second.num_tokens)
    table_a, table_b = list(manager.block_table("a")), list(manager.block_table("b"))
    assert set(table_a).isdisjoint(table_b)
    assert manager.update_cache_blocks(first, first.num_tokens) == 2
    assert manager.update_cache_blocks(second, second.num_tokens) == 0
    assert all(manager.prefix_cache.hash_of(b) is None for b in table_b)
    assert len(events) == 1
    third = FakeRequest("c", list(prompt))
    assert manager.match_prefix(third).block_ids == tuple(table_a[:2])
    manager.check_integrity()
    manager.free("a")
    assert manager.match_prefix(third).block_ids == tuple(table_a[:2])
    manager.check_integrity()


# -- KVCacheManager: sharing and freeing -------------------------------------------------------


def test_allocate_adds_references_to_shared_prefix_and_free_releases_them(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(num_blocks=10)
    prompt = tokens(2 * BLOCK_SIZE + 3)
    table_a = run_prefill(manager, FakeRequest("a", list(prompt)))
    second = FakeRequest("b", [*prompt, 7])
    new_blocks = manager.allocate(second, second.num_tokens, manager.match_prefix(second))
    table_b = list(manager.block_table("b"))
    assert table_b[:2] == table_a[:2]
    assert new_blocks == table_b[2:]
    assert new_blocks[0] != table_a[2]
    assert [manager.pool.ref_count(b) for b in table_a[:2]] == [2, 2]
    manager.check_integrity()
    manager.free("a")
    assert [manager.pool.ref_count(b) for b in table_a[:2]] == [1, 1]
    assert manager.pool.is_free(table_a[2])
    manager.free("b")
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_cached_blocks == 2
    manager.check_integrity()


def test_allocate_revives_free_cached_prefix_when_matched(make_manager: ManagerFactory) -> None:
    manager = make_manager(num_blocks=6)
    table_a = run_prefill(manager, FakeRequest("a", tokens(2 * BLOCK_SIZE + 1)))
    manager.free("a")
    free_before = manager.num_free_blocks
    request = FakeRequest("b", tokens(2 * BLOCK_SIZE + 1))
    prefix = manager.match_prefix(request)
    manager.allocate(request, request.num_tokens, prefix)
    assert list(manager.block_table("b"))[:2] == table_a[:2]
    assert manager.num_free_blocks == free_before - 3
    assert all(b not in set(manager.pool.free_blocks()) for b in table_a[:2])


def test_free_is_idempotent_when_called_twice(make_manager: ManagerFactory) -> None:
    manager = make_manager()
    run_prefill(manager, FakeRequest("a", tokens(BLOCK_SIZE + 1)))
    manager.free("a")
    manager.free("a")
    manager.free("never-added")
    assert manager.num_free_blocks == manager.num_blocks
    assert not manager.has_request("a")


# -- KVCacheManager: lazy LRU eviction and events ----------------------------------------------


def test_evict_cached_blocks_removes_least_recently_freed_first(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=8, event_sink=events.append)
    old = FakeRequest("old", tokens(BLOCK_SIZE + 1, start=0))
    new = FakeRequest("new", tokens(BLOCK_SIZE + 1, start=1000))
    table_old = run_prefill(manager, old)
    table_new = run_prefill(manager, new)
    manager.free("old")
    manager.free("new")
    events.clear()
    assert manager.evict_cached_blocks(1) == 1
    assert events == [BlockRemoved((old.block_hashes[0],))]
    assert manager.prefix_cache.hash_of(table_old[0]) is None
    assert manager.prefix_cache.hash_of(table_new[0]) == new.block_hashes[0]


def test_evict_cached_blocks_removes_tail_before_head_when_request_freed(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=8, event_sink=events.append)
    request = FakeRequest("a", tokens(3 * BLOCK_SIZE + 1))
    run_prefill(manager, request)
    manager.free("a")
    events.clear()
    assert manager.evict_cached_blocks(1) == 1
    assert manager.evict_cached_blocks(1) == 1
    hashes = request.block_hashes
    assert events == [BlockRemoved((hashes[2],)), BlockRemoved((hashes[1],))]
    probe = FakeRequest("b", tokens(3 * BLOCK_SIZE + 1))
    assert len(manager.match_prefix(probe).block_ids) == 1


def test_evict_cached_blocks_keeps_blocks_of_live_requests(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=8, event_sink=events.append)
    live = FakeRequest("live", tokens(2 * BLOCK_SIZE + 1))
    run_prefill(manager, live)
    dead = FakeRequest("dead", tokens(BLOCK_SIZE + 1, start=1000))
    run_prefill(manager, dead)
    manager.free("dead")
    assert manager.evict_cached_blocks() == 1
    assert manager.evict_cached_blocks() == 0
    assert manager.num_cached_blocks == 2
    assert replay(events) == set(live.block_hashes[:2])
    assert len(manager.match_prefix(FakeRequest("p", tokens(2 * BLOCK_SIZE + 1))).block_ids) == 2


def test_allocate_reuses_least_recently_freed_cached_block_and_emits_removed(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=4, event_sink=events.append)
    old = FakeRequest("old", tokens(BLOCK_SIZE + 1, start=0))
    new = FakeRequest("new", tokens(BLOCK_SIZE + 1, start=1000))
    table_old = run_prefill(manager, old)
    table_new = run_prefill(manager, new)
    manager.free("old")
    manager.free("new")
    # free: the two uncached tails, then the cached heads, old's released first
    events.clear()
    third = FakeRequest("c", tokens(3 * BLOCK_SIZE, start=2000))
    allocated = manager.allocate(third, third.num_tokens)
    assert allocated == sorted([table_old[1], table_new[1], table_old[0]])
    assert events == [BlockRemoved((old.block_hashes[0],))]
    assert manager.match_prefix(FakeRequest("p", tokens(BLOCK_SIZE + 1))).block_ids == ()
    assert manager.prefix_cache.hash_of(table_new[0]) == new.block_hashes[0]
    assert replay([BlockStored((old.block_hashes[0], new.block_hashes[0])), *events]) == {
        new.block_hashes[0]
    }


def test_allocate_uses_never_cached_blocks_before_cached_ones(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(num_blocks=6)
    request = FakeRequest("a", tokens(BLOCK_SIZE + 1))
    table = run_prefill(manager, request)
    manager.free("a")
    other = FakeRequest("b", tokens(4 * BLOCK_SIZE, start=1000))
    manager.allocate(other, other.num_tokens)
    assert table[0] not in manager.block_table("b")
    assert manager.match_prefix(FakeRequest("p", tokens(BLOCK_SIZE + 1))).block_ids == (table[0],)


def test_events_replay_equals_prefix_cache_after_mixed_operations(
    make_manager: ManagerFactory, events: list[KVEvent]
) -> None:
    manager = make_manager(num_blocks=5, event_sink=events.append)
    published: dict[BlockHash, int] = {}
    for index in range(4):
        request = FakeRequest(f"r{index}", tokens(2 * BLOCK_SIZE + 1, start=100 * index))
        table = run_prefill(manager, request)
        published.update(zip(request.block_hashes, table, strict=False))
        manager.free(request.request_id)
        assert replay(events) == {
            h for h, b in published.items() if manager.prefix_cache.hash_of(b) == h
        }
    manager.evict_cached_blocks(1)
    cached = {manager.prefix_cache.hash_of(b) for b in range(manager.num_blocks)} - {None}
    assert replay(events) == cached
    assert len(cached) == manager.num_cached_blocks


# -- KVCacheManager: integrity -----------------------------------------------------------------


def test_check_integrity_raises_when_pool_touched_directly() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)
    request = FakeRequest("a", tokens(BLOCK_SIZE + 1))
    run_prefill(manager, request)
    manager.check_integrity()
    manager.pool.touch([manager.block_table("a")[0]])
    with pytest.raises(IntegrityError):
        manager.check_integrity()


def test_check_integrity_raises_when_pool_freed_directly() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)
    request = FakeRequest("a", tokens(BLOCK_SIZE + 1))
    manager.allocate(request, request.num_tokens)
    manager.pool.free([manager.block_table("a")[1]])
    with pytest.raises(IntegrityError):
        manager.check_integrity()


def test_allocate_raises_integrity_error_when_prefix_block_unpublished(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager()
    first = FakeRequest("a", tokens(BLOCK_SIZE + 1))
    block = manager.allocate(first, first.num_tokens)[0]
    second = FakeRequest("b", tokens(BLOCK_SIZE + 1))
    before = snapshot(manager, ["a", "b"])
    # a hand-made match on a block whose prefill has not completed must be refused
    with pytest.raises(IntegrityError):
        manager.allocate(second, second.num_tokens, PrefixMatch((block,), BLOCK_SIZE))
    assert snapshot(manager, ["a", "b"]) == before
