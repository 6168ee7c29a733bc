"""Attempts: one routed run of a request, retried on other instances until its first token.

Each attempt chooses a prefill (or mixed) instance with the prefill policy over the KV-event
index and a decode instance with the decode policy, takes a load lease on each, and starts the
request through the `PDClient`. A failure before the first token blames an instance (the side
the error names), marks it unhealthy in the membership, backs off and tries again, up to
`router.max_attempts`; a failure after it blames the streaming instance and is raised (the
router may migrate the stream).

Every lease is released exactly once on every path (success, error, retry, abort, client
disconnect): `Lease.release` is idempotent, and both an attempt's `finally` and `abort` call it.
Runs on the router's event loop; `abort` and `active` may be called from other threads.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.engine.request import SamplingParams
from pdserve.errors import (
    DecodeUnavailableError,
    DuplicateRequestError,
    InstanceUnavailableError,
    InvalidRequestError,
    NoCapacityError,
    PdserveError,
    RequestAbortedError,
    ResourceExhaustedError,
    StepFailedError,
    StreamMovedError,
)
from pdserve.kvcache.events import LoadReport
from pdserve.kvcache.hashing import BlockHash, BlockHasher, PromptHashes
from pdserve.metrics import RouterMetrics
from pdserve.observability import tracing
from pdserve.rpc.clients import Metadata
from pdserve.transfer.base import PrefixSource
from pdserve.v1.common_pb2 import InstanceStats
from services.router.kv_index import KVEventIndex
from services.router.load import Lease
from services.router.membership import Membership
from services.router.pd_client import Finished, PDClient, TokenDelta
from services.router.routing import Route, Routing
from services.router.timeline import RequestRecord

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    route: Route
    leases: tuple[Lease, ...]


class Attempts:
    """The attempt loop of every request the router runs."""

    def __init__(
        self,
        config: RouterConfig,
        hasher: BlockHasher,
        membership: Membership,
        index: KVEventIndex,
        reported: Callable[[str], LoadReport | None],
        client: PDClient,
        metrics: RouterMetrics,
        on_unreachable: Callable[[], None],
        stats: Callable[[str], InstanceStats | None] = lambda address: None,
    ) -> None:
        """`reported(address)`: an instance's last load report; `stats(address)`: its last
        polled GetStats (conditional disaggregation's step time models)."""
        self.config = config
        self._hasher = hasher
        self._membership = membership
        self._client = client
        self._metrics = metrics
        self._on_unreachable = on_unreachable  # an instance could not be reached
        self.routing = Routing(
            config, hasher.block_size, membership, index, reported, metrics, stats
        )
        self.load = self.routing.load
        self.disaggregation = self.routing.disaggregation
        self._active: dict[str, _Active] = {}
        self.on_routed: Callable[[], None] = lambda: None  # an attempt took its leases

    def set_policy(self, name: str) -> str:
        """Switch the prefill routing policy; returns the previous one. Raises ConfigError."""
        return self.routing.set_policy(name)

    @property
    def policy_name(self) -> str:
        return self.routing.policy_name

    def active(self) -> set[str]:
        """Ids of the requests with an attempt running now."""
        return set(self._active)

    async def run(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        excluded: set[str],
        aborted: Callable[[], bool],
        record: RequestRecord,
        source: PrefixSource | None = None,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """The request's events from one routed run; failures before its first token are
        retried on other instances (added to `excluded`). A failure after it blames the
        instance that was streaming (added to `excluded`) and is raised. A stream whose decode
        instance is drained is moved: it ends with StreamMovedError (that instance added to
        `excluded`) once its context fills whole blocks there (`_move_point`). Raises
        RequestAbortedError once `aborted()`, NoCapacityError when every attempt failed.
        `source`: a decode instance holding the prompt's first blocks (the previous attempt's,
        moved off it). Each routing decision and attempt is a stage of `record` (and a span of
        its trace)."""
        hashes = self._hasher.hash_tokens(token_ids)
        chain = PromptHashes(self._hasher.root, self._hasher.block_size, tuple(hashes))
        backoff = self.config.retry_backoff_s  # doubles after each failed attempt
        failure: Exception | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            if aborted():
                raise RequestAbortedError(f"request {request_id} was aborted")
            route = self._routed(record, request_id, token_ids, hashes, excluded, source)
            leases = self._take_leases(request_id, route, len(token_ids))
            dispatched = time.perf_counter()
            record.dispatched = record.dispatched or dispatched
            span = (
                tracing.start("attempt", record.span, _attempt_attributes(attempt, route))
                if record.span is not None
                else None
            )
            events = self._start(
                route, token_ids, params, request_id, chain, tracing.metadata(span), leases[0].seq
            )
            error: BaseException | None = None
            try:
                try:
                    first = await anext(events)
                except DuplicateRequestError as e:
                    # the id is the router's own: an instance still tears down an earlier
                    # attempt of this request. Not the caller's mistake, nobody is sick: later.
                    failure = error = e
                    self._failed_attempt(e, request_id, attempt, route, blame=False)
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                except (InvalidRequestError, RequestAbortedError):
                    raise  # the caller's mistake, or stopped on purpose: not retried
                except PdserveError as e:
                    failure = error = e
                    excluded |= self._failed_attempt(e, request_id, attempt, route)
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                first_token = self._first_token(route, leases, record)
                yield first
                mover = self._mover(route, len(token_ids))
                try:
                    mover.streamed(first)
                    async for event in events:
                        if isinstance(event, Finished):
                            _reported(record, route, event, dispatched, first_token)
                            self._count_hits(route, event)
                        yield event
                        mover.streamed(event)
                except StreamMovedError as e:
                    excluded.add(e.address)  # moved on purpose: nobody is blamed
                    e.release_hold = self.load.acquire(e.address, 0).release  # until read
                    raise
                except (InstanceUnavailableError, StepFailedError) as e:
                    excluded.add(self._lost_stream(e, route.decode or route.prefill))
                    raise
                return
            except Exception as e:  # not a consumer that stopped reading (GeneratorExit)
                error = e
                raise
            finally:
                tracing.end(span, error=error)
                await events.aclose()
                self._release(request_id)
        raise self._exhausted(failure)

    def abort(self, request_id: str) -> None:
        """Stop the request's running attempt on every instance that holds it and release its
        leases (blocking: one Abort call per instance)."""
        active = self._active.get(request_id)
        if active is None:
            return
        self._client.abort(active.route.prefill, active.route.decode, request_id)
        self._release(request_id)

    # -- one attempt ------------------------------------------------------------------------------

    def _routed(
        self,
        record: RequestRecord,
        request_id: str,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        excluded: set[str],
        source: PrefixSource | None,
    ) -> Route:
        """`_choose`, recorded as the request's `route` stage (after its `admission`: edge
        checks, admission and hashing, from its arrival to its first routing)."""
        started = time.perf_counter()
        if record.attempts == 0 and record.migrations == 0:
            record.add("admission", record.arrival, started)
        route = self.routing.choose(request_id, len(token_ids), hashes, excluded, source)
        record.attempts += 1
        decision: dict[str, object] = {
            "prefill": route.prefill, "decode": route.decode or "", "policy": self.policy_name,
            "reason": route.reason, "score": route.score,
            "predicted_hit_tokens": route.cached_tokens,
        }  # fmt: skip
        if route.source is not None:
            decision["pull_from"] = route.source.address
            decision["pull_blocks"] = route.source.num_blocks
        if route.path is not None:
            decision["path"] = "local" if route.on_decode else "remote"
            if route.path.remote_s == route.path.remote_s:  # predicted (not nan)
                decision["predicted_remote_ttft_s"] = round(route.path.remote_s, 6)
                decision["predicted_local_ttft_s"] = round(route.path.local_s, 6)
                decision["predicted_local_delay_s"] = round(route.path.delay_s, 6)
        record.add("route", started, time.perf_counter(), "", decision)
        return route

    def _take_leases(self, request_id: str, route: Route, prompt_tokens: int) -> tuple[Lease, ...]:
        leases = self.routing.leases(route, prompt_tokens)
        self._active[request_id] = _Active(route, leases)
        self.on_routed()
        return leases

    def _start(
        self,
        route: Route,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hashes: PromptHashes,
        metadata: Metadata,
        route_seq: int,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """The instances take the prompt's hash chain after checking three links of it: the
        prompt is hashed once, here, not on every instance it passes. `metadata`: the
        attempt's trace context; `route_seq`: its number (the instances acknowledge it)."""
        if route.decode is None:
            return self._client.generate_mixed(
                route.prefill, token_ids, params, request_id, hashes, metadata, route.on_decode,
                route_seq,
            )  # fmt: skip
        return self._client.generate(
            route.prefill, route.decode, token_ids, params, request_id, hashes, metadata,
            route_seq, route.source,
        )  # fmt: skip

    def _first_token(self, route: Route, leases: tuple[Lease, ...], record: RequestRecord) -> float:
        """The attempt's first token came: its instances' breakers close and prefill's load
        ends (a mixed instance keeps the request, not its prompt). Returns when."""
        now = time.perf_counter()
        record.first_token = record.first_token or now
        self._succeeded(route)
        if route.decode is None:
            leases[0].finish_prefill()
        else:
            leases[0].release()
        return now

    def _mover(self, route: Route, prompt_tokens: int) -> "_Mover":
        """What moves the attempt's stream off its decode instance once that is drained."""
        watched = self._membership if self.config.drain_moves_streams else None
        return _Mover(route, prompt_tokens, self._hasher.block_size, watched)

    def _release(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is not None:
            for lease in active.leases:
                lease.release()

    def _count_hits(self, route: Route, finished: Finished) -> None:
        """The prompt tokens the index predicted the prompt's instance held, and those it
        found in its device prefix cache: their gap is the index's drift."""
        if finished.prefill is not None and route.decode is not None:
            actual = finished.prefill.num_device_hit_tokens
        elif finished.timings is not None:
            actual = finished.timings.device_hit_tokens
        else:
            return
        self._metrics.predicted_hit_tokens.inc(route.cached_tokens)
        self._metrics.actual_hit_tokens.inc(actual)

    # -- failures ---------------------------------------------------------------------------------

    def _failed_attempt(
        self, error: PdserveError, request_id: str, attempt: int, route: Route, blame: bool = True
    ) -> set[str]:
        """Count, blame (unless not `blame`) and log a failure before the first token; returns
        who to avoid."""
        self._metrics.retries.inc()
        blamed = self._blame(error, route) if blame else set()
        logger.warning("request %s attempt %d on %s -> %s failed: %s",
                       request_id, attempt, route.prefill, route.decode, error,
                       extra={"request_id": request_id})  # fmt: skip
        self._release(request_id)
        return blamed

    def _blame(self, error: Exception, route: Route) -> set[str]:
        """Instances not to retry on, marked unhealthy for a while: the side the error names
        (decode refused or unreachable: decode; prefill unreachable or its step failed:
        prefill; a transfer between them, or anything else: both). A prefill's KV-event view is
        kept: its event stream says by itself whether it is alive (a broken stream drops it)."""
        prefill, decode = route.prefill, route.decode
        if isinstance(error, ResourceExhaustedError) and decode is not None:
            return {decode}  # busy, not sick: not marked unhealthy
        if decode is None:
            blamed = {prefill}
        elif isinstance(error, DecodeUnavailableError):
            blamed = {decode}
        elif isinstance(error, InstanceUnavailableError | StepFailedError):
            blamed = {prefill}
        else:
            blamed = {prefill, decode}
        for address in blamed:
            self._membership.mark_unhealthy(address)
            self.routing.breakers.failed(address)
        if isinstance(error, InstanceUnavailableError):
            self._on_unreachable()
        return blamed

    def _lost_stream(self, error: PdserveError, streaming: str) -> str:
        """Mark the instance whose stream broke after its first token (only it held the
        request by then) unhealthy; returns it."""
        self._membership.mark_unhealthy(streaming)
        self.routing.breakers.failed(streaming)
        if isinstance(error, InstanceUnavailableError):
            self._on_unreachable()
        return streaming

    def _succeeded(self, route: Route) -> None:
        """The attempt's instances gave its first token: their breakers close."""
        self.routing.breakers.succeeded(route.prefill)
        if route.decode is not None:
            self.routing.breakers.succeeded(route.decode)

    def _exhausted(self, failure: Exception | None) -> NoCapacityError:
        """Every attempt failed: a 503 with the last failure's retry hint."""
        retry_ms = getattr(failure, "retry_after_ms", 0) or 1000  # RetryableError carries one
        return NoCapacityError(
            f"the request failed on {self.config.max_attempts} attempts; last error: {failure}; "
            "retry later",
            retry_ms,
        )


class _Mover:
    """Watches one attempt's stream for its decode instance being drained, and then ends it
    where the move costs least: when the tokens whose KV the decode instance computed (all
    but the newest) fill whole blocks, so that the next attempt reads every one of them back
    and computes only the newest token. A stream whose deltas keep skipping that point (a
    reader that lags gets several tokens at once) moves after two blocks' worth anyway."""

    def __init__(
        self, route: Route, prompt_tokens: int, block_size: int, members: Membership | None
    ) -> None:
        """`members`: whose drained marks to watch (None: streams never move)."""
        streaming = route.decode or (route.prefill if route.on_decode else None)
        # the decode instance streaming, and who says whether it is drained
        self._watch = (members, streaming) if members is not None and streaming else None
        self._tokens = prompt_tokens
        self._block_size = block_size
        self._waited = -1  # tokens streamed since the drain was seen (-1: not seen)

    def streamed(self, event: TokenDelta | Finished) -> None:
        """Count the event's tokens; raise StreamMovedError when the stream should move now."""
        if not isinstance(event, TokenDelta) or self._watch is None:
            return
        members, streaming = self._watch
        self._tokens += len(event.token_ids)
        if self._waited < 0:
            if not members.is_drained(streaming):
                return
            self._waited = 0
        self._waited += len(event.token_ids)
        computed = self._tokens - 1  # the newest token's KV is computed by the next step
        if computed % self._block_size and self._waited < 2 * self._block_size:
            return
        raise StreamMovedError(
            f"moved off {streaming}, which is drained", streaming, computed // self._block_size
        )


def _attempt_attributes(attempt: int, route: Route) -> tracing.Attributes:
    return {"pdserve.attempt": attempt, "pdserve.prefill": route.prefill,
            "pdserve.decode": route.decode or ""}  # fmt: skip


def _reported(
    record: RequestRecord, route: Route, finished: Finished, dispatched: float, first_token: float
) -> None:
    """The stages the attempt's instances reported with its end."""
    if finished.prefill is not None and route.decode is not None:
        record.prefill_reported(finished.prefill, route.prefill, dispatched)
        record.message_s = finished.message_s
    if finished.timings is not None:
        role = "decode" if route.decode is not None or route.on_decode else "mixed"
        record.stream_reported(finished.timings, route.decode or route.prefill, role, first_token)
