"""Prefill/decode disaggregation through the router over real gRPC servers (in-process
instances on port 0): the production request path (`tests/stacks.py`).

Each stack is checked at rest at teardown: `check_integrity()` on every instance, every block
free or cached, no reservation and no lease left.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from stacks import Stack
from waiting import wait_for

from pdserve.config import DecodeConfig, PrefillConfig, TransferConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import NoCapacityError, PromptTooLongError
from pdserve.instance.convert import generate_request
from pdserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.router.pd_client import Finished, TokenDelta

MakeStack = Callable[..., Stack]


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(3 * i + 5 * offset + 1) % 250 for i in range(n)]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def decode_stub(stack: Stack) -> decode_pb2_grpc.DecodeServiceStub:
    return decode_pb2_grpc.DecodeServiceStub(stack.channels.get(stack.decode[0].address))


SUBSCRIBER = "test"


@contextlib.contextmanager
def subscribed(stack: Stack) -> Iterator[Any]:
    """An output subscription on the decode instance (its first, empty message read: open),
    as a router holds one; the requests below name it."""
    stub = common_pb2_grpc.InstanceServiceStub(stack.channels.get(stack.decode[0].address))
    call = stub.SubscribeOutputs(common_pb2.OutputsRequest(subscriber=SUBSCRIBER), timeout=120)
    assert not next(call).outputs
    try:
        yield call
    finally:
        call.cancel()


def reserve_request(request_id: str, tokens: list[int]) -> decode_pb2.ReserveRequest:
    request = generate_request(request_id, tokens, GREEDY, subscriber=SUBSCRIBER)
    return decode_pb2.ReserveRequest(request=request)


def test_pd_output_equals_mixed_output_for_concurrent_shared_prefixes(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    system = prompt(40)
    prompts = [system + prompt(n, offset=n) for n in (1, 9, 30, 47)]
    stack = make_stack()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: stack.generate(p, GREEDY), prompts))
    mixed = make_engine().generate(prompts, GREEDY)
    for result, expected in zip(results, mixed, strict=True):
        assert result.tokens == list(expected.token_ids)
        assert result.final.finish_reason == "length"
        assert result.final.num_output_tokens == 24


@pytest.mark.parametrize(
    ("family", "kv_cache_dtype"),
    [
        ("llama", "auto"),
        ("qwen3", "auto"),
        ("qwen3-moe", "auto"),
        ("mixtral", "auto"),
        ("deepseek-v3", "auto"),
        ("llama", "fp8_e4m3"),
        ("deepseek-v3", "fp8_e4m3"),
        ("deepseek-v3-fp8", "fp8_e4m3"),  # FP8 weights too: DeepSeek-V3 as it ships
    ],
)
@pytest.mark.parametrize("transport", ["grpc", "shm", "mooncake"])
def test_pd_output_is_identical_over_every_transport(
    transport: str,
    family: str,
    kv_cache_dtype: str,
    family_dirs: Callable[[str], Path],
    make_stack: MakeStack,
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Every family over every transport, the second prompt hitting the first's prefix on
    both sides, equals one engine (whose equality to transformers the reference tests show);
    an FP8 cache's blocks move as its 8-bit bytes."""
    engine = {"model": str(family_dirs(family)), "kv_cache_dtype": kv_cache_dtype}
    stack = make_stack(engine=engine, transfer=TransferConfig(transport=transport))
    system = prompt(40)
    prompts = [system + prompt(n, offset=n) for n in (3, 30)]
    results = [stack.generate(p, GREEDY) for p in prompts]
    one = make_engine(**engine)
    mixed = one.generate(prompts, GREEDY)
    assert [r.tokens for r in results] == [list(m.token_ids) for m in mixed]
    first, second = (r.final.prefill for r in results)
    assert first.transport == transport and first.kv_blocks_sent == 3  # ceil(43 / 16)
    assert second.kv_blocks_sent == 3  # 5 blocks, of which decode held 2 (the system prompt)
    assert one.runner.kv_cache.element_size() == (1 if kv_cache_dtype == "fp8_e4m3" else 4)
    assert first.kv_bytes_sent == 3 * one.runner.stager.block_bytes
    stats = stack.prefill[0].instance.stats()
    assert stats.kv_blocks_sent_by_transport[transport] == 6
    assert stack.decode[0].instance.stats().kv_blocks_received == 6


