"""Routing policies: small strategy objects that pick one instance among candidates.

Mechanism lives elsewhere (`KVEventIndex` measures prefix overlap, `LoadTracker` counts in-flight
work, the instances report their KV capacity); a policy only reads those numbers and decides.

* Prefill (and mixed-mode) policies, registry `POLICIES` (keyed by
  `pdserve.choices.PrefillPolicyName`, the names `router.prefill_policy` takes), built by
  `make_policy`: `round_robin`, `least_load`, `cache_aware` (the default).
* Decode policies, registry `DECODE_POLICIES`, built by `make_decode_policy`: `least_kv_usage`.

Every `choose` returns a `Decision` naming the instance and why (`RouteReason`, a string enum
usable as a metric label). Candidates are passed in a stable order (e.g. sorted addresses); ties
are broken by that order, rotated per decision where noted so that equal instances share work.
Policies are thread-safe: concurrent `choose` calls are allowed.
"""

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from pdserve.choices import PrefillPolicyName, registry
from pdserve.errors import ConfigError, NoCandidateError
from services.router.load import IDLE, InstanceLoad


class RouteReason(StrEnum):
    """Why a policy chose an instance."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_HIT = "cache_hit"  # the chosen instance holds a prefix of the prompt
    LOAD_OVER_CACHE = "load_over_cache"  # others hold a prefix, but their load outweighed it
    NO_OVERLAP = "no_overlap"  # nobody holds a prefix: least loaded
    LOAD_IMBALANCE_FALLBACK = "load_imbalance_fallback"  # too unbalanced: least loaded
    MOST_FREE_KV = "most_free_kv"
    NO_STATS = "no_stats"  # no candidate has reported capacity yet


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request."""

    request_id: str
    num_prompt_tokens: int
    block_size: int
    """Tokens per KV block: converts the index's block overlaps into tokens."""


@dataclass(frozen=True, slots=True)
class Decision:
    instance_id: str
    reason: RouteReason
    overlap_blocks: int = 0
    """Leading prompt blocks the chosen instance holds, per the KV-event index (0 if unused)."""
    score: float = 0.0
    """The chosen instance's score (`cache_aware`: cached tokens - load_weight x its in-flight
    prefill tokens; 0 for the policies that score nothing)."""


@dataclass(frozen=True, slots=True)
class DecodeCapacity:
    """A decode instance's last reported capacity (from its `InstanceStats`)."""

    num_free_blocks: int
    num_running: int


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Tuning of the policies; the defaults suit a prefill pool of a few to a few dozen instances.

    `load_weight`: `cache_aware` scores an instance as
        overlap_tokens - load_weight * in_flight_prefill_tokens,
    i.e. at 1.0 it minimises the prefill work queued ahead of the request plus the work of the
    request itself (prompt tokens minus cached tokens). 0 ignores load; larger favours balance.
    The default 0.3 comes from `pdserve simulate` (4 instances, conversations and documents
    workloads): 1.0 let queued tokens outweigh the overlap and moved requests away from their
    prefix (hit rate 0.820 / 0.872 against 0.840 / 0.886 at 0.3; 0.1 gave 0.827 / 0.885).

    `balance_abs_threshold`, `balance_rel_threshold`: the candidates are *unbalanced* when, over
    their in-flight request counts, max - min > abs AND max > rel * min; `cache_aware` then routes
    to the least loaded instance whatever the overlap. Defaults are those of SGLang's
    cache-aware router (32 and 1.0001).
    """

    load_weight: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ConfigError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.balance_abs_threshold < 0:
            raise ConfigError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}"
            )
        if self.balance_rel_threshold < 1.0:
            raise ConfigError(
                f"balance_rel_threshold must be >= 1.0, got {self.balance_rel_threshold}"
            )


# -- prefill policies ------------------------------------------------------------------------------


class RoutingPolicy(ABC):
    """Chooses the instance for a request's prompt (prefill, or both phases in mixed mode)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        loads: Mapping[str, InstanceLoad],
        overlaps: Mapping[str, int],
    ) -> Decision:
        """Pick one of `candidates`; mutates nothing but the policy's own rotation counter.

        `loads` maps instance ids to their in-flight load (missing: idle); `overlaps` maps them to
        the number of leading prompt blocks they hold (missing: 0). Raises NoCandidateError if
        `candidates` is empty.
        """


class RoundRobinPolicy(RoutingPolicy):
    """Each candidate in turn, ignoring load and cache."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._turns = _Rotation()

    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        loads: Mapping[str, InstanceLoad],
        overlaps: Mapping[str, int],
    ) -> Decision:
        _require(candidates)
        instance_id = candidates[self._turns.next() % len(candidates)]
        return Decision(instance_id, RouteReason.ROUND_ROBIN, overlaps.get(instance_id, 0))


class LeastLoadPolicy(RoutingPolicy):
    """Fewest in-flight requests, then fewest in-flight prefill tokens; ties rotate."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._turns = _Rotation()

    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        loads: Mapping[str, InstanceLoad],
        overlaps: Mapping[str, int],
    ) -> Decision:
        return self.choose_with_reason(candidates, loads, overlaps, RouteReason.LEAST_LOAD)

    def choose_with_reason(
        self,
        candidates: Sequence[str],
        loads: Mapping[str, InstanceLoad],
        overlaps: Mapping[str, int],
        reason: RouteReason,
    ) -> Decision:
        """The least loaded candidate, reported with `reason` (for policies that fall back here)."""
        _require(candidates)
        start = self._turns.next() % len(candidates)
        rotated = itertools.chain(candidates[start:], candidates[:start])
        instance_id = min(rotated, key=lambda c: _load_key(loads.get(c, IDLE)))
        return Decision(instance_id, reason, overlaps.get(instance_id, 0))


