"""Stateful property test: KVCacheManager under random add / compute / decode / free / evict.

The model keeps the KV "written" into every block (block id -> token per slot) so that a prefix hit
can be checked against the tokens it claims to cover, and so that any write into a published block
(a block another request may be reading) is caught at the moment it happens.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pdserve.errors import OutOfBlocksError
from pdserve.kvcache import (
    BlockHash,
    BlockHasher,
    BlockStored,
    KVCacheManager,
    KVEvent,
    PrefixMatch,
)
from pdserve.kvcache.eviction import EVICTION_POLICIES, make_eviction_policy
from pdserve.kvcache.manager import NO_MATCH

BLOCK_SIZE = 4
MIN_BLOCKS = 6
MAX_BLOCKS = 16
ALPHABET = st.integers(min_value=0, max_value=2)
# Prompts start with a cut of one of these, so requests share prefixes and hit each other's blocks.
BASES: tuple[tuple[int, ...], ...] = (
    (0,) * 16,
    (1, 2, 1, 2, 0, 0, 1, 1, 2, 2, 0, 1, 2, 0, 1, 2),
    (2, 1, 0, 2, 1, 0, 2, 1, 0, 2, 1, 0, 2, 1, 0, 2),
)


@dataclass
class FakeRequest:
    """Implements the `CacheRequest` protocol; hashes follow the tokens as they grow."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[BlockHash] = field(init=False)

    def __post_init__(self) -> None:
        self._hasher = BlockHasher.for_model(BLOCK_SIZE, "test")
        self.block_hashes = self._hasher.hash_tokens(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        self._hasher.extend(self.block_hashes, self.token_ids)

    def block_tokens(self, index: int) -> tuple[int, ...]:
        return tuple(self.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])


@dataclass
class LiveRequest:
    request: FakeRequest
    num_computed_tokens: int


