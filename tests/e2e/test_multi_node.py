"""pdserve on a Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`: a head
and two worker nodes, each its own raylet, resources and workers). `pdserve up --address` joins
it; `cluster.placement_strategy: SPREAD` places the prefill and the two decode instances on
different nodes; greedy completions equal the engine's own. Then a whole worker node is lost
under a load of streaming and non-streaming requests: every request completes with the
undisturbed text (streams on the lost decode instance migrate), the lost instance is re-placed
on a surviving node and serves again, and the cluster ends at rest."""

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chaos_load import CLIENTS, MAX_TOKENS, PROMPTS, Load, alive_again, check_lost_nothing, request
from pdserve_up import UpCluster, pdserve_up
from ray_nodes import RayNodes, ray_nodes
from waiting import wait_for

from pdserve.engine import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    with ray_nodes(head_cpus=1, worker_cpus=[2, 2]) as started:
        yield started


def busy_decode_on(up: UpCluster, workers: set[str]) -> str:
    """A decode instance on one of the `workers` nodes that is running requests (waits)."""
    found: list[str] = []

    def busy() -> bool:
        found.extend(
            name
            for name, info in up.list_instances().items()
            if info.role == "decode"
            and info.node in workers
            and up.stats(info.address).num_running > 0
        )
        return bool(found)

    wait_for(busy, 60)
    return found[0]


def test_spread_over_nodes_and_a_lost_node_loses_no_request(
    nodes: RayNodes,
    tiny_model_dir: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 192\n"
        f"prefill:\n  replicas: 1\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-multi-node\n  state_dir: {tmp_path}\n"
        f"  placement_strategy: SPREAD\n  restart_backoff_s: 0.2\n"
    )
    with pdserve_up(config, tmp_path, nodes.address, "--health-interval", "0.5") as up:
        placed = {name: info.node for name, info in up.list_instances().items()}
        assert len(set(placed.values())) == 3, placed  # one instance per node
        model = tiny_model_dir.name
        reference = {p: request(up, model, p, streamed=False) for p in range(len(PROMPTS))}
        greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        engine = make_engine().generate(PROMPTS, greedy)
        assert [reference[p].text for p in range(len(PROMPTS))] == [c.text for c in engine]

        workers = {n.node_id for n in nodes.workers}
        with Load(up, model) as load:
            load.wait_for_more(2 * CLIENTS)
            victim = busy_decode_on(up, workers)
            lost = up.list_instances()[victim]
            started = len(load.outcomes)
            killed_at = time.monotonic()
            nodes.kill(nodes.node_of(lost.node))
            wait_for(lambda: alive_again(up, victim, lost.pid), 180)
            replaced_s = time.monotonic() - killed_at
            load.wait_for_more(2 * CLIENTS)
        again = up.list_instances()[victim]
        assert again.node != lost.node  # re-placed on a surviving node
        print(f"node lost: {victim} re-placed and serving after {replaced_s:.1f} s")
        outcomes = load.outcomes
        assert len(outcomes) - started >= 2 * CLIENTS
        check_lost_nothing(up, outcomes, reference)
