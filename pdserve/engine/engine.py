"""LLMEngine: one in-process engine. Each step reads schedule -> run -> update."""

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.choices import KVCacheDTypeName
from pdserve.config import EngineConfig
from pdserve.engine.admission import Admission, PromptAdmission
from pdserve.engine.grammar import Grammars
from pdserve.engine.output import OutputProcessor
from pdserve.engine.perf_model import StepShape, StepTimeModel, step_shape
from pdserve.engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
)
from pdserve.engine.sampler import Sampler, token_logprob
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.staged_reads import StagedReads
from pdserve.engine.stop import stop_status
from pdserve.engine.storage_connector import StorageConnector
from pdserve.engine.tensor_parallel import (
    RankZero,
    WorkerLauncher,
    default_launcher,
    rank_shard,
    start_rank_zero,
)
from pdserve.engine.validation import validate_prompt
from pdserve.errors import (
    ConfigError,
    IntegrityError,
    ModelLoadError,
    RequestNotFoundError,
)
from pdserve.kvcache.events import KVEventSink
from pdserve.kvcache.eviction import make_eviction_policy
from pdserve.kvcache.hashing import BlockHash, BlockHasher, PromptHashes
from pdserve.kvcache.manager import KVCacheManager
from pdserve.model.attention import make_backend
from pdserve.model.config import ModelConfig
from pdserve.model.graphs import Capture, capture_sizes
from pdserve.model.linear import limit_kernel_caches
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.memory import (
    KVPlan,
    MemoryReport,
    calibrate_kv_scales,
    check_context,
    cuda_free_at_start,
    describe,
    size_kv_cache,
    weight_bytes,
)
from pdserve.model.parallel import TPGroup, check_divides
from pdserve.model.runner import ModelRunner, SequenceChunk
from pdserve.model.tiny import default_model_dir
from pdserve.storage.tier import StorageTier

logger = logging.getLogger(__name__)

StorageTierFactory = Callable[[str], StorageTier]
"""Builds the storage tier for a KV layout tag (`storage_tag`)."""


