"""A default local `pdserve up` (its own Ray, embedded Redis), tried as an attacker on the same
host: what listens where, and who is let in."""

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import psutil
import pytest
from pdserve_up import UpCluster, pdserve_up
from waiting import wait_for

from pdserve.v1 import common_pb2, common_pb2_grpc


def on_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def is_wildcard(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified  # 0.0.0.0, ::


def listeners(root_pid: int) -> list[tuple[str, int, psutil.Process]]:
    """(address, port, process) of every TCP listener of `root_pid` and its descendants."""
    root = psutil.Process(root_pid)
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:  # exited meanwhile
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                found.append((c.laddr.ip, c.laddr.port, process))
    return found


def pdserve_ports(up: UpCluster, state: dict[str, object]) -> set[int]:
    """Every port pdserve itself opened: router, admin, instances' gRPC and metrics."""
    urls = [up.router_url, *up.metrics_urls, str(state["admin_address"])]
    urls += [address for _, address in up.instances.values()]
    return {urlsplit(url if "//" in url else f"//{url}").port or 0 for url in urls}


def is_ray_service(process: psutil.Process) -> bool:
    name = process.name()
    return name in ("gcs_server", "raylet") or "ray" in " ".join(process.cmdline()[:3]).lower()


@pytest.fixture
def ray_started_here(ray_session: None) -> Iterator[tuple[str, str]]:
    """A Ray temp dir (for `RAY_TMPDIR`) whose `ray_current_cluster` names a live Ray cluster,
    as `ray start` leaves it on a machine: (that temp dir, the cluster's address)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    (temp_dir / "ray").mkdir()
    (temp_dir / "ray" / "ray_current_cluster").write_text(address)
    yield str(temp_dir), address
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_default_up_listens_on_loopback_and_lets_no_stranger_in(
    tiny_model_dir: Path, tmp_path: Path, ray_started_here: tuple[str, str]
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 64\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-secure\n  state_dir: {tmp_path}\n"
    )
    ray_tmpdir, other_ray = ray_started_here
    env = {"RAY_TMPDIR": ray_tmpdir}
    with pdserve_up(config, tmp_path, None, "--health-interval", "0.5", env=env) as up:
        state = json.loads((tmp_path / "cluster.json").read_text())
        # no address: a Ray of its own, not the one another `ray start` left on this machine
        assert state["ray_address"] != other_ray
        gcs_port = int(str(state["ray_address"]).rsplit(":", 1)[1])
        assert gcs_port in {port for _, port, p in listeners(up.process.pid) if is_ray_service(p)}
        secrets = {
            name: (tmp_path / name) for name in ("admin_token", "cluster_secret", "ray_token")
        }
        for path in secrets.values():
            assert path.stat().st_mode & 0o777 == 0o600, path
            assert path.read_text().strip() not in json.dumps(state)  # cluster.json holds none
        printed = "".join(up.lines)
        assert all(p.read_text().strip() not in printed for p in secrets.values())

        # Nothing of pdserve's listens beyond 127.0.0.1; beyond it, only Ray's own servers (Ray
        # 2.60 binds every interface), one per Ray worker process at most, and they want a token.
        # Ray's servers bind the node's own address, where the kernel may hand out the number of
        # one of pdserve's loopback ports again: ours are told apart by address, not number.
        ours = pdserve_ports(up, state)
        found = listeners(up.process.pid)
        assert ours <= {port for ip, port, _ in found if on_loopback(ip)}
        wide = [(ip, port, p) for ip, port, p in found if not on_loopback(ip)]
        assert not [(ip, port) for ip, port, _ in wide if port in ours and is_wildcard(ip)]
        # the `up` process and each instance's are Ray workers too: one core-worker server each
        drivers = {up.process.pid} | {
            p.pid for _, _, p in found if "InstanceActor" in " ".join(p.cmdline())
        }
        assert len(drivers) == 3
        # the instances' engines run at normal priority (Ray's workers default to niceness 15)
        instances = {p for _, _, p in found if "InstanceActor" in " ".join(p.cmdline())}
        assert len(instances) == 2 and all(p.nice() == 0 for p in instances)
        for pid in drivers:
            assert sum(1 for _, _, p in wide if p.pid == pid) <= 1, (pid, wide)
        strangers = [
            (ip, port, p.cmdline()[:4])
            for ip, port, p in wide
            if p.pid not in drivers and not is_ray_service(p)
        ]
        assert not strangers, strangers  # the embedded Redis, anything else: loopback only

        # A Ray driver without the token is refused.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env["RAY_AUTH_MODE"] = "disabled"
        driver = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ray; ray.init(address={state['ray_address']!r}); "
                "print('ran', ray.get(ray.remote(lambda: 1).remote()))",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert driver.returncode != 0 and "ran" not in driver.stdout
        assert "Authentication" in driver.stderr or "authentication" in driver.stderr

        # An instance RPC without the cluster secret is refused; the router still serves.
        _, address = next(iter(up.instances.values()))
        with grpc.insecure_channel(address) as channel:
            stub = common_pb2_grpc.InstanceServiceStub(channel)
            try:
                stub.GetStats(common_pb2.StatsRequest(), timeout=10)
                raise AssertionError("GetStats answered without the cluster secret")
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert up.stats(address).num_blocks == 64  # with the secret `up` kept in its state dir
        reply = httpx.post(
            f"{up.router_url}/completions",
            json={"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text

        # The embedded Redis is supervised: killed, it is back on its port, password unchanged.
        [redis_server] = [
            p for p in psutil.Process(up.process.pid).children() if "redis" in p.name()
        ]
        [port] = {port for _, port, p in found if p.pid == redis_server.pid}
        redis_server.kill()

        def redis_is_back() -> bool:
            return any(
                q == port and p.pid != redis_server.pid for _, q, p in listeners(up.process.pid)
            )

        wait_for(redis_is_back, 20)
        reply = httpx.post(
            f"{up.router_url}/completions",
            json={"model": tiny_model_dir.name, "prompt": "again", "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    for path in ("cluster.json", "admin_token", "ray_token"):
        assert not (tmp_path / path).exists()  # removed at shutdown
    assert (tmp_path / "cluster_secret").stat().st_mode & 0o777 == 0o600  # kept: it signs the
    # storage tier's index entries
