"""LLMEngine: one in-process engine. Each step reads schedule -> run -> update."""

import logging
import queue
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request, RequestStatus, SamplingParams, StorageFetch
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.errors import (
    IntegrityError,
    InvalidRequestError,
    PromptTooLongError,
    RequestNotFoundError,
)
from pdserve.kvcache.events import KVEventSink
from pdserve.kvcache.hashing import BlockHash, BlockHasher
from pdserve.kvcache.manager import KVCacheManager
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.runner import BlockIO, ModelRunner, SequenceChunk
from pdserve.model.tiny import default_model_dir
from pdserve.storage.tier import StorageTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (deltas), plus totals for usage reporting."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    kv_ready: bool  # prefill-only request: KV computed and pinned, first token sampled
    finish_reason: str | None  # stop | length | abort
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-cached KV cache. Not thread-safe: one
    thread drives `add_request`, `abort_request` and `step`."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.hasher = BlockHasher.for_model(kv_cache.block_size, loaded.model_tag)
        self.max_model_len = min(loaded.max_model_len, kv_cache.num_blocks * kv_cache.block_size)
        self.block_io = BlockIO(runner.kv_cache)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.storage: StorageTier | None = None
        self.on_storage_ready: Callable[[], None] | None = None  # wakes an idle loop
        self._fetched: queue.SimpleQueue[tuple[Request, int, list[bytes]]] = queue.SimpleQueue()
        self._fetches_in_flight = 0

    # -- the storage tier -----------------------------------------------------------------------

    def attach_storage(self, tier: StorageTier) -> None:
        """Write published blocks back to `tier` as its config says, and read ahead from it
        what a waiting request's device prefix hit lacks."""
        self.storage = tier
        kv, config = self.kv_cache, tier.config
        kv.write_sink = self._write_back
        kv.write_on_evict = config.device_write_policy == "on_eviction"
        kv.write_through = config.device_write_policy == "write_through"
        kv.write_on_preempt = config.write_back_on_preempt
        self.scheduler.prefetch = self._prefetch

    def storage_tag(self) -> str:
        """Names the KV layout: blocks are only shared between engines with the same tag."""
        return (
            f"{self.loaded.model_tag}/{str(self.loaded.dtype).removeprefix('torch.')}"
            f"/b{self.kv_cache.block_size}/kv1"
        )

    def _write_back(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Copy published blocks to host memory now (they may be overwritten next step) and
        queue them for the storage writer. A copy, not I/O: the engine thread never waits."""
        tier = self.storage
        if tier is None:
            return
        fresh = [(b, h) for b, h in blocks if not tier.is_known_stored(h)]
        if fresh:
            views = self.block_io.read([b for b, _ in fresh])
            tier.write([(h, bytes(v)) for (_, h), v in zip(fresh, views, strict=True)])

    def _prefetch(self, request: Request, device_blocks: int) -> bool:
        tier = self.storage
        max_blocks = (request.num_tokens - 1) // self.kv_cache.block_size
        if tier is None or device_blocks >= max_blocks or not tier.available:
            return False
        request.storage_fetch = StorageFetch.PENDING
        self._fetches_in_flight += 1

        def done(blocks: list[bytes]) -> None:  # on the storage worker thread
            self._fetched.put((request, device_blocks, blocks))
            if self.on_storage_ready is not None:
                self.on_storage_ready()

        tier.prefetch(request.block_hashes[device_blocks:max_blocks], done)
        return True

    def apply_fetched(self, wait: bool = False) -> None:
        """Hand finished storage reads to their requests (admission can then proceed). With
        `wait`, and nothing else to do, wait up to a second for one (loop-less `generate`)."""
        block = wait and self._fetches_in_flight > 0
        block = block and not self.scheduler.has_schedulable_requests()
        while True:
            try:
                request, first_block, blocks = self._fetched.get(block=block, timeout=1.0)
            except queue.Empty:
                return
            block = False
            self._fetches_in_flight -= 1
            if self.scheduler.requests.get(request.request_id) is request:
                request.stage(first_block, blocks)

    def load_staged(self, request: Request, device_blocks: int) -> int:
        """Write the request's usable staged blocks into its table after its device prefix hit
        of `device_blocks` blocks and publish them (their bytes were verified when read).
        Returns how many were loaded."""
        blocks = request.take_staged(device_blocks)
        if not blocks:
            return 0
        table = self.kv_cache.block_table(request.request_id)
        for block_id, data in zip(table[device_blocks:], blocks, strict=False):
            self.block_io.write([block_id], memoryview(data))
        block_size = self.kv_cache.block_size
        self.kv_cache.update_cache_blocks(request, (device_blocks + len(blocks)) * block_size)
        self.scheduler.stats.storage_loaded_tokens += len(blocks) * block_size
        return len(blocks)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        event_sink: KVEventSink | None = None,
        shared_kv_cache: bool = False,
    ) -> "LLMEngine":
        """An engine for `config`; `shared_kv_cache` puts a CPU KV cache in shared memory."""
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        model_dir = config.model or default_model_dir()
        loaded = load_model(
            model_dir, dtype=config.dtype, device=config.device, max_model_len=config.max_model_len
        )
        num_blocks = config.num_kv_blocks or max(
            1,
            config.kv_cache_bytes
            // (loaded.config.kv_bytes_per_token(loaded.dtype) * config.block_size),
        )
        kv_cache = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            event_sink=event_sink,
        )
        scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), kv_cache
        )
        runner = ModelRunner.create(
            loaded.model, num_blocks, config.block_size, loaded.dtype, shared=shared_kv_cache
        )
        logger.info("engine ready: %d KV blocks of %d tokens", num_blocks, config.block_size)
        return cls(loaded, kv_cache, scheduler, runner, Sampler(loaded.device, config.seed))

    # -- requests -----------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
    ) -> Request:
        """Validate and build a request without queueing it; raises InvalidRequestError /
        PromptTooLongError for bad input."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        params = params or SamplingParams()
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            hasher=self.hasher,
            eos_token_ids=() if params.ignore_eos else self.loaded.eos_token_ids,
            prefill_only=prefill_only,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError / PromptTooLongError for bad input."""
        request = self.make_request(prompt, params, request_id)
        self.submit(request)
        return request.request_id

    def submit(self, request: Request) -> None:
        """Queue a request built by `make_request` (its blocks may be preallocated)."""
        self.scheduler.add_request(request)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.sampling_params.stop
        )

    def preallocate(self, request: Request) -> bool:
        """Match the request's prefix and allocate blocks for its whole prompt now, loading the
        blocks staged from storage (`InstanceCore.read_ahead`) after the device hit.

        Sets `num_computed_tokens` to the hit. Returns False (changing nothing) when the pool
        cannot hold the prompt at the moment; the scheduler then allocates at admission.
        """
        prefix = self.kv_cache.match_prefix(request)
        if not self.kv_cache.can_allocate(request, request.num_prompt_tokens, prefix):
            return False
        self.kv_cache.allocate(request, request.num_prompt_tokens, prefix)
        loaded = self.load_staged(request, len(prefix.block_ids)) * self.kv_cache.block_size
        request.num_storage_tokens = loaded
        request.num_computed_tokens = prefix.num_tokens + loaded
        return True

    def admit_prefilled(self, request: Request, first_token_id: int) -> RequestOutput:
        """Start decoding a request whose prompt KV is already in its (allocated) blocks.

        Publishes the prompt's full blocks, appends the first token (sampled by the prefill
        instance), applies the stop conditions to it and returns its output.
        """
        request.num_computed_tokens = request.num_prompt_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = 0
        self.kv_cache.update_cache_blocks(request, request.num_prompt_tokens)
        self.scheduler.admit_running(request)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.sampling_params.stop
        )
        request.append_output_token(first_token_id)
        return self._emit(request, self._check_stop(request))

    def release(self, request_id: str) -> None:
        """Free a TRANSFERRING request after its KV was handed over (or the handoff failed),
        or the preallocated blocks of a request that was never queued. Idempotent."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        else:
            self.kv_cache.free(request_id)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; raises RequestNotFoundError if it is not live."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise RequestNotFoundError(f"no live request with id {request_id!r}")
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule -> run -> update. Returns the outputs of this step."""
        if self.storage is not None:
            self.apply_fetched(wait=True)
        scheduled = self.scheduler.schedule()
        for load in scheduled.loads:
            self.load_staged(load.request, load.first_block)
        sampled = self._run(scheduled)
        return self._update(scheduled, sampled)

    def _run(self, scheduled: SchedulerOutput) -> list[int]:
        """Forward the scheduled chunks, then sample for those that completed their tokens."""
        if not scheduled.chunks:
            return []
        chunks = [
            SequenceChunk(
                token_ids=c.request.all_token_ids[
                    c.request.num_computed_tokens : c.request.num_computed_tokens + c.num_new_tokens
                ],
                start_pos=c.request.num_computed_tokens,
                block_table=self.kv_cache.block_table(c.request.request_id),
                needs_logits=c.completes_known_tokens,
            )
            for c in scheduled.chunks
        ]
        logits = self.runner.execute(chunks)
        sampling = [c.request for c in scheduled.chunks if c.completes_known_tokens]
        return self.sampler.sample(
            logits, [r.sampling_params for r in sampling], [r.num_output_tokens for r in sampling]
        )

    def _update(self, scheduled: SchedulerOutput, sampled: list[int]) -> list[RequestOutput]:
        """Advance computed counts, publish computed blocks, append sampled tokens, stop."""
        tokens = iter(sampled)
        outputs = []
        for chunk in scheduled.chunks:
            request = chunk.request
            samples = chunk.completes_known_tokens
            request.num_computed_tokens += chunk.num_new_tokens
            self.scheduler.stats.num_computed_tokens += chunk.num_new_tokens
            self.kv_cache.update_cache_blocks(request, request.num_computed_tokens)
            if not samples:
                continue
            request.append_output_token(next(tokens))
            if request.prefill_only:
                self.scheduler.hold_for_transfer(request)
                outputs.append(self._kv_ready(request))
            else:
                outputs.append(self._emit(request, self._check_stop(request)))
        return outputs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        params = request.sampling_params
        if token in params.stop_token_ids or token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _emit(self, request: Request, status: RequestStatus | None) -> RequestOutput:
        detokenizer = self._detokenizers[request.request_id]
        token_ids = request.output_token_ids
        stop_reason: str | int | None = None
        if status == RequestStatus.FINISHED_STOPPED:
            stop_reason, token_ids = token_ids[-1], token_ids[:-1]
        new_text = detokenizer.update(token_ids, finished=status is not None)
        if detokenizer.stop_reason is not None:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stop_reason
        if status is not None:
            self._finish(request, status)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(request.output_token_ids[-1],),
            new_text=new_text,
            finished=status is not None,
            kv_ready=False,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _kv_ready(self, request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(request.output_token_ids[-1],),
            new_text="",
            finished=False,
            kv_ready=True,
            finish_reason=None,
            stop_reason=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self._detokenizers.pop(request.request_id, None)

    # -- conveniences -------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run `prompts` to completion together; results in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.new_token_ids)
                    texts[out.request_id].append(out.new_text)
                    if out.finished:
                        finals[out.request_id] = out
        return [
            Completion(
                i,
                tuple(tokens[i]),
                "".join(texts[i]),
                finals[i].finish_reason,
                finals[i].num_cached_tokens,
            )
            for i in ids
        ]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they are produced (drives the loop itself)."""
        request_id = self.add_request(prompt, params)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if request_id in self.scheduler.requests:
                self.abort_request(request_id)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the KV cache and scheduler bookkeeping agree."""
        self.kv_cache.check_integrity()
        for request_id, request in self.scheduler.requests.items():
            table = self.kv_cache.block_table(request_id)
            running = request.status == RequestStatus.RUNNING
            if running and len(table) * self.kv_cache.block_size < request.num_computed_tokens:
                raise IntegrityError(f"running request {request_id} lacks blocks for its KV")
            if not running and table:
                raise IntegrityError(
                    f"request {request_id} holds blocks while {request.status.name}"
                )

    def _validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens but the context window is "
                f"{self.max_model_len} tokens (at least one is needed for output); shorten it"
            )
