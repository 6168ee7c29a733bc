"""The instances' KV-event streams as the router follows them: numbered events that cannot drift
(faults injected on the instance side: lost, repeated, reordered, corrupted events and a
restart's epoch), and the load reports two routers share."""

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stacks import Stack, routed
from waiting import wait_for

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.kvcache.events import KVDigest
from pdserve.v1 import common_pb2

GREEDY = SamplingParams(max_tokens=2)


class OneFault:
    """A KV-event fault hook (`InstanceRuntime.kv_event_fault`) that spoils the first `stored`
    event it sees once armed, as `kind` says; every other message passes unchanged."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.armed = False
        self.done = False
        self._held: list[common_pb2.KVEvent] = []

    def __call__(self, message: common_pb2.KVEvent) -> list[common_pb2.KVEvent]:
        held, self._held = self._held, []
        if not self.armed or self.done or message.WhichOneof("event") != "stored":
            return [message, *held]  # a held event goes out after the one that overtook it
        self.done = True
        if self.kind == "drop":
            return []
        if self.kind == "repeat":
            return [message, message]
        if self.kind == "hold":
            self._held = [message]
            return []
        spoiled = common_pb2.KVEvent()
        spoiled.CopyFrom(message)
        if self.kind == "corrupt":  # a hash lost without a trace in the numbering
            del spoiled.stored.block_hashes[-1]
        else:  # "epoch": the item of another run of the instance
            spoiled.epoch += 1
        return [spoiled]


def resyncs(stack: Stack, reason: str) -> float:
    value = stack.router.metrics.registry.get_sample_value(
        "pdserve_router_kv_index_resyncs_total", {"reason": reason}
    )
    return value or 0.0


def snapshots(stack: Stack) -> float:
    registry = stack.router.metrics.registry
    return registry.get_sample_value("pdserve_router_kv_index_snapshots_total") or 0.0


@pytest.mark.parametrize(
    ("kind", "reason", "snapshot"),
    [
        ("drop", "gap", False),
        ("repeat", "duplicate", False),
        ("hold", "gap", False),
        ("corrupt", "digest", True),
        ("epoch", "epoch", True),
    ],
)
def test_the_index_converges_to_the_instance_after_a_spoiled_event(
    make_stack: Callable[..., Stack], kind: str, reason: str, snapshot: bool
) -> None:
    stack = make_stack()
    runtime = stack.prefill[0].instance.runtime
    address = stack.prefill[0].address
    index = stack.router.kv_events.index
    wait_for(lambda: snapshots(stack) == 2)  # one per instance followed: prefill and decode
    fault = OneFault(kind)
    runtime.kv_event_fault = fault
    fault.armed = True
    for n in range(4):  # each publishes new blocks: stored events
        stack.generate([3 + n] + [5 + (i * n) % 40 for i in range(40)], GREEDY)
    assert fault.done

    def converged() -> bool:
        published = runtime.loop.call(LLMEngine.published_hashes)
        return index.digest(address) == KVDigest.of(published) == runtime.events.digest

    wait_for(converged)
    assert resyncs(stack, reason) >= 1
    # a short gap is filled from the instance's replay buffer, drift needs a snapshot
    assert snapshots(stack) == (3 if snapshot else 2)
    published = runtime.loop.call(LLMEngine.published_hashes)
    assert index.overlaps(published, [address])[address] >= 1
    assert index.num_blocks(address) == len(published)
    index.check_integrity()


@pytest.fixture
def slow_steps() -> Iterator[Callable[[object, float], None]]:
    """Make an instance's every step take `seconds` longer (a slow instance), until the test
    ends."""
    restore: list[Callable[[], None]] = []

    def slow(instance: object, seconds: float) -> None:
        runner = instance.runtime.engine.runner  # type: ignore[attr-defined]
        execute = runner.execute_all

        def slowed(chunks: object) -> object:
            time.sleep(seconds)  # the step's own duration, not a synchronisation
            return execute(chunks)

        runner.execute_all = slowed
        restore.append(lambda: setattr(runner, "execute_all", execute))

    yield slow
    for undo in restore:
        undo()


def test_a_burst_through_one_router_steers_the_other_routers_choices(
    make_stack: Callable[..., Stack],
    tiny_model_dir: Path,
    slow_steps: Callable[[object, float], None],
) -> None:
    engine = {"num_kv_blocks": 256, "max_model_len": 1024}
    stack_b = make_stack(mixed=2, engine=engine, router={"prefill_policy": "least_load"})
    busy, idle = (m.address for m in stack_b.mixed)
    slow_steps(stack_b.mixed[0].instance, 0.02)
    config = EngineConfig(model=str(tiny_model_dir), **engine)
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    with routed(config, mixed=[busy], router={"prefill_policy": "least_load"}) as stack_a:
        burst = [
            threading.Thread(target=stack_a.generate, args=([7 + n] * 12, params)) for n in range(3)
        ]
        for thread in burst:
            thread.start()
        routing_b = stack_b.router.attempts.routing
        # router B sent nothing, yet sees router A's requests on `busy` in its load reports
        wait_for(lambda: routing_b.load_of(busy).in_flight_requests == 3)
        assert stack_b.router.attempts.load.load_of(busy).in_flight_requests == 0
        chosen = [routing_b.choose(f"b{n}", 12, [], set()).prefill for n in range(6)]
        assert chosen == [idle] * 6
        for thread in burst:
            thread.join()
    wait_for(lambda: routing_b.load_of(busy).in_flight_requests == 0)


def test_predicted_and_actual_prefix_hits_are_counted_per_routed_request(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack()
    registry = stack.router.metrics.registry
    address = stack.prefill[0].address

    def hits(kind: str) -> float:
        name = f"pdserve_router_{kind}_hit_tokens_total"
        return registry.get_sample_value(name) or 0.0

    prompt = [9 + i % 31 for i in range(52)]  # 3 full blocks of 16, then 4 tokens
    stack.generate(prompt, GREEDY)
    assert (hits("predicted"), hits("actual")) == (0, 0)
    hashes = stack.router.model.hasher.hash_tokens(prompt)
    wait_for(lambda: stack.router.kv_events.index.overlaps(hashes, [address])[address] == 3)
    stack.generate(prompt, GREEDY)
    assert (hits("predicted"), hits("actual")) == (48, 48)
