"""Router replicas: `router.replicas: 2` serves one port from two processes. Killing the replica
that is not `up`'s own under streaming load ends only the streams it carried (a broken
connection, never a hang); every request started after it died succeeds on the other; it is
back within its backoff and serves again; the instances end idle (the dead replica's requests
were aborted when its output subscriptions closed)."""

import json
import threading
from pathlib import Path

import httpx
import psutil
import ray
from pdserve_up import UpCluster, pdserve_up, scrape_metrics
from waiting import wait_for

from pdserve.v1 import admin_pb2

MAX_TOKENS = 120
STREAMS = 10


def routers(up: UpCluster) -> dict[str, admin_pb2.RouterReplica]:
    reply = up.admin().ListInstances(
        admin_pb2.ListInstancesRequest(), metadata=up.admin_auth, timeout=30
    )
    return {r.name: r for r in reply.routers}


def running_on(replica: admin_pb2.RouterReplica) -> float:
    metrics = scrape_metrics(f"http://{replica.metrics_address}")
    return metrics.get("pdserve_router_running_generations", 0.0)


def served_by(replica: admin_pb2.RouterReplica) -> float:
    metrics = scrape_metrics(f"http://{replica.metrics_address}")
    return sum(v for k, v in metrics.items() if k.startswith("pdserve_router_requests_total"))


def complete(up: UpCluster, model: str, n: int) -> int:
    """One completion on a new connection; its status."""
    body = {"model": model, "prompt": f"request {n}", "max_tokens": 8, "ignore_eos": True}
    return httpx.post(f"{up.router_url}/completions", json=body, timeout=60).status_code


def stream(up: UpCluster, model: str, n: int, started: threading.Event, out: list[str]) -> None:
    """A long stream: 'complete' when it got every token, else the error that ended it."""
    body = {"model": model, "prompt": f"stream {n}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    try:
        with httpx.stream("POST", f"{up.router_url}/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
                    started.set()
        out.append("complete" if tokens == MAX_TOKENS else f"short: {tokens}")
    except httpx.TransportError as e:  # the replica died under it: the connection broke
        out.append(f"broken: {type(e).__name__}")
    started.set()


def test_a_killed_replica_loses_only_its_own_streams_and_comes_back(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 256\n"
        f"prefill:\n  replicas: 1\n  num_cpus: 1\ndecode:\n  replicas: 1\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  replicas: 2\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-replicas\n  state_dir: {tmp_path}\n"
        f"  restart_backoff_s: 0.5\n"
    )
    address = ray.get_runtime_context().gcs_address
    with pdserve_up(config, tmp_path, address) as up:
        model = tiny_model_dir.name
        before = routers(up)
        assert sorted(before) == ["router-0", "router-1"]
        assert all(r.alive and r.metrics_address for r in before.values())
        assert [complete(up, model, n) for n in range(20)] == [200] * 20
        assert all(served_by(r) > 0 for r in before.values())  # the kernel spread them

        outcomes: list[str] = []
        events = [threading.Event() for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream, args=(up, model, n, events[n], outcomes))
            for n in range(STREAMS)
        ]
        for thread in threads:
            thread.start()
        for event in events:
            event.wait(60)
        victim = before["router-1"]
        wait_for(lambda: running_on(victim) >= 1, 30)
        psutil.Process(victim.pid).kill()
        wait_for(lambda: not psutil.pid_exists(victim.pid), 30)
        after_kill = [complete(up, model, 100 + n) for n in range(20)]
        for thread in threads:
            thread.join(120)
        assert after_kill == [200] * 20  # every connection since went to router-0
        assert len(outcomes) == STREAMS
        assert all(o == "complete" or o.startswith("broken") for o in outcomes), outcomes
        assert any(o.startswith("broken") for o in outcomes)  # router-1 carried some

        def back() -> bool:
            replica = routers(up)["router-1"]
            return replica.alive and replica.pid != victim.pid and replica.restarts == 1

        wait_for(back, 60)
        again = routers(up)["router-1"]
        assert [complete(up, model, 200 + n) for n in range(20)] == [200] * 20
        assert served_by(again) > 0
        for info in up.list_instances().values():
            wait_for(lambda a=info.address: up.stats(a).num_running == 0, 30)
            stats = up.stats(info.address)
            assert stats.num_reservations == 0 and stats.num_free_blocks == stats.num_blocks
