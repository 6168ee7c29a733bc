"""Conditional disaggregation through real PD stacks: a decode instance that computes the prompt
itself gives the same greedy tokens, publishes its blocks for the router, refuses what would eat
its running requests' headroom; `auto` predicts both paths from the instances' models."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from stacks import Stack
from waiting import wait_for

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.instance.convert import generate_request
from pdserve.v1 import common_pb2, common_pb2_grpc, decode_pb2_grpc
from services.router.membership import Role

MakeStack = Callable[..., Stack]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 * offset + 2) % 250 for i in range(n)]


def paths(stack: Stack) -> dict[str, float]:
    counter = stack.router.metrics.disaggregation
    return {path: counter.labels(path)._value.get() for path in ("local", "remote")}


def test_never_prefills_on_decode_with_the_same_greedy_tokens(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    stack = make_stack(router={"disaggregation": "never"})
    prompts = [prompt(40) + prompt(n, offset=n) for n in (3, 20, 70)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: stack.generate(p, GREEDY), prompts))
    expected = make_engine().generate(prompts, GREEDY)
    for result, reference in zip(results, expected, strict=True):
        assert result.tokens == list(reference.token_ids)
    assert paths(stack) == {"local": 3, "remote": 0}
    assert stack.prefill[0].instance.stats().num_computed_tokens == 0  # prefill did nothing
    decode = stack.decode[0].address
    index = stack.router.kv_events.index
    wait_for(lambda: index.num_blocks(decode) >= 6)  # decode's blocks reach the router's index
    # a follow-up sharing the first prompt's 40+ tokens finds them on decode
    before = stack.decode[0].instance.stats().device_hit_tokens
    again = stack.generate(prompts[2] + prompt(5, offset=9), GREEDY)
    assert len(again.tokens) == 16
    assert stack.decode[0].instance.stats().device_hit_tokens - before >= 96


def test_a_decode_refuses_local_prefill_that_would_eat_the_running_requests_headroom(
    make_stack: MakeStack,
) -> None:
    stack = make_stack(decode_engine={"num_kv_blocks": 32})
    stub = decode_pb2_grpc.DecodeServiceStub(stack.channels.get(stack.decode[0].address))
    outputs = common_pb2_grpc.InstanceServiceStub(stack.channels.get(stack.decode[0].address))
    subscription = outputs.SubscribeOutputs(
        common_pb2.OutputsRequest(subscriber="test"), timeout=60
    )
    assert not next(subscription).outputs
    try:  # a running request that will grow by 256 tokens (16 blocks) keeps them free
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        stub.Generate(generate_request("long", prompt(20), long, subscriber="test"), timeout=30)
        wait_for(lambda: stack.decode[0].instance.stats().num_running == 1)
        big = generate_request("big", prompt(250), GREEDY, subscriber="test")  # 16 blocks
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(big, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "growth of running requests" in str(refused.value.details())
        small = generate_request("small", prompt(40), GREEDY, subscriber="test")  # 3 blocks
        stub.Generate(small, timeout=30)  # fits beside the headroom
    finally:
        subscription.cancel()  # the router went away: its requests end
    wait_for(lambda: stack.decode[0].instance.stats().num_running == 0)


def test_auto_predicts_both_paths_and_serves_either_with_the_same_tokens(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    stack = make_stack(router={"disaggregation": "auto", "stats_interval_s": 0.1})
    router = stack.router
    members = [*router.membership.members(Role.PREFILL), *router.membership.members(Role.DECODE)]
    wait_for(lambda: all(router.stats.stats(a) is not None for a in members))
    prompts = [prompt(24, offset=1), prompt(600, offset=2)]
    results = [stack.generate(p, GREEDY, request_id=f"auto-{i}") for i, p in enumerate(prompts)]
    expected = make_engine().generate(prompts, GREEDY)
    for result, reference in zip(results, expected, strict=True):
        assert result.tokens == list(reference.token_ids)
    assert sum(paths(stack).values()) == 2
    for i in range(2):
        record = router.recent.get(f"auto-{i}")
        assert record is not None
        [route] = [s for s in record.stages if s.name == "route"]
        assert route.attributes["path"] in ("local", "remote")
        remote = float(route.attributes["predicted_remote_ttft_s"])
        local = float(route.attributes["predicted_local_ttft_s"])
        delay = float(route.attributes["predicted_local_delay_s"])
        assert remote > 0 and local > 0 and delay >= 0
        assert route.attributes["path"] == ("local" if local + delay < remote else "remote")