def test_auto_transport_picks_shared_memory_on_the_same_host(make_stack: MakeStack) -> None:
    stack = make_stack(transfer=TransferConfig())
    assert stack.generate(prompt(50), GREEDY).final.prefill.transport == "shm"


def test_second_request_with_the_same_prefix_moves_fewer_bytes(make_stack: MakeStack) -> None:
    stack = make_stack()
    first = stack.generate(prompt(100), GREEDY).final.prefill
    second = stack.generate([*prompt(100), 7, 8, 9], GREEDY).final.prefill
    assert first.kv_blocks_sent == 7  # ceil(100 / 16)
    assert second.num_decode_cached_tokens == 96
    assert second.num_cached_tokens == 96  # prefill's own device cache hit
    assert second.kv_blocks_sent == 1
    assert 0 < second.kv_bytes_sent < first.kv_bytes_sent
    stats = stack.decode[0].instance.stats()
    assert stats.kv_bytes_received == first.kv_bytes_sent + second.kv_bytes_sent


def test_sampling_with_a_seed_is_identical_in_pd_and_mixed_mode(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    tokens = make_stack().generate(prompt(33), params).tokens
    [mixed] = make_engine().generate([prompt(33)], params)
    assert tokens == list(mixed.token_ids)


def test_stop_string_and_text_stream_from_decode(make_stack: MakeStack) -> None:
    stack = make_stack()
    text = stack.generate(prompt(20), GREEDY).text
    stop = text[5:8]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    stopped = stack.generate(prompt(20), params)
    assert stopped.text == text[: text.index(stop)]
    assert (stopped.final.finish_reason, stopped.final.stop_reason) == ("stop", stop)


def test_full_decode_refuses_a_request_that_would_eat_the_reserve(make_stack: MakeStack) -> None:
    # 24 blocks; each running request (40-token prompt, 150 new tokens) may grow to 12 blocks.
    stack = make_stack(
        engine={"num_kv_blocks": 24},
        decode_config=DecodeConfig(reserve_horizon_tokens=None, retry_after_ms=10),
        prefill_config=PrefillConfig(reserve_max_attempts=2),
        router={"max_attempts": 1},
    )
    decode = stack.decode[0].instance
    long_run = SamplingParams(max_tokens=150, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(stack.generate, prompt(40, offset=i), long_run) for i in range(2)]
        wait_for(lambda: decode.stats().num_running == 2)
        with pytest.raises(NoCapacityError, match="refused") as refused:
            stack.generate(prompt(40, offset=9), GREEDY)
        assert refused.value.retry_after_ms == 10  # decode's hint reaches the client
        assert all(len(f.result().tokens) == 150 for f in running)
    result = stack.generate(prompt(40, offset=9), GREEDY)
    assert len(result.tokens) == 24 and result.final.finish_reason == "length"


REFUSALS = {  # why decode refuses a handoff: its engine's settings, prompt tokens, the error
    "no room": ({"num_kv_blocks": 24}, 200, NoCapacityError, "cannot take 13 blocks"),
    "prompt too long": ({"max_model_len": 128}, 200, PromptTooLongError, "window is 128"),
    "KV layout": ({"kv_cache_dtype": "fp8_e4m3"}, 40, NoCapacityError, "KV blocks of layout"),
}


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_a_refused_handoff_is_answered_to_prefill_which_frees_its_blocks(
    reason: str, make_stack: MakeStack
) -> None:
    """Decode refuses the reservation: the refusal is prefill's reply (not a timeout), the
    client gets its class, no KV moves, and prefill and decode hold nothing after it."""
    settings, length, error, message = REFUSALS[reason]
    stack = make_stack(
        decode_engine=settings,
        prefill_config=PrefillConfig(reserve_max_attempts=1),
        router={"max_attempts": 1},
    )
    prefill, decode = stack.prefill[0].instance, stack.decode[0].instance
    with subscribed(stack):
        if reason == "no room":  # another request's reservation holds 13 of the 24 blocks
            decode_stub(stack).Reserve(reserve_request("holder", prompt(200, offset=50)))
        with pytest.raises(error, match=message):
            stack.generate(prompt(length), GREEDY)
        if reason == "no room":
            decode.abort("holder")
    assert decode.stats().kv_blocks_received == 0
    assert sum(prefill.stats().kv_blocks_sent_by_transport.values()) == 0
    for instance in (prefill, decode):
        stats = instance.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_reservations) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_blocks


