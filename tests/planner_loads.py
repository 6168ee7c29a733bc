"""Driving the SLA planner of a `pdserve up` cluster in e2e tests: open-loop loads, the
planner's status, and moving it to a split by setting its targets at run time between what it
predicts for the current split and the wanted one under the running load (so a test exercises
the live loop — forecast, simulation on the instances' own step time fits, decision, change —
whatever the machine's speed)."""

import itertools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from pdserve_up import UpCluster
from waiting import wait_for

from pdserve.v1 import admin_pb2

GENEROUS_S = 30.0  # a target nothing misses
INTERVAL_S, HISTORY_S = 2, 4  # the planner's, in the tests' configs


def planner_config(**bounds: int) -> str:
    """The tests' `planner:` section: generous targets until a test sets its own, short
    intervals and history, one confirmation, a short cooldown, and `bounds` (min_instances=2,
    ...)."""
    return (
        f"planner:\n  enabled: true\n  ttft_p90_s: {GENEROUS_S}\n  itl_p90_s: {GENEROUS_S}\n"
        f"  interval_s: {INTERVAL_S}\n  history_s: {HISTORY_S}\n  cooldown_s: 2\n"
        f"  confirm_intervals: 1\n"
    ) + "".join(f"  {name}: {value}\n" for name, value in bounds.items())


def chat(model: str) -> dict[str, object]:
    """Short prompt, 96-token answer."""
    return {"model": model, "prompt": "hello there", "max_tokens": 96, "ignore_eos": True,
            "temperature": 0}  # fmt: skip


class Load:
    """Open loop: `body(n)` sent as the n-th request, `rate_per_s` times a second until
    stopped, each request on its own (users do not wait for each other: a slow cluster sees the
    load it cannot serve); failures kept."""

    def __init__(
        self, up: UpCluster, body: Callable[[int], dict[str, object]], rate_per_s: float
    ) -> None:
        self.url, self.body, self.rate_per_s = f"{up.router_url}/completions", body, rate_per_s
        self.output_tokens = int(str(body(0)["max_tokens"]))
        self.done, self.failures = 0, []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(96)
        self._client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=96))
        self._sender = threading.Thread(target=self._send)

    def __enter__(self) -> "Load":
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sender.join()
        self._pool.shutdown(wait=True)  # every request sent ends
        self._client.close()

    def _send(self) -> None:
        at = time.monotonic()
        for n in itertools.count():
            if self._stop.is_set():
                return
            self._pool.submit(self._one, self.body(n))
            at += 1 / self.rate_per_s
            self._stop.wait(max(0.0, at - time.monotonic()))

    def _one(self, body: dict[str, object]) -> None:
        try:
            reply = self._client.post(self.url, json=body)
        except httpx.HTTPError as e:
            self.failures.append(repr(e))
            return
        if reply.status_code != 200:
            self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
        else:
            self.done += 1


def status(up: UpCluster) -> admin_pb2.PlannerStatus:
    reply: admin_pb2.PlannerStatus = up.admin().GetPlannerStatus(
        admin_pb2.PlannerStatusRequest(), metadata=up.admin_auth, timeout=30
    )
    return reply


def split(up: UpCluster) -> str:
    roles = [i.role for i in up.list_instances().values()]
    return f"{roles.count('prefill')}P{roles.count('decode')}D"


CLEAR_GAIN = 1.5  # how much lower the wanted split's predicted p90 must be to set a target
RAISE_AFTER = 4  # intervals without a clear gain before a load is raised
MAX_RATE_PER_S = 60.0


def gain(decision: admin_pb2.PlannerDecision, wanted: str) -> tuple[str, float, float]:
    """The figure ("ttft" or "itl") where the planner predicts the `wanted` split gains most
    over the decision's current one, with the two predictions (wanted's, current's)."""
    candidate = {c.split: c for c in decision.candidates}[wanted]
    ttft = (candidate.ttft_p90_s, decision.predicted_ttft_p90_s)
    itl = (candidate.itl_p90_s, decision.predicted_itl_p90_s)
    if ttft[1] / max(ttft[0], 1e-9) >= itl[1] / max(itl[0], 1e-9):
        return "ttft", *ttft
    return "itl", *itl


