"""A Ray cluster with Ray's own autoscaler on its fake multi-node provider: the head node and
every node the autoscaler launches are processes on this machine, nodes come and go as demand
asks (`ray.autoscaler.sdk.request_resources`, pending actors).

`ray.cluster_utils.AutoscalingCluster` starts the same thing but on Ray's default port, from an
example config its wheel does not ship, and stops it with `ray stop --force` (every Ray on the
machine: another test's too). This one takes a free port and its own temp dir, and stops only
its own processes."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
WORKER_TYPE = "pdserve.worker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _config(address: str, head_cpus: int, worker_cpus: int, max_workers: int) -> dict[str, object]:
    """The autoscaler's cluster config: one worker node type of `worker_cpus` CPUs, none
    running until asked for; a node idle for a minute goes."""
    return {
        "cluster_name": "pdserve-autoscaling-test",
        "max_workers": max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1.0,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": head_cpus},
                "node_config": {},
                "max_workers": 0,
            },
            WORKER_TYPE: {
                "resources": {"CPU": worker_cpus},
                "node_config": {},
                "min_workers": 0,
                "max_workers": max_workers,
            },
        },
        "auth": {},
        "docker": {},
        **{key: [] for key in ("initialization_commands", "setup_commands",
                               "head_setup_commands", "worker_setup_commands",
                               "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }  # fmt: skip


@contextmanager
def autoscaling_ray(head_cpus: int, worker_cpus: int, max_workers: int) -> Iterator[str]:
    """Start the cluster; yields its GCS address. Ray's token authentication as the
    environment sets it (the tests' conftest turns it on)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-as-", dir="/tmp"))  # short: socket paths
    address = f"127.0.0.1:{_free_port()}"
    config = temp_dir / "autoscaling.json"
    config.write_text(json.dumps(_config(address, head_cpus, worker_cpus, max_workers)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    try:
        started = subprocess.run(
            [RAY, "start", "--head", f"--port={address.split(':')[1]}",
             "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
             f"--num-cpus={head_cpus}", "--include-dashboard=false",
             f"--autoscaling-config={config}", "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=120,
            start_new_session=True,  # its own process group: every process of the cluster
        )  # fmt: skip
        assert started.returncode == 0, f"ray start failed:\n{started.stderr[-3000:]}"
        yield address
    finally:
        _stop(_group_of(address))  # (what started of a failed start too)
        shutil.rmtree(temp_dir, ignore_errors=True)


def nodes(address: str) -> dict[str, int]:
    """Active nodes by type, as `ray status` reports them (`{"ray.head.default": 1, ...}`)."""
    status = subprocess.run([RAY, "status", f"--address={address}"], check=True,
                            capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    active = status.split("Active:", 1)[1].split("Pending:", 1)[0]
    counts = {}
    for line in active.strip().splitlines():
        count, _, kind = line.strip().partition(" ")
        if count.isdigit():
            counts[kind] = int(count)
    return counts


def _group_of(address: str) -> int | None:
    """The process group of the cluster's GCS server (the one `ray start` made: the head's and
    the launched nodes' Ray processes, the workers in them all belong to it); None if it is
    not running."""
    port = address.rsplit(":", 1)[1]
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or ()
        if process.info["name"] == "gcs_server" and f"--gcs_server_port={port}" in cmdline:
            with suppress(psutil.Error, ProcessLookupError):
                return os.getpgid(process.pid)
    return None


def _stop(group: int | None) -> None:
    """SIGTERM every process of the cluster's process group, SIGKILL what is left after 10 s
    (by group, not by command line: Ray renames its agents and workers)."""
    if group is None or group == os.getpgid(0):  # never the tests' own
        return
    mine = []
    for process in psutil.process_iter():
        with suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group:
                mine.append(process)
    for process in mine:
        with suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(mine, timeout=10)
    for process in alive:
        with suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=10)
