"""Routing: where one attempt of a request runs, and the load leases it takes there.

The prefill policy chooses a prefill (or mixed) instance over the KV-event index's prefix
overlaps and the instances' loads; the decode policy chooses a decode instance from its free
blocks and load; conditional disaggregation then decides between prefill on that prefill
instance and prefill on the decode instance itself; a decode instance holding more of the
prompt than the prefill instance (a conversation's earlier answers) is named as the source
prefill pulls that prefix from. An instance's load is what it last
reported on its KV-event stream (every router's requests) plus this router's requests it has
not acknowledged yet (`LoadTracker.pending`); before its first report, this router's leases.
The router's attempts call it for every attempt, and `pdserve simulate --latency` calls the
same object for every simulated request: what the simulator predicts is what this code
decides.

Thread-safe: the policies, the index and the load tracker are; `choose` mutates nothing but
the policies' rotation counters and the decision counters.
"""

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.errors import NoCandidateError, NoCapacityError
from pdserve.kvcache.events import LoadReport
from pdserve.kvcache.hashing import BlockHash
from pdserve.metrics import RouterMetrics
from pdserve.transfer.base import PrefixSource
from pdserve.v1.common_pb2 import InstanceStats
from services.router.breakers import BreakerState, CircuitBreakers
from services.router.disaggregation import Disaggregation, PathChoice
from services.router.kv_index import KVEventIndex
from services.router.load import InstanceLoad, Lease, LoadTracker
from services.router.membership import Membership, Role
from services.router.policies import (
    DecodeCapacity,
    PolicyConfig,
    RouteRequest,
    RoutingPolicy,
    make_decode_policy,
    make_policy,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    """Where one attempt runs."""

    prefill: str  # the prefill instance, or the mixed instance
    decode: str | None  # None: `prefill` is a mixed instance
    cached_tokens: int  # prompt tokens the prefill instance holds (the index's view)
    reason: str = ""  # why the prefill policy chose it
    score: float = 0.0  # its score under the policy
    # `prefill` is a decode instance that computes the prompt itself (conditional
    # disaggregation chose local prefill; `decode` is None)
    on_decode: bool = False
    path: PathChoice | None = None  # the disaggregation decision, when one was made
    # a decode instance holding more of the prompt than `prefill`: prefill pulls it from there
    source: PrefixSource | None = None


class Routing:
    def __init__(
        self,
        config: RouterConfig,
        block_size: int,
        membership: Membership,
        index: KVEventIndex,
        reported: Callable[[str], LoadReport | None],
        metrics: RouterMetrics,
        stats: Callable[[str], InstanceStats | None] = lambda address: None,
    ) -> None:
        """`reported(address)`: an instance's last load report (None: none yet);
        `stats(address)`: an instance's last polled GetStats (conditional disaggregation's
        step time models)."""
        self.load = LoadTracker()
        self._config = config
        self.block_size = block_size
        self._membership = membership
        self._index = index
        self._reported = reported
        self.breakers = CircuitBreakers(
            config.breaker_failures, config.breaker_cooldown_s, self._breaker_changed
        )
        self._metrics = metrics
        self._stats = stats
        self.disaggregation = Disaggregation(
            config.disaggregation, config.kv_transfer_gbps, block_size
        )
        tuning = PolicyConfig(
            load_weight=config.load_weight,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
        )
        self.policy_name = config.prefill_policy
        self._policy: RoutingPolicy = make_policy(config.prefill_policy, tuning)
        self._decode_policy = make_decode_policy("least_kv_usage", tuning)

    def set_policy(self, name: str) -> str:
        """Switch the prefill routing policy; returns the previous one. Raises ConfigError."""
        self._policy = make_policy(name, self._policy.config)
        previous, self.policy_name = self.policy_name, name
        return previous

    def choose(
        self,
        request_id: str,
        prompt_tokens: int,
        hashes: Sequence[BlockHash],
        excluded: set[str],
        source: PrefixSource | None = None,
    ) -> Route:
        """The route of a prompt of `prompt_tokens` tokens whose full blocks hash to `hashes`,
        avoiding the `excluded` instances; `source`: a decode instance known to hold the
        prompt's first blocks (a stream moved off it), else the index's best. Raises
        NoCapacityError when a role has no candidate."""
        prefills = self._admitted(self._membership.candidates(Role.PREFILL, excluded))
        request = RouteRequest(request_id, prompt_tokens, self.block_size)
        try:
            overlaps = self._index.overlaps(hashes, prefills)
            loads = {address: self.load_of(address) for address in prefills}
            prefill = self._policy.choose(prefills, request, loads, overlaps)
            self._metrics.decisions.labels(self.policy_name, str(prefill.reason)).inc()
            cached = prefill.overlap_blocks * self.block_size
            reason, score = str(prefill.reason), prefill.score
            if self._membership.mixed:
                return Route(prefill.instance_id, None, cached, reason, score)
            decodes = self._admitted(self._membership.candidates(Role.DECODE, excluded))
            decode = self._decode_policy.choose(decodes, request, self._capacities(decodes))
        except NoCandidateError as e:
            raise NoCapacityError(str(e), 1000) from e
        decode_cached = 0  # the decode instance's own prefix, followed when it may prefill
        if self.disaggregation.follows_decode:
            blocks = self._index.overlaps(hashes, [decode.instance_id])
            decode_cached = blocks.get(decode.instance_id, 0) * self.block_size
        path = self._path(
            prompt_tokens, prefill.instance_id, cached, decode.instance_id, decode_cached
        )
        self._metrics.disaggregation.labels("local" if path.local else "remote").inc()
        if path.local:
            return Route(decode.instance_id, None, decode_cached, reason, score, True, path)
        if source is None or source.num_blocks <= prefill.overlap_blocks:
            source = self._pull_source(hashes, prefill.overlap_blocks)
        logger.debug(
            "request %s -> prefill %s (%s, %d blocks cached%s) -> decode %s",
            request_id, prefill.instance_id, prefill.reason, prefill.overlap_blocks,
            f", {source.num_blocks} on {source.address}" if source else "", decode.instance_id,
            extra={"request_id": request_id},
        )  # fmt: skip
        return Route(
            prefill.instance_id, decode.instance_id, cached, reason, score, path=path, source=source
        )

    def _pull_source(self, hashes: Sequence[BlockHash], prefill_blocks: int) -> PrefixSource | None:
        """The decode instance holding the most of the prompt's leading blocks (drained ones
        too: they serve reads), when that is `router.kv_pull_min_tokens` more than the prefill
        instance holds (a conversation's earlier answers stay where they were generated)."""
        min_tokens = self._config.kv_pull_min_tokens
        decodes = self._membership.readable(Role.DECODE)
        if min_tokens is None or not decodes:
            return None
        overlaps = self._index.overlaps(hashes, decodes)
        holder = max(decodes, key=lambda address: overlaps.get(address, 0))
        blocks = overlaps.get(holder, 0)
        if (blocks - prefill_blocks) * self.block_size < min_tokens:
            return None
        self._metrics.kv_pulls.inc()
        return PrefixSource(holder, blocks)

    def _path(
        self, prompt_tokens: int, prefill: str, prefill_cached: int, decode: str, decode_cached: int
    ) -> PathChoice:
        """Remote prefill on `prefill`, or local prefill on `decode` (`router.disaggregation`;
        `*_cached`: the prompt's tokens each holds)."""
        disaggregation = self.disaggregation
        if disaggregation.mode != "auto":
            return disaggregation.choose(prompt_tokens, None, 0, 0, None, 0)
        return disaggregation.choose(
            prompt_tokens,
            self._stats(prefill),
            prefill_cached,
            self.load_of(prefill).in_flight_prefill_tokens,
            self._stats(decode),
            decode_cached,
            self.load_of(decode).in_flight_requests,
        )

    def _admitted(self, candidates: list[str]) -> list[str]:
        """The candidates whose circuit breakers let a request through; raises NoCapacityError
        (retry when the first cool-down ends) when none does."""
        admitted = self.breakers.admitted(candidates)
        if candidates and not admitted:
            wait_s = self.breakers.retry_after_s(candidates)
            raise NoCapacityError(
                f"every candidate instance failed router.breaker_failures requests in a row "
                f"and is skipped for now ({', '.join(candidates)}); retry in {wait_s:.1f} s",
                max(1, math.ceil(wait_s * 1000)),
            )
        return admitted

    def _breaker_changed(self, address: str, state: BreakerState) -> None:
        self._metrics.circuit_state.labels(address).set(int(state))
        if state == BreakerState.OPEN:
            self._metrics.circuit_opens.labels(address).inc()
            logger.warning("instance %s: circuit breaker open (failures in a row)", address)
        elif state == BreakerState.CLOSED:
            logger.info("instance %s: circuit breaker closed", address)

    def load_of(self, address: str) -> InstanceLoad:
        """The instance's last reported load plus this router's requests it has not
        acknowledged; this router's leases before its first report."""
        report = self._reported(address)
        if report is None:
            return self.load.load_of(address)
        pending = self.load.pending(address)
        return InstanceLoad(
            report.num_requests + pending.in_flight_requests,
            report.queued_prefill_tokens + pending.in_flight_prefill_tokens,
        )

    def saturated(self, address: str, blocks: int, waiting: int | None) -> bool:
        """Whether the instance has no room for a prompt of `blocks` blocks now: fewer free
        blocks than that (a prompt larger than its whole cache is not waiting for room: the
        instance refuses it), or (`waiting` given) that many requests waiting there (reported,
        with this router's unacknowledged ones). An instance that has not reported is not."""
        report = self._reported(address)
        if report is None:
            return False
        if report.num_free_blocks < blocks <= report.num_blocks:
            return True
        pending = self.load.pending(address).in_flight_requests
        return waiting is not None and report.num_waiting + pending >= waiting

    def _capacities(self, decodes: Sequence[str]) -> dict[str, DecodeCapacity]:
        """The decode candidates that reported: their free blocks, and their requests with
        this router's unacknowledged ones."""
        capacities = {}
        for address in decodes:
            report = self._reported(address)
            if report is not None:
                pending = self.load.pending(address).in_flight_requests
                capacities[address] = DecodeCapacity(
                    report.num_free_blocks, report.num_requests + pending
                )
        return capacities

    def leases(self, route: Route, prompt_tokens: int) -> tuple[Lease, ...]:
        """Count the request on its instances: only the tokens prefill must compute count as
        its prefill load. The first lease is the prompt's instance's, the second decode's."""
        reused = route.cached_tokens
        if route.source is not None:
            reused = max(reused, route.source.num_blocks * self.block_size)
        uncached = max(1, prompt_tokens - reused)
        seq = self.load.next_seq()  # the attempt's route number: both leases wait for it
        leases: tuple[Lease, ...] = (self.load.acquire(route.prefill, uncached, seq),)
        self.breakers.sent(route.prefill)
        if route.decode is not None:
            leases += (self.load.acquire(route.decode, 0, seq),)
            self.breakers.sent(route.decode)
        return leases
