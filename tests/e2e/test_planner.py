"""The SLA planner on a `pdserve up` cluster (tiny model, 3 instances, 2 s intervals): under a
chat load (short prompts, long answers) it moves a prefill instance to decode; under a RAG load
(long prompts, one-token answers) it moves one back; no request fails meanwhile.

The targets are set at run time between what the planner itself predicts (`planner_loads`)
for the two splits under each load, so that the test exercises the live loop — forecast,
simulation on the instances' own step time fits, decision, role change — whatever this
machine's speed; how well the planner sizes a cluster is measured in the simulator
(benchmarks/planner_sim.py)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from pdserve_up import UpCluster, pdserve_up
from planner_loads import Load, chat, check_at_rest, move, planner_config, split, status


@pytest.fixture(scope="module")
def up(
    ray_session: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("planner")
    # 8,192 KV blocks (512 MiB an instance): room for the requests that queue on the one
    # overloaded instance until the planner moves (a request's decode blocks are reserved before
    # its prefill: 15 s of the RAG load before the move, on a machine busy with other tests,
    # holds ~7,000)
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 8192\n"
        f"  max_num_seqs: 4\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\n"
        f"admin:\n  port: 0\nstorage:\n  enabled: false\n"
        f"{planner_config(min_instances=3, max_instances=3)}"
        f"cluster:\n  namespace: pdserve-planner\n  state_dir: {workdir}\n"
    )
    with pdserve_up(config, workdir, ray.get_runtime_context().gcs_address) as cluster:
        yield cluster


def test_the_planner_moves_an_instance_to_the_role_the_load_needs_and_back(
    up: UpCluster, tiny_model_dir: Path
) -> None:
    model = tiny_model_dir.name
    assert split(up) == "2P1D"
    # answers of 96 tokens, from 10 a second (`move` raises it until the planner sees one decode
    # instance's 4 slots, max_num_seqs, fall behind)
    with Load(up, lambda n: chat(model), rate_per_s=10) as load:
        move(up, load, "2P1D", "1P2D")
    chat_failures = load.failures

    # long prompts, one token each, each its own (no prefix cache computes them): one prefill
    # instance computes them one after the other (from 8 a second, raised as the chat load)
    def rag(n: int) -> dict[str, object]:
        prompt = [3 + (n + i) % 250 for i in range(900)]  # ids within the tiny model's vocabulary
        return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}

    with Load(up, rag, rate_per_s=8) as load:
        move(up, load, "1P2D", "2P1D")
    assert chat_failures == [] and load.failures == []
    changes = [d for d in status(up).decisions if d.action == "change"]
    assert [(d.current, d.target) for d in changes] == [("2P1D", "1P2D"), ("1P2D", "2P1D")]
    metrics = up.router_metrics()
    assert metrics['pdserve_planner_decisions_total{action="change"}'] == 2
    check_at_rest(up)