prompts = st.builds(
    lambda base, cut, suffix: [*BASES[base][:cut], *suffix],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 16),
    st.lists(ALPHABET, max_size=5),
).filter(bool)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[KVEvent] = []
        self.num_blocks = MAX_BLOCKS
        self.manager = KVCacheManager(self.num_blocks, BLOCK_SIZE, event_sink=self.events.append)
        self.live: dict[str, LiveRequest] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.tokens_of_hash: dict[BlockHash, tuple[int, ...]] = {}
        self.next_id = 0
        self.past: list[tuple[int, ...]] = []
        self.parent_of: dict[BlockHash, BlockHash | None] = {}
        self.now = 0.0
        # reference model of the free blocks: uncached ones in reuse order, and cached ones
        self.plain_order: list[int] = list(range(self.num_blocks))

    @initialize(
        num_blocks=st.integers(MIN_BLOCKS, MAX_BLOCKS),
        policy=st.sampled_from(EVICTION_POLICIES),
        half_life=st.sampled_from([0.5, 300.0]),
    )
    def make_manager(self, num_blocks: int, policy: str, half_life: float) -> None:
        """Small pools make allocation refusals and evictions by reuse common."""
        self.num_blocks = num_blocks
        eviction = make_eviction_policy(
            policy, num_blocks, half_life_s=half_life, score_capacity=2, clock=lambda: self.now
        )
        self.manager = KVCacheManager(
            num_blocks, BLOCK_SIZE, event_sink=self.events.append, eviction=eviction
        )
        self.plain_order = list(range(num_blocks))
        event(f"policy {policy}")

    # -- helpers ---------------------------------------------------------------------------------

    def _snapshot(self) -> object:
        manager = self.manager
        return (
            list(manager.pool.free_blocks()),
            [manager.pool.ref_count(b) for b in range(self.num_blocks)],
            [manager.prefix_cache.hash_of(b) for b in range(self.num_blocks)],
            {rid: list(manager.block_table(rid)) for rid in self.live},
            len(self.events),
        )

    def _allocate_checked(self, request: FakeRequest, prefix: PrefixMatch = NO_MATCH) -> bool:
        """Allocate all of `request`'s tokens iff `can_allocate` says so; returns success."""
        before = self._snapshot()
        predicted = self.manager.can_allocate(request, request.num_tokens, prefix)
        assert self._snapshot() == before, "can_allocate changed state"
        if not predicted:
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(request, request.num_tokens, prefix)
            assert self._snapshot() == before, "failed allocate changed state"
            event("allocation refused")
            return False
        referenced = self._referenced()
        new_blocks = self.manager.allocate(request, request.num_tokens, prefix)
        revived = [b for b in prefix.block_ids if b not in referenced]
        if revived:
            event("free cached prefix blocks revived")
        self.now += 1.0
        self.plain_order = [b for b in self.plain_order if b not in revived]
        uncached = self.plain_order[: len(new_blocks)]
        assert set(uncached) <= set(new_blocks), "a cached block went before an uncached one"
        assert new_blocks == sorted(new_blocks)
        del self.plain_order[: len(new_blocks)]
        for block_id in new_blocks:
            self.kv[block_id] = [None] * BLOCK_SIZE
        return True

    def _referenced(self) -> set[int]:
        return {b for rid in self.live for b in self.manager.block_table(rid)}

    def _free(self, request_id: str) -> None:
        """Free a request; its unshared blocks join the model free queue, tail blocks first."""
        table = list(self.manager.block_table(request_id))
        self.manager.free(request_id)
        del self.live[request_id]
        assert not self.manager.has_request(request_id)
        still_referenced = self._referenced()
        cache = self.manager.prefix_cache
        self.plain_order += [
            b for b in reversed(table) if b not in still_referenced and cache.hash_of(b) is None
        ]

    def _remember_hashes(self, request: FakeRequest) -> None:
        for index, block_hash in enumerate(request.block_hashes):
            self.tokens_of_hash[block_hash] = request.block_tokens(index)
            self.parent_of[block_hash] = request.block_hashes[index - 1] if index else None

    def _check_match(self, request: FakeRequest) -> PrefixMatch:
        """Match `request` and check every hit block holds exactly the tokens it stands for."""
        match = self.manager.match_prefix(request)
        assert match.num_tokens < request.num_tokens, "hit covers the last token"
        for index, block_id in enumerate(match.block_ids):
            assert tuple(self.kv[block_id]) == request.block_tokens(index)
            assert self.manager.prefix_cache.hash_of(block_id) == request.block_hashes[index]
        return match

    def _compute(self, live: LiveRequest, end: int) -> None:
        """Write the KV of tokens up to `end` (never into a published block), then publish."""
        request = live.request
        table = self.manager.block_table(request.request_id)
        start = live.num_computed_tokens
        end = min(request.num_tokens, end)
        for position in range(start, end):
            block_id = table[position // BLOCK_SIZE]
            assert self.manager.prefix_cache.hash_of(block_id) is None, (
                f"writing into published block {block_id}"
            )
            self.kv[block_id][position % BLOCK_SIZE] = request.token_ids[position]
        live.num_computed_tokens = end
        newly_full = end // BLOCK_SIZE - start // BLOCK_SIZE
        published = self.manager.update_cache_blocks(request, end)
        # beyond the newly full blocks: its own copies of earlier blocks whose published copy
        # (another request's) was evicted meanwhile, republished so the new ones are reachable
        assert 0 <= published <= end // BLOCK_SIZE
        if published < newly_full:
            event("block already published by another request")
        if published > newly_full:
            event("earlier blocks republished")

    def _admit(self, token_ids: list[int], prefill: bool) -> None:
        """Match, then allocate the prompt iff `can_allocate`; with `prefill` compute it at once."""
        request = FakeRequest(f"r{self.next_id}", token_ids)
        self.next_id += 1
        self.past.append(tuple(token_ids))
        self._remember_hashes(request)
        prefix = self._check_match(request)
        event(f"prefix hit of {len(prefix.block_ids)} blocks")
        if not self._allocate_checked(request, prefix):
            assert not self.manager.has_request(request.request_id)
            return
        live = LiveRequest(request, prefix.num_tokens)
        self.live[request.request_id] = live
        if prefill:
            self._compute(live, request.num_tokens)

    # -- rules -----------------------------------------------------------------------------------

    @rule(data=st.data(), prefill=st.booleans())
    def add_request(self, data: st.DataObject, prefill: bool) -> None:
        """Admit a request (match, then allocate its prompt); with `prefill` compute it at once.

        Half the prompts extend the tokens of an earlier request, so freed cached blocks get hit.
        """
        reuse = bool(self.past) and data.draw(st.booleans(), label="reuse past tokens")
        if reuse:
            past = data.draw(st.sampled_from(self.past), label="past tokens")
            token_ids = [*past, *data.draw(st.lists(ALPHABET, max_size=3), label="suffix")]
        else:
            token_ids = data.draw(prompts, label="prompt")
        self._admit(token_ids, prefill)

    @precondition(
        lambda self: any(r.num_computed_tokens < r.request.num_tokens for r in self.live.values())
    )
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def compute_chunk(self, data: st.DataObject, chunk: int) -> None:
        pending = sorted(
            rid for rid, r in self.live.items() if r.num_computed_tokens < r.request.num_tokens
        )
        live = self.live[data.draw(st.sampled_from(pending))]
        self._compute(live, live.num_computed_tokens + chunk)

    @precondition(
        lambda self: any(r.num_computed_tokens == r.request.num_tokens for r in self.live.values())
    )
    @rule(data=st.data(), token=ALPHABET)
    def decode_append(self, data: st.DataObject, token: int) -> None:
        done = sorted(
            rid for rid, r in self.live.items() if r.num_computed_tokens == r.request.num_tokens
        )
        request = self.live[data.draw(st.sampled_from(done))].request
        request.append([token])
        self._remember_hashes(request)
        if not self._allocate_checked(request):
            # preempted: the scheduler frees a request it cannot grow
            self._free(request.request_id)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        self._free(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), prefill=st.booleans())
    def preempt_and_readmit(self, data: st.DataObject, prefill: bool) -> None:
        """Free a request and admit its tokens again, hitting (and reviving) its freed blocks."""
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        token_ids = list(self.live[request_id].request.token_ids)
        self._free(request_id)
        self._admit(token_ids, prefill)

    @rule(max_blocks=st.none() | st.integers(0, 4))
    def evict(self, max_blocks: int | None) -> None:
        """Unpublish the policy's victims among the free cached blocks; live requests' blocks
        stay."""
        cache = self.manager.prefix_cache
        referenced = self._referenced()
        cached = [b for b in range(self.num_blocks) if b not in referenced and cache.hash_of(b)]
        expected = len(cached) if max_blocks is None else min(max_blocks, len(cached))
        published_before = [cache.hash_of(b) for b in range(self.num_blocks)]
        assert self.manager.evict_cached_blocks(max_blocks) == expected
        event(f"evicted {min(expected, 1)}+ blocks")
        victims = [b for b in cached if cache.hash_of(b) is None]
        assert len(victims) == expected
        self.plain_order += [b for b in self.manager.pool.free_blocks() if b in victims]
        for block_id in range(self.num_blocks):
            if block_id not in victims:
                assert cache.hash_of(block_id) == published_before[block_id]

    @rule(token_ids=prompts)
    def check_hit(self, token_ids: list[int]) -> None:
        before = self._snapshot()
        self._check_match(FakeRequest("probe", token_ids))
        assert self._snapshot() == before

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def integrity_holds(self) -> None:
        self.manager.check_integrity()

    @invariant()
    def writable_blocks_have_one_owner(self) -> None:
        owners: Counter[int] = Counter()
        for request_id in self.live:
            table = self.manager.block_table(request_id)
            assert len(set(table)) == len(table)
            owners.update(table)
        for block_id, count in owners.items():
            if count > 1:
                assert self.manager.prefix_cache.hash_of(block_id) is not None, (
                    f"unpublished block {block_id} has {count} owners"
                )

    @invariant()
    def free_plus_referenced_is_pool_size(self) -> None:
        assert self.manager.num_free_blocks + len(self._referenced()) == self.num_blocks

    @invariant()
    def uncached_free_blocks_are_reused_in_release_order(self) -> None:
        cache = self.manager.prefix_cache
        free = list(self.manager.pool.free_blocks())
        assert [b for b in free if cache.hash_of(b) is None] == self.plain_order

    @invariant()
    def no_cached_block_is_unreachable(self) -> None:
        """Every published block's parent is published (lookups walk from the root), unless
        the policy had to take a block with a published child (counted)."""
        if self.manager.eviction.forced_evictions:
            event("forced eviction")
            return
        published = set(self.manager.prefix_cache.hashes())
        for block_hash in published:
            parent = self.parent_of[block_hash]
            assert parent is None or parent in published

    @invariant()
    def replayed_events_equal_prefix_cache(self) -> None:
        replayed: set[BlockHash] = set()
        for kv_event in self.events:
            if isinstance(kv_event, BlockStored):
                assert replayed.isdisjoint(kv_event.block_hashes), "hash stored twice"
                replayed.update(kv_event.block_hashes)
            else:
                assert set(kv_event.block_hashes) <= replayed, "removed a hash never stored"
                replayed.difference_update(kv_event.block_hashes)
        cached = {self.manager.prefix_cache.hash_of(b) for b in range(self.num_blocks)} - {None}
        assert replayed == cached
        assert len(cached) == self.manager.num_cached_blocks

    @invariant()
    def published_blocks_hold_their_tokens(self) -> None:
        for block_id in range(self.num_blocks):
            block_hash = self.manager.prefix_cache.hash_of(block_id)
            if block_hash is not None:
                assert tuple(self.kv[block_id]) == self.tokens_of_hash[block_hash]


def test_manager_invariants_hold_when_operations_random() -> None:
    run_state_machine_as_test(
        KVCacheMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None),
    )