def clear_gain_under_load(
    up: UpCluster, load: "Load", current: str, wanted: str
) -> admin_pb2.PlannerDecision | None:
    """The first decision taken on `load` alone — its forecast's lengths are this load's, its
    rate windows (two intervals) began after the load did, or after its last raise — that
    predicts `wanted` at least CLEAR_GAIN better than `current`. What overloads one instance
    depends on the machine (and on what else runs on it): without such a decision for
    `RAISE_AFTER` intervals, the load is raised by half, up to `MAX_RATE_PER_S`. None if the
    planner moved on its own meanwhile."""

    def ready(since: float) -> admin_pb2.PlannerDecision | None:
        for d in status(up).decisions:
            if (d.at_unix_s >= since and d.current == current and len(d.candidates) > 1
                    and d.forecast_output_tokens == load.output_tokens):  # fmt: skip
                _, low, high = gain(d, wanted)
                if high >= CLEAR_GAIN * low:
                    return d
        return None

    while True:
        since = time.time() + 2 * INTERVAL_S
        deadline = since + RAISE_AFTER * INTERVAL_S

        def settled(since: float = since, deadline: float = deadline) -> bool:
            return bool(ready(since)) or split(up) != current or time.time() > deadline

        wait_for(settled, 60)
        if split(up) != current:
            return None
        if (decision := ready(since)) is not None:
            return decision
        if load.rate_per_s * 1.5 > MAX_RATE_PER_S:
            raise AssertionError(f"no clear gain predicted for {wanted}:\n{recent(up)}")
        load.rate_per_s *= 1.5


def set_targets(up: UpCluster, ttft_s: float, itl_s: float) -> None:
    up.admin().SetPlannerTargets(
        admin_pb2.PlannerTargets(ttft_p90_s=ttft_s, itl_p90_s=itl_s),
        metadata=up.admin_auth,
        timeout=30,
    )


def move(up: UpCluster, load: Load, current: str, wanted: str) -> None:
    """Under `load` (raised until the planner predicts a clear gain for the wanted split), set
    a target between the current split's predicted p90 and the wanted split's — of the figure
    (TTFT or ITL) where it gains most; the other target generous — then wait until the planner
    moved there."""
    decision = clear_gain_under_load(up, load, current, wanted)
    if decision is not None:  # (the planner may have moved on its own: an unreachable target)
        figure, low, high = gain(decision, wanted)
        target = math.sqrt(low * high)
        set_targets(up, *((target, GENEROUS_S) if figure == "ttft" else (GENEROUS_S, target)))
    try:
        wait_for(lambda: split(up) == wanted, 120)
    except AssertionError:
        raise AssertionError(f"still {split(up)}, not {wanted}:\n{recent(up)}") from None
    assert load.done > 0


def recent(up: UpCluster) -> str:
    """The planner's targets and last decisions (TTFT/ITL p90 predicted, observed, and per
    candidate with its goodput), one a line: what a failed wait shows."""
    now = status(up)
    lines = [f"targets {now.targets.ttft_p90_s:.3f}/{now.targets.itl_p90_s:.4f}"]
    for d in now.decisions[-8:]:
        candidates = " ".join(
            f"{c.split} {c.ttft_p90_s:.3f}/{c.itl_p90_s:.4f}/{c.goodput:.2f}" for c in d.candidates
        )
        lines.append(
            f"{d.action} {d.current}->{d.target} ({d.reason}) forecast "
            f"{d.forecast_rate_per_s:.1f}/s {d.forecast_prompt_tokens:.0f}"
            f"({d.forecast_cached_tokens:.0f})->{d.forecast_output_tokens:.0f} predicted "
            f"{d.predicted_ttft_p90_s:.3f}/{d.predicted_itl_p90_s:.4f} observed "
            f"{d.observed_ttft_p90_s:.3f}/{d.observed_itl_p90_s:.4f}; {candidates}"
        )
    return "\n".join(lines)


def check_at_rest(up: UpCluster) -> None:
    """Once the load's requests ended: every instance runs nothing, holds no reservation, and
    has every KV block free."""
    for info in up.list_instances().values():
        wait_for(lambda a=info.address: up.stats(a).num_running == 0, 30)
        stats = up.stats(info.address)
        assert stats.num_reservations == 0 and stats.num_free_blocks == stats.num_blocks
