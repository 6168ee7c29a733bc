"""AdmissionQueue: requests wait while the cluster is saturated, lowest priority first, users
taking turns; past its size or wait limit they get RateLimitedError (429). And what saturated
means for one instance."""

import asyncio

import pytest

from pdserve.config import RouterConfig
from pdserve.errors import RateLimitedError
from pdserve.kvcache.events import LoadReport
from pdserve.metrics import RouterMetrics
from services.router.admission import AdmissionQueue
from services.router.kv_index import KVEventIndex
from services.router.membership import Membership
from services.router.routing import Routing


class Cluster:
    """Room for `room` more requests; each admitted one takes a place until `finish`."""

    def __init__(self, room: int = 0) -> None:
        self.room = room

    def saturated(self, generations: int, prompt_tokens: int) -> bool:
        return self.room < generations


def run_queue(
    cluster: Cluster, arrivals: list[tuple[str, int]], max_requests: int = 100
) -> list[str]:
    """Queue `arrivals` (user, priority) while the cluster is full, then free one place at a
    time: the order in which they were let through."""
    served: list[str] = []

    async def scenario() -> None:
        queue = AdmissionQueue(max_requests, 30.0, cluster.saturated, RouterMetrics())

        async def request(name: str, user: str, priority: int) -> None:
            await queue.enter(user, priority, 10)
            cluster.room -= 1
            served.append(name)

        tasks = []
        for n, (user, priority) in enumerate(arrivals):
            tasks.append(asyncio.ensure_future(request(f"{user}{n}", user, priority)))
            await asyncio.sleep(0)  # it takes its place in arrival order
        while len(served) < len(arrivals):
            cluster.room += 1
            queue.pump()
            await asyncio.sleep(0)  # the one let through runs
        await asyncio.gather(*tasks)
        await queue.close()

    asyncio.run(scenario())
    return served


def test_a_flood_from_one_user_does_not_starve_another() -> None:
    arrivals = [("a", 0)] * 8 + [("b", 0)] * 2
    served = run_queue(Cluster(), arrivals)
    assert served[:4] == ["a0", "b8", "a1", "b9"]  # b's two arrived last, served among the first
    assert served[4:] == ["a2", "a3", "a4", "a5", "a6", "a7"]


def test_a_lower_priority_value_goes_first() -> None:
    served = run_queue(Cluster(), [("a", 5), ("b", 5), ("c", -1), ("a", 0)])
    assert served == ["c2", "a3", "a0", "b1"]


def test_nobody_queues_while_there_is_room() -> None:
    served = run_queue(Cluster(room=3), [("a", 0), ("b", 0)])
    assert served == ["a0", "b1"]


def test_a_full_queue_and_a_long_wait_are_429s_and_a_gone_client_leaves_no_place() -> None:
    metrics = RouterMetrics()

    async def scenario() -> None:
        cluster = Cluster()
        queue = AdmissionQueue(2, 0.2, cluster.saturated, metrics)
        waiting = [asyncio.ensure_future(queue.enter("a", 0, 10)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(RateLimitedError, match="queue_max_requests"):
            await queue.enter("b", 0, 10)
        waiting[0].cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        assert len(queue) == 1
        with pytest.raises(RateLimitedError, match="queue_timeout_s"):
            await waiting[1]  # saturated for longer than its wait limit
        assert len(queue) == 0
        await queue.close()

    asyncio.run(scenario())
    reasons = {
        s.labels["reason"]: s.value
        for s in metrics.rejections.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert reasons == {"queue_full": 1.0, "queue_timeout": 1.0}


def test_an_instance_is_saturated_by_its_waiting_requests_or_its_free_blocks() -> None:
    reports = {
        "idle": LoadReport(num_free_blocks=100, num_blocks=100),
        "queued": LoadReport(num_waiting=3, num_free_blocks=100, num_blocks=100),
        "full": LoadReport(num_running=9, num_free_blocks=2, num_blocks=100),
    }
    routing = Routing(
        RouterConfig(), 16, Membership(), KVEventIndex(), reports.get, RouterMetrics()
    )
    assert not routing.saturated("idle", 4, 4)
    assert not routing.saturated("queued", 4, 4)
    routing.load.acquire("queued", 10, routing.load.next_seq())  # one more on its way
    assert routing.saturated("queued", 4, 4)
    assert routing.saturated("full", 4, None)  # 2 free blocks, the prompt needs 4
    assert not routing.saturated("full", 200, None)  # never fits: the instance refuses it
    assert not routing.saturated("unreported", 4, 4)