class CacheAwarePolicy(RoutingPolicy):
    """Most cached prefix traded against load, unless load is too unbalanced (see PolicyConfig).

    Balanced candidates: the highest `overlap_tokens - load_weight * in_flight_prefill_tokens`
    wins, ties going to the least loaded, then rotating. Unbalanced candidates, or no overlap
    anywhere: the least loaded wins.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._fallback = LeastLoadPolicy(config)
        self._turns = _Rotation()  # equal scores: the winner rotates

    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        loads: Mapping[str, InstanceLoad],
        overlaps: Mapping[str, int],
    ) -> Decision:
        _require(candidates)
        candidate_loads = [loads.get(c, IDLE) for c in candidates]
        if self._unbalanced([load.in_flight_requests for load in candidate_loads]):
            reason = RouteReason.LOAD_IMBALANCE_FALLBACK
            return self._fallback.choose_with_reason(candidates, loads, overlaps, reason)
        cached = _cached_tokens(candidates, request, overlaps)
        if not any(cached):
            reason = RouteReason.NO_OVERLAP
            return self._fallback.choose_with_reason(candidates, loads, overlaps, reason)
        weight = self.config.load_weight
        # (benefit, then fewer requests, then fewer prefill tokens); built in one pass, with no
        # call per candidate, because this runs on every request
        scores = [
            (
                tokens - weight * load.in_flight_prefill_tokens,
                -load.in_flight_requests,
                -load.in_flight_prefill_tokens,
            )
            for tokens, load in zip(cached, candidate_loads, strict=True)
        ]
        start = self._turns.next() % len(candidates)
        order = itertools.chain(range(start, len(candidates)), range(start))
        best = max(order, key=scores.__getitem__)
        instance_id = candidates[best]
        overlap = overlaps.get(instance_id, 0)
        reason = RouteReason.CACHE_HIT if overlap else RouteReason.LOAD_OVER_CACHE
        return Decision(instance_id, reason, overlap, scores[best][0])

    def _unbalanced(self, counts: Sequence[int]) -> bool:
        low, high = min(counts), max(counts)
        config = self.config
        return (
            high - low > config.balance_abs_threshold and high > config.balance_rel_threshold * low
        )


# -- decode policies -------------------------------------------------------------------------------


class DecodePolicy(ABC):
    """Chooses the decode instance that receives a request's KV and generates its tokens."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        capacities: Mapping[str, DecodeCapacity],
    ) -> Decision:
        """Pick one of `candidates` from their last reported capacity (missing: not reported).

        Mutates nothing. Raises NoCandidateError if `candidates` is empty.
        """


class LeastKVUsagePolicy(DecodePolicy):
    """Most free KV blocks, then fewest running requests; candidates that have not reported
    come last, in candidate order."""

    def choose(
        self,
        candidates: Sequence[str],
        request: RouteRequest,
        capacities: Mapping[str, DecodeCapacity],
    ) -> Decision:
        _require(candidates)
        reported = [c for c in candidates if c in capacities]
        if not reported:
            return Decision(candidates[0], RouteReason.NO_STATS)
        instance_id = max(
            reported,
            key=lambda c: (capacities[c].num_free_blocks, -capacities[c].num_running),
        )
        return Decision(instance_id, RouteReason.MOST_FREE_KV)


# -- registries ------------------------------------------------------------------------------------

# keyed by pdserve.choices.PrefillPolicyName, the list `router.prefill_policy` is checked against
POLICIES: dict[str, type[RoutingPolicy]] = registry(
    PrefillPolicyName,
    {
        PrefillPolicyName.ROUND_ROBIN: RoundRobinPolicy,
        PrefillPolicyName.LEAST_LOAD: LeastLoadPolicy,
        PrefillPolicyName.CACHE_AWARE: CacheAwarePolicy,
    },
)

DECODE_POLICIES: dict[str, type[DecodePolicy]] = {
    "least_kv_usage": LeastKVUsagePolicy,
}


def make_policy(name: str, config: PolicyConfig | None = None) -> RoutingPolicy:
    """The prefill policy registered as `name`. Raises ConfigError naming the valid choices."""
    return _lookup(POLICIES, name, "routing policy")(config or PolicyConfig())


def make_decode_policy(name: str, config: PolicyConfig | None = None) -> DecodePolicy:
    """The decode policy registered as `name`. Raises ConfigError naming the valid choices."""
    return _lookup(DECODE_POLICIES, name, "decode routing policy")(config or PolicyConfig())


# -- helpers ---------------------------------------------------------------------------------------


class _Rotation:
    """A thread-safe increasing counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def next(self) -> int:
        with self._lock:
            value = self._count
            self._count = value + 1
            return value


_T = TypeVar("_T")


def _lookup(registry: Mapping[str, _T], name: str, what: str) -> _T:
    try:
        return registry[name]
    except KeyError:
        choices = ", ".join(sorted(registry))
        raise ConfigError(f"unknown {what} {name!r}; choose one of: {choices}") from None


def _cached_tokens(
    candidates: Sequence[str], request: RouteRequest, overlaps: Mapping[str, int]
) -> list[int]:
    """Prompt tokens each candidate holds. A hit never covers the last prompt token: at least
    one token is always computed."""
    hittable = max(request.num_prompt_tokens - 1, 0)
    size = request.block_size
    return [min(overlaps.get(c, 0) * size, hittable) for c in candidates]


def _load_key(load: InstanceLoad) -> tuple[int, int]:
    return load.in_flight_requests, load.in_flight_prefill_tokens


def _require(candidates: Sequence[str]) -> None:
    if not candidates:
        raise NoCandidateError("no live instance to route to; retry when one has registered")
