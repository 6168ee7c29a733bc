"""A pdserve cluster started the way an operator starts one: `pdserve up` in a subprocess."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import httpx

from pdserve.rpc.auth import authenticated_channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, common_pb2_grpc

CLI = [sys.executable, "-m", "services.controller.cli"]


@dataclass
class UpCluster:
    process: subprocess.Popen[str]
    config: Path
    env: dict[str, str]
    lines: list[str]  # what `pdserve up` printed up to "pdserve is up"
    router_url: str  # ends in /v1
    instances: dict[str, tuple[str, str]]  # name -> (role, host:port)
    metrics_urls: list[str]  # every instance's http://host:port/metrics
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def addresses(self, role: str) -> list[str]:
        return sorted(address for r, address in self.instances.values() if r == role)

    def stats(self, address: str) -> common_pb2.InstanceStats:
        """GetStats of an instance, over gRPC, with the secret `up` kept in its state dir."""
        channel = self._channels.get(address)
        if channel is None:
            secret = (self.config.parent / "cluster_secret").read_text().strip()
            plain = grpc.insecure_channel(address)
            channel = self._channels[address] = authenticated_channel(plain, secret)
        stub = common_pb2_grpc.InstanceServiceStub(channel)
        return stub.GetStats(common_pb2.StatsRequest(), timeout=10)

    def state(self) -> dict[str, Any]:
        """cluster.json as `up` last wrote it."""
        state: dict[str, Any] = json.loads((self.config.parent / "cluster.json").read_text())
        return state

    def admin(self) -> admin_pb2_grpc.AdminServiceStub:
        """The admin API, with the token `up` generated (calls need `metadata=up.admin_auth`)."""
        channel = self._channels.get("admin")
        if channel is None:
            plain = grpc.insecure_channel(self.state()["admin_address"])
            channel = self._channels["admin"] = plain
        return admin_pb2_grpc.AdminServiceStub(channel)

    @property
    def admin_auth(self) -> tuple[tuple[str, str], ...]:
        token = (self.config.parent / "admin_token").read_text().strip()
        return (("authorization", f"Bearer {token}"),)

    def list_instances(self) -> dict[str, admin_pb2.InstanceInfo]:
        reply = self.admin().ListInstances(
            admin_pb2.ListInstancesRequest(), metadata=self.admin_auth, timeout=30
        )
        return {i.name: i for i in reply.instances}

    def kill(self, name: str) -> int:
        """SIGKILL the process of instance `name`'s actor; returns its pid."""
        pid = self.list_instances()[name].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def router_metrics(self) -> dict[str, float]:
        """The router's /metrics samples: `name{labels}` -> value."""
        return scrape_metrics(self.router_url.removesuffix("/v1"))

    def close_channels(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The samples of `base_url`/metrics (Prometheus text format): `name{labels}` -> value."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@contextmanager
def pdserve_up(
    config_text: str,
    workdir: Path,
    ray_address: str | None,
    *extra_args: str,
    env: dict[str, str] | None = None,
) -> Iterator[UpCluster]:
    """Run `pdserve up` with `config_text` (its `cluster.state_dir` should be `workdir`) on the
    Ray cluster at `ray_address` (None: `up` starts its own), the test's environment updated
    with `env`; stop it with SIGTERM (as `pdserve down` does) on exit and check that it shut
    down cleanly."""
    config = workdir / "pdserve.yaml"
    config.write_text(config_text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # Ray's token: the environment
    log = (workdir / "up.log").open("w")
    process = subprocess.Popen(
        [
            *CLI,
            "up",
            "--config",
            str(config),
            *(["--address", ray_address] if ray_address else []),
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    cluster: UpCluster | None = None
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "pdserve is up" in line:
                break
        else:
            raise AssertionError(f"`pdserve up` ended early:\n{''.join(lines)}\n(see {log.name})")
        instances = {
            name: (role, url.removeprefix("grpc://"))
            for name, role, url, *_ in (line.split() for line in lines if "grpc://" in line)
        }
        metrics = [
            word.removeprefix("metrics=")
            for line in lines
            if "grpc://" in line
            for word in line.split()
            if word.startswith("metrics=")
        ]
        [router_url] = [line.split()[2] for line in lines if line.startswith("router")]
        # The rest of stdout (Ray prints the actors' stdout there) into up.out: a pipe nobody
        # reads fills (64 KiB, half an hour of a soak) and `up`'s next print blocks for good.
        drain = threading.Thread(
            target=_copy, args=(process.stdout, workdir / "up.out"), daemon=True
        )
        drain.start()
        cluster = UpCluster(process, config, env, lines, router_url, instances, metrics)
        yield cluster
    finally:
        if cluster is not None:
            cluster.close_channels()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                returncode = process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGUSR1)  # its threads' stacks, into up.log
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
                process.kill()
                process.wait()
                raise
            assert returncode == 0, f"`pdserve up` exited with {returncode} (see {log.name})"
        log.close()


def _copy(stream: IO[str], path: Path) -> None:
    with path.open("w") as out:
        for line in stream:
            out.write(line)
            out.flush()
