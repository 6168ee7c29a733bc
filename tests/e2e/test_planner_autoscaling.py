"""The SLA planner on a Ray cluster with Ray's own autoscaler (its fake multi-node provider:
nodes are processes on this machine): the head node holds the two instances the cluster starts
with; a load that needs a second decode instance makes the planner ask Ray for its resources,
the autoscaler launches a node, the new instance is placed there and serves, and no request
fails meanwhile; idle again, the cluster shrinks back to its minimum."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from autoscaling_ray import WORKER_TYPE, autoscaling_ray, nodes
from pdserve_up import UpCluster, pdserve_up
from planner_loads import Load, chat, check_at_rest, move, planner_config, split, status
from waiting import wait_for


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    # the head: room for the starting prefill and decode instances (one CPU each), no more
    with autoscaling_ray(head_cpus=2, worker_cpus=1, max_workers=1) as address:
        yield address


@pytest.fixture(scope="module")
def up(
    ray_address: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("planner-autoscaling")
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 4096\n"
        f"  max_num_seqs: 4\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\n"
        f"admin:\n  port: 0\nstorage:\n  enabled: false\n"
        f"{planner_config(min_instances=2, max_instances=3, max_prefill=1)}"
        f"cluster:\n  namespace: pdserve-planner-autoscaling\n  state_dir: {workdir}\n"
    )
    with pdserve_up(config, workdir, ray_address) as cluster:
        yield cluster


def test_an_instance_the_load_needs_is_placed_on_a_node_the_autoscaler_adds(
    up: UpCluster, ray_address: str, tiny_model_dir: Path
) -> None:
    assert split(up) == "1P1D"
    assert nodes(ray_address) == {"ray.head.default": 1}
    # answers of 96 tokens, from 10 a second (`move` raises it until the planner sees one decode
    # instance's 4 slots, max_num_seqs, fall behind)
    with Load(up, lambda n: chat(tiny_model_dir.name), rate_per_s=10) as load:
        move(up, load, "1P1D", "1P2D")
        added = up.list_instances()["decode-1"]
        wait_for(lambda: up.stats(added.address).num_steps > 0, 60)  # it serves
    assert load.failures == []
    assert nodes(ray_address) == {"ray.head.default": 1, WORKER_TYPE: 1}  # where else: head full
    wait_for(lambda: split(up) == "1P1D", 60)  # idle again: back to the minimum
    changes = [d for d in status(up).decisions if d.action == "change"]
    assert [(d.current, d.target) for d in changes] == [("1P1D", "1P2D"), ("1P2D", "1P1D")]
    check_at_rest(up)
