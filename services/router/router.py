"""Router: picks a prefill and a decode instance per request, holds their load leases, retries.

Threads: `generate` is an async generator that HTTP handlers consume on the server's event loop
(grpc.aio: no thread per request or token); one background thread per prefill instance follows
its KV-event stream into the KVEventIndex; one thread refreshes decode load. Every lease is
released exactly once on every path (success, error, retry, abort, client disconnect):
`Lease.release` is idempotent and both the generator's `finally` and `abort` call it. At most
`router.max_concurrent_requests` generations run at once (`admit`); more get a 503.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from pdserve.config import RouterConfig
from pdserve.engine.request import SamplingParams
from pdserve.errors import (
    ConfigError,
    DecodeUnavailableError,
    InstanceUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    NoCandidateError,
    NoCapacityError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    ResourceExhaustedError,
    StepFailedError,
)
from pdserve.kvcache.events import BlockRemoved, BlockStored
from pdserve.kvcache.hashing import BlockHash, BlockHasher, PromptHashes
from pdserve.metrics import RouterMetrics
from pdserve.model.tokenizer import Tokenizer
from pdserve.v1 import common_pb2
from services.router.kv_index import KVEventIndex
from services.router.load import Lease, LoadTracker
from services.router.migration import Transcript
from services.router.pd_client import Finished, PDClient, TokenDelta
from services.router.policies import (
    DecodeCapacity,
    PolicyConfig,
    RouteRequest,
    make_decode_policy,
    make_policy,
)

logger = logging.getLogger(__name__)

UNHEALTHY_COOLDOWN_S = 5.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str
    tokenizer: Tokenizer
    hasher: BlockHasher
    max_model_len: int
    vocab_size: int


@dataclass(slots=True)
class _Active:
    prefill: str
    decode: str | None  # None: `prefill` is a mixed instance
    leases: tuple[Lease, ...]


class Router:
    def __init__(
        self,
        config: RouterConfig,
        model: ModelInfo,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: PDClient | None = None,
        mixed: Sequence[str] = (),
    ) -> None:
        if mixed and (prefill or decode):
            raise ConfigError("a router serves either mixed instances or prefill + decode pairs")
        self.config = config
        self.model = model
        self.mixed = bool(mixed)
        self.prefill = list(mixed) or list(prefill)  # mixed instances take the prefill role
        self.decode = list(decode)
        self.client = client or PDClient()
        self.index = KVEventIndex()
        self.load = LoadTracker()
        tuning = PolicyConfig(
            load_weight=config.load_weight,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
        )
        # Prometheus HTTP SD groups ({targets, labels}), filled in by whoever started us
        self.scrape_targets: list[dict[str, Any]] = []
        self.policy = make_policy(config.prefill_policy, tuning)
        self.decode_policy = make_decode_policy("least_kv_usage", tuning)
        self._decode_load: dict[str, DecodeCapacity] = {}
        self.metrics = RouterMetrics()
        self._unhealthy_until: dict[str, float] = {}
        self.drained: set[str] = set()  # no new requests; in-flight ones finish
        self._active: dict[str, _Active] = {}
        self._transcripts: dict[str, Transcript] = {}  # every request being generated
        # called when an instance could not be reached (the supervisor checks liveness now)
        self.on_unreachable: Callable[[], None] = lambda: None
        self.draining = False  # shutting down: new requests are refused, in-flight ones finish
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        for address in self.prefill:
            self._spawn(self._follow_kv_events, address)
        self._spawn(self._poll_decode_load)

    def add_instance(self, role: str, address: str) -> None:
        """Start routing to a new instance (prefill, mixed or decode)."""
        if role == "decode":
            self.decode = [*self.decode, address]
            return
        self.prefill = [*self.prefill, address]
        self._spawn(self._follow_kv_events, address)

    def remove_instance(self, address: str) -> None:
        """Stop routing to an instance (drain it first to let its requests finish)."""
        self.prefill = [a for a in self.prefill if a != address]
        self.decode = [a for a in self.decode if a != address]
        self.drained.discard(address)
        self.index.drop_instance(address)

    def set_policy(self, name: str) -> str:
        """Switch the prefill routing policy; returns the previous one. Raises ConfigError."""
        tuning = self.policy.config
        self.policy = make_policy(name, tuning)
        previous = self.config.prefill_policy
        self.config = replace(self.config, prefill_policy=name)
        return previous

    def stop(self) -> None:
        self._stopped.set()
        self.client.close()
        for thread in self._threads:
            thread.join(5)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    # -- request edge ---------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def num_prefill(self) -> int:
        return len(self.prefill)

    @property
    def num_decode(self) -> int:
        return len(self.decode)

    @property
    def num_running(self) -> int:
        """Generations running now (each `n` choice is one)."""
        return len(self._transcripts)

    def check_accepting(self) -> None:
        """Raise NoCapacityError (a 503 with Retry-After) while the cluster is shutting down."""
        if self.draining:
            raise NoCapacityError("the cluster is shutting down; retry on another one", 5000)

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to `timeout_s` for the in-flight ones to finish;
        returns whether they all did."""
        self.draining = True
        return self._wait_until(lambda: not self._transcripts, timeout_s)

    def wait_idle(self, address: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no request the router routed holds `address` (its
        lease: a prefill's ends with its first token); returns whether none does."""
        return self._wait_until(
            lambda: not self.load.load_of(address).in_flight_requests, timeout_s
        )

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Poll `done` (other threads finish the requests) for up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._stopped.wait(0.05)
        return done()

    def admit(self, generations: int) -> None:
        """Raise NoCapacityError (a 503 with Retry-After) when `generations` more would pass
        `router.max_concurrent_requests`."""
        limit = self.config.max_concurrent_requests
        if self.num_running + generations > limit:
            self.metrics.rejected.inc()
            raise NoCapacityError(
                f"the router runs {self.num_running} generations, its limit is {limit} "
                "(router.max_concurrent_requests); retry later",
                1000,
            )

    def check_model(self, name: str) -> None:
        if name != self.model.model_id:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves {self.model.model_id!r}"
            )

    def tokenize(self, prompt: str) -> list[int]:
        return self.model.tokenizer.encode(prompt)

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.model.tokenizer.encode_chat(messages, tools)

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        limit = self.model.max_model_len
        if len(token_ids) >= limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; "
                f"the prompt has {len(token_ids)} tokens (at least one is needed for output)"
            )
        if len(token_ids) + params.max_tokens > limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, "
                f"{params.max_tokens} to generate): lower max_tokens to at most "
                f"{limit - len(token_ids)}"
            )

    # -- generation -------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """Route and run one request (on the event loop). Errors before the first token are
        retried on other instances (bounded, with backoff), then raised as NoCapacityError; a
        stream whose instance fails after that continues on another (a migration, at most
        `migration_limit` times), token-identical to an undisturbed run."""
        transcript = Transcript(self.model.tokenizer, token_ids, params)
        self._transcripts[request_id] = transcript
        excluded: set[str] = set()
        try:
            while True:
                prompt, resumed = transcript.submission()
                events = self._attempts(request_id, prompt, resumed, excluded)
                try:
                    event: TokenDelta | Finished | None = None
                    async for event in events:
                        for relayed in transcript.relay(event):
                            yield relayed
                        if transcript.finished:
                            break
                    if not isinstance(event, Finished):  # ended by a stop string at the seam
                        await asyncio.to_thread(self.abort, request_id)
                    return
                except (InstanceUnavailableError, StepFailedError) as e:
                    final = self._migrate(request_id, transcript, e)
                    if final is not None:
                        yield final
                        return
                finally:
                    await events.aclose()
        finally:
            del self._transcripts[request_id]

    def _migrate(
        self, request_id: str, transcript: Transcript, error: PdserveError
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
        logger.warning(
            "request %s migrates after %d tokens (%s): %s",
            request_id, len(transcript.token_ids), reason, error,
        )  # fmt: skip
        return transcript.begin_migration()

    async def _attempts(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        excluded: set[str],
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """One routed run of the request; failures before its first token are retried on
        other instances. A failure after it blames the instance that was streaming (added to
        `excluded`) and is raised."""
        hashes = self.model.hasher.hash_tokens(token_ids)
        chain = PromptHashes(self.model.hasher.root, self.model.hasher.block_size, tuple(hashes))
        backoff = self.config.retry_backoff_s  # doubles after each failed attempt
        failure: Exception | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            if self._transcripts[request_id].aborted:
                raise RequestAbortedError(f"request {request_id} was aborted")
            prefill, decode, cached = self._choose(request_id, token_ids, hashes, excluded)
            leases = self._take_leases(request_id, prefill, decode, len(token_ids) - cached)
            events = self._start(prefill, decode, token_ids, params, request_id, chain)
            try:
                try:
                    first = await anext(events)
                except (InvalidRequestError, RequestAbortedError):
                    raise  # the caller's mistake, or stopped on purpose: not retried
                except PdserveError as e:
                    failure = e
                    excluded |= self._failed_attempt(e, request_id, attempt, prefill, decode)
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                if decode is None:
                    leases[0].finish_prefill()  # mixed: the prompt is computed, decoding goes on
                else:
                    leases[0].release()  # prefill is done once the first token exists
                yield first
                try:
                    async for event in events:
                        yield event
                except (InstanceUnavailableError, StepFailedError) as e:
                    excluded.add(self._lost_stream(e, decode or prefill))
                    raise
                return
            finally:
                await events.aclose()
                self._release(request_id)
        raise self._exhausted(failure)

    def _exhausted(self, failure: Exception | None) -> NoCapacityError:
        """Every attempt failed: a 503 with the last failure's retry hint."""
        retry_ms = getattr(failure, "retry_after_ms", 0) or 1000  # RetryableError carries one
        return NoCapacityError(
            f"the request failed on {self.config.max_attempts} attempts; last error: {failure}; "
            "retry later",
            retry_ms,
        )

    def _take_leases(
        self, request_id: str, prefill: str, decode: str | None, uncached: int
    ) -> tuple[Lease, ...]:
        """Count the request on its instances: only the tokens prefill must compute count as
        its prefill load."""
        leases: tuple[Lease, ...] = (self.load.acquire(prefill, max(1, uncached)),)
        if decode is not None:
            leases += (self.load.acquire(decode, 0),)
        self._active[request_id] = _Active(prefill, decode, leases)
        return leases

    def _start(
        self,
        prefill: str,
        decode: str | None,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hashes: PromptHashes,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """The instances take the prompt's hash chain after checking three links of it: the
        prompt is hashed once, here, not on every instance it passes."""
        if decode is None:
            return self.client.agenerate_mixed(prefill, token_ids, params, request_id, hashes)
        return self.client.agenerate(prefill, decode, token_ids, params, request_id, hashes)

    def active_requests(self) -> set[str]:
        """Ids of the requests the router is serving now."""
        return set(self._active)

    def abort(self, request_id: str) -> None:
        """Stop a request on every instance that holds it and release its leases."""
        transcript = self._transcripts.get(request_id)
        if transcript is not None:
            transcript.aborted = True  # its instance may be dying: it must not continue elsewhere
        active = self._active.get(request_id)
        if active is None:
            return
        self.client.abort(active.prefill, active.decode, request_id)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is not None:
            for lease in active.leases:
                lease.release()

    def export_load(self) -> None:
        """Copy the in-flight lease counts and index sizes into their gauges (before a scrape)."""
        self.metrics.running.set(self.num_running)
        for address in [*self.prefill, *self.decode]:
            load = self.load.load_of(address)
            self.metrics.in_flight.labels(address).set(load.in_flight_requests)
        for address in self.prefill:
            self.metrics.indexed_blocks.labels(address).set(self.index.num_blocks(address))

    def _blame(self, error: Exception, prefill: str, decode: str | None) -> set[str]:
        """Instances not to retry on, marked unhealthy for a while: the side the error names
        (decode refused or unreachable: decode; prefill unreachable or its step failed:
        prefill; a transfer between them, or anything else: both). A prefill's KV-event view is
        kept: its event stream says by itself whether it is alive (a broken stream drops it)."""
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
        now = time.monotonic()
        for address in blamed:
            self._unhealthy_until[address] = now + UNHEALTHY_COOLDOWN_S
        if isinstance(error, InstanceUnavailableError):
            self.on_unreachable()
        return blamed

    def _failed_attempt(
        self, error: PdserveError, request_id: str, attempt: int, prefill: str, decode: str | None
    ) -> set[str]:
        """Count, blame and log a failure before the first token; returns who to avoid."""
        self.metrics.retries.inc()
        blamed = self._blame(error, prefill, decode)
        logger.warning("request %s attempt %d on %s -> %s failed: %s",
                       request_id, attempt, prefill, decode, error)  # fmt: skip
        self._release(request_id)
        return blamed

    def _lost_stream(self, error: PdserveError, streaming: str) -> str:
        """Mark the instance whose stream broke after its first token (only it held the
        request by then) unhealthy; returns it."""
        self._unhealthy_until[streaming] = time.monotonic() + UNHEALTHY_COOLDOWN_S
        if isinstance(error, InstanceUnavailableError):
            self.on_unreachable()
        return streaming

    def _choose(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        excluded: set[str],
    ) -> tuple[str, str | None, int]:
        """(prefill or mixed instance, decode instance or None, prompt tokens it holds)."""
        prefills = self._candidates(self.prefill, excluded)
        request = RouteRequest(request_id, len(token_ids), self.model.hasher.block_size)
        try:
            overlaps = self.index.overlaps(hashes, prefills)
            prefill = self.policy.choose(prefills, request, self.load.snapshot(), overlaps)
            self.metrics.decisions.labels(self.config.prefill_policy, str(prefill.reason)).inc()
            cached = prefill.overlap_blocks * self.model.hasher.block_size
            if self.mixed:
                return prefill.instance_id, None, cached
            decodes = self._candidates(self.decode, excluded)
            decode = self.decode_policy.choose(decodes, request, dict(self._decode_load))
        except NoCandidateError as e:
            raise NoCapacityError(str(e), 1000) from e
        logger.debug(
            "request %s -> prefill %s (%s, %d blocks cached) -> decode %s",
            request_id, prefill.instance_id, prefill.reason, prefill.overlap_blocks,
            decode.instance_id,
        )  # fmt: skip
        return prefill.instance_id, decode.instance_id, cached

    def _candidates(self, instances: list[str], excluded: set[str]) -> list[str]:
        now = time.monotonic()
        instances = [i for i in instances if i not in self.drained]
        healthy = [i for i in instances if self._unhealthy_until.get(i, 0.0) <= now]
        preferred = [i for i in healthy if i not in excluded]
        chosen = preferred or healthy or [i for i in instances if i not in excluded] or instances
        if not chosen:
            raise NoCapacityError("no instance is configured", 1000)
        return chosen

    # -- background -------------------------------------------------------------------------------

    def _follow_kv_events(self, address: str) -> None:
        """Mirror one prefill (or mixed) instance's KV events: each subscription starts with a
        snapshot that replaces the view, then live events. On disconnect drop the view and
        resubscribe (until the instance is removed)."""
        while not self._stopped.is_set() and address in self.prefill:
            stream = self.client.instance(address).kv_events()
            try:
                for event in stream:
                    self._apply_kv_event(address, event)
                    if self._stopped.is_set() or address not in self.prefill:
                        stream.cancel()
            except grpc.RpcError:
                pass
            self.index.drop_instance(address)
            self._stopped.wait(1.0)

    def _apply_kv_event(self, address: str, event: common_pb2.KVEvent) -> None:
        self._unhealthy_until.pop(address, None)
        kind = event.WhichOneof("event")
        if kind == "snapshot":
            hashes = tuple(BlockHash(h) for h in event.snapshot.block_hashes)
            self.index.replace_instance(address, hashes)
        elif kind == "stored":
            hashes = tuple(BlockHash(h) for h in event.stored.block_hashes)
            self.index.apply(address, BlockStored(hashes))
        elif kind == "removed":
            hashes = tuple(BlockHash(h) for h in event.removed.block_hashes)
            self.index.apply(address, BlockRemoved(hashes))

    def _poll_decode_load(self) -> None:
        while not self._stopped.wait(self.config.stats_interval_s):
            for address in self.decode:
                try:
                    stats = self.client.instance(address).stats()
                except PdserveError:
                    self._decode_load.pop(address, None)
                    continue
                self._decode_load[address] = DecodeCapacity(
                    stats.num_free_blocks, stats.num_running
                )
