"""How long an instance takes to change role in place, under load.

    python benchmarks/role_change.py [--quick]

`pdserve up` (its own local Ray; 2 prefill + 1 decode instances, one torch thread each, no
storage tier) on the built-in tiny model and on the ~156M Llama-shaped random model (8 layers,
hidden 1024; skipped with `--quick`), while two client threads stream short greedy completions
without pause. prefill-1 is switched to decode and back (`ChangeRole`, as `pdserve admin role`
does), `--rounds` times each way (3; quick 1).

Per switch: the call's duration (drain, switch, back in routing) and the time from the call to
the first request served in the new role (decode: the instance's first received KV blocks;
prefill: its first sent ones), read from its stats every 10 ms. Medians per model and
direction; the issue's target is ≤ 2 s for the tiny model. Also the requests that failed during
the run (must be 0). Writes benchmarks/results/role_change.json, ends with one RESULT line.
"""

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from _common import finish, parse_args, print_table, repeats
from _online import PdserveCluster
from vs_vllm import big_model_dir

from pdserve.model.tiny import default_model_dir
from pdserve.v1 import admin_pb2, admin_pb2_grpc

NAME = "role_change"
ROOT = Path(__file__).resolve().parent.parent


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="switches each way (3; 1)")


def config(model: Path) -> dict[str, Any]:
    return {
        "engine": {"model": str(model), "torch_threads": 1, "num_kv_blocks": 512},
        "prefill": {"replicas": 2, "num_cpus": 0.5},
        "decode": {"num_cpus": 0.5},
        "router": {"model_name": "m"},
        "storage": {"enabled": False},
    }


class Load:
    """Two threads streaming completions back to back; counts successes and failures."""

    def __init__(self, url: str) -> None:
        self.url = f"{url}/v1/completions"
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,)) for n in range(2)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)

    def _run(self, worker: int) -> None:
        n = 0
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                n += 1
                body = {"model": "m", "prompt": f"client {worker} request {n} " * 8,
                        "max_tokens": 16, "ignore_eos": True, "temperature": 0}  # fmt: skip
                try:
                    reply = client.post(self.url, json=body)
                    if reply.status_code != 200:
                        self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
                        continue
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                    continue
                self.done += 1


class Admin:
    def __init__(self, state_dir: Path) -> None:
        state = json.loads((state_dir / "cluster.json").read_text())
        self._channel = grpc.insecure_channel(state["admin_address"])
        self.stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        token = (state_dir / "admin_token").read_text().strip()
        self.auth = (("authorization", f"Bearer {token}"),)

    def instance(self, name: str) -> admin_pb2.InstanceInfo:
        reply = self.stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=self.auth)
        return next(i for i in reply.instances if i.name == name)

    def change(self, name: str, role: str) -> None:
        request = admin_pb2.ChangeRoleRequest(name=name, role=role)
        self.stub.ChangeRole(request, metadata=self.auth, timeout=300)

    def close(self) -> None:
        self._channel.close()


def served_blocks(info: admin_pb2.InstanceInfo, role: str) -> int:
    """Blocks the instance moved in `role`'s direction so far."""
    return info.stats.kv_blocks_received if role == "decode" else info.stats.kv_blocks_sent


def switch(admin: Admin, role: str) -> dict[str, float]:
    """prefill-1 to `role`: the call's seconds, and seconds until it served in the role."""
    before = served_blocks(admin.instance("prefill-1"), role)
    started = time.perf_counter()
    admin.change("prefill-1", role)
    call_s = time.perf_counter() - started
    while served_blocks(admin.instance("prefill-1"), role) == before:
        if time.perf_counter() - started > 120:
            raise RuntimeError(f"prefill-1 served nothing as {role} within 120 s")
        time.sleep(0.01)
    return {"call_s": call_s, "first_served_s": time.perf_counter() - started}


def measure(model: Path, rounds: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cluster = PdserveCluster(f"role-{model.name}", config(model), env, 600, root=ROOT)
    cluster.start()
    admin = Admin(cluster.state_dir)
    switches: dict[str, list[dict[str, float]]] = {"decode": [], "prefill": []}
    try:
        with Load(cluster.url) as load:
            while load.done < 4:
                time.sleep(0.1)
            for _ in range(rounds):
                for role in ("decode", "prefill"):
                    switches[role].append(switch(admin, role))
            served = load.done
    finally:
        admin.close()
        cluster.stop()
    medians = {
        f"to_{role}_{what}": statistics.median(s[what] for s in runs)
        for role, runs in switches.items()
        for what in ("call_s", "first_served_s")
    }
    return {"switches": switches, "medians": medians, "requests": served,
            "failed_requests": len(load.failures), "failures": load.failures[:5]}  # fmt: skip


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    rounds = args.rounds or repeats(args, 1, 3)
    models = {"tiny": default_model_dir()}
    if not args.quick:
        models["llama_156m"] = big_model_dir(8)
    results = {name: measure(path, rounds) for name, path in models.items()}
    rows = [
        [name, role, r["medians"][f"to_{role}_call_s"], r["medians"][f"to_{role}_first_served_s"],
         r["requests"], r["failed_requests"]]
        for name, r in results.items()
        for role in ("decode", "prefill")
    ]  # fmt: skip
    print_table(
        f"prefill-1 switched in place, {rounds} times each way, under load (medians)",
        ["model", "to", "call (s)", "first served (s)", "requests", "failed"],
        rows,
    )
    metrics = {
        f"{name}_to_{role}_first_served_s": r["medians"][f"to_{role}_first_served_s"]
        for name, r in results.items()
        for role in ("decode", "prefill")
    }
    metrics["failed_requests"] = sum(r["failed_requests"] for r in results.values())
    finish(NAME, args, {"models": results, "rounds": rounds}, metrics)


if __name__ == "__main__":
    main()
