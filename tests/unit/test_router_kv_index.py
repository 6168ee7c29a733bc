"""KVEventIndex: exact prefix overlap per instance, maintained from KV events."""

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvcache import BlockHash, BlockHasher, BlockRemoved, BlockStored, KVCacheManager
from services.router.kv_index import KVEventIndex

BLOCK_SIZE = 16
A, B, C = "10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"
HASHER = BlockHasher.for_model(BLOCK_SIZE, "test-model")


def chain(num_blocks: int, seed: int = 0) -> list[BlockHash]:
    """Real hashes of `num_blocks` full blocks of tokens derived from `seed`."""
    tokens = [(seed * 7919 + i * 31) % 32_000 for i in range(num_blocks * BLOCK_SIZE)]
    return HASHER.hash_tokens(tokens)


@pytest.fixture
def index() -> Iterator[KVEventIndex]:
    index = KVEventIndex()
    yield index
    index.check_integrity()


def test_overlaps_count_leading_blocks_when_instances_hold_prefixes(index: KVEventIndex) -> None:
    hashes = chain(8)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(B, BlockStored(tuple(hashes[:3])))
    assert index.overlaps(hashes, [A, B]) == {A: 8, B: 3}
    assert index.overlaps(hashes[:5], [A, B]) == {A: 5, B: 3}


def test_overlaps_stop_at_first_missing_block_when_later_blocks_are_held(
    index: KVEventIndex,
) -> None:
    hashes = chain(6)
    index.apply(A, BlockStored((hashes[0], hashes[1], hashes[3], hashes[4], hashes[5])))
    index.apply(B, BlockStored(tuple(hashes[1:])))
    assert index.overlaps(hashes, [A, B]) == {A: 2, B: 0}


def test_overlaps_are_zero_when_instance_unknown_or_prompt_unrelated(index: KVEventIndex) -> None:
    index.apply(A, BlockStored(tuple(chain(4, seed=1))))
    assert index.overlaps(chain(4, seed=2), [A, C]) == {A: 0, C: 0}
    assert index.overlaps([], [A]) == {A: 0}
    assert index.overlaps(chain(4, seed=1), []) == {}


def test_overlaps_answer_only_requested_instances_when_others_hold_more(
    index: KVEventIndex,
) -> None:
    hashes = chain(4)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(B, BlockStored(tuple(hashes[:1])))
    assert index.overlaps(hashes, [B]) == {B: 1}


def test_overlaps_shrink_when_blocks_are_removed(index: KVEventIndex) -> None:
    hashes = chain(6)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(B, BlockStored(tuple(hashes)))
    index.apply(A, BlockRemoved((hashes[2],)))
    assert index.overlaps(hashes, [A, B]) == {A: 2, B: 6}
    index.apply(B, BlockRemoved(tuple(hashes)))
    assert index.overlaps(hashes, [A, B]) == {A: 2, B: 0}
    assert index.num_blocks(B) == 0
    assert len(index) == 5  # A's blocks 0, 1, 3, 4, 5


def test_apply_ignores_repeated_store_and_unknown_removal(index: KVEventIndex) -> None:
    hashes = chain(3)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(A, BlockStored(tuple(hashes[:2])))
    index.apply(A, BlockRemoved(tuple(chain(2, seed=9))))
    assert index.num_blocks(A) == 3
    index.apply(A, BlockRemoved((hashes[1],)))
    assert index.overlaps(hashes, [A]) == {A: 1}


def test_drop_instance_forgets_blocks_and_reuses_slot_when_instance_dies(
    index: KVEventIndex,
) -> None:
    hashes = chain(4)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(B, BlockStored(tuple(hashes)))
    index.drop_instance(A)
    assert index.instances() == (B,)
    assert index.overlaps(hashes, [A, B]) == {A: 0, B: 4}
    index.apply(C, BlockStored(tuple(hashes[:2])))  # takes A's slot: must not inherit its blocks
    assert index.overlaps(hashes, [A, B, C]) == {A: 0, B: 4, C: 2}
    index.drop_instance("never-seen:1")
    assert index.instances() == (B, C)


def test_an_empty_snapshot_clears_blocks_but_keeps_the_instance(
    index: KVEventIndex,
) -> None:
    hashes = chain(4)
    index.apply(A, BlockStored(tuple(hashes)))
    index.apply(B, BlockStored(tuple(hashes)))
    index.replace_instance(A, ())
    assert index.instances() == (A, B)
    assert index.overlaps(hashes, [A, B]) == {A: 0, B: 4}
    index.apply(A, BlockStored(tuple(hashes[:1])))
    assert index.overlaps(hashes, [A, B]) == {A: 1, B: 4}


