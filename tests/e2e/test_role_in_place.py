"""`pdserve admin role` on a `pdserve up` cluster (2 prefill + 1 decode) under a streaming load:
prefill-1 becomes a decode instance and back without a new process, and no request fails or
changes its greedy text meanwhile. Bad calls get one clear status."""

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import ray
from pdserve_up import CLI, UpCluster, pdserve_up
from waiting import wait_for

from pdserve.v1 import admin_pb2

PROMPTS = [f"Request {n} asks about the weather in city {n}" for n in range(6)]


@pytest.fixture(scope="module")
def up(
    ray_session: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("role")
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 256\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\n"
        f"admin:\n  port: 0\nstorage:\n  enabled: false\n"
        f"cluster:\n  namespace: pdserve-role\n  state_dir: {workdir}\n  drain_timeout_s: 30\n"
    )
    address = ray.get_runtime_context().gcs_address
    with pdserve_up(config, workdir, address) as cluster:
        yield cluster


class Load:
    """Threads that stream the prompts round and round until stopped; every text is checked
    against `reference` and every failure kept."""

    def __init__(self, up: UpCluster, model: str, reference: dict[str, str]) -> None:
        self.url, self.model, self.reference = f"{up.router_url}/completions", model, reference
        self.failures: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,)) for n in range(3)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self, offset: int) -> None:
        n = offset
        while not self._stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                text = complete(self.url, self.model, prompt)
            except (httpx.HTTPError, AssertionError) as e:
                self.failures.append(f"{prompt!r}: {e}")
                continue
            if text != self.reference[prompt]:
                self.failures.append(f"{prompt!r}: {text!r} != {self.reference[prompt]!r}")
            self.done += 1


def complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    parts = []
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                parts += [c["text"] for c in chunk["choices"]]
    return "".join(parts)


def change_role(up: UpCluster, name: str, role: str) -> admin_pb2.InstanceInfo:
    request = admin_pb2.ChangeRoleRequest(name=name, role=role)
    reply: admin_pb2.InstanceInfo = up.admin().ChangeRole(
        request, metadata=up.admin_auth, timeout=120
    )
    return reply


def test_an_instance_changes_role_under_load_without_a_failed_request(
    up: UpCluster, tiny_model_dir: Path
) -> None:
    url, model = f"{up.router_url}/completions", tiny_model_dir.name
    reference = {prompt: complete(url, model, prompt) for prompt in PROMPTS}
    before = up.list_instances()["prefill-1"]
    with Load(up, model, reference) as load:
        wait_for(lambda: load.done >= 6, 60)
        started = time.monotonic()
        changed = change_role(up, "prefill-1", "decode")
        assert changed.role == "decode" and changed.alive
        assert changed.pid == before.pid and changed.address == before.address
        # it decodes: prefill-0 now sends it prompts' KV
        wait_for(lambda: up.stats(changed.address).kv_blocks_received > 0, 60)
        print(
            f"prefill-1 served its first decode {time.monotonic() - started:.2f} s after the call"
        )
        served = load.done
        wait_for(lambda: load.done >= served + 6, 60)
        back = change_role(up, "prefill-1", "prefill")
        assert back.role == "prefill" and back.pid == before.pid
        served = load.done
        wait_for(lambda: load.done >= served + 6, 60)
    assert load.failures == []
    instances = up.list_instances()
    assert [i.role for i in instances.values()].count("decode") == 1
    for info in instances.values():
        wait_for(lambda a=info.address: up.stats(a).num_running == 0, 30)
        stats = up.stats(info.address)
        assert stats.num_reservations == 0 and stats.num_free_blocks == stats.num_blocks
    in_flight = up.router_metrics().items()
    assert sum(v for k, v in in_flight if k.startswith("pdserve_router_in_flight")) == 0


def test_role_changes_that_cannot_happen_are_refused_with_one_line(up: UpCluster) -> None:
    def refused(name: str, role: str) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as error:
            change_role(up, name, role)
        assert "\n" not in (error.value.details() or "")
        return error.value.code()

    assert refused("prefill-9", "decode") == grpc.StatusCode.NOT_FOUND
    assert refused("decode-0", "prefill") == grpc.StatusCode.FAILED_PRECONDITION  # the last one
    assert refused("prefill-0", "mixed") == grpc.StatusCode.FAILED_PRECONDITION
    assert refused("prefill-0", "router") == grpc.StatusCode.INVALID_ARGUMENT
    cli = subprocess.run(
        [*CLI, "admin", "role", "prefill-9", "decode", "--config", str(up.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 3, cli.stderr
    assert cli.stderr.strip().count("\n") == 0 and "NOT_FOUND" in cli.stderr
