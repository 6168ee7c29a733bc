"""The engine's failure policy for a step, its integrity contract, and what carries an error
from the engine to a client (OutputStream, the exception <-> status table)."""

from collections.abc import Callable, Sequence

import grpc
import pytest
import torch

from pdserve.engine import LLMEngine, RequestStatus, SamplingParams
from pdserve.engine.engine import OOM_BUDGET_COOLDOWN_S
from pdserve.errors import (
    DecodeUnavailableError,
    DuplicateRequestError,
    InstanceUnavailableError,
    IntegrityError,
    KVTransferError,
    ModelNotFoundError,
    NoCapacityError,
    OutOfBlocksError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    RequestNotFoundError,
    ResourceExhaustedError,
    StepFailedError,
)
from pdserve.instance.streams import OutputStream, aborted_output
from pdserve.model.runner import SequenceChunk
from pdserve.rpc.status import classify, error_from_reply, error_reply

MakeEngine = Callable[..., LLMEngine]


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(5 * i + 7 * offset + 3) % 250 for i in range(n)]


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


class FailingRunner:
    """Wraps the engine's runner: the next `failures` forward passes raise `error`."""

    def __init__(self, engine: LLMEngine, error: Exception, failures: int = 1) -> None:
        self.execute_all = engine.runner.execute_all
        self.error, self.failures, self.batches = error, failures, 0
        engine.runner.execute_all = self  # type: ignore[method-assign]

    def __call__(
        self, chunks: Sequence[SequenceChunk]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self.batches += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        return self.execute_all(chunks)


def run(engine: LLMEngine) -> dict[str, list[object]]:
    """Every request's outputs until none is left."""
    outputs: dict[str, list[object]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def expected_tokens(make_engine: MakeEngine, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [c.token_ids for c in make_engine().generate(prompts, GREEDY)]


def test_a_failing_step_fails_its_batch_and_the_engine_serves_the_next(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(max_num_seqs=2)  # "c" waits while "a" and "b" run the failing step
    FailingRunner(engine, RuntimeError("kernel exploded"))
    engine.add_request(prompt(20), GREEDY, request_id="a")
    engine.add_request(prompt(30, 1), GREEDY, request_id="b")
    engine.add_request(prompt(40, 2), GREEDY, request_id="c")
    failed = engine.step()
    assert {o.request_id for o in failed} == {"a", "b"}
    assert all(o.finished and o.error and "kernel exploded" in o.error for o in failed)
    assert set(engine.scheduler.requests) == {"c"}
    engine.check_integrity()

    tokens = [t for o in run(engine)["c"] for t in o.new_token_ids]  # type: ignore[attr-defined]
    assert tuple(tokens) == expected_tokens(make_engine, [prompt(40, 2)])[0]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # nothing leaked
    engine.check_integrity()


def test_out_of_memory_preempts_the_newest_and_retries_the_rest_once(
    make_engine: MakeEngine,
) -> None:
    prompts = [prompt(20, i) for i in range(4)]
    engine = make_engine()
    runner = FailingRunner(engine, torch.OutOfMemoryError("CUDA out of memory"))
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    first = engine.step()
    assert runner.batches == 2  # the failed pass and its retry
    assert sorted(o.request_id for o in first) == ["r0", "r1"]  # the older half went on
    assert not any(o.error for o in first)
    assert engine.scheduler.stats.num_preemptions == 2
    outputs = run(engine)
    for i, expected in enumerate(expected_tokens(make_engine, prompts)):
        mine = [o for o in first if o.request_id == f"r{i}"] + outputs[f"r{i}"]
        assert tuple(t for o in mine for t in o.new_token_ids) == expected  # type: ignore[attr-defined]
    engine.check_integrity()


def test_out_of_memory_halves_the_step_budget_for_a_while(make_engine: MakeEngine) -> None:
    """After the out-of-memory step (4 prompts of 100 tokens, budget 512: 400 tokens), steps
    schedule at most half of it (chunked prefill) until the cooldown ends; outputs unchanged."""
    prompts = [prompt(100, i) for i in range(4)]
    engine = make_engine(max_num_batched_tokens=512)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    FailingRunner(engine, torch.OutOfMemoryError("CUDA out of memory"))
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    outputs: dict[str, list[object]] = {}
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)
    assert engine.scheduler.token_budget() == 200
    scheduled = engine.scheduler.schedule
    sizes: list[int] = []

    def recording() -> object:
        step = scheduled()
        sizes.append(sum(c.num_new_tokens for c in step.chunks))
        return step

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert sizes and max(sizes) <= 200
    now[0] = OOM_BUDGET_COOLDOWN_S + 1.0
    assert engine.scheduler.token_budget() == 512
    for request_id, more in run(engine).items():
        outputs.setdefault(request_id, []).extend(more)
    for i, expected in enumerate(expected_tokens(make_engine, prompts)):
        mine = outputs[f"r{i}"]
        assert tuple(t for o in mine for t in o.new_token_ids) == expected  # type: ignore[attr-defined]
    engine.check_integrity()


def test_out_of_memory_twice_fails_the_retried_requests(make_engine: MakeEngine) -> None:
    engine = make_engine()
    FailingRunner(engine, torch.OutOfMemoryError("CUDA out of memory"), failures=2)
    engine.add_request(prompt(20), GREEDY, request_id="old")
    engine.add_request(prompt(20, 1), GREEDY, request_id="new")
    [failed] = engine.step()
    assert failed.request_id == "old" and failed.error is not None
    assert [t for o in run(engine)["new"] for t in o.new_token_ids]  # type: ignore[attr-defined]
    engine.check_integrity()


def test_integrity_accepts_preallocated_and_transferring_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    waiting = engine.make_request(prompt(40), GREEDY, "waiting", prefill_only=True)
    assert engine.preallocate(waiting) is not None
    engine.submit(waiting)
    engine.check_integrity()  # WAITING with its blocks preallocated
    while waiting.status != RequestStatus.TRANSFERRING:
        engine.step()
    engine.check_integrity()  # TRANSFERRING: blocks pinned for the handoff
    engine.release("waiting")
    engine.check_integrity()


def test_integrity_catches_an_orphaned_block_table(make_engine: MakeEngine) -> None:
    engine = make_engine()
    orphan = engine.make_request(prompt(40), GREEDY, "orphan")
    engine.kv_cache.allocate(orphan, orphan.num_tokens)  # a table no live request owns
    with pytest.raises(IntegrityError, match="orphan"):
        engine.check_integrity()
    engine.check_integrity(reserved=["orphan"])  # a reservation may own it
    engine.kv_cache.free("orphan")


def test_output_stream_ends_with_a_step_failure_as_step_failed_error(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    FailingRunner(engine, RuntimeError("boom"))
    engine.add_request(prompt(10), GREEDY, request_id="s")
    stream = OutputStream("s")
    for output in engine.step():
        stream.put(output)
    assert stream.ended
    with pytest.raises(StepFailedError, match="boom"):
        stream.get(timeout_s=1)


def test_output_stream_ignores_outputs_after_its_end() -> None:
    stream = OutputStream("r")
    stream.put(aborted_output("r"))
    stream.fail(RequestAbortedError("late"))
    assert [o.finish_reason for o in stream] == ["abort"]


ROUND_TRIPS: list[PdserveError] = [
    PromptTooLongError("too long"),
    DuplicateRequestError("twice"),
    ModelNotFoundError("no model"),
    RequestNotFoundError("gone"),
    RequestAbortedError("aborted"),
    ResourceExhaustedError("full", 250),
    KVTransferError("broken", 0),
    InstanceUnavailableError("down", 0),
    DecodeUnavailableError("decode down", 0),
    StepFailedError("oom", 0),
]


@pytest.mark.parametrize("error", ROUND_TRIPS, ids=lambda e: type(e).__name__)
def test_an_error_keeps_its_class_message_and_retry_after_across_the_wire(
    error: PdserveError,
) -> None:
    back = error_from_reply(error_reply(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "retry_after_ms", 0) == getattr(error, "retry_after_ms", 0)


def test_status_codes_of_errors() -> None:
    assert classify(PromptTooLongError("x"))[1] == grpc.StatusCode.INVALID_ARGUMENT
    assert classify(OutOfBlocksError("x"))[1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert classify(NoCapacityError("x", 5))[3] == 5
    assert classify(ValueError("secret detail"))[1:3] == (
        grpc.StatusCode.INTERNAL,
        "internal error",
    )


def test_preallocated_requests_run_behind_a_request_the_pool_cannot_hold(
    make_engine: MakeEngine,
) -> None:
    """PD prefill preallocates a prompt's blocks before queueing it; one that found the pool
    short is admitted by the scheduler later. Queued first, it must not pin the preallocated
    ones behind it: they hold the blocks it waits for (found by the latency simulator)."""
    engine = make_engine(num_kv_blocks=12, block_size=16)
    big = engine.make_request(prompt(150, 1), GREEDY, "big", prefill_only=True)  # 10 blocks
    small = engine.make_request(prompt(60, 2), GREEDY, "small", prefill_only=True)  # 4 blocks
    assert engine.preallocate(small) is not None
    assert engine.preallocate(big) is None  # 8 blocks free: it waits for the scheduler
    engine.submit(big)
    engine.submit(small)
    for _ in range(10):
        engine.step()
        if small.status == RequestStatus.TRANSFERRING:
            break
    assert small.status == RequestStatus.TRANSFERRING
    assert big.status == RequestStatus.WAITING  # arrival order kept among the rest
    engine.release("small")
    while big.status != RequestStatus.TRANSFERRING:
        engine.step()
    engine.release("big")
