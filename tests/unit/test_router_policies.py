"""Routing policies: round robin, least load, cache-aware with imbalance fallback, decode KV."""

from collections.abc import Mapping

import pytest

from pdserve.config import RouterConfig
from pdserve.errors import ConfigError, NoCandidateError
from services.router.load import InstanceLoad, LoadTracker
from services.router.policies import (
    POLICIES,
    CacheAwarePolicy,
    DecodeCapacity,
    PolicyConfig,
    RouteReason,
    RouteRequest,
    make_decode_policy,
    make_policy,
)

A, B, C = "10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"
CANDIDATES = (A, B, C)
BLOCK_SIZE = 16
REQUEST = RouteRequest("req-1", num_prompt_tokens=4096, block_size=BLOCK_SIZE)
NO_LOAD: Mapping[str, InstanceLoad] = {}
NO_OVERLAP: Mapping[str, int] = {}


def loads_of(**requests_by_letter: int) -> dict[str, InstanceLoad]:
    """In-flight request counts by instance letter (a, b, c), no prefill tokens."""
    ids = {"a": A, "b": B, "c": C}
    return {ids[k]: InstanceLoad(v, 0) for k, v in requests_by_letter.items()}


def test_round_robin_cycles_through_candidates_in_order() -> None:
    policy = make_policy("round_robin")
    chosen = [policy.choose(CANDIDATES, REQUEST, NO_LOAD, NO_OVERLAP) for _ in range(6)]
    assert [d.instance_id for d in chosen] == [A, B, C, A, B, C]
    assert {d.reason for d in chosen} == {RouteReason.ROUND_ROBIN}


def test_least_load_picks_fewest_in_flight_requests() -> None:
    policy = make_policy("least_load")
    decision = policy.choose(CANDIDATES, REQUEST, loads_of(a=3, b=1, c=2), NO_OVERLAP)
    assert decision.instance_id == B
    assert decision.reason is RouteReason.LEAST_LOAD


def test_least_load_breaks_request_ties_by_prefill_tokens() -> None:
    policy = make_policy("least_load")
    loads = {A: InstanceLoad(2, 900), B: InstanceLoad(2, 100), C: InstanceLoad(2, 500)}
    assert policy.choose(CANDIDATES, REQUEST, loads, NO_OVERLAP).instance_id == B


def test_least_load_spreads_decisions_when_loads_are_equal() -> None:
    policy = make_policy("least_load")
    chosen = {policy.choose(CANDIDATES, REQUEST, NO_LOAD, NO_OVERLAP).instance_id for _ in range(3)}
    assert chosen == set(CANDIDATES)


def test_least_load_treats_missing_instances_as_idle() -> None:
    policy = make_policy("least_load")
    assert policy.choose(CANDIDATES, REQUEST, loads_of(a=1, b=1), NO_OVERLAP).instance_id == C


def test_cache_aware_picks_longest_overlap_when_load_is_balanced() -> None:
    policy = make_policy("cache_aware")
    decision = policy.choose(CANDIDATES, REQUEST, loads_of(a=1, b=3, c=0), {A: 4, B: 200, C: 0})
    assert decision.instance_id == B
    assert decision.reason is RouteReason.CACHE_HIT
    assert decision.overlap_blocks == 200


def test_cache_aware_falls_back_to_least_load_when_load_is_unbalanced() -> None:
    config = PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy = make_policy("cache_aware", config)
    loads = loads_of(a=3, b=10, c=5)  # 10 - 3 > 4 and 10 > 1.5 * 3
    decision = policy.choose(CANDIDATES, REQUEST, loads, {B: 256})
    assert decision.instance_id == A
    assert decision.reason is RouteReason.LOAD_IMBALANCE_FALLBACK
    assert decision.overlap_blocks == 0


@pytest.mark.parametrize(
    ("low", "high"),
    [(3, 7), (10, 15)],  # abs gap 4 is not > 4; 15 is not > 1.5 * 10
    ids=["abs-gap-within-threshold", "ratio-within-threshold"],
)
def test_cache_aware_keeps_cache_affinity_when_only_one_threshold_is_exceeded(
    low: int, high: int
) -> None:
    policy = make_policy(
        "cache_aware", PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    )
    loads = {A: InstanceLoad(low, 0), B: InstanceLoad(high, 0)}
    decision = policy.choose((A, B), REQUEST, loads, {B: 100})
    assert decision.instance_id == B
    assert decision.reason is RouteReason.CACHE_HIT


def test_cache_aware_uses_sglang_thresholds_by_default() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAwarePolicy)
    balanced = policy.choose((A, B), REQUEST, loads_of(a=0, b=32), {B: 100})
    assert (balanced.instance_id, balanced.reason) == (B, RouteReason.CACHE_HIT)
    unbalanced = policy.choose((A, B), REQUEST, loads_of(a=0, b=33), {B: 100})
    assert unbalanced.instance_id == A  # more than 32 apart and more than 1.5x: load wins


