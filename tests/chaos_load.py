"""Clients for fault tests against a `pdserve up` cluster: greedy completions of a few prompts
(streamed and not), sent back to back by threads, each outcome kept to compare with an
undisturbed run."""

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from pdserve_up import UpCluster
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


def request(
    up: UpCluster,
    model: str,
    prompt: int,
    streamed: bool,
    max_tokens: int = MAX_TOKENS,
    on_text: Callable[[], None] | None = None,
) -> Outcome:
    """A greedy completion of `PROMPTS[prompt]`; `on_text` is called at each streamed text."""
    body = {"model": model, "prompt": PROMPTS[prompt], "max_tokens": max_tokens,
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
                if on_text is not None and choice["text"]:
                    on_text()
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return Outcome(prompt, True, 200, "".join(text), finish, usage)


class LongStream:
    """One streamed greedy completion of `max_tokens` in a thread of its own: a stream still
    under way when a fault strikes. `streaming` is set at its first text."""

    def __init__(self, up: UpCluster, model: str, prompt: int, max_tokens: int) -> None:
        self.prompt = prompt
        self.streaming = threading.Event()
        self.outcome: Outcome | None = None
        self._thread = threading.Thread(target=self._run, args=(up, model, max_tokens))
        self._thread.start()

    def _run(self, up: UpCluster, model: str, max_tokens: int) -> None:
        try:
            self.outcome = request(up, model, self.prompt, True, max_tokens, self.streaming.set)
        except httpx.HTTPError as e:  # the connection broke: a failure the outcome shows
            self.outcome = Outcome(self.prompt, True, 0, repr(e), None, None)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Outcome:
        self._thread.join(300)
        assert self.outcome is not None, "the stream did not end"
        return self.outcome


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


def check_lost_nothing(
    up: UpCluster, outcomes: list[Outcome], reference: dict[int, Outcome], migrated: bool = True
) -> None:
    """Every outcome a success with its undisturbed text, at least one stream migrated (unless
    not `migrated`: no instance was lost), and the cluster at rest: no router lease, every
    instance idle with all its blocks free."""
    assert [o for o in outcomes if o.status != 200] == []
    for outcome in outcomes:
        assert outcome.text == reference[outcome.prompt].text, outcome
        assert (outcome.finish_reason, outcome.completion_tokens) == ("length", MAX_TOKENS)
    metrics = up.router_metrics()
    if migrated:  # lost with the instance; or moved, when the lost process had a moment to
        # leave (a node's workers may get SIGTERM as it goes)
        reasons = ("instance_lost", "moved")
        assert sum(metrics.get(f'pdserve_router_migrations_total{{reason="{r}"}}', 0)
                   for r in reasons) >= 1  # fmt: skip
    assert sum(v for k, v in metrics.items() if k.startswith("pdserve_router_in_flight")) == 0
    for info in up.list_instances().values():
        stats = up.stats(info.address)
        assert stats.num_running == 0 and stats.num_reservations == 0, info.name
        assert stats.num_free_blocks == stats.num_blocks, info.name
