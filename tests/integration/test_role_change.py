"""An instance changes role in place (`InstanceActor.change_role`, run here without Ray): the
same process, engine, port and prefix cache serve the other role; the old role's service
refuses as UNAVAILABLE and reports NOT_SERVING; greedy output through the router is unchanged."""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from credentials import SECRET
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stacks import Stack, routed
from waiting import wait_for

from pdserve.config import (
    ClusterConfig,
    DecodeConfig,
    EngineConfig,
    PrefillConfig,
    StorageConfig,
)
from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.controller.actors import InstanceActor
from services.controller.cluster import role_change_refusal
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[7 + n, *range(20, 60)] for n in range(3)]


@pytest.fixture
def actors(tiny_model_dir: Path) -> Iterator[dict[str, InstanceActor]]:
    """Two prefill instances and one decode instance, each an InstanceActor of this process;
    decode may hold more sequences than prefill (a scheduler limit the change applies)."""
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8)
    config = ClusterConfig(
        engine=engine,
        decode=DecodeConfig(engine=replace(engine, max_num_seqs=16)),
        storage=StorageConfig(enabled=False),
    )
    started: dict[str, InstanceActor] = {}
    try:
        for name, role in (
            ("prefill-0", "prefill"),
            ("prefill-1", "prefill"),
            ("decode-0", "decode"),
        ):
            started[name] = InstanceActor(role, config, SECRET)
        yield started
    finally:
        for actor in started.values():
            actor.stop()


def serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def change(stack: Stack, actor: InstanceActor, role: str) -> None:
    """What `pdserve admin role` does once the instance is idle: out of routing, switch, back
    in its new role."""
    stack.router.remove_instance(actor.address())
    actor.change_role(role)
    stack.router.add_instance(role, actor.address())


def test_a_prefill_instance_serves_decode_in_place_and_back(
    actors: dict[str, InstanceActor],
) -> None:
    moving = actors["prefill-1"]
    address, pid = moving.address(), moving.pid()
    prefill = [actors["prefill-0"].address(), address]
    engine = moving.config.engine
    with routed(engine, prefill, [actors["decode-0"].address()]) as stack:
        before = [stack.generate(p, GREEDY).tokens for p in PROMPTS]
        index = stack.router.kv_events.index
        wait_for(lambda: index.num_blocks(address) > 0)  # it prefilled some of them
        cached = moving.instance.stats().num_cached_blocks

        change(stack, moving, "decode")
        stats = moving.instance.stats()
        assert stats.role == "decode" and moving.pid() == pid and moving.address() == address
        assert stats.num_cached_blocks == cached  # its prefix cache stayed
        assert stats.max_num_seqs == 16  # decode's scheduler limit
        assert serving(address, DECODE_SERVICE) and not serving(address, PREFILL_SERVICE)
        with grpc.insecure_channel(address) as channel:  # its old role refuses, retryably
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            request = prefill_pb2.PrefillRequest(
                request=common_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2]),
                decode_address=actors["decode-0"].address(),
            )
            with pytest.raises(grpc.RpcError) as refused:
                stub.Prefill(request, metadata=(("authorization", f"Bearer {SECRET}"),))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # both decode instances serve now: every request lands on one of them, same tokens
        outputs = [stack.generate(p, GREEDY).tokens for p in PROMPTS * 2]
        assert outputs == before * 2
        assert moving.instance.stats().kv_blocks_received > 0  # prefill-0 sent it prompts

        change(stack, moving, "prefill")
        assert moving.instance.stats().role == "prefill"
        assert serving(address, PREFILL_SERVICE) and not serving(address, DECODE_SERVICE)
        wait_for(lambda: index.num_blocks(address) > 0)  # its cache, announced again
        assert [stack.generate(p, GREEDY).tokens for p in PROMPTS] == before
    for actor in actors.values():
        actor.check_integrity()


def test_role_changes_need_matching_engines_and_resources() -> None:
    base = ClusterConfig()
    assert role_change_refusal(base, "prefill", "decode") is None
    assert role_change_refusal(base, "decode", "prefill") is None
    assert "prefill and decode only" in (role_change_refusal(base, "decode", "mixed") or "")
    limits = replace(base, decode=DecodeConfig(engine=replace(base.engine, max_num_seqs=256)))
    assert role_change_refusal(limits, "prefill", "decode") is None  # on CPU: applied
    blocks = replace(base, decode=DecodeConfig(engine=replace(base.engine, num_kv_blocks=64)))
    assert "differ in num_kv_blocks" in (role_change_refusal(blocks, "prefill", "decode") or "")
    cpus = replace(base, decode=DecodeConfig(num_cpus=4.0))
    assert "num_cpus (Ray resources)" in (role_change_refusal(cpus, "prefill", "decode") or "")
    gpu = replace(
        base,
        engine=replace(base.engine, device="cuda"),
        prefill=PrefillConfig(num_gpus=1.0),
        decode=DecodeConfig(num_gpus=1.0),
    )
    grown = replace(gpu, decode=replace(gpu.decode, engine=replace(gpu.engine, max_num_seqs=256)))
    assert "max_num_seqs exceed" in (role_change_refusal(grown, "prefill", "decode") or "")
    shrunk = replace(gpu, decode=replace(gpu.decode, engine=replace(gpu.engine, max_num_seqs=8)))
    assert role_change_refusal(shrunk, "prefill", "decode") is None
