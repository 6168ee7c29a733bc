"""Router: runs each request on a prefill and a decode instance (or one mixed instance) and
continues a broken stream elsewhere.

An orchestrator of small parts:
- `Membership`: the instances of each role, drained and unhealthy marks (one lock);
- `KVEventFollower`: every instance's KV-event stream: its blocks mirrored into the prefix
  index, its load reports for the policies;
- `StatsPoller`: with conditional disaggregation, the instances' step time models;
- `Attempts`: choosing a route, load leases, blame and retries before the first token;
- `Transcript` (migration): what a request streamed so far, to continue it elsewhere.

Threads: `generate` is an async generator that HTTP handlers consume on the server's event loop
(grpc.aio: no thread per request or token); the followers run on their own threads. `admit`
holds a request in the `AdmissionQueue` while the cluster is saturated (at most
`router.max_concurrent_requests` generations run at once; every candidate's waiting requests
or free blocks); past the queue's bounds it gets 429.
"""

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncGenerator, Callable

from pdserve.config import ObservabilityConfig, RouterConfig
from pdserve.engine.request import SamplingParams
from pdserve.errors import (
    InstanceUnavailableError,
    NoCapacityError,
    PdserveError,
    RequestAbortedError,
    StepFailedError,
    StreamMovedError,
)
from pdserve.metrics import RouterMetrics
from pdserve.observability import tracing
from pdserve.transfer.base import PrefixSource
from services.router.admission import AdmissionQueue
from services.router.attempts import Attempts
from services.router.followers import KVEventFollower, StatsPoller
from services.router.history import RequestHistory
from services.router.membership import Membership, Role
from services.router.migration import Transcript
from services.router.model_info import ModelInfo
from services.router.pd_client import Finished, PDClient, TokenDelta
from services.router.timeline import RecentRequests, RequestRecord

logger = logging.getLogger(__name__)

# a removed instance's channels are closed this long after it left routing (a role change adds
# it back meanwhile), once no request of this router holds it any more
RELEASE_CHANNELS_AFTER_S = 30.0


