"""The SLA planner on a `pdserve up` cluster (tiny model, 3 instances, 2 s intervals): under a
chat load (short prompts, long answers) it moves a prefill instance to decode; under a RAG load
(long prompts, one-token answers) it moves one back; no request fails meanwhile.

The targets are set at run time (`SetPlannerTargets`) between what the planner itself predicts
for the two splits under each load, so that the test exercises the live loop — forecast,
simulation on the instances' own step time fits, decision, role change — whatever this
machine's speed; how well the planner sizes a cluster is measured in the simulator
(benchmarks/planner_sim.py)."""

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
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
    # 8,192 KV blocks (512 MiB an instance): room for the requests that queue on the one
    # overloaded instance until the planner moves (a request's decode blocks are reserved before
    # its prefill: 15 s of the RAG load before the move, on a machine busy with other tests,
    # holds ~7,000)
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 8192\n"
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
    """Open loop: `body(n)` sent as the n-th request, `rate_per_s` times a second until
    stopped, each request on its own (users do not wait for each other: a slow cluster sees the
    load it cannot serve); failures kept."""

    def __init__(
        self, up: UpCluster, body: Callable[[int], dict[str, object]], rate_per_s: float
    ) -> None:
        self.url, self.body, self.rate_per_s = f"{up.router_url}/completions", body, rate_per_s
        self.output_tokens = int(str(body(0)["max_tokens"]))
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
        for n in itertools.count():
            if self._stop.is_set():
                return
            self._pool.submit(self._one, self.body(n))
            at += 1 / self.rate_per_s
            self._stop.wait(max(0.0, at - time.monotonic()))

    def _one(self, body: dict[str, object]) -> None:
        try:
            reply = self._client.post(self.url, json=body)
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


def predictions_under_load(
    up: UpCluster, current: str, output_tokens: int
) -> admin_pb2.PlannerDecision:
    """A decision taken on the load now running only: its forecast's lengths are this load's
    (`output_tokens` each) and its rate windows (two intervals) began after the load did."""
    clean = time.time() + 2 * INTERVAL_S

    def fresh() -> admin_pb2.PlannerDecision | None:
        decisions = status(up).decisions
        ready = [d for d in decisions if d.at_unix_s >= clean and d.current == current
                 and d.forecast_output_tokens == output_tokens
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
    decision = predictions_under_load(up, current, load.output_tokens)
    if split(up) != wanted:  # (it may have moved on its own: the old target was unreachable)
        candidate = {c.split: c for c in decision.candidates}[wanted]
        ttft = (candidate.ttft_p90_s, decision.predicted_ttft_p90_s)
        itl = (candidate.itl_p90_s, decision.predicted_itl_p90_s)
        if ttft[1] / ttft[0] >= itl[1] / max(itl[0], 1e-9):
            set_targets(up, between(*ttft), GENEROUS_S)
        else:
            set_targets(up, GENEROUS_S, between(*itl))
    try:
        wait_for(lambda: split(up) == wanted, 120)
    except AssertionError:
        raise AssertionError(f"still {split(up)}, not {wanted}:\n{recent(up)}") from None
    assert load.done > 0


def recent(up: UpCluster) -> str:
    """The planner's targets and last decisions (TTFT/ITL p90 predicted, observed, and per
    candidate with its goodput), one a line: what a failed wait shows."""
    now = status(up)
    lines = [f"targets {now.targets.ttft_p90_s:.3f}/{now.targets.itl_p90_s:.4f}"]
    for d in now.decisions[-8:]:
        candidates = " ".join(
            f"{c.split} {c.ttft_p90_s:.3f}/{c.itl_p90_s:.4f}/{c.goodput:.2f}" for c in d.candidates
        )
        lines.append(
            f"{d.action} {d.current}->{d.target} ({d.reason}) forecast "
            f"{d.forecast_rate_per_s:.1f}/s {d.forecast_prompt_tokens:.0f}"
            f"({d.forecast_cached_tokens:.0f})->{d.forecast_output_tokens:.0f} predicted "
            f"{d.predicted_ttft_p90_s:.3f}/{d.predicted_itl_p90_s:.4f} observed "
            f"{d.observed_ttft_p90_s:.3f}/{d.observed_itl_p90_s:.4f}; {candidates}"
        )
    return "\n".join(lines)


def test_the_planner_moves_an_instance_to_the_role_the_load_needs_and_back(
    up: UpCluster, tiny_model_dir: Path
) -> None:
    model = tiny_model_dir.name
    assert split(up) == "2P1D"
    # answers of 96 tokens, 10 a second: more than one decode instance's 4 slots (max_num_seqs)
    # serve, not more than two's
    chat = {"model": model, "prompt": "hello there", "max_tokens": 96, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    with Load(up, lambda n: chat, rate_per_s=10) as load:
        move(up, load, "2P1D", "1P2D")
    chat_failures = load.failures

    # long prompts, one token each, each its own (no prefix cache computes them): one prefill
    # instance computes them one after the other
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
    for info in up.list_instances().values():
        wait_for(lambda a=info.address: up.stats(a).num_running == 0, 30)
        stats = up.stats(info.address)
        assert stats.num_reservations == 0 and stats.num_free_blocks == stats.num_blocks