def test_a_decode_whose_kv_layout_differs_gets_no_block(make_stack: MakeStack) -> None:
    """A decode with an FP8 cache behind a full-precision prefill (which `pdserve up` refuses
    at start): its reply names its layout, prefill sends nothing and says both; the router's
    error reaches the client."""
    stack = make_stack(decode_engine={"kv_cache_dtype": "fp8_e4m3"}, router={"max_attempts": 1})
    with pytest.raises(NoCapacityError, match=r"float8_e4m3fn.*this prefill.*float32"):
        stack.generate(prompt(40), GREEDY)
    assert stack.decode[0].instance.stats().kv_blocks_received == 0
    assert sum(stack.prefill[0].instance.stats().kv_blocks_sent_by_transport.values()) == 0


def test_expired_reservation_frees_its_blocks(make_stack: MakeStack) -> None:
    stack = make_stack(decode_config=DecodeConfig(reservation_timeout_s=0.2))
    decode = stack.decode[0].instance
    with subscribed(stack):
        reply = decode_stub(stack).Reserve(reserve_request("r1", prompt(50)))
        assert reply.num_blocks == 4
        assert decode.stats().num_reserved_blocks == 4
        wait_for(lambda: decode.stats().num_expired_reservations == 1)
        stats = decode.stats()
        assert (stats.num_reservations, stats.num_free_blocks) == (0, stats.num_blocks)
        start = decode_pb2.StartDecodeRequest(request_id="r1", first_token_id=5)
        with pytest.raises(grpc.RpcError) as late:
            decode_stub(stack).StartDecode(start)
        assert late.value.code() == grpc.StatusCode.NOT_FOUND


def test_broken_kv_stream_releases_the_reservation_at_once(make_stack: MakeStack) -> None:
    stack = make_stack(decode_config=DecodeConfig(reservation_timeout_s=600))
    decode = stack.decode[0].instance
    stub = decode_stub(stack)
    with subscribed(stack):
        reply = stub.Reserve(reserve_request("r2", prompt(50)))
        push_until_cancelled(stub, decode, reply)
    assert decode.stats().num_expired_reservations == 0


def push_until_cancelled(stub: Any, decode: Any, reply: decode_pb2.ReserveReply) -> None:
    """Push the first of r2's blocks, then keep the stream open until it is cancelled."""
    first_sent, hang = threading.Event(), threading.Event()

    def chunks() -> Iterator[decode_pb2.KVChunk]:
        yield decode_pb2.KVChunk(
            request_id="r2", first_block=0, num_blocks=1, data=bytes(reply.block_bytes)
        )
        first_sent.set()
        hang.wait(30)

    call = stub.PushKV.future(chunks())
    try:
        first_sent.wait(10)
        wait_for(lambda: decode.stats().kv_blocks_received == 1)
        call.cancel()  # the stream stays open until now: only the cancellation can end it
        wait_for(lambda: decode.stats().num_reservations == 0)
    finally:
        hang.set()


def test_kv_chunk_outside_the_reservation_is_rejected(make_stack: MakeStack) -> None:
    stack = make_stack()
    stub = decode_stub(stack)
    with subscribed(stack):
        reply = stub.Reserve(reserve_request("r3", prompt(20)))
        bad = decode_pb2.KVChunk(
            request_id="r3", first_block=5, num_blocks=1, data=bytes(reply.block_bytes), last=True
        )
        with pytest.raises(grpc.RpcError) as rejected:
            stub.PushKV(iter([bad]))
        assert rejected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert stack.decode[0].instance.stats().num_reservations == 0