class Router:
    def __init__(
        self,
        config: RouterConfig,
        model: ModelInfo,
        membership: Membership,
        client: PDClient | None = None,
        *,
        on_unreachable: Callable[[], None] = lambda: None,
        observability: ObservabilityConfig | None = None,
    ) -> None:
        """`on_unreachable` is called (from any thread, must not block) when an instance
        could not be reached: the supervisor checks liveness now."""
        observability = observability or ObservabilityConfig()
        self.config = config
        self.recent = RecentRequests(observability.recent_requests)  # `pdserve admin trace`
        self.history = RequestHistory()  # what the planner forecasts from
        self._request_log = observability.request_log
        self.model = model
        self.membership = membership
        self.client = client or PDClient()
        self.metrics = RouterMetrics()
        self.stats = StatsPoller(membership, self.client, config.stats_interval_s)
        self.kv_events = KVEventFollower(membership, self.client, self.metrics)
        self.attempts = Attempts(
            config,
            model.hasher,
            membership,
            self.kv_events.index,
            self.kv_events.load,
            self.client,
            self.metrics,
            on_unreachable,
            self.stats.stats,
        )
        self.kv_events.on_acknowledged = self.attempts.load.acknowledge
        self.queue = AdmissionQueue(
            config.queue_max_requests, config.queue_timeout_s, self._saturated, self.metrics
        )
        self.attempts.on_routed = self.queue.pump  # the next waiter's check counts this one
        self._transcripts: dict[str, Transcript] = {}  # every request being generated
        self._draining = False  # shutting down: new requests are refused, in-flight ones finish
        self._stopped = threading.Event()
        self.release_channels_after_s = RELEASE_CHANNELS_AFTER_S

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        for role in (Role.PREFILL, Role.DECODE):
            for address in self.membership.members(role):
                self.kv_events.follow(address)
        if self.attempts.disaggregation.mode == "auto":
            self.stats.start()

    def stop(self) -> None:
        self._stopped.set()
        self.kv_events.stop()
        self.stats.stop()
        self.client.close()

    def add_instance(self, role: str, address: str) -> None:
        """Start routing to a new instance (prefill, mixed or decode)."""
        # a mixed instance takes the prefill role
        self.membership.add(Role.DECODE if role == Role.DECODE else Role.PREFILL, address)
        self.kv_events.follow(address)

    def remove_instance(self, address: str) -> None:
        """Stop routing to an instance (drain it first to let its requests finish)."""
        self.membership.remove(address)
        self.kv_events.forget(address)
        self.attempts.routing.breakers.forget(address)
        self.metrics.forget_instance(address)
        self._release_channels_later(address)

    def _release_channels_later(self, address: str) -> None:
        timer = threading.Timer(self.release_channels_after_s, self._release_channels, (address,))
        timer.daemon = True
        timer.start()

    def _release_channels(self, address: str) -> None:
        """Close the channels to a removed instance (see `ChannelPool.forget`), unless it was
        added back; later while a request still holds it (a stream migrating away from it)."""
        if self._stopped.is_set() or address in self.membership:
            return
        if self.attempts.load.load_of(address).in_flight_requests:
            self._release_channels_later(address)
            return
        self.client.forget(address, keep=lambda: address in self.membership)

    def set_policy(self, name: str) -> str:
        """Switch the prefill routing policy; returns the previous one. Raises ConfigError."""
        return self.attempts.set_policy(name)

    # -- admission and draining -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Generations running now (each `n` choice is one)."""
        return len(self._transcripts)

    async def admit(
        self, generations: int, prompt_tokens: int, user: str = "", priority: int = 0,
        key: str = "",
    ) -> None:  # fmt: skip
        """Return when `generations` generations of a prompt of `prompt_tokens` tokens may be
        routed: at once while the cluster has room, else after waiting their turn in the
        admission queue (`user`: who takes turns, `priority`: lower first, `key`: the API key's
        name). Raises NoCapacityError (503) while the cluster shuts down, RateLimitedError (429)
        when the queue is full or the wait passed `router.queue_timeout_s`."""
        if self._draining:
            raise NoCapacityError("the cluster is shutting down; retry on another one", 5000)
        await self.queue.enter(user, priority, prompt_tokens, generations, key)
        if key:
            self.metrics.key_requests.labels(key).inc()

    def _saturated(self, generations: int, prompt_tokens: int) -> bool:
        """No room for `generations` more of a prompt of `prompt_tokens` tokens: the router's
        concurrency limit, or every routable instance of a role is saturated (its waiting
        requests, or its free blocks for the prompt: `Routing.saturated`)."""
        if self.num_running + generations > self.config.max_concurrent_requests:
            return True
        routing = self.attempts.routing
        blocks = math.ceil(prompt_tokens / routing.block_size)
        waiting = self.config.queue_when_waiting
        roles = (Role.PREFILL,) if self.membership.mixed else (Role.PREFILL, Role.DECODE)
        for role in roles:
            limit = waiting if role == Role.PREFILL else None  # decode: only its blocks
            candidates = self.membership.routable(role)
            if candidates and all(routing.saturated(a, blocks, limit) for a in candidates):
                return True
        return False

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to `timeout_s` for the in-flight ones to finish;
        returns whether they all did."""
        self._draining = True
        return self._wait_until(lambda: not self._transcripts, timeout_s)

    def wait_idle(self, address: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no request holds `address`: none this router routed
        there (its lease: a prefill's ends with its first token) and none by the instance's
        last load report (other routers', e.g. the replicas'); returns whether none does."""
        load = self.attempts.load

        def idle() -> bool:
            report = self.kv_events.load(address)
            reported = report is not None and report.num_requests > 0
            return not load.load_of(address).in_flight_requests and not reported

        return self._wait_until(idle, timeout_s)

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Poll `done` (other threads finish the requests) for up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._stopped.wait(0.05)
        return done()

    # -- generation -------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: float | None = None,
        parent: tracing.Context | None = None,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """Route and run one request (on the event loop). Errors before the first token are
        retried on other instances (bounded, with backoff), then raised as NoCapacityError; a
        stream whose instance fails after that continues on another (a migration, at most
        `migration_limit` times), token-identical to an undisturbed run. `arrival`: when it
        came (time.perf_counter(); default now); `parent`: the caller's trace context."""
        record = RequestRecord(request_id, len(token_ids), arrival or time.perf_counter(), parent)
        self.recent.started(record)
        self.history.arrived(record.arrival)
        status, error = "abort", None  # closed before its end: the client went away
        model = self.model
        transcript = Transcript(
            model.tokenizer,
            token_ids,
            params,
            eos_token_ids=model.eos_token_ids,
            max_model_len=model.max_model_len,
            grammars=model.grammars,
        )
        self._transcripts[request_id] = transcript
        excluded: set[str] = set()
        source: PrefixSource | None = None  # where a moved stream's context is read back
        hold: Callable[[], object] | None = None  # releases the router's hold on that instance
        try:
            while True:
                prompt, resumed = transcript.submission()
                events = self.attempts.run(
                    request_id, prompt, resumed, excluded, lambda: transcript.aborted, record,
                    source,
                )  # fmt: skip
                try:
                    event: TokenDelta | Finished | None = None
                    async for event in events:
                        if hold is not None:  # the source was read before the first token
                            hold()
                            hold = None
                        for relayed in transcript.relay(event):
                            if isinstance(relayed, Finished):
                                status = relayed.finish_reason
                            yield relayed
                        if transcript.finished:
                            break
                    if not isinstance(event, Finished):  # ended by a stop string at the seam
                        await asyncio.to_thread(self.abort, request_id)
                    return
                except StreamMovedError as e:
                    source = self._move(request_id, transcript, e, record)
                    hold = e.release_hold
                    final = transcript.begin_migration()
                    if final is not None:
                        status = final.finish_reason
                        yield final
                        return
                except (InstanceUnavailableError, StepFailedError) as e:
                    source = None
                    final = self._migrate(request_id, transcript, e, record)
                    if final is not None:
                        status = final.finish_reason
                        yield final
                        return
                finally:
                    await events.aclose()
        except Exception as e:
            status, error = f"error: {e}", e
            raise
        finally:
            if hold is not None:
                hold()
            del self._transcripts[request_id]
            record.output_tokens = len(transcript.token_ids)
            self._finished(record, status, error)
            self.queue.pump()  # its place is free

    def _finished(self, record: RequestRecord, status: str, error: BaseException | None) -> None:
        """The request's last stage (`stream`: first token to end), its histograms, its log
        line, its place among the recent requests."""
        if record.first_token is not None:
            record.add("stream", record.first_token, time.perf_counter(), "",
                       {"output_tokens": record.output_tokens})  # fmt: skip
        record.finish(status, error)
        if record.dispatched is not None:
            self.metrics.queue_time.observe(record.dispatched - record.arrival)
        sample = record.sample()
        if sample.tpot_s is not None:
            self.metrics.time_per_output_token.observe(sample.tpot_s)
        if sample.message_s is not None:
            self.metrics.message_time.observe(sample.message_s)
        if status in ("stop", "length"):  # served whole: a sample of the workload
            self.history.add(sample)
        if self._request_log and logger.isEnabledFor(logging.INFO):
            _log_request(record)
        self.recent.finished(record)

    def _migrate(
        self, request_id: str, transcript: Transcript, error: PdserveError, record: RequestRecord
    ) -> Finished | None:
        """Prepare `transcript` to continue after `error` broke its stream, or raise it (as
        the cause of the error that ends the stream) when the request may not migrate."""
        context = len(transcript.prompt) + len(transcript.token_ids)
        limit = self.config.migration_max_tokens
        if transcript.aborted:
            raise RequestAbortedError(f"request {request_id} was aborted") from error
        if transcript.migrations >= self.config.migration_limit:
            raise InstanceUnavailableError(
                f"the stream broke after {transcript.migrations} migrations "
                f"(router.migration_limit): {error}"
            ) from error
        if limit is not None and context > limit:
            raise InstanceUnavailableError(
                f"the stream broke and its {context} tokens exceed router.migration_max_tokens "
                f"({limit}): {error}"
            ) from error
        reason = "step_failed" if isinstance(error, StepFailedError) else "instance_lost"
        self.metrics.migrations.labels(reason).inc()
        record.migrations += 1
        now = time.perf_counter()
        record.add("migration", now, now, "", {"reason": reason,
                                               "tokens": len(transcript.token_ids)})  # fmt: skip
        logger.warning(
            "request %s migrates after %d tokens (%s): %s",
            request_id, len(transcript.token_ids), reason, error,
            extra={"request_id": request_id},
        )  # fmt: skip
        return transcript.begin_migration()

    def _move(
        self,
        request_id: str,
        transcript: Transcript,
        moved: StreamMovedError,
        record: RequestRecord,
    ) -> PrefixSource:
        """Record a stream moved off a drained decode instance; returns where its context is
        read back from. A move is not a failure: neither `migration_limit` nor
        `migration_max_tokens` applies (a drain never ends a stream)."""
        context = len(transcript.prompt) + len(transcript.token_ids)
        self.metrics.migrations.labels("moved").inc()
        self.metrics.moved_context_tokens.inc(context)
        record.migrations += 1
        now = time.perf_counter()
        record.add("migration", now, now, "", {"reason": "moved", "from": moved.address,
                                               "tokens": len(transcript.token_ids),
                                               "pull_blocks": moved.num_blocks})  # fmt: skip
        logger.info(
            "request %s moves off %s after %d tokens (%d blocks of context read back)",
            request_id, moved.address, len(transcript.token_ids), moved.num_blocks,
            extra={"request_id": request_id},
        )  # fmt: skip
        return PrefixSource(moved.address, moved.num_blocks)

    def abort(self, request_id: str) -> None:
        """Stop a request on every instance that holds it and release its leases (blocking)."""
        transcript = self._transcripts.get(request_id)
        if transcript is not None:
            transcript.aborted = True  # its instance may be dying: it must not continue elsewhere
        self.attempts.abort(request_id)

    def active_requests(self) -> set[str]:
        """Ids of the requests the router is serving now."""
        return set(self._transcripts)

    def export_load(self) -> None:
        """Copy the in-flight lease counts and index sizes into their gauges (before a scrape)."""
        self.metrics.running.set(self.num_running)
        prefill = self.membership.members(Role.PREFILL)
        for address in (*prefill, *self.membership.members(Role.DECODE)):
            load = self.attempts.load.load_of(address)
            self.metrics.in_flight.labels(address).set(load.in_flight_requests)
        for address in prefill:
            self.metrics.indexed_blocks.labels(address).set(
                self.kv_events.index.num_blocks(address)
            )


def _log_request(record: RequestRecord) -> None:
    """One INFO line per finished request: its status, tokens and where its time went (the
    stages as JSON fields with `observability.log_format: json`)."""
    duration = (record.ended or time.perf_counter()) - record.arrival
    stages = {name: round(seconds, 6) for name, seconds in record.stage_durations().items()}
    logger.info(
        "request %s %s: %d prompt + %d output tokens in %.3f s, %d attempts, %d migrations; %s",
        record.request_id, record.status, record.prompt_tokens, record.output_tokens, duration,
        record.attempts, record.migrations,
        " ".join(f"{name}={seconds * 1000:.1f}ms" for name, seconds in stages.items()),
        extra={"request_id": record.request_id, "trace_id": record.trace_id,
               "status": record.status, "prompt_tokens": record.prompt_tokens,
               "output_tokens": record.output_tokens, "duration_s": round(duration, 6),
               "stages": stages},
    )  # fmt: skip
