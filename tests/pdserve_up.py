"""A pdserve cluster started the way an operator starts one: `pdserve up` in a subprocess."""

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from pdserve.rpc.auth import authenticated_channel
from pdserve.v1 import common_pb2, common_pb2_grpc

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
    config_text: str, workdir: Path, ray_address: str | None, *extra_args: str
) -> Iterator[UpCluster]:
    """Run `pdserve up` with `config_text` (its `cluster.state_dir` should be `workdir`) on the
    Ray cluster at `ray_address` (None: `up` starts its own); stop it with SIGTERM (as `pdserve
    down` does) on exit and check that it shut down cleanly."""
    config = workdir / "pdserve.yaml"
    config.write_text(config_text)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # Ray's token comes from the environment
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
                process.kill()
                process.wait()
                raise
            assert returncode == 0, f"`pdserve up` exited with {returncode} (see {log.name})"
        log.close()