def storage_tag(loaded: LoadedModel, block_size: int) -> str:
    """Names the KV layout: blocks are only shared between engines with the same tag (the
    model and its weights' dtype, the block size, what a block holds: `KVLayout.tag`). A
    tensor-parallel block is its ranks' slices in rank order: another layout (`tp<size>`)."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    ranks = loaded.model.shard.size
    layout = loaded.model.kv_layout(loaded.dtype).tag
    tag = f"{loaded.model_tag}/{dtype}/b{block_size}/{layout}"
    return tag + (f"/tp{ranks}" if ranks > 1 else "")


def is_out_of_memory(error: BaseException) -> bool:
    """A device (or host) allocation failed: retrying with a smaller batch may succeed."""
    return isinstance(error, torch.OutOfMemoryError | MemoryError)


OOM_BUDGET_COOLDOWN_S = 30.0  # how long steps stay smaller after running out of memory


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
    thread (the owner: the engine loop, or the caller of `generate`) drives every method."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        storage_connector: StorageConnector | None = None,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.admission = scheduler.admission
        self.runner = runner
        self.sampler = sampler
        self.storage_connector = storage_connector
        self.hasher = BlockHasher.for_model(kv_cache.block_size, loaded.model_tag)
        self.max_model_len = loaded.config.context_window(
            loaded.max_model_len, kv_cache.num_blocks * kv_cache.block_size
        )
        self.kv_plan: KVPlan | None = None  # how the KV cache was sized (`from_config`)
        self.memory: MemoryReport | None = None  # the device's, when it was profiled
        self.outputs = OutputProcessor(loaded.tokenizer)  # the text of every output
        # `step` adds the text itself; an EngineLoop turns this off and adds it on its thread
        self.inline_text = True
        self._ended: list[str] = []  # finished without a final output, for `outputs` (text)
        self._step_started = 0.0  # time.perf_counter() when the current (or last) step began
        self._left_work_at: float | None = None  # when the last step ended with work left
        # the step time model, fitted from every step (`step_shape` of its batch, its time)
        self.step_time = StepTimeModel()
        self._shape: StepShape | None = None  # the current step's, once scheduled
        self._scheduled_at = 0.0
        self.grammars = Grammars(
            loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids
        )  # compiled on first use (xgrammar is imported only then)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        event_sink: KVEventSink | None = None,
        shared_kv_cache: bool = False,
        storage_tier: StorageTierFactory | None = None,
        wake: Callable[[], None] = lambda: None,
        graph_capture: Capture | None = None,
        tp_workers: tuple[WorkerLauncher, str] | None = None,
    ) -> "LLMEngine":
        """An engine for `config`; `shared_kv_cache` puts a CPU KV cache in shared memory;
        `storage_tier(tag)` builds the storage tier for the engine's KV layout tag (None: no
        tier);
        `wake` is called from other threads when a storage read finished (must not block);
        `graph_capture` records the decode graphs (default: CUDA graphs, when
        `engine.cuda_graphs` resolves on; tests pass `eager_capture`); `tp_workers`: how a
        tensor-parallel instance's other ranks start and the host where they find this one
        (default: `tensor_parallel.use_launcher`'s, else local processes on 127.0.0.1)."""
        tp = None
        if config.tensor_parallel_size > 1:
            check_model(config)  # before any worker starts
            tp = start_rank_zero(config, *(tp_workers or default_launcher()))
        try:
            return cls._build(
                config, event_sink, shared_kv_cache, storage_tier, wake, graph_capture, tp
            )
        except BaseException:
            if tp is not None:
                tp.stop()
            raise

    @classmethod
    def _build(
        cls,
        config: EngineConfig,
        event_sink: KVEventSink | None,
        shared_kv_cache: bool,
        storage_tier: StorageTierFactory | None,
        wake: Callable[[], None],
        graph_capture: Capture | None,
        tp: RankZero | None,
    ) -> "LLMEngine":
        if tp is None:
            loaded, plan, memory = load_and_size(config)
        else:
            loaded, plan, memory = load_and_size(config, tp.group, tp.loaded)
        if tp is not None:
            plan = dataclasses.replace(plan, num_blocks=tp.agree_on_blocks(plan.num_blocks))
        graphs = graph_capture is not None or _cuda_graphs(config, loaded.device)
        pool_blocks = plan.num_blocks - 1 if graphs else plan.num_blocks  # the last: padding
        if pool_blocks < 1:
            raise ConfigError("the KV cache holds one block: CUDA graphs need a second one")
        runner = _runner(config, loaded, plan, shared_kv_cache, tp)
        tag = storage_tag(loaded, config.block_size)
        tier = storage_tier(tag) if storage_tier is not None else None
        staged = StagedReads(runner.stager, config.block_size)
        connector = (
            StorageConnector(tier, runner.stager, staged, wake) if tier is not None else None
        )
        kv_cache = _kv_cache_manager(
            config, pool_blocks, event_sink, connector, runner.block_tables.forget
        )
        scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            kv_cache,
            PromptAdmission(kv_cache, staged, connector),
        )
        sampler = Sampler(loaded.device, config.seed)
        engine = cls(loaded, kv_cache, scheduler, runner, sampler, connector)
        engine.kv_plan, engine.memory = plan, memory
        if graphs:
            max_blocks = -(-engine.max_model_len // config.block_size)
            runner.capture_graphs(capture_sizes(config.max_num_seqs), max_blocks, graph_capture)
        return engine

    @property
    def kv_tag(self) -> str:
        """What this engine's KV blocks hold (`storage_tag`): blocks move only between engines
        whose tags are equal."""
        return storage_tag(self.loaded, self.block_size)

    # -- requests -----------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
        block_hashes: PromptHashes | None = None,
    ) -> Request:
        """Validate and build a request without queueing it; raises InvalidRequestError /
        PromptTooLongError for bad input. `block_hashes` (the router's chain of the prompt) is
        taken when it passes `BlockHasher.adopt`'s check, else the chain is computed here."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = params or SamplingParams()
        validate_prompt(
            token_ids,
            params,
            vocab_size=self.loaded.config.vocab_size,
            max_model_len=self.max_model_len,
        )
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            hasher=self.hasher,
            eos_token_ids=() if params.ignore_eos else self.loaded.eos_token_ids,
            prefill_only=prefill_only,
            block_hashes=self.hasher.adopt(block_hashes, token_ids),
        )
        if params.structured is not None:
            earlier = token_ids[len(token_ids) - params.output_offset :]  # a migrated request's
            request.grammar = self.grammars.matcher(*params.structured, accepted=earlier)
        return request

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
        if not request.prefill_only:  # a prefill-only request's outputs carry no text
            self.outputs.register(request.request_id, request.sampling_params.stop)

    def preallocate(self, request: Request, growth_headroom_blocks: int = 0) -> Admission | None:
        """Admit a request that is not queued (`PromptAdmission.admit`: device hit, the blocks
        staged from storage, blocks for the whole prompt) if `growth_headroom_blocks` stay free.
        Returns None, changing nothing, when the pool cannot hold it now."""
        return self.admission.admit(request, growth_headroom_blocks=growth_headroom_blocks)

    def admit_prefilled(
        self, request: Request, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Start decoding a request whose prompt KV is already in its (allocated) blocks.

        Publishes the prompt's full blocks, appends the first token (sampled by the prefill
        instance), applies the stop conditions to it and returns its output (without its text
        when `inline_text` is off: the caller hands it to the loop's output thread).
        """
        # not counted as a routing hit here; its prefill took no time here (StageTimes says 0)
        request.first_scheduled_at = request.first_token_at = time.perf_counter()
        self.scheduler.admit_prefilled(request)
        self.outputs.register(request.request_id, request.sampling_params.stop)
        request.append_output_token(first_token_id, first_logprob)
        output = self._emit(request, self._check_stop(request))
        return self.add_text([output])[0] if self.inline_text else output

    def release(self, request_id: str) -> None:
        """Free a TRANSFERRING request after its KV was handed over (or the handoff failed),
        or the preallocated blocks of a request that was never queued. Idempotent."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        else:
            self.kv_cache.free(request_id)
            self.admission.forget(request_id)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; raises RequestNotFoundError if it is not live."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise RequestNotFoundError(f"no live request with id {request_id!r}")
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def check_ranks(self) -> None:
        """Raise TensorParallelError when a tensor-parallel rank of this engine failed (its
        requests fail until the instance is restarted)."""
        if self.runner.tp is not None:
            self.runner.tp.check()

    def close(self) -> None:
        """Stop a tensor-parallel instance's workers and free the KV cache's shared memory.
        The engine is unusable afterwards."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step could advance a request now (finished storage reads are handed to
        their requests first; requests waiting on I/O do not count)."""
        if self.storage_connector is not None:
            self.storage_connector.apply_fetched()
        return self.scheduler.has_schedulable_requests()

    def published_hashes(self) -> list[BlockHash]:
        """Every block hash the device prefix cache can match now (a KV-event snapshot)."""
        return self.kv_cache.prefix_cache.hashes()

    # -- what the instance roles ask of their engine (reads change nothing) ---------------------

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached, unreferenced ones included)."""
        return self.kv_cache.num_free_blocks

    def has_request(self, request_id: str) -> bool:
        """Whether a live request (queued, running, preempted or transferring) has the id."""
        return request_id in self.scheduler.requests

    def holds_blocks(self, request_id: str) -> bool:
        """Whether blocks are allocated under the id (a live request's, or preallocated ones
        of a request that is not queued)."""
        return self.kv_cache.has_request(request_id)

    def device_hit_blocks(self, request: Request) -> int:
        """Blocks of the request's prefix in the device prefix cache now."""
        return self.admission.device_hit_blocks(request)

    def pin_prefix(self, holder: str, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Reference the blocks of the longest cached prefix of the hash chain `block_hashes`
        under the id `holder`, so that no eviction reuses them until `unpin(holder)` (a peer
        instance reads them meanwhile); returns their ids, in chain order."""
        pin = _Pin(holder, tuple(block_hashes), len(block_hashes) * self.kv_cache.block_size + 1)
        prefix = self.kv_cache.match_prefix(pin)
        self.kv_cache.allocate(pin, prefix.num_tokens, prefix)
        return list(prefix.block_ids)

    def unpin(self, holder: str) -> None:
        """Drop the references `pin_prefix(holder, ...)` took. Idempotent."""
        self.kv_cache.free(holder)

    def num_blocks_needed(self, request: Request) -> int:
        """Free blocks `preallocate(request)` would take (for refusal messages)."""
        return self.admission.num_blocks_needed(request)

    def growth_headroom_blocks(
        self, horizon_tokens: int | None, reserved: Iterable[Request] = ()
    ) -> int:
        """Free blocks the decoding requests (running, or prefilled and waiting for a place in
        the batch) and the `reserved` ones may still need: each grows by its remaining
        `max_tokens`, at most `horizon_tokens` (None: no limit), up to the context window."""
        scheduler = self.scheduler
        decoding = [*scheduler.running, *scheduler.prefilled, *reserved]
        return self.admission.growth_headroom_blocks(decoding, horizon_tokens, self.max_model_len)

    def stop_computing(self, request_id: str) -> None:
        """Abort a live request unless its KV is being handed over (TRANSFERRING: its blocks
        stay pinned until `release`, which the sender calls once the send ended)."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.status != RequestStatus.TRANSFERRING:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule -> run -> update. Returns the outputs of this step, with
        their text when `inline_text` is on (else `add_text` is the caller's, in order).

        A forward pass that raises fails only its batch (`_recover`); the engine goes on."""
        started = self._step_started = time.perf_counter()
        stats = self.scheduler.stats
        if self._left_work_at is not None:
            stats.step_gaps += 1
            stats.step_gap_seconds += started - self._left_work_at
        outputs = self._step()
        ended = time.perf_counter()
        stats.num_steps += 1
        stats.step_seconds += ended - started
        self._left_work_at = ended if self.has_work() else None
        shape, self._shape = self._shape, None
        if shape is not None:  # from its schedule on: a wait for storage reads is not the batch's
            self.step_time.observe(shape, ended - self._scheduled_at)
        return self.add_text(outputs) if self.inline_text else outputs

    def add_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`OutputProcessor.process` on this thread; finishes the requests a stop string
        ended."""
        delivered, stopped = self.outputs.process(outputs, self.take_ended())
        self.stop_requests(stopped)
        return delivered

    def take_ended(self) -> list[str]:
        """The requests finished without a final output since the last call (for the
        OutputProcessor, in order with the outputs)."""
        ended, self._ended = self._ended, []
        return ended

    def stop_requests(self, request_ids: Sequence[str]) -> None:
        """Finish requests whose text reached a stop string (their final output is out)."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_STOPPED)

    def _step(self) -> list[RequestOutput]:
        if self.storage_connector is not None:
            self.storage_connector.apply_fetched(wait=not self.scheduler.has_schedulable_requests())
        self._scheduled_at = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.chunks:
            self._shape = step_shape(
                (c.request.num_computed_tokens, c.num_new_tokens) for c in scheduled.chunks
            )
        try:
            sampled = self._run(scheduled)
        except Exception as error:
            return self._recover(scheduled, error)
        try:
            return self._update(scheduled, sampled)
        except Exception as error:  # after the forward pass: no retry, the batch is failed
            logger.exception("updating a step's requests failed; failing them")
            return [self._fail(chunk.request, error) for chunk in scheduled.chunks]

    def _recover(self, scheduled: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """After a failed forward pass: out of memory halves the step token budget for
        `OOM_BUDGET_COOLDOWN_S`, preempts the newer half of the batch and retries the rest once;
        any other error (or a failed retry, or a batch of one) fails the batch's requests with
        StepFailedError outputs. Their blocks are freed; nothing was published."""
        if is_out_of_memory(error):  # smaller steps for a while: the memory was not there
            tokens = sum(chunk.num_new_tokens for chunk in scheduled.chunks)
            self.scheduler.limit_budget(tokens // 2, OOM_BUDGET_COOLDOWN_S)
        if is_out_of_memory(error) and len(scheduled.chunks) > 1:
            keep = len(scheduled.chunks) // 2
            by_age = sorted(scheduled.chunks, key=lambda c: c.request.arrival_order)
            for chunk in reversed(by_age[keep:]):  # newest first: the oldest ends up first
                self.scheduler.preempt(chunk.request)
            logger.warning(
                "step ran out of memory: preempted %d requests, retrying %d",
                len(by_age) - keep, keep,
            )  # fmt: skip
            retry = SchedulerOutput(chunks=by_age[:keep])
            try:
                return self._update(retry, self._run(retry))
            except Exception as again:
                scheduled, error = retry, again
        logger.error(
            "engine step failed; failing its %d requests", len(scheduled.chunks), exc_info=error
        )
        return [self._fail(chunk.request, error) for chunk in scheduled.chunks]

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            kv_ready=False,
            finish_reason="abort",
            stop_reason=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=f"the engine step failed ({type(error).__name__}: {error}); retry the request",
        )

    def _run(self, scheduled: SchedulerOutput) -> list[tuple[int, TokenLogprob | None]]:
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
                all_logits=_wants_prompt_logprobs(c.request),
                seq_id=c.request.request_id,
            )
            for c in scheduled.chunks
        ]
        logits, every = self.runner.execute_all(chunks)
        for index, position_logits in every.items():
            _record_prompt_logprobs(scheduled.chunks[index].request, chunks[index], position_logits)
        sampling = [c.request for c in scheduled.chunks if c.completes_known_tokens]
        return self.sampler.sample_rows(logits, sampling)

    def _update(
        self, scheduled: SchedulerOutput, sampled: list[tuple[int, TokenLogprob | None]]
    ) -> list[RequestOutput]:
        """Advance computed counts, publish computed blocks, append sampled tokens, stop."""
        tokens = iter(sampled)
        outputs = []
        for chunk in scheduled.chunks:
            if not self.scheduler.computed(chunk):
                continue
            request = chunk.request
            request.append_output_token(*next(tokens))
            if request.prefill_only:
                self.scheduler.hold_for_transfer(request)
                outputs.append(self._kv_ready(request))
            else:
                outputs.append(self._emit(request, self._check_stop(request)))
        return outputs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        grammar = request.grammar
        return stop_status(
            request.output_token_ids,
            request.num_prompt_tokens,
            request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            max_model_len=self.max_model_len,
            grammar_ended=grammar is not None and grammar.is_terminated(),
        )

    def _emit(self, request: Request, status: RequestStatus | None) -> RequestOutput:
        """The request's newest token as an output, without text (`add_text`); a stop token
        is its `stop_reason`."""
        stopped = status == RequestStatus.FINISHED_STOPPED
        stop_reason = request.output_token_ids[-1] if stopped else None
        if request.num_output_tokens <= 2:
            self._stamp_first_tokens(request)
        if status is not None:
            self._finish(request, status, final_output=True)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(request.output_token_ids[-1],),
            new_text="",
            finished=status is not None,
            kv_ready=False,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=_newest_logprob(request),
            prompt_logprobs=_prompt_logprobs_once(request),
            stage_times=request.stage_times() if status is not None else None,
        )

    def _stamp_first_tokens(self, request: Request) -> None:
        """When its first token came (on decode: handed over) and which step made the next."""
        now = time.perf_counter()
        if request.num_output_tokens == 1:
            request.first_token_at = request.first_token_at or now
        elif request.second_token_step is None:
            request.second_token_step = (min(self._step_started, now), now)

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
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=_newest_logprob(request),
            prompt_logprobs=_prompt_logprobs_once(request),
            block_ids=tuple(self.kv_cache.block_table(request.request_id)),
        )

    def _finish(self, request: Request, status: RequestStatus, final_output: bool = False) -> None:
        """`final_output`: this step's output tells the OutputProcessor (else `take_ended`)."""
        self.scheduler.finish(request, status)
        if not final_output:
            self._ended.append(request.request_id)

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

    def check_integrity(self, reserved: Collection[str] = ()) -> None:
        """Raise IntegrityError unless the KV cache and the scheduler agree. Call when idle (no
        request between admission steps on another thread). Every block table must belong to a
        live request or to one of the `reserved` ids (a decode instance's reservations); a
        running or transferring request's table covers its computed tokens; a preempted one
        holds none; the model runner keeps block-table rows of live allocations only."""
        self.kv_cache.check_integrity()
        owners = set(self.scheduler.requests) | set(reserved)
        orphans = sorted(set(self.kv_cache.request_ids()) - owners)
        if orphans:
            raise IntegrityError(f"block tables without a live request: {', '.join(orphans)}")
        stale = sorted(set(self.runner.block_tables.seq_ids()) - set(self.kv_cache.request_ids()))
        if stale:
            raise IntegrityError(f"block-table rows of freed allocations: {', '.join(stale)}")
        self.admission.check_integrity(owners)
        for request_id, request in self.scheduler.requests.items():
            table = self.kv_cache.block_table(request_id)
            if request.status in (RequestStatus.RUNNING, RequestStatus.TRANSFERRING):
                if len(table) * self.kv_cache.block_size < request.num_computed_tokens:
                    raise IntegrityError(f"request {request_id} lacks blocks for its KV")
            elif request.status == RequestStatus.PREEMPTED and table:
                raise IntegrityError(f"preempted request {request_id} still holds blocks")


def load_and_size(
    config: EngineConfig,
    group: TPGroup | None = None,
    loaded_everywhere: Callable[[], None] = lambda: None,
) -> tuple[LoadedModel, KVPlan, MemoryReport | None]:
    """The model loaded with its attention backend (tensor parallel: this rank's part), and
    the KV cache's size (logged). Every rank of a tensor-parallel instance runs it together:
    `loaded_everywhere()` returns once every rank loaded, then the profiling forward's
    collectives run."""
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    limit_kernel_caches(config.onednn_cache_entries)
    device = torch.device(config.device)
    device_memory = cuda_free_at_start(device) if device.type == "cuda" else None
    if device.type == "cuda":  # before any weight is read
        check_fp8_weights(ModelConfig.from_dir(Path(config.model or default_model_dir())), device)
    loaded = load_model(
        config.model or default_model_dir(),
        dtype=config.dtype,
        device=config.device,
        max_model_len=config.max_model_len,
        group=group,
    )
    loaded.model.attention = make_backend(config.attention_backend, loaded.device)
    loaded_everywhere()
    if config.kv_cache_dtype == KVCacheDTypeName.FP8_E4M3:
        check_fp8_backend(loaded.model.attention.name, loaded.device)
        scales = loaded.kv_scales or calibrate_kv_scales(loaded, config.block_size, group)
        loaded.model.set_kv_scales(scales)
        logger.info("FP8 KV cache, %s scales %s", scales.source, scales.digest())
    plan, memory = size_kv_cache(config, loaded, device_memory)
    context = check_context(plan, loaded.max_model_len, config.max_model_len is not None)
    logger.info("%s", describe(plan, memory, weight_bytes(loaded.model), context))
    return loaded, plan, memory


def _runner(
    config: EngineConfig, loaded: LoadedModel, plan: KVPlan, shared: bool, tp: RankZero | None
) -> ModelRunner:
    """The model runner and its KV cache; rank 0 of a tensor-parallel instance also drives the
    other ranks and moves their KV slices."""
    runner = ModelRunner.create(
        loaded.model,
        plan.num_blocks,
        config.block_size,
        loaded.dtype,
        shared=shared,
        staging_bytes=config.kv_staging_bytes,
    )
    if tp is not None:
        caches = tp.worker_caches(runner.kv_cache)
        runner.attach_ranks(tp, [c.tensor for c in caches], [c.shm_name for c in caches])
    return runner


def check_model(config: EngineConfig) -> None:
    """ConfigError (one line, naming the setting) unless `engine.model` is a model directory
    pdserve can load, and `tensor_parallel_size` / `expert_parallel_size` split its heads, MLP
    and experts evenly. Reads `config.json` only: run before any worker starts."""
    path = Path(config.model or default_model_dir()).expanduser()
    try:
        model = ModelConfig.from_dir(path)
    except ModelLoadError as e:
        raise ConfigError(f"engine.model {str(path)!r}: {e}") from e
    check_divides(rank_shard(config, 0), model)


def check_fp8_backend(backend: str, device: torch.device) -> None:
    """ConfigError unless attention backend `backend` can read an FP8 cache on `device`: the
    triton kernels need compute capability 8.9 or newer (Ada, Hopper); the CPU kernels and
    the reference read one anywhere."""
    if backend == "triton":
        _check_fp8_gpu(device, "engine.kv_cache_dtype fp8_e4m3", "use kv_cache_dtype auto")


def check_fp8_weights(model: ModelConfig, device: torch.device) -> None:
    """ConfigError for a checkpoint of FP8 weights on a GPU below compute capability 8.9
    (triton's grouped experts cannot read them there); CPUs dequantize them anywhere."""
    if model.weight_block is not None and device.type == "cuda":
        _check_fp8_gpu(device, "engine.model's FP8 weights", "load a bfloat16 copy")


def _check_fp8_gpu(device: torch.device, what: str, instead: str) -> None:
    from pdserve.model.triton_attention import fp8_supported

    if not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"{what} need a GPU of compute capability 8.9 or newer (Ada, Hopper) for the "
            f"triton kernels; {device} is {major}.{minor}: {instead}"
        )


def _cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """`engine.cuda_graphs`, resolved: unset means on for CUDA devices (a CPU device with it on
    is refused by `EngineConfig`)."""
    if config.cuda_graphs is None:
        return device.type == "cuda" and config.tensor_parallel_size == 1
    return config.cuda_graphs


@dataclass(frozen=True, slots=True)
class _Pin:
    """The cache request `pin_prefix` holds blocks under (a `CacheRequest`)."""

    request_id: str
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int


def _newest_logprob(request: Request) -> tuple[TokenLogprob, ...]:
    return () if request.last_logprob is None else (request.last_logprob,)


def _kv_cache_manager(
    config: EngineConfig,
    num_blocks: int,
    event_sink: KVEventSink | None,
    connector: StorageConnector | None,
    on_free: Callable[[str], None],
) -> KVCacheManager:
    eviction = make_eviction_policy(
        config.eviction_policy,
        num_blocks,
        half_life_s=config.lrfu_half_life_s,
        score_capacity=config.lrfu_score_capacity,
    )
    return KVCacheManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        event_sink=event_sink,
        write_back=connector,
        eviction=eviction,
        on_free=on_free,
    )


def _prompt_logprobs_once(request: Request) -> tuple[TokenLogprob, ...]:
    """The prompt's logprobs, on the request's first output only."""
    return tuple(request.prompt_logprobs) if request.num_output_tokens == 1 else ()


def _wants_prompt_logprobs(request: Request) -> bool:
    return (
        request.sampling_params.prompt_logprobs is not None
        and request.num_computed_tokens < request.num_prompt_tokens
    )


def _record_prompt_logprobs(request: Request, chunk: SequenceChunk, logits: torch.Tensor) -> None:
    """Logits at position p give prompt token p + 1's logprob (raw: no bias or penalty). A
    preempted request computes its prompt again: positions already recorded are skipped."""
    top = request.sampling_params.prompt_logprobs or 0
    prompt = request.prompt_token_ids
    table = torch.log_softmax(logits.float(), dim=-1)
    for offset in range(len(chunk.token_ids)):
        target = chunk.start_pos + offset + 1
        if target >= len(prompt) or target != len(request.prompt_logprobs) + 1:
            continue
        request.prompt_logprobs.append(token_logprob(table[offset], prompt[target], top))
