"""PD disaggregation with instances as real Ray actors placed by the controller."""

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from credentials import SECRET, channels
from reference import hf_greedy, hf_model
from waiting import wait_for

from pdserve.config import ClusterConfig, DecodeConfig, EngineConfig, PrefillConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import PdserveError
from pdserve.v1 import common_pb2
from services.controller.cluster import Cluster
from services.router.pd_client import Finished, PDClient, TokenDelta

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


def decode_stats(client: PDClient, address: str) -> common_pb2.InstanceStats:
    return client.instance(address).stats()


@pytest.fixture(scope="module")
def cluster(ray_session: None, tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(cluster_config(tiny_model_dir), SECRET)
    cluster.up()
    yield cluster
    cluster.down()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[PDClient]:
    client = PDClient(channels())
    yield client
    client.close()
    for info in cluster.instances:
        ray.get(cluster.actor(info.name).check_integrity.remote())


def generate(client: PDClient, cluster: Cluster, prompt: list[int]) -> list[int]:
    where = addresses(cluster)
    tokens: list[int] = []
    for event in client.generate(where["prefill"], where["decode"], prompt, GREEDY):
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, Finished) and event.finish_reason == "length"
    return tokens


def test_pd_on_ray_equals_mixed_and_transformers(
    cluster: Cluster,
    client: PDClient,
    tiny_model_dir: Path,
    make_engine: Callable[..., LLMEngine],
) -> None:
    shared = [(11 * i + 2) % 250 for i in range(48)]
    prompts = [shared + [(7 * i + n) % 250 for i in range(n)] for n in (3, 17, 40)]
    with ThreadPoolExecutor(3) as pool:
        pd_outputs = list(pool.map(lambda p: generate(client, cluster, p), prompts))
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
    """Not at the lease's end (30 s): as soon as the loss is known (the client's Prefill call
    fails, and the client aborts the request on decode)."""
    config = cluster_config(tiny_model_dir, "pdserve-test-kill", reservation_timeout_s=30.0)
    cluster = Cluster(config, SECRET)
    cluster.up()
    client = PDClient(channels())
    try:
        where = addresses(cluster)
        failure: list[BaseException] = []

        def long_request() -> None:
            prompt = [(5 * i + 1) % 250 for i in range(3000)]
            try:
                list(client.generate(where["prefill"], where["decode"], prompt, GREEDY))
            except PdserveError as e:
                failure.append(e)

        worker = threading.Thread(target=long_request)
        worker.start()
        wait_for(lambda: decode_stats(client, where["decode"]).num_reservations == 1)
        ray.kill(cluster.actor("prefill-0"))
        worker.join(60)
        assert failure, "the request should fail when its prefill instance dies"
        wait_for(lambda: decode_stats(client, where["decode"]).num_reservations == 0, 2.0)
        stats = decode_stats(client, where["decode"])
        assert stats.num_free_blocks == stats.num_blocks
        ray.get(cluster.actor("decode-0").check_integrity.remote())
        assert cluster.dead_instances(timeout_s=5) == ["prefill-0"]
    finally:
        client.close()
        cluster.down()
