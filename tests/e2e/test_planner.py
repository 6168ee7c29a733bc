"""The SLA planner on a `pdserve up` cluster (tiny model, 3 instances, 2 s intervals): under a
chat load (short prompts, long answers) it moves a prefill instance to decode; under a RAG load
(long prompts, one-token answers) it moves one back; no request fails meanwhile.

The targets are set at run time (`SetPlannerTargets`) between what the planner itself predicts
for the two splits under each load, so that the test exercises the live loop — forecast,
simulation on the instances' own step time fits, decision, role change — whatever this
machine's speed; how well the planner sizes a cluster is measured in the simulator
(benchmarks/planner.py)."""

import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from pdserve_up import UpCluster, pdserve_up
from waiting import wait_for

from pdserve.v1 import admin_pb2

GENEROUS_S = 30.0  # a target nothing misses
INTERVAL_S, HISTORY_S = 2, 4  # the planner's


@pytest.fixture(scope="module")
def up(
    ray_session: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("planner")
    # 2,048 KV blocks: room for the requests that queue on the one overloaded decode instance
    # until the planner moves (reservations wait rather than fail): ~10 s alone, longer on a
    # machine busy with other tests
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 2048\n"
        f"  max_num_seqs: 4\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\nadmin:\n  port: 0\nstorage:\n  enabled: false\n"
        f"planner:\n  enabled: true\n  ttft_p90_s: {GENEROUS_S}\n  itl_p90_s: {GENEROUS_S}\n"
        f"  interval_s: {INTERVAL_S}\n  history_s: {HISTORY_S}\n  cooldown_s: 2\n"
        f"  confirm_intervals: 1\n"
        f"  min_instances: 3\n  max_instances: 3\n"
        f"cluster:\n  namespace: pdserve-planner\n  state_dir: {workdir}\n"
    )
    with pdserve_up(config, workdir, ray.get_runtime_context().gcs_address) as cluster:
        yield cluster


class Load:
    """Open loop: `body` sent `rate_per_s` times a second until stopped, each request on its
    own (users do not wait for each other: a slow cluster sees the load it cannot serve);
    failures kept."""

    def __init__(self, up: UpCluster, body: dict[str, object], rate_per_s: float) -> None:
        self.url, self.body, self.rate_per_s = f"{up.router_url}/completions", body, rate_per_s
        self.done, self.failures = 0, []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(96)
        self._client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=96))
        self._sender = threading.Thread(target=self._send)

    def __enter__(self) -> "Load":
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sender.join()
        self._pool.shutdown(wait=True)  # every request sent ends
        self._client.close()

    def _send(self) -> None:
        at = time.monotonic()
        while not self._stop.is_set():
            self._pool.submit(self._one)
            at += 1 / self.rate_per_s
            self._stop.wait(max(0.0, at - time.monotonic()))

    def _one(self) -> None:
        try:
            reply = self._client.post(self.url, json=self.body)
        except httpx.HTTPError as e:
            self.failures.append(repr(e))
            return
        if reply.status_code != 200:
            self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
        else:
            self.done += 1


def status(up: UpCluster) -> admin_pb2.PlannerStatus:
    reply: admin_pb2.PlannerStatus = up.admin().GetPlannerStatus(
        admin_pb2.PlannerStatusRequest(), metadata=up.admin_auth, timeout=30
    )
    return reply


def split(up: UpCluster) -> str:
    roles = [i.role for i in up.list_instances().values()]
    return f"{roles.count('prefill')}P{roles.count('decode')}D"


def predictions_under_load(up: UpCluster, current: str) -> admin_pb2.PlannerDecision:
    """A decision taken on the load now running only: once the requests of the one before
    left the planner's history (`history_s` + an interval after this load began)."""
    clean = time.time() + HISTORY_S + INTERVAL_S

    def fresh() -> admin_pb2.PlannerDecision | None:
        decisions = status(up).decisions
        ready = [d for d in decisions if d.at_unix_s >= clean and d.current == current
                 and len(d.candidates) > 1]  # fmt: skip
        return ready[-1] if ready else None

    wait_for(lambda: fresh() is not None or split(up) != current, 120)
    return fresh() or status(up).decisions[-1]


def between(low: float, high: float) -> float:
    assert low < high, f"the planner predicts no gain: {low} >= {high}"
    return math.sqrt(low * high)


def set_targets(up: UpCluster, ttft_s: float, itl_s: float) -> None:
    up.admin().SetPlannerTargets(
        admin_pb2.PlannerTargets(ttft_p90_s=ttft_s, itl_p90_s=itl_s),
        metadata=up.admin_auth,
        timeout=30,
    )


def move(up: UpCluster, load: Load, current: str, wanted: str) -> None:
    """Under `load`, set a target between the current split's predicted p90 and the wanted
    split's — of the figure (TTFT or ITL) where the planner predicts the wanted split gains
    most; the other target generous — then wait until the planner moved there."""
    decision = predictions_under_load(up, current)
    if split(up) != wanted:  # (it may have moved on its own: the old target was unreachable)
        candidate = {c.split: c for c in decision.candidates}[wanted]
        ttft = (candidate.ttft_p90_s, decision.predicted_ttft_p90_s)
        itl = (candidate.itl_p90_s, decision.predicted_itl_p90_s)
        if ttft[1] / ttft[0] >= itl[1] / max(itl[0], 1e-9):
            set_targets(up, between(*ttft), GENEROUS_S)
        else:
            set_targets(up, GENEROUS_S, between(*itl))
    wait_for(lambda: split(up) == wanted, 120)
    assert load.done > 0


def test_the_planner_moves_an_instance_to_the_role_the_load_needs_and_back(
    up: UpCluster, tiny_model_dir: Path
) -> None:
    model = tiny_model_dir.name
    assert split(up) == "2P1D"
    # answers of 96 tokens, 10 a second: more than one decode instance's 4 slots (max_num_seqs)
    # serve, not more than two's
    chat = {"model": model, "prompt": "hello there", "max_tokens": 96, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    with Load(up, chat, rate_per_s=10) as load:
        move(up, load, "2P1D", "1P2D")
    chat_failures = load.failures
    # long prompts, one token each: one prefill instance computes them one after the other
    prompt = [3 + i % 250 for i in range(900)]  # token ids within the tiny model's vocabulary
    rag = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with Load(up, rag, rate_per_s=10) as load:
        move(up, load, "1P2D", "2P1D")
    assert chat_failures == [] and load.failures == []
    changes = [d for d in status(up).decisions if d.action == "change"]
    assert [(d.current, d.target) for d in changes] == [("2P1D", "1P2D"), ("1P2D", "2P1D")]
    metrics = up.router_metrics()
    assert metrics['pdserve_planner_decisions_total{action="change"}'] == 2
    for info in up.list_instances().values():
        wait_for(lambda a=info.address: up.stats(a).num_running == 0, 30)
        stats = up.stats(info.address)
        assert stats.num_reservations == 0 and stats.num_free_blocks == stats.num_blocks