def test_invalid_request_is_reported_and_nothing_is_reserved(make_stack: MakeStack) -> None:
    stack = make_stack()
    with pytest.raises(Exception, match="outside the vocabulary"):
        stack.generate([1, 2, 10_000], GREEDY)
    with subscribed(stack):
        for request_id, tokens, subscriber in (("x", [], SUBSCRIBER), ("y", prompt(20), "")):
            message = reserve_request(request_id, tokens)
            message.request.subscriber = subscriber  # none: nowhere to send its outputs
            with pytest.raises(grpc.RpcError) as refused:
                decode_stub(stack).Reserve(message)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_on_decode_ends_the_token_stream(make_stack: MakeStack) -> None:
    stack = make_stack()
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    events = stack.stream(prompt(30), params, request_id="long")
    assert isinstance(next(events), TokenDelta)
    assert stack.router.client.instance(stack.decode[0].address).abort("long")
    final = [e for e in events if isinstance(e, Finished)]
    assert final[0].finish_reason == "abort"


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_decode_that_disappears_mid_transfer_leaves_nothing_pinned_on_prefill(
    transport: str, make_stack: MakeStack
) -> None:
    """The decode instance goes away between its reservation and the direct write: the write or
    its commit fails, the request fails with a clear error, and prefill releases every block."""
    stack = make_stack(transfer=TransferConfig(transport=transport), router={"max_attempts": 1})
    decode = stack.decode[0]
    errors: list[Exception] = []

    def run() -> None:
        try:
            stack.generate(prompt(900), GREEDY)
        except Exception as e:  # the failure the client must see
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: decode.instance.stats().num_reservations == 1)  # prefill computes now
    decode.stop()  # its KV memory is unregistered and its segment removed
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], NoCapacityError), errors
    # whichever side notices first: decode's broken token stream, or prefill's failed write
    assert decode.address in str(errors[0]) or "KV" in str(errors[0]), errors[0]
    # the stack's teardown checks prefill: every block free, nothing running


def test_outputs_go_to_the_named_subscription_and_a_stale_attempts_abort_spares_them(
    make_stack: MakeStack,
) -> None:
    """A router's request names its output subscription and its attempt: decode sends each
    step's outputs there, tagged with the attempt; an abort naming another attempt (an
    earlier one's, arriving late) leaves the request alone."""
    stack = make_stack()
    expected = stack.generate(prompt(40, offset=3), GREEDY).tokens
    request = generate_request(
        "early", prompt(40, offset=3), GREEDY, attempt="a1", subscriber=SUBSCRIBER
    )
    message = prefill_pb2.PrefillRequest(request=request, decode_address=stack.decode[0].address)
    prefill = prefill_pb2_grpc.PrefillServiceStub(stack.channels.get(stack.prefill[0].address))
    instance = common_pb2_grpc.InstanceServiceStub(stack.channels.get(stack.decode[0].address))
    with subscribed(stack) as outputs:
        result = prefill.Prefill(message, timeout=60)
        stale = instance.Abort(common_pb2.AbortRequest(request_id="early", attempt="a0"))
        assert not stale.found
        tokens: list[int] = []
        for step in outputs:
            for output in step.outputs:
                assert (output.request_id, output.attempt) == ("early", "a1")
                tokens += output.chunk.token_ids
            if any(output.HasField("final") for output in step.outputs):
                break
    assert result.first_token_id == expected[0]
    assert tokens == expected


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "mixtral", "deepseek-v3"])
def test_a_stream_whose_decode_dies_migrates_and_ends_as_the_undisturbed_one(
    family: str,
    family_dirs: Callable[[str], Path],
    make_stack: MakeStack,
    make_engine: Callable[..., LLMEngine],
) -> None:
    """The decode instance serving a greedy stream is stopped after 15 tokens: the router
    resubmits prompt + output to the other decode, and the client sees exactly one engine's
    tokens."""
    model = str(family_dirs(family))
    stack = make_stack(decode=2, engine={"model": model})
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    tokens = prompt(37)
    [expected] = make_engine(model=model).generate([tokens], params)
    received: list[int] = []
    stopped = None
    for event in stack.stream(tokens, params):
        if isinstance(event, TokenDelta):
            received += event.token_ids
        if stopped is None and len(received) >= 15:
            [stopped] = [m for m in stack.decode if m.instance.stats().num_running]
            stopped.stop()
    assert received == list(expected.token_ids)
    assert stack.router.metrics.migrations.labels("instance_lost")._value.get() == 1


