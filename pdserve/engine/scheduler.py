"""Scheduler: continuous batching with a token budget, chunked prefill and preemption.

Each step it first continues running requests (oldest first: a decode token, or the next prefill
chunk), then admits waiting requests in arrival order while the budget, the sequence limit and the
KV pool allow. When a running request cannot get a block, the newest running request is preempted
(its blocks freed, its KV recomputed later: published blocks usually still hit the prefix cache).
"""

import bisect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.request import Request, RequestStatus, StorageFetch
from pdserve.errors import DuplicateRequestError
from pdserve.kvcache.manager import NO_MATCH, KVCacheManager

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


@dataclass(frozen=True, slots=True)
class StagedLoad:
    """Blocks [first_block, first_block + num_blocks) of the request's table are to be filled
    from its staged storage bytes before this step's forward pass."""

    request: Request
    first_block: int
    num_blocks: int


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    loads: list[StagedLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of requests admitted for the first time
    prefix_cache_hits: int = 0  # of which were found in the device prefix cache
    storage_cache_hits: int = 0  # of which were loaded from the storage tier
    storage_loaded_tokens: int = 0  # every load from storage, re-admissions after preemption too
    num_computed_tokens: int = 0  # tokens run through forward passes


class Scheduler:
    """Owns the waiting queue and the running batch. Not thread-safe: the engine loop calls it."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        prefetch: Callable[[Request, int], bool] | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        # asks the storage tier to read ahead what a request's device prefix hit lacks; returns
        # whether it did (the request then waits for the answer, others are admitted meanwhile)
        self.prefetch = prefetch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_order
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Requests a step could advance (TRANSFERRING requests and storage reads wait on I/O)."""
        return bool(self.running) or any(
            r.storage_fetch != StorageFetch.PENDING for r in self.waiting
        )

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks and allocate their KV blocks."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and release its blocks. Idempotent."""
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        self._unqueue(request)
        request.status = status
        self.kv_cache.free(request.request_id)

    def hold_for_transfer(self, request: Request) -> None:
        """Take a request out of the batch but keep its blocks pinned (status TRANSFERRING)."""
        self._unqueue(request)
        request.status = RequestStatus.TRANSFERRING

    def admit_running(self, request: Request) -> None:
        """Add a request whose KV is already in its blocks (received from a prefill instance)
        straight to the running batch."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.arrival_order)

    def _unqueue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
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
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.pop()
        self.kv_cache.free(request.request_id, preempted=True)
        request.status = RequestStatus.PREEMPTED
        request.storage_fetch = StorageFetch.NONE  # its blocks may be in storage by re-admission
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info("preempted request %s (%d tokens)", request.request_id, request.num_tokens)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.storage_fetch == StorageFetch.PENDING:
                continue  # its storage read is in flight; later requests may go first
            preallocated = self.kv_cache.has_request(request.request_id)  # prefix already set
            loaded = 0
            if preallocated:
                prefix, num_computed = NO_MATCH, request.num_computed_tokens
            else:
                prefix = self.kv_cache.match_prefix(request)
                device_blocks = len(prefix.block_ids)
                if request.staged_blocks and device_blocks < request.staged_first_block:
                    request.storage_fetch = StorageFetch.NONE  # the device lost blocks since the
                    request.staged_blocks = []  # read: read again from the shorter device hit
                if (
                    request.storage_fetch == StorageFetch.NONE
                    and self.prefetch is not None
                    and self.prefetch(request, device_blocks)
                ):
                    continue
                loaded = request.num_usable_staged(device_blocks)
                num_computed = prefix.num_tokens + loaded * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv_cache.can_allocate(request, num_computed + num_new, prefix):
                return
            self.kv_cache.allocate(request, num_computed + num_new, prefix)
            self.waiting.remove(request)
            if loaded:
                output.loads.append(StagedLoad(request, len(prefix.block_ids), loaded))
            else:
                request.staged_blocks = []
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                if not preallocated:
                    request.num_storage_tokens = loaded * self.kv_cache.block_size
                request.num_cached_tokens = num_computed
                self.stats.prefix_cache_queries += request.num_prompt_tokens
                self.stats.prefix_cache_hits += num_computed - request.num_storage_tokens
                self.stats.storage_cache_hits += request.num_storage_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_order)
            output.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
