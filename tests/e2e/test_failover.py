"""A `pdserve up` cluster that heals itself: instances killed with SIGKILL leave routing at
once, are recreated within their restart budget, and requests keep succeeding."""

from pathlib import Path

import httpx
import ray
from pdserve_up import UpCluster, pdserve_up
from waiting import wait_for


def complete(up: UpCluster, model: str, n: int) -> httpx.Response:
    body = {"model": model, "prompt": f"request {n} " * 6, "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{up.router_url}/completions", json=body, timeout=60)


def restarted(up: UpCluster, name: str, times: int, old_pid: int) -> bool:
    info = up.list_instances().get(name)
    return info is not None and info.alive and info.restarts == times and info.pid != old_pid


def test_killed_instances_leave_routing_come_back_and_nothing_fails(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 128\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-heal\n  state_dir: {tmp_path}\n"
        f"  max_restarts: 1\n  restart_backoff_s: 0.5\n"
    )
    address = ray.get_runtime_context().gcs_address
    # The default health interval; the router's failed connections wake the supervisor sooner.
    with pdserve_up(config, tmp_path, address) as up:
        model = tiny_model_dir.name
        old = {name: info.address for name, info in up.list_instances().items()}
        # One dead prefill and one dead decode out of 2 + 2: a healthy pair is always found.
        pids = {name: up.kill(name) for name in ("prefill-0", "decode-0")}
        statuses = [complete(up, model, n).status_code for n in range(30)]
        assert statuses == [200] * 30
        for name, pid in pids.items():
            wait_for(lambda name=name, pid=pid: restarted(up, name, 1, pid), 120)
        instances = up.list_instances()
        assert instances["prefill-0"].address != old["prefill-0"]  # new endpoints, followed
        state = {i["name"]: i for i in up.state()["instances"]}
        assert state["decode-0"]["address"] == instances["decode-0"].address
        assert state["decode-0"]["restarts"] == 1
        routed = [complete(up, model, 100 + n) for n in range(8)]
        assert all(r.status_code == 200 for r in routed)
        targets = httpx.get(up.router_url.removesuffix("/v1") + "/prometheus/targets").json()
        scraped = {t for group in targets for t in group["targets"]}
        assert instances["decode-0"].metrics_address in scraped
        # The budget (one restart) is spent: the next death is reported and the rest serves.
        pid = up.kill("decode-0")
        assert all(complete(up, model, 200 + n).status_code == 200 for n in range(6))
        wait_for(lambda: "restart budget is spent" in (tmp_path / "up.log").read_text(), 60)
        assert not up.list_instances()["decode-0"].alive
        metrics = up.router_metrics()
        assert metrics["pdserve_router_dead_instances"] == 1
        restarts = 'pdserve_router_instance_restarts_total{name="%s",role="%s"}'
        assert metrics[restarts % ("decode-0", "decode")] == 1
        assert metrics[restarts % ("prefill-0", "prefill")] == 1
        assert pid not in {i.pid for i in up.list_instances().values() if i.alive}
