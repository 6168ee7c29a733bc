"""Eviction policies through the real KVCacheManager: which cached block a full pool reuses."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvcache import BlockHash, BlockHasher, BlockRemoved, KVCacheManager, KVEvent
from pdserve.kvcache.eviction import EVICTION_POLICIES, LRFUPolicy, make_eviction_policy

BLOCK = 4


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    block_hashes: list[BlockHash] = field(init=False)

    def __post_init__(self) -> None:
        self.block_hashes = BlockHasher.for_model(BLOCK, "t").hash_tokens(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Recorder:
    write_on_evict = True
    write_through = False
    write_on_preempt = False

    def __init__(self) -> None:
        self.written: list[BlockHash] = []

    def write_back(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        self.written += [h for _, h in blocks]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(manager: KVCacheManager, request: Req) -> None:
    """Prefill the whole prompt, publish it, release it."""
    prefix = manager.match_prefix(request)
    manager.allocate(request, request.num_tokens, prefix)
    manager.update_cache_blocks(request, request.num_tokens)
    manager.free(request.request_id)


def prompt(start: int, blocks: int) -> list[int]:
    return [*range(start, start + blocks * BLOCK), 9999]  # one token more: every block hittable


def cached(manager: KVCacheManager, tokens: list[int]) -> int:
    return len(manager.match_prefix(Req("probe", tokens)).block_ids)


def manager_with(policy: str, num_blocks: int, clock: Clock, **kwargs: object) -> KVCacheManager:
    eviction = make_eviction_policy(policy, num_blocks, clock=clock, **kwargs)  # type: ignore[arg-type]
    return KVCacheManager(num_blocks, BLOCK, eviction=eviction, write_back=Recorder())


def test_lru_reuses_the_least_recently_released_cached_block() -> None:
    manager = manager_with("lru", 4, Clock())
    a, b = prompt(0, 1), prompt(100, 1)
    run(manager, Req("a", a))  # 2 blocks: 1 published + the partial tail (uncached)
    run(manager, Req("b", b))
    run(manager, Req("new", prompt(200, 2)))  # takes the two uncached tails, then a's block
    assert cached(manager, a) == 0 and cached(manager, b) == 1


def test_lrfu_keeps_a_block_used_twice_over_a_newer_one_used_once() -> None:
    clock = Clock()
    manager = manager_with("lrfu", 4, clock, half_life_s=60.0)
    a, b = prompt(0, 1), prompt(100, 1)
    run(manager, Req("a1", a))
    clock.now = 1.0
    run(manager, Req("a2", a))
    clock.now = 2.0
    run(manager, Req("b", b))  # newer, but once
    clock.now = 3.0
    run(manager, Req("new", prompt(200, 2)))  # the two uncached tails, then one cached block
    assert cached(manager, a) == 1 and cached(manager, b) == 0
    lru = manager_with("lru", 4, Clock())  # the same sequence under lru loses a instead
    for name, tokens in (("a1", a), ("a2", a), ("b", b), ("new", prompt(200, 2))):
        run(lru, Req(name, tokens))
    assert cached(lru, a) == 0 and cached(lru, b) == 1


def test_lrfu_counts_a_waiting_request_at_its_arrival_not_its_admission() -> None:
    """Under a backlog a request waits long before it is admitted: its prefix is valued from
    its arrival (and again at its admission), so the newer one-off prompts admitted meanwhile
    do not push it out."""
    clock = Clock()
    manager = manager_with("lrfu", 4, clock, half_life_s=60.0)
    a, b = prompt(0, 1), prompt(100, 1)
    run(manager, Req("a1", a))
    clock.now = 30.0
    waiting = Req("a2", [*a[:-1], 5, 6, 7])  # a's block, then its own
    manager.arrived(waiting)  # queued behind a backlog
    clock.now = 60.0
    run(manager, Req("b", b))  # a newer one-off, admitted while a2 waits
    clock.now = 61.0
    run(manager, Req("new", prompt(200, 2)))  # needs one cached block: b's, not a's
    assert cached(manager, a) == 1 and cached(manager, b) == 0
    late = manager_with("lrfu", 4, clock := Clock(), half_life_s=60.0)  # counted at admission
    run(late, Req("a1", a))
    for now, name, tokens in ((60.0, "b", b), (61.0, "new", prompt(200, 2))):
        clock.now = now
        run(late, Req(name, tokens))
    assert cached(late, a) == 0 and cached(late, b) == 1


def test_lrfu_scores_outlive_eviction_and_decay() -> None:
    clock = Clock()
    manager = manager_with("lrfu", 2, clock, half_life_s=10.0)
    a = prompt(0, 1)
    for n in range(3):  # a is popular ...
        run(manager, Req(f"a{n}", a))
    run(manager, Req("evicts-a", prompt(100, 1)))  # ... but a full pool reuses its block
    assert cached(manager, a) == 0
    policy = manager.eviction
    assert isinstance(policy, LRFUPolicy)
    score = policy._scores[Req("a", a).block_hashes[0]]
    assert score == pytest.approx(3.0)  # kept although the block is gone
    clock.now = 10.0  # one half-life later a new admission weighs twice as much
    run(manager, Req("c", prompt(300, 1)))
    assert policy._scores[Req("c", prompt(300, 1)).block_hashes[0]] == pytest.approx(2.0)


def test_lrfu_keeps_at_most_capacity_times_blocks_scores() -> None:
    manager = manager_with("lrfu", 4, Clock(), score_capacity=2)
    for n in range(50):
        run(manager, Req(f"r{n}", prompt(1000 * n, 1)))
    assert isinstance(manager.eviction, LRFUPolicy)
    assert len(manager.eviction._scores) <= 8
    manager.check_integrity()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_every_evicted_published_block_is_written_back_first(policy: str) -> None:
    events: list[KVEvent] = []
    recorder = Recorder()
    eviction = make_eviction_policy(policy, 6, clock=Clock())
    manager = KVCacheManager(
        6, BLOCK, eviction=eviction, write_back=recorder, event_sink=events.append
    )
    for n in range(12):
        run(manager, Req(f"r{n}", prompt(100 * (n % 5), 1 + n % 3)))
    manager.evict_cached_blocks()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and sorted(removed) == sorted(recorder.written)
    manager.check_integrity()


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        make_eviction_policy("fifo", 4)


def test_greedy_output_does_not_depend_on_the_policy(tiny_model_dir: object) -> None:
    """A pool small enough that every request evicts: both policies give the same tokens."""
    prompts = [[5 + (n % 3)] * 40 + list(range(10 + n, 30 + n)) for n in range(8)]
    outputs = {}
    for policy in EVICTION_POLICIES:
        config = EngineConfig(
            model=str(tiny_model_dir), num_kv_blocks=12, eviction_policy=policy, block_size=16
        )
        engine = LLMEngine.from_config(config)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        outputs[policy] = [c.token_ids for c in engine.generate(prompts, params)]
        engine.check_integrity()
    assert outputs["lru"] == outputs["lrfu"]
