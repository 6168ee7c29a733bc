"""A soak that loses nothing: a mixed load under a chaos schedule, then the books.

    python benchmarks/soak.py [--minutes 10] [--quick] [--clients 4] [--seed N]

A `pdserve up` cluster (built-in tiny model; 2 prefill + 2 decode instances spread over a Ray
cluster of a head and two worker nodes on this machine, `router.replicas: 2`,
`router.disaggregation: auto`, the embedded Redis, every block written to the storage tier)
serves `--clients` threads sending, back to back, a mix of greedy requests: completions
(streamed and not, n = 2), chat with tools (`tool_choice: required`), chat streams with a JSON
schema. Every answer is compared with the answer to the same request before the chaos began.

Meanwhile a chaos schedule kills, every `--chaos-interval-s`, one of: an instance actor
(SIGKILL), the router replica that is not `up`'s own (SIGKILL), the embedded Redis (SIGKILL),
a worker node whole (its raylet and workers; a fresh node joins in its place) — in rounds of
all four, each round in random order (`--quick`, 2 minutes: one round). Each kill waits for
the cluster to heal.

Reports: requests started, succeeded, failed by reason — the only failure allowed is a request
in flight through a router replica when it was killed (its connection breaks) — wrong answers
(must be 0), leaks once the load stops (instances holding requests, reservations or blocks,
routers with requests in flight, KV cache segments of killed instances left in /dev/shm: must
be 0), and the growth per hour of each process's RSS and private memory (RSS less shared
pages), over the second half of its life (the first warms up), of its incarnation measured
longest if the chaos restarted it.

RESULT: `started`, `succeeded`, `failed_allowed`, `failed_other` (must be 0), `wrong` (must be
0), `leaks` (must be 0), `rss_growth_mb_per_h_max`, `private_growth_mb_per_h_max`, `kills`.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
from _common import finish, parse_args, print_table

from pdserve.model.shm_segments import left_behind
from pdserve.rpc.auth import secret_file
from pdserve.v1 import admin_pb2

# Ray's token authentication, as a production cluster runs it: set before Ray is imported
# (it reads the mode then), inherited by `pdserve up`.
WORKDIR = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
secret_file(WORKDIR / "ray_token")
os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(WORKDIR / "ray_token")}

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers
from chaos_load import alive_again  # noqa: E402
from pdserve_up import UpCluster, pdserve_up, scrape_metrics  # noqa: E402
from ray_nodes import RayNodes, ray_nodes  # noqa: E402
from waiting import wait_for  # noqa: E402

NAME = "soak"
PROMPTS = [f"Note {n}: the {w} said" for n, w in enumerate(["river", "lamp", "crow", "tide"])]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "the weather somewhere",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
KINDS = ("completion", "completion_stream", "completion_n2", "chat_tools", "chat_json_stream")
CHAOS = ("instance", "router", "redis", "node")
HEAL_S = 180.0
MEMORY_SAMPLE_S = 5.0
MIN_STRETCH_S = 60.0
KILL_WINDOW_S = 2.0  # a killed router replica's connections break within this
WARMUP_S = 60.0  # a process's first minute (model load, first compilations) is not growth


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=None, help="10; --quick: 2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--chaos-interval-s", type=float, default=None, help="45; --quick: 20")
    parser.add_argument("--seed", type=int, default=None)


# -- requests -------------------------------------------------------------------------------


def request_of(kind: str, prompt: int, model: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of request `kind` on prompt number `prompt`; every one greedy."""
    text = PROMPTS[prompt]
    base: dict[str, Any] = {"model": model, "temperature": 0}
    if kind.startswith("completion"):
        body = {**base, "prompt": text, "max_tokens": 48, "ignore_eos": True}
        if kind == "completion_stream":
            body["stream"] = True
        if kind == "completion_n2":
            body |= {"n": 2, "max_tokens": 24}
        return "completions", body
    messages = [{"role": "user", "content": text}]
    if kind == "chat_tools":
        return "chat/completions", {**base, "messages": messages, "tools": TOOLS,
                                    "tool_choice": "required", "max_tokens": 64}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    return "chat/completions", {**base, "messages": messages, "response_format": response_format,
                                "max_tokens": 64, "stream": True}  # fmt: skip


