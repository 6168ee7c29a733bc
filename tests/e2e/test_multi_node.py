"""pdserve on a Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`: a head
and two worker nodes, each its own raylet, resources and workers). `pdserve up --address` joins
it; `cluster.placement_strategy: SPREAD` places the prefill and the two decode instances on
different nodes; greedy completions equal the engine's own. Then a whole worker node is lost
under a load of streaming and non-streaming requests, with a long stream under way on the lost
decode instance: every request completes with the undisturbed text (streams on the lost
instance migrate), the lost instance is re-placed on a surviving node and serves again, and the
cluster ends at rest."""

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chaos_load import (
    CLIENTS,
    MAX_TOKENS,
    PROMPTS,
    Load,
    LongStream,
    alive_again,
    check_lost_nothing,
    request,
)
from pdserve_up import UpCluster, pdserve_up
from ray_nodes import RayNodes, ray_nodes
from waiting import wait_for

from pdserve.engine import LLMEngine, SamplingParams

LONG_TOKENS = 1000  # seconds of decoding: under way when its node is lost


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    with ray_nodes(head_cpus=1, worker_cpus=[2, 2]) as started:
        yield started


def a_stream_on_a_worker(
    up: UpCluster, model: str, workers: set[str]
) -> tuple[str, LongStream, list[LongStream]]:
    """On an idle cluster: long streams started one at a time until one is served by a decode
    instance on one of the `workers` nodes (each stream's decode is the one newly running;
    the router sends the next stream to the other, less loaded, decode). Returns that
    instance, its stream, and every stream started."""
    streams: list[LongStream] = []
    serving: set[str] = set()
    decodes = {n: i for n, i in up.list_instances().items() if i.role == "decode"}
    for prompt in range(len(PROMPTS)):
        stream = LongStream(up, model, prompt, LONG_TOKENS)
        streams.append(stream)
        wait_for(stream.streaming.is_set, 60)
        running = {n for n, i in decodes.items() if up.stats(i.address).num_running > 0}
        for name in running - serving:
            if decodes[name].node in workers:
                return name, stream, streams
        serving |= running
    raise AssertionError(f"no long stream went to a decode instance on {workers}")


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
        victim, doomed, streams = a_stream_on_a_worker(up, model, workers)
        with Load(up, model) as load:
            load.wait_for_more(CLIENTS)
            lost = up.list_instances()[victim]
            started = len(load.outcomes)
            assert not doomed.done()  # under way on the decode instance about to be lost
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
        long = make_engine().generate(
            [PROMPTS[s.prompt] for s in streams],
            SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True),
        )
        for stream, expected in zip(streams, long, strict=True):
            outcome = stream.result()
            assert outcome.status == 200 and outcome.completion_tokens == LONG_TOKENS, outcome
            assert outcome.text == expected.text
        check_lost_nothing(up, outcomes, reference)  # the doomed stream migrated, at least
