"""Scheduler: continuous batching with a token budget, chunked prefill and preemption.

Each step it first continues running requests (oldest first: a decode token, or the next prefill
chunk), then admits waiting requests in arrival order while the budget, the sequence limit and the
KV pool allow (a request whose blocks were preallocated, which PD prefill does, is not held back
by an earlier one the pool cannot hold yet). When a running request cannot get a block, the
newest running request is preempted (its blocks freed, its KV recomputed later: published blocks
usually still hit the prefix cache).
"""

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.admission import PromptAdmission
from pdserve.engine.request import Request, RequestStatus
from pdserve.errors import DuplicateRequestError
from pdserve.kvcache.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def completes_known_tokens(self) -> bool:
        """After this chunk every known token is computed: its logits give the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    """Counted on the engine thread; read there too (stats snapshots are engine-thread calls)."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of requests scheduled for the first time
    device_hit_tokens: int = 0  # of which were found in the device prefix cache
    storage_hit_tokens: int = 0  # of which were loaded from the storage tier
    peer_hit_tokens: int = 0  # of which were pulled from a decode instance
    num_computed_tokens: int = 0  # tokens run through forward passes
    num_steps: int = 0  # engine steps run (`LLMEngine.step`)
    step_seconds: float = 0.0  # their wall time: schedule, forward pass, update
    # between a step that left work and the next: the loop's mailbox, outputs, GIL waits
    step_gaps: int = 0
    step_gap_seconds: float = 0.0


class Scheduler:
    """Owns the waiting queue and the running batch. Engine thread only (not thread-safe)."""

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, admission: PromptAdmission
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.admission = admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_order
        # prompts computed elsewhere (decode's handoffs) waiting for a place in the batch
        self.prefilled: deque[Request] = deque()
        # after an out-of-memory step: a lower token budget until `_limited_until` (monotonic)
        self._budget_limit = config.max_num_batched_tokens
        self._limited_until = 0.0
        self.clock = time.monotonic
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.kv_cache.arrived(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted (waiting or running) and not computed yet."""
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for requests in (self.waiting, self.running)
            for r in requests
        )

    def has_schedulable_requests(self) -> bool:
        """Requests a step could advance (TRANSFERRING requests and storage reads wait on I/O)."""
        connector = self.admission.storage_connector
        if connector is None or not connector.has_pending:
            return bool(self.running or self.waiting or self.prefilled)
        return bool(self.running or self.prefilled) or any(
            not connector.is_pending(r.request_id) for r in self.waiting
        )

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks and allocate their KV blocks."""
        while self.prefilled and len(self.running) < self.config.max_num_seqs:
            self._run(self.prefilled.popleft())
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.token_budget())
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def token_budget(self) -> int:
        """Tokens a step may schedule: `max_num_batched_tokens`, or less for a while after a
        step ran out of memory (`limit_budget`)."""
        if self.clock() < self._limited_until:
            return self._budget_limit
        return self.config.max_num_batched_tokens

    def limit_budget(self, tokens: int, for_s: float) -> None:
        """Schedule at most `tokens` (at least 1) per step for the next `for_s` seconds."""
        self._budget_limit = max(1, min(tokens, self.config.max_num_batched_tokens))
        self._limited_until = self.clock() + for_s

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and release its blocks. Idempotent."""
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        self._unqueue(request)
        request.status = status
        self.kv_cache.free(request.request_id)
        self.admission.forget(request.request_id)

    def hold_for_transfer(self, request: Request) -> None:
        """Take a request out of the batch but keep its blocks pinned (status TRANSFERRING)."""
        self._unqueue(request)
        request.status = RequestStatus.TRANSFERRING

    def admit_running(self, request: Request) -> None:
        """Add a request whose KV is already in its blocks (received from a prefill instance)
        to the running batch, or, while it holds `max_num_seqs`, to the queue of prefilled
        requests that join it as places free up (first come, first served)."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        if self.prefilled or len(self.running) >= self.config.max_num_seqs:
            request.status = RequestStatus.WAITING
            self.prefilled.append(request)
        else:
            self._run(request)

    def admit_prefilled(self, request: Request) -> None:
        """`admit_running` for a request whose whole prompt's KV is in its (allocated) blocks:
        the prompt counts as computed and its full blocks are published."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache.update_cache_blocks(request, request.num_prompt_tokens)
        self.admit_running(request)

    def computed(self, chunk: ScheduledChunk) -> bool:
        """A scheduled chunk's forward pass ran: its tokens count as computed and the blocks
        they filled are published. Returns whether its logits give the request's next token."""
        request = chunk.request
        samples = chunk.completes_known_tokens
        request.num_computed_tokens += chunk.num_new_tokens
        self.stats.num_computed_tokens += chunk.num_new_tokens
        self.kv_cache.update_cache_blocks(request, request.num_computed_tokens)
        return samples

    def _run(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.arrival_order)

    def _unqueue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, request.num_computed_tokens + num_new, output):
                break  # `request` itself was preempted; everything after it too
            self.kv_cache.allocate(request, request.num_computed_tokens + num_new)
            output.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _make_room(self, request: Request, num_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `request` can cover `num_tokens`.
        Returns False when `request` had to be preempted itself."""
        while not self.kv_cache.can_allocate(request, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Take a running request out of the batch and free its blocks; it waits at the head of
        the queue to be recomputed (or restored from storage). Counted once per preemption."""
        self.running.remove(request)
        self.kv_cache.free(request.request_id, preempted=True)
        request.status = RequestStatus.PREEMPTED
        self.admission.forget(request.request_id)  # its blocks may be in storage by re-admission
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info("preempted request %s (%d tokens)", request.request_id, request.num_tokens,
                    extra={"request_id": request.request_id})  # fmt: skip

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        connector = self.admission.storage_connector
        # once the pool cannot hold a request, later ones wait behind it (arrival order),
        # except those whose blocks were preallocated: they hold them already, and waiting
        # would pin them until the head's blocks free, which may be never
        short = False
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if connector is not None and connector.is_pending(request.request_id):
                continue  # its storage read is in flight; later requests may go first
            if not self.kv_cache.has_request(request.request_id):  # else: preallocated
                if short:
                    continue
                if connector is not None:
                    device_blocks = self.admission.device_hit_blocks(request)
                    if connector.needs_prefetch(request, device_blocks):
                        connector.prefetch(request, device_blocks)
                        continue
                if self.admission.admit(request, token_budget=budget) is None:
                    short = True
                    continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache.can_allocate(request, request.num_computed_tokens + num_new):
                return
            self.kv_cache.allocate(request, request.num_computed_tokens + num_new)
            self.waiting.remove(request)
            self._count_first_step(request)
            self._run(request)
            output.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new

    def _count_first_step(self, request: Request) -> None:
        """Hit-rate counters: each request once, when it is first scheduled."""
        if request.first_scheduled_at is not None:
            return
        request.first_scheduled_at = time.perf_counter()
        self.stats.prefix_cache_queries += request.num_prompt_tokens
        self.stats.device_hit_tokens += request.device_hit_tokens or 0
        self.stats.storage_hit_tokens += request.storage_hit_tokens
        self.stats.peer_hit_tokens += request.peer_hit_tokens