@dataclass
class Outcome:
    kind: str
    prompt: int
    started: float
    ended: float
    status: int  # 0: the connection broke; 599: the stream ended with an error event
    answer: str  # the choices' texts and tool calls (JSON), when status is 200
    error: str = ""


def send(http: httpx.Client, kind: str, prompt: int, model: str) -> Outcome:
    path, body = request_of(kind, prompt, model)
    started = time.monotonic()
    try:
        if body.get("stream"):
            status, answer, error = _streamed(http, path, body)
        else:
            reply = http.post(f"/{path}", json=body)
            status, error = reply.status_code, "" if reply.is_success else reply.text[:200]
            answer = _answer(reply.json()["choices"]) if reply.is_success else ""
    except httpx.TransportError as e:
        status, answer, error = 0, "", repr(e)
    return Outcome(kind, prompt, started, time.monotonic(), status, answer, error)


def _answer(choices: list[dict[str, Any]]) -> str:
    parts = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        message = choice.get("message") or {}
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls") or []]  # fmt: skip
        parts.append([choice.get("text", message.get("content")), calls, choice["finish_reason"]])
    return json.dumps(parts)


def _streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    with http.stream("POST", f"/{path}", json=body) as reply:
        if not reply.is_success:
            return reply.status_code, "", reply.read().decode()[:200]
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return 599, "", json.dumps(chunk["error"])[:200]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                piece = choice.get("text", delta.get("content")) or ""
                texts.setdefault(choice["index"], []).append(piece)
                finish[choice["index"]] = choice.get("finish_reason") or finish.get(
                    choice["index"], ""
                )
    return 200, json.dumps([["".join(texts[i]), finish[i]] for i in sorted(texts)]), ""


class Load:
    """`clients` threads sending the mix back to back, each outcome kept."""

    def __init__(self, up: UpCluster, model: str, clients: int, seed: int) -> None:
        self.up, self.model = up, model
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(random.Random(seed + i),))
            for i in range(clients)
        ]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(300)

    def _client(self, rng: random.Random) -> None:
        with httpx.Client(base_url=self.up.router_url, timeout=120) as http:
            while not self.stop.is_set():
                kind, prompt = rng.choice(KINDS), rng.randrange(len(PROMPTS))
                self.outcomes.append(send(http, kind, prompt, self.model))


# -- chaos ----------------------------------------------------------------------------------


@dataclass
class Kill:
    kind: str
    target: str
    at: float  # time.monotonic() just before the kill
    healed_s: float = 0.0


@dataclass
class Chaos:
    up: UpCluster
    nodes: RayNodes
    rng: random.Random
    kills: list[Kill] = field(default_factory=list)

    def strike(self, kind: str) -> None:
        kill = getattr(self, f"_kill_{kind}")()
        self.kills.append(kill)
        print(f"  killed {kill.kind} {kill.target}; healed in {kill.healed_s:.1f} s", flush=True)

    def _kill_instance(self) -> Kill:
        name = self.rng.choice(sorted(self.up.list_instances()))
        pid, at = self.up.kill(name), time.monotonic()
        wait_for(lambda: alive_again(self.up, name, pid), HEAL_S)
        return Kill("instance", name, at, time.monotonic() - at)

    def _kill_router(self) -> Kill:
        own = self.up.process.pid
        [replica] = [r for r in routers(self.up) if r.alive and r.pid != own]
        at = time.monotonic()
        psutil.Process(replica.pid).kill()
        wait_for(lambda: any(r.alive and r.pid not in (own, replica.pid) for r in routers(self.up)),
              HEAL_S)  # fmt: skip
        return Kill("router", replica.name, at, time.monotonic() - at)

    def _kill_redis(self) -> Kill:
        log = Path(self.up.config).parent / "up.log"
        restarts = log.read_text().count("embedded Redis died: restarted")
        [redis] = [p for p in psutil.Process(self.up.process.pid).children() if "redis" in p.name()]
        redis.kill()
        at = time.monotonic()
        wait_for(lambda: log.read_text().count("embedded Redis died: restarted") > restarts, HEAL_S)
        return Kill("redis", str(redis.pid), at, time.monotonic() - at)

    def _kill_node(self) -> Kill:
        placed = {info.node for info in self.up.list_instances().values()}
        candidates = [n for n in self.nodes.workers if n.node_id in placed] or self.nodes.workers
        node = self.rng.choice(candidates)
        pids = {name: info.pid for name, info in self.up.list_instances().items()}
        lost = [n for n, i in self.up.list_instances().items() if i.node == node.node_id]
        self.nodes.kill(node)
        at = time.monotonic()
        self.nodes.add(num_cpus=2)  # room to re-place
        wait_for(lambda: all(alive_again(self.up, n, pids[n]) for n in lost), HEAL_S)
        return Kill("node", f"{node.node_id[:8]} ({', '.join(lost) or 'no instance'})", at,
                    time.monotonic() - at)  # fmt: skip