def test_follow_up_turn_overlaps_instance_holding_previous_turn(index: KVEventIndex) -> None:
    system = [1000 + i for i in range(40)]
    turn1 = [*system, *(2000 + i for i in range(30))]  # 70 tokens: 4 full blocks
    answer = [3000 + i for i in range(25)]
    turn2 = [*turn1, *answer, *(4000 + i for i in range(50))]
    other = [*system, *(5000 + i for i in range(60))]
    index.apply(A, BlockStored(tuple(HASHER.hash_tokens(turn1))))
    index.apply(B, BlockStored(tuple(HASHER.hash_tokens(other))))

    overlaps = index.overlaps(HASHER.hash_tokens(turn2), [A, B])
    assert overlaps == {A: len(turn1) // BLOCK_SIZE, B: len(system) // BLOCK_SIZE}
    assert overlaps[A] == 4 and overlaps[B] == 2


def test_overlaps_are_zero_when_model_differs(index: KVEventIndex) -> None:
    tokens = list(range(64))
    index.apply(
        A, BlockStored(tuple(BlockHasher.for_model(BLOCK_SIZE, "other").hash_tokens(tokens)))
    )
    assert index.overlaps(HASHER.hash_tokens(tokens), [A]) == {A: 0}


@dataclass
class CacheRequestStub:
    request_id: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        return HASHER.hash_tokens(self.token_ids)


def test_index_mirrors_cache_manager_when_fed_its_events(index: KVEventIndex) -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, event_sink=lambda event: index.apply(A, event))
    request = CacheRequestStub("r1", list(range(5 * BLOCK_SIZE + 3)))
    manager.allocate(request, request.num_tokens)
    manager.update_cache_blocks(request, 3 * BLOCK_SIZE)
    assert index.overlaps(request.block_hashes, [A]) == {A: 3}
    manager.update_cache_blocks(request, request.num_tokens)
    assert index.overlaps(request.block_hashes, [A]) == {A: 5}
    manager.free(request.request_id)
    manager.evict_cached_blocks()
    assert index.overlaps(request.block_hashes, [A]) == {A: 0}
    assert index.num_blocks(A) == 0
    manager.check_integrity()


def test_overlaps_see_whole_events_when_applied_concurrently(index: KVEventIndex) -> None:
    hashes = chain(64)
    stop = threading.Event()
    seen: set[int] = set()

    def churn() -> None:
        while not stop.is_set():
            index.apply(A, BlockStored(tuple(hashes)))
            index.apply(A, BlockRemoved(tuple(reversed(hashes))))

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(2_000):
            seen.add(index.overlaps(hashes, [A])[A])
    finally:
        stop.set()
        writer.join()
    assert seen <= {0, 64}


# -- property test against a naive reference -------------------------------------------------------

INSTANCES = (A, B, C)
POOL = chain(12, seed=3)  # one chain: stores of its sub-ranges make partial prefixes likely

events = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "reset", "drop"]),
        st.sampled_from(INSTANCES),
        st.lists(st.integers(0, len(POOL) - 1), max_size=6),
    ),
    max_size=40,
)


def reference_overlap(held: set[BlockHash], hashes: Sequence[BlockHash]) -> int:
    count = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        count += 1
    return count


@settings(max_examples=150, deadline=None)
@given(events=events, query_len=st.integers(0, len(POOL)))
def test_overlaps_match_reference_model_under_random_events(
    events: list[tuple[str, str, list[int]]], query_len: int
) -> None:
    index = KVEventIndex()
    model: dict[str, set[BlockHash]] = {i: set() for i in INSTANCES}
    for kind, instance_id, positions in events:
        hashes = tuple(POOL[p] for p in positions)
        if kind == "store":
            index.apply(instance_id, BlockStored(hashes))
            model[instance_id] |= set(hashes)
        elif kind == "remove":
            index.apply(instance_id, BlockRemoved(hashes))
            model[instance_id] -= set(hashes)
        elif kind == "reset":
            index.replace_instance(instance_id, ())
            model[instance_id] = set()
        else:
            index.drop_instance(instance_id)
            model[instance_id] = set()
        index.check_integrity()
    query = POOL[:query_len]
    expected = {i: reference_overlap(model[i], query) for i in INSTANCES}
    assert index.overlaps(query, INSTANCES) == expected
    assert len(index) == len(set().union(*model.values()))
