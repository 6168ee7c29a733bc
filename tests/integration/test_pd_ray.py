"""PD disaggregation with instances as real Ray actors placed by the controller, driven
through a real router over their addresses (the production request path: the instances run in
Ray's worker processes, not in this one, so `pd_stack` cannot start them; `stacks.routed` puts
the router in front of them and `Stack` drives it)."""

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from credentials import SECRET
from reference import hf_greedy, hf_model
from stacks import Stack, routed
from waiting import wait_for

from pdserve.config import ClusterConfig, DecodeConfig, EngineConfig, PrefillConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import PdserveError
from pdserve.rpc.clients import InstanceClient
from pdserve.v1 import common_pb2
from services.controller.cluster import Cluster

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def cluster_config(model: Path, namespace: str = "pdserve-test", **decode: object) -> ClusterConfig:
    engine = EngineConfig(
        model=str(model), num_kv_blocks=256, torch_threads=1, max_num_batched_tokens=128
    )
    return ClusterConfig(
        engine=engine,
        prefill=PrefillConfig(num_cpus=1),
        decode=DecodeConfig(num_cpus=1, **decode),  # type: ignore[arg-type]
        namespace=namespace,
    )


def addresses(cluster: Cluster) -> dict[str, str]:
    return {info.role: info.address for info in cluster.instances}


def routed_cluster(cluster: Cluster, **router: object) -> contextlib.AbstractContextManager[Stack]:
    where = addresses(cluster)
    return routed(cluster.config.engine, [where["prefill"]], [where["decode"]], router=router)


def instance_stats(stack: Stack, address: str) -> common_pb2.InstanceStats:
    return InstanceClient(address, stack.channels).stats()


@pytest.fixture(scope="module")
def cluster(ray_session: None, tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(cluster_config(tiny_model_dir), SECRET)
    cluster.up()
    yield cluster
    cluster.down()


@pytest.fixture(scope="module")
def router(cluster: Cluster) -> Iterator[Stack]:
    with routed_cluster(cluster) as stack:
        yield stack


@pytest.fixture
def stack(cluster: Cluster, router: Stack) -> Iterator[Stack]:
    """The router over the cluster; every instance's integrity is checked after the test."""
    yield router
    router.check()
    for info in cluster.instances:
        ray.get(cluster.actor(info.name).check_integrity.remote())


def generate(stack: Stack, prompt: list[int]) -> list[int]:
    result = stack.generate(prompt, GREEDY)
    assert result.final.finish_reason == "length"
    return result.tokens


def test_pd_on_ray_equals_mixed_and_transformers(
    stack: Stack,
    tiny_model_dir: Path,
    make_engine: Callable[..., LLMEngine],
) -> None:
    shared = [(11 * i + 2) % 250 for i in range(48)]
    prompts = [shared + [(7 * i + n) % 250 for i in range(n)] for n in (3, 17, 40)]
    with ThreadPoolExecutor(3) as pool:
        pd_outputs = list(pool.map(lambda p: generate(stack, p), prompts))
    mixed = [list(c.token_ids) for c in make_engine().generate(prompts, GREEDY)]
    reference = hf_model(tiny_model_dir)
    assert pd_outputs == mixed
    assert pd_outputs == [hf_greedy(reference, p, 20) for p in prompts]


def test_cluster_reports_every_instance_alive(cluster: Cluster) -> None:
    assert sorted(info.name for info in cluster.instances) == ["decode-0", "prefill-0"]
    assert cluster.dead_instances() == []


def test_killed_prefill_leaves_no_reserved_blocks_on_decode(
    ray_session: None, tiny_model_dir: Path
) -> None:
    """Not at the lease's end (30 s): as soon as the loss is known (the router's Prefill call
    fails, and the router's client aborts the request on decode). With the only prefill
    instance gone, the router has nowhere to retry: the request fails."""
    config = cluster_config(tiny_model_dir, "pdserve-test-kill", reservation_timeout_s=30.0)
    cluster = Cluster(config, SECRET)
    cluster.up()
    try:
        decode = addresses(cluster)["decode"]
        with routed_cluster(cluster) as stack:
            failure: list[BaseException] = []

            def long_request() -> None:
                prompt = [(5 * i + 1) % 250 for i in range(3000)]
                try:
                    stack.generate(prompt, GREEDY)
                except PdserveError as e:
                    failure.append(e)

            worker = threading.Thread(target=long_request)
            worker.start()
            wait_for(lambda: instance_stats(stack, decode).num_reservations == 1)
            ray.kill(cluster.actor("prefill-0"))
            worker.join(60)
            assert failure, "the request should fail when its prefill instance dies"
            wait_for(lambda: instance_stats(stack, decode).num_reservations == 0, 2.0)
            stats = instance_stats(stack, decode)
            assert stats.num_free_blocks == stats.num_blocks
        ray.get(cluster.actor("decode-0").check_integrity.remote())
        assert cluster.dead_instances(timeout_s=5) == ["prefill-0"]
    finally:
        cluster.down()