def test_cache_aware_picks_least_load_with_reason_when_nothing_overlaps() -> None:
    policy = make_policy("cache_aware")
    decision = policy.choose(CANDIDATES, REQUEST, loads_of(a=2, b=1, c=2), {A: 0})
    assert decision.instance_id == B
    assert decision.reason is RouteReason.NO_OVERLAP


def test_cache_aware_trades_overlap_against_queued_prefill_tokens() -> None:
    policy = make_policy("cache_aware")  # load_weight 0.3: a cached token offsets 3.3 queued
    loads = {A: InstanceLoad(1, 14000), B: InstanceLoad(1, 0)}
    decision = policy.choose((A, B), REQUEST, loads, {A: 256})  # 4095 cached < 0.3 x 14000
    assert decision.instance_id == B
    assert decision.reason is RouteReason.LOAD_OVER_CACHE
    light = {A: InstanceLoad(1, 13000), B: InstanceLoad(1, 0)}
    assert policy.choose((A, B), REQUEST, light, {A: 256}).instance_id == A


def test_cache_aware_ignores_load_when_load_weight_is_zero() -> None:
    policy = make_policy("cache_aware", PolicyConfig(load_weight=0.0))
    loads = {A: InstanceLoad(1, 100_000), B: InstanceLoad(1, 0)}
    assert policy.choose((A, B), REQUEST, loads, {A: 1}).instance_id == A


def test_cache_aware_rotates_among_candidates_that_tie_completely() -> None:
    """Requests with the same overlap everywhere (a shared first block) and equal loads do not
    all go to the same instance."""
    policy = make_policy("cache_aware")
    overlaps = {A: 1, B: 1, C: 1}
    winners = [policy.choose(CANDIDATES, REQUEST, {}, overlaps).instance_id for _ in range(6)]
    assert set(winners) == set(CANDIDATES)


def test_cache_aware_prefers_less_loaded_when_overlaps_tie() -> None:
    policy = make_policy("cache_aware")
    decision = policy.choose(CANDIDATES, REQUEST, loads_of(a=5, b=2, c=4), {A: 10, B: 10, C: 10})
    assert decision.instance_id == B
    assert decision.reason is RouteReason.CACHE_HIT


def test_cache_aware_reads_load_tracker_snapshot() -> None:
    tracker = LoadTracker()
    leases = [tracker.acquire(A, 0) for _ in range(40)]
    policy = make_policy("cache_aware")
    decision = policy.choose((A, B), REQUEST, tracker.snapshot(), {A: 256})
    assert (decision.instance_id, decision.reason) == (B, RouteReason.LOAD_IMBALANCE_FALLBACK)
    for lease in leases:
        lease.release()
    decision = policy.choose((A, B), REQUEST, tracker.snapshot(), {A: 256})
    assert (decision.instance_id, decision.reason) == (A, RouteReason.CACHE_HIT)
    tracker.check_integrity()


def test_least_kv_usage_picks_most_free_blocks_then_fewest_running() -> None:
    policy = make_decode_policy("least_kv_usage")
    capacities = {A: DecodeCapacity(100, 1), B: DecodeCapacity(500, 9), C: DecodeCapacity(500, 3)}
    decision = policy.choose(CANDIDATES, REQUEST, capacities)
    assert decision.instance_id == C
    assert decision.reason is RouteReason.MOST_FREE_KV


def test_least_kv_usage_prefers_reported_instances_over_unreported() -> None:
    policy = make_decode_policy("least_kv_usage")
    assert policy.choose(CANDIDATES, REQUEST, {C: DecodeCapacity(0, 50)}).instance_id == C
    decision = policy.choose(CANDIDATES, REQUEST, {})
    assert (decision.instance_id, decision.reason) == (A, RouteReason.NO_STATS)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_raises_when_no_candidates(name: str) -> None:
    with pytest.raises(NoCandidateError, match="no live instance"):
        make_policy(name).choose((), REQUEST, NO_LOAD, NO_OVERLAP)


def test_decode_policy_raises_when_no_candidates() -> None:
    with pytest.raises(NoCandidateError):
        make_decode_policy("least_kv_usage").choose((), REQUEST, {})


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_chooses_a_candidate_when_one_remains(name: str) -> None:
    decision = make_policy(name).choose((B,), REQUEST, loads_of(b=100), {B: 3})
    assert decision.instance_id == B
    assert decision.overlap_blocks == 3


def test_make_policy_raises_config_error_naming_choices_when_name_unknown() -> None:
    with pytest.raises(ConfigError, match=r"'fastest'.*cache_aware, least_load, round_robin"):
        make_policy("fastest")
    with pytest.raises(ConfigError, match="least_kv_usage"):
        make_decode_policy("cache_aware")


def test_the_default_prefill_policy_is_cache_aware() -> None:
    assert isinstance(make_policy(RouterConfig().prefill_policy), CacheAwarePolicy)


@pytest.mark.parametrize(
    "overrides",
    [{"load_weight": -1.0}, {"balance_abs_threshold": -1}, {"balance_rel_threshold": 0.5}],
)
def test_policy_config_rejects_out_of_range_values(overrides: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(overrides))):
        PolicyConfig(**overrides)  # type: ignore[arg-type]