def routers(up: UpCluster) -> list[admin_pb2.RouterReplica]:
    reply = up.admin().ListInstances(
        admin_pb2.ListInstancesRequest(), metadata=up.admin_auth, timeout=30
    )
    return list(reply.routers)


# -- the books ------------------------------------------------------------------------------


def failure_reason(outcome: Outcome, kills: list[Kill]) -> str:
    """Why `outcome` failed: `router_replica_killed` when its connection broke as a router
    replica died (within KILL_WINDOW_S of the kill: a stream it carried, or a connection the
    kernel had just handed to its listening socket); else its status."""
    if outcome.status == 0 and any(
        k.kind == "router" and k.at <= outcome.ended <= k.at + KILL_WINDOW_S for k in kills
    ):
        return "router_replica_killed"
    return f"status_{outcome.status}"


def leaks(up: UpCluster) -> list[str]:
    """What still holds something once the load stopped (waits up to 60 s for it to let go)."""
    found: list[str] = []

    def settled() -> bool:
        found.clear()
        for info in up.list_instances().values():
            if not info.alive:
                found.append(f"{info.name}: not alive")
                continue
            s = up.stats(info.address)
            if s.num_running or s.num_waiting or s.num_reservations:
                found.append(f"{info.name}: {s.num_running} running, {s.num_reservations} reserved")
            elif s.num_free_blocks != s.num_blocks:
                found.append(f"{info.name}: {s.num_blocks - s.num_free_blocks} blocks held")
        for replica in routers(up):
            metrics = scrape_metrics(f"http://{replica.metrics_address}")
            if sum(v for k, v in metrics.items() if k.startswith("pdserve_router_in_flight")):
                found.append(f"{replica.name}: requests in flight")
        found.extend(f"{path}: its process is gone" for path in left_behind())
        return not found

    deadline = time.monotonic() + 60
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def processes(up: UpCluster) -> dict[int, str]:
    """pid -> name of `up`, its children (router replica, Redis) and every instance actor."""
    named = {up.process.pid: "up"}
    for replica in routers(up):
        named.setdefault(replica.pid, replica.name)  # `up`'s own replica is `up`
    for child in psutil.Process(up.process.pid).children():
        named.setdefault(child.pid, "redis" if "redis" in child.name() else child.name())
    for name, info in up.list_instances().items():
        named[info.pid] = name
    return named


def memory_mb(pids: dict[int, str]) -> dict[str, tuple[int, float, float]]:
    """name -> (pid, RSS, private memory) in MB of each process of `pids` still running.
    Private is RSS less the pages it shares with files and other processes (libraries, the
    shared-memory segments of the transfers and the storage tier, which fill up to their size
    as they are touched): what a leak grows."""
    sizes = {}
    for pid, name in pids.items():
        try:
            memory = psutil.Process(pid).memory_info()
        except psutil.NoSuchProcess:
            continue
        sizes[name] = (pid, memory.rss / 2**20, (memory.rss - memory.shared) / 2**20)
    return sizes