def test_a_reservation_is_renewed_while_its_kv_stream_writes(make_stack: MakeStack) -> None:
    """A transfer slower than the lease keeps its reservation while its blocks arrive: each
    written chunk renews the lease (here 0.5 s, the transfer 7 chunks 0.2 s apart)."""
    stack = make_stack(decode_config=DecodeConfig(reservation_timeout_s=0.5))
    decode = stack.decode[0].instance
    stub = decode_stub(stack)
    with subscribed(stack):
        reply = stub.Reserve(reserve_request("slow", prompt(100)))
        assert reply.num_blocks == 7

        def chunks() -> Iterator[decode_pb2.KVChunk]:
            for block in range(reply.num_blocks):
                if block:
                    threading.Event().wait(0.2)  # the link is slow: a gap between blocks
                yield decode_pb2.KVChunk(request_id="slow", first_block=block, num_blocks=1,
                                         data=bytes(reply.block_bytes),
                                         last=block == reply.num_blocks - 1)  # fmt: skip

        pushed = stub.PushKV(chunks(), timeout=30)
        assert pushed.blocks_received == reply.num_blocks
        stub.StartDecode(decode_pb2.StartDecodeRequest(request_id="slow", first_token_id=5))
        assert decode.stats().num_expired_reservations == 0
        wait_for(lambda: decode.stats().num_running == 0)


def test_a_long_transfer_near_the_context_window_outlasts_its_lease_and_is_not_cut(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    """A 1,000-token prompt (of a 1,024-token window) written slowly by decode: 63 one-block
    chunks, each delayed, take 2.5 times the reservation's lease; each written chunk renews
    it, so nothing expires and nothing is cut. (The sender sees progress as gRPC takes chunks:
    here the whole transfer fits gRPC's flow-control window, so the stall limit must exceed
    decode's time to write it.)"""
    stack = make_stack(
        engine={"max_model_len": 1024},
        decode_config=DecodeConfig(reservation_timeout_s=0.5),
        prefill_config=PrefillConfig(transfer_chunk_bytes=1),  # a block per chunk
        transfer=TransferConfig(transport="grpc", stall_timeout_s=5),
    )
    decode = stack.decode[0].instance
    decode.kv_write_fault = lambda request_id, first_block: threading.Event().wait(0.02)
    tokens = prompt(1000, offset=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    result = stack.generate(tokens, params)
    assert result.tokens == list(
        make_engine(max_model_len=1024).generate([tokens], params)[0].token_ids
    )
    stats = decode.stats()
    assert stats.kv_blocks_received == 63 and stats.num_expired_reservations == 0
    assert stack.prefill[0].instance.stats().kv_transfer_failures_by_transport["grpc"] == 0


@pytest.mark.parametrize("transport", ["grpc", "shm", "mooncake"])
def test_a_stalled_kv_transfer_is_cut_and_the_request_served_by_another_pair(
    transport: str, make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    """The decode instance stops taking a transfer (gRPC: its first chunk is held; shared
    memory and Mooncake: the commit after the write): prefill cuts it after
    transfer.stall_timeout_s without progress, aborts the reservation, and the request is
    retried on the other decode instance; nothing waits for the stall to end."""
    config = TransferConfig(transport=transport, stall_timeout_s=0.5)
    stack = make_stack(decode=2, transfer=config)
    release, stalled = threading.Event(), threading.Event()

    def stall_once(request_id: str, first_block: int) -> None:
        if not stalled.is_set():
            stalled.set()
            release.wait(60)  # until the test ends: a transfer that neither ends nor fails

    for member in stack.decode:
        member.instance.kv_write_fault = stall_once
    try:
        tokens = prompt(60, offset=7)
        result = stack.generate(tokens, GREEDY)
        assert stalled.is_set() and not release.is_set()  # served while the stall went on
        assert result.tokens == list(make_engine().generate([tokens], GREEDY)[0].token_ids)
        failures = stack.prefill[0].instance.stats().kv_transfer_failures_by_transport
        assert failures[transport] == 1
        for member in stack.decode:  # the stalled reservation was aborted, not left to expire
            wait_for(lambda m=member: m.instance.stats().num_reservations == 0)
            assert member.instance.stats().num_expired_reservations == 0
    finally:
        release.set()
