"""Chaos: under a steady load of streaming and non-streaming requests on a 2 + 2 `pdserve up`
cluster, a decode actor, a prefill actor and the embedded Redis are killed in turn (SIGKILL).
Every request must complete with the text of an undisturbed run (0 lost, 0 duplicated tokens,
0 5xx), and every instance's blocks and reservations and the router's leases return to 0."""

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import ray
from pdserve_up import UpCluster, pdserve_up
from waiting import wait_for

PROMPTS = [
    f"Story {n}: the {word} went" for n, word in enumerate(["fox", "owl", "cat", "bee", "elk"])
]
MAX_TOKENS = 120
CLIENTS = 4


@dataclass
class Outcome:
    prompt: int
    streamed: bool
    status: int
    text: str
    finish_reason: str | None
    completion_tokens: int | None


def request(up: UpCluster, model: str, prompt: int, streamed: bool) -> Outcome:
    body = {"model": model, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    url = f"{up.router_url}/completions"
    if not streamed:
        reply = httpx.post(url, json=body, timeout=120)
        if reply.status_code != 200:
            return Outcome(prompt, False, reply.status_code, "", None, None)
        data = reply.json()
        choice = data["choices"][0]
        usage = data["usage"]["completion_tokens"]
        return Outcome(prompt, False, 200, choice["text"], choice["finish_reason"], usage)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage = [], None, None
    with httpx.stream("POST", url, json=body, timeout=120) as reply:
        if reply.status_code != 200:
            return Outcome(prompt, True, reply.status_code, "", None, None)
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return Outcome(prompt, True, 599, "".join(text), None, None)  # an error event
            for choice in chunk.get("choices", []):
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return Outcome(prompt, True, 200, "".join(text), finish, usage)


class Load:
    """CLIENTS threads sending requests back to back: half of them stream, half do not."""

    def __init__(self, up: UpCluster, model: str) -> None:
        self.up, self.model = up, model
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(180)

    def _client(self, index: int) -> None:
        n = index
        while not self.stop.is_set():
            prompt = n % len(PROMPTS)
            try:
                outcome = request(self.up, self.model, prompt, streamed=index % 2 == 0)
            except httpx.HTTPError as e:  # the connection broke: as much a failure as a 5xx
                outcome = Outcome(prompt, index % 2 == 0, 0, repr(e), None, None)
            self.outcomes.append(outcome)  # list.append is atomic
            n += CLIENTS

    def wait_for_more(self, count: int) -> None:
        """Until `count` more requests have completed than now."""
        target = len(self.outcomes) + count
        wait_for(lambda: len(self.outcomes) >= target, 120)


def redis_process(up: UpCluster) -> psutil.Process:
    [redis] = [p for p in psutil.Process(up.process.pid).children() if "redis" in p.name()]
    return redis


def test_kills_under_load_lose_nothing(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 192\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
        f"storage:\n  device_write_policy: write_through\n"
        f"cluster:\n  namespace: pdserve-chaos\n  state_dir: {tmp_path}\n"
        f"  restart_backoff_s: 0.2\n"
    )
    address = ray.get_runtime_context().gcs_address
    with pdserve_up(config, tmp_path, address, "--health-interval", "0.5") as up:
        model = tiny_model_dir.name
        reference = {p: request(up, model, p, streamed=False) for p in range(len(PROMPTS))}
        assert all(r.status == 200 for r in reference.values())
        log = tmp_path / "up.log"
        with Load(up, model) as load:
            for victim in ("a busy decode", "prefill-1", "redis"):
                load.wait_for_more(2 * CLIENTS)
                if victim == "a busy decode":  # one streaming now: its requests must migrate
                    victim = a_busy_decode(up)
                if victim == "redis":
                    redis_process(up).kill()
                    wait_for(lambda: "embedded Redis died: restarted" in log.read_text(), 60)
                else:
                    pid = up.kill(victim)
                    wait_for(lambda v=victim, p=pid: alive_again(up, v, p), 120)
            load.wait_for_more(2 * CLIENTS)
        outcomes = load.outcomes
        assert len(outcomes) >= 8 * CLIENTS
        failed = [o for o in outcomes if o.status != 200]
        assert failed == []
        for outcome in outcomes:
            expected = reference[outcome.prompt]
            assert outcome.text == expected.text, outcome
            assert (outcome.finish_reason, outcome.completion_tokens) == ("length", MAX_TOKENS)
        metrics = up.router_metrics()
        assert metrics.get('pdserve_router_migrations_total{reason="instance_lost"}', 0) >= 1
        assert sum(v for k, v in metrics.items() if k.startswith("pdserve_router_in_flight")) == 0
        for info in up.list_instances().values():
            stats = up.stats(info.address)
            assert stats.num_running == 0 and stats.num_reservations == 0, info.name
            assert stats.num_free_blocks == stats.num_blocks, info.name


def a_busy_decode(up: UpCluster) -> str:
    """The name of a decode instance running requests (waits for one)."""
    busy: list[str] = []

    def found() -> bool:
        busy.extend(
            name
            for name, info in up.list_instances().items()
            if info.role == "decode" and up.stats(info.address).num_running > 0
        )
        return bool(busy)

    wait_for(found, 60)
    return busy[0]


def alive_again(up: UpCluster, name: str, old_pid: int) -> bool:
    info = up.list_instances()[name]
    return info.alive and info.pid != old_pid