def slope_per_h(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, MB) points, in MB per hour: unlike the first and
    last samples' difference, a step (a new peer's connection buffers) is weighed by how long
    the process stayed up after it, and one noisy sample does not decide it."""
    times, sizes = zip(*points, strict=True)
    return 3600 * statistics.linear_regression(times, sizes).slope


def _second_half(
    points: list[tuple[float, float, float]],
) -> list[tuple[float, float, float]]:
    """The samples of the second half of an incarnation's life, none of its first WARMUP_S
    (at least its last sample)."""
    born, last = points[0][0], points[-1][0]
    since = max(born + WARMUP_S, (born + last) / 2)
    return [p for p in points if p[0] >= since] or points[-1:]


class MemorySampler:
    """Every MEMORY_SAMPLE_S, the RSS and private memory of every process of the cluster by
    name (`processes`): one the chaos restarted is a new incarnation (pid) under the same name.

    A leak grows a process for as long as it lives; warm-up (model load, caches and allocator
    arenas, connections to peers, a request history filling to its capacity) is over after a
    few minutes. So an incarnation is measured over the second half of its life, and not before
    WARMUP_S; a name's growth is that of its incarnation measured longest (at least
    MIN_STRETCH_S). Under this chaos an instance lives minutes: its last incarnation may be a
    minute old when the run ends, and would measure nothing but its warm-up."""

    def __init__(self, up: UpCluster) -> None:
        self.up = up
        self.samples: list[tuple[float, dict[str, tuple[int, float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(MEMORY_SAMPLE_S):
                return

    def _sample(self) -> None:
        try:
            self.samples.append((time.monotonic(), memory_mb(processes(self.up))))
        except (psutil.Error, grpc.RpcError):  # mid-kill: the next sample
            return

    def at_start(self) -> dict[str, float]:
        return {name: round(rss, 1) for name, (_, rss, _) in self.samples[0][1].items()}

    def incarnations(self) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
        """(name, pid) -> its (seconds since the first sample, RSS MB, private MB) samples."""
        start = self.samples[0][0]
        seen: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        for t, by_name in self.samples:
            for name, (pid, rss, private) in by_name.items():
                seen.setdefault((name, pid), []).append((t - start, rss, private))
        return seen

    def growth(self) -> dict[str, dict[str, float]]:
        """name -> the RSS and private memory growth in MB/h of its incarnation measured
        longest, the minutes measured and lived, and how many incarnations it had."""
        by_name: dict[str, list[list[tuple[float, float, float]]]] = {}
        for (name, _), points in self.incarnations().items():
            by_name.setdefault(name, []).append(points)
        growth = {}
        for name, incarnations in by_name.items():
            stretches = [(points, _second_half(points)) for points in incarnations]
            points, stretch = max(stretches, key=lambda s: s[1][-1][0] - s[1][0][0])
            if stretch[-1][0] - stretch[0][0] >= MIN_STRETCH_S:
                growth[name] = {
                    "rss_mb_per_h": round(slope_per_h([(t, r) for t, r, _ in stretch]), 1),
                    "private_mb_per_h": round(slope_per_h([(t, p) for t, _, p in stretch]), 1),
                    "minutes": round((stretch[-1][0] - stretch[0][0]) / 60, 1),
                    "lived_minutes": round((points[-1][0] - points[0][0]) / 60, 1),
                    "incarnations": len(incarnations),
                }
        return growth

    def trace(self, every: int = 6) -> dict[str, list[list[float]]]:
        """Every `every`-th sample of each incarnation, `name pid` -> [[s, RSS, private]]: the
        figures behind `growth`, for a reader to check."""
        return {
            f"{name} {pid}": [[round(v, 1) for v in p] for p in points[::every]]
            for (name, pid), points in self.incarnations().items()
        }


# -- the run --------------------------------------------------------------------------------


def config_text(state_dir: Path) -> str:
    return (
        "engine:\n  model: null\n  torch_threads: 1\n  num_kv_blocks: 256\n"
        "prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
        "router:\n  port: 0\n  replicas: 2\n  disaggregation: auto\nadmin:\n  port: 0\n"
        "storage:\n  device_write_policy: write_through\n"
        f"cluster:\n  namespace: pdserve-soak\n  state_dir: {state_dir}\n"
        "  placement_strategy: SPREAD\n  restart_backoff_s: 0.2\n"
        # the chaos hits each instance every few minutes, restart tries on a node that died
        # under them count too: far above any real failure rate. The budget stops crash loops,
        # which the soak does not test; 5 tries in 10 min (the default) ran out in a 30-min run.
        "  max_restarts: 50\n"
    )


def soak(args: argparse.Namespace, workdir: Path, nodes: RayNodes) -> dict[str, Any]:
    minutes = args.minutes or (2.0 if args.quick else 10.0)
    interval = args.chaos_interval_s or (20.0 if args.quick else 45.0)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    print(f"soak: {minutes:g} min, a kill every {interval:g} s, seed {seed}", flush=True)
    with pdserve_up(config_text(workdir), workdir, nodes.address, "--health-interval", "0.5") as up:
        with httpx.Client(base_url=up.router_url, timeout=120) as http:
            model = http.get("/models").json()["data"][0]["id"]
            reference = {
                (k, p): send(http, k, p, model) for k in KINDS for p in range(len(PROMPTS))
            }
        bad = [o for o in reference.values() if o.status != 200]
        if bad:
            raise RuntimeError(f"reference requests failed before any chaos: {bad[:3]}")
        chaos = Chaos(up, nodes, rng)
        schedule: list[str] = []  # rounds of every kind of kill, each round in random order
        end = time.monotonic() + minutes * 60
        with MemorySampler(up) as memory, Load(up, model, args.clients, seed) as load:
            while time.monotonic() + interval < end:
                time.sleep(interval)
                schedule = schedule or rng.sample(CHAOS, len(CHAOS))
                chaos.strike(schedule.pop(0))
            time.sleep(max(0.0, end - time.monotonic()))
        left = leaks(up)
    outcomes = load.outcomes
    failed: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.status != 200:
            reason = failure_reason(outcome, chaos.kills)
            failed[reason] = failed.get(reason, 0) + 1
    wrong = [o for o in outcomes
             if o.status == 200 and o.answer != reference[(o.kind, o.prompt)].answer]  # fmt: skip
    return {
        "seed": seed,
        "minutes": minutes,
        "started": len(outcomes),
        "succeeded": sum(o.status == 200 for o in outcomes),
        "failed_by_reason": failed,
        "failures": [vars(o) for o in outcomes if o.status != 200][:20],
        "wrong": len(wrong),
        "wrong_examples": [vars(o) for o in wrong][:5],
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in KINDS},
        "kills": [vars(k) for k in chaos.kills],
        "leaks": left,
        "rss_mb_at_start": memory.at_start(),
        "memory_growth": memory.growth(),
        "memory_trace": memory.trace(),
    }


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    with ray_nodes(head_cpus=1, worker_cpus=[2, 2]) as nodes:
        results = soak(args, WORKDIR, nodes)  # on failure WORKDIR (up.log) is kept
    shutil.rmtree(WORKDIR, ignore_errors=True)
    allowed = results["failed_by_reason"].get("router_replica_killed", 0)
    print_table(
        "Soak",
        ["started", "succeeded", "failed (replica killed)", "failed (other)", "wrong", "leaks"],
        [[results["started"], results["succeeded"], allowed,
          sum(results["failed_by_reason"].values()) - allowed, results["wrong"],
          len(results["leaks"])]],
    )  # fmt: skip
    print_table(
        "Kills",
        ["kind", "target", "healed s"],
        [[k["kind"], k["target"], k["healed_s"]] for k in results["kills"]],
    )
    growth = results["memory_growth"]
    print_table(
        "Memory growth (each process's incarnation measured longest, over the second half of its "
        "life; least-squares slope)",
        ["process", "RSS MB at start", "RSS MB/h", "private MB/h", "minutes measured",
         "minutes lived", "incarnations"],
        [[name, results["rss_mb_at_start"].get(name, "-"), g["rss_mb_per_h"],
          g["private_mb_per_h"], g["minutes"], g["lived_minutes"], g["incarnations"]]
         for name, g in growth.items()],
    )  # fmt: skip
    metrics = {
        "started": results["started"],
        "succeeded": results["succeeded"],
        "failed_allowed": allowed,
        "failed_other": sum(results["failed_by_reason"].values()) - allowed,
        "wrong": results["wrong"],
        "leaks": len(results["leaks"]),
        "rss_growth_mb_per_h_max": max((g["rss_mb_per_h"] for g in growth.values()), default=0.0),
        "private_growth_mb_per_h_max": max(
            (g["private_mb_per_h"] for g in growth.values()), default=0.0
        ),
        "kills": len(results["kills"]),
    }
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()
