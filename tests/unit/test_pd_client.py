"""PDClient's attempt ends: a finished request is never aborted (the caller may stop reading at
its final event), an unfinished one is, by its attempt. The instances' side is a fake."""

import asyncio
from typing import Any

from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2
from services.router.outputs import RequestReplies
from services.router.pd_client import Finished, PDClient


class FakeInstance:
    """Submit queues the request's outputs (two steps, the second ending it); Abort records."""

    def __init__(self) -> None:
        self.replies = RequestReplies()
        self.subscriber = "router-1"
        self.aborted: list[tuple[str, str, str]] = []

    async def register(self, address: str, request_id: str, attempt: str) -> RequestReplies:
        self.attempt = attempt
        return self.replies

    def unregister(self, address: str, request_id: str, attempt: str) -> None:
        pass

    async def submit(self, address: str, message: common_pb2.GenerateRequest) -> None:
        for step, last in ((1, False), (2, True)):
            output = common_pb2.RequestOutputs(request_id=message.request_id, attempt=self.attempt)
            output.chunk.token_ids.append(step)
            if last:
                output.final.finish_reason = common_pb2.FINISH_REASON_LENGTH
                output.final.num_output_tokens = 2
            self.replies.push(output)

    async def abort(self, address: str, request_id: str, attempt: str = "") -> bool:
        self.aborted.append((address, request_id, attempt))
        return True


def client_over(fake: FakeInstance) -> PDClient:
    client = PDClient()
    client.aio, client.outputs = fake, fake  # type: ignore[assignment]
    return client


def run(fake: FakeInstance, stop_after: int) -> list[Any]:
    async def drive() -> list[Any]:
        events = client_over(fake).generate_mixed("m0", [5, 6], SamplingParams(), "r")
        seen = [event async for event in _first(events, stop_after)]
        await asyncio.sleep(0)  # a scheduled abort would run now
        return seen

    return asyncio.run(drive())


async def _first(events: Any, count: int) -> Any:
    """The first `count` events, then the generator is closed (as a caller that stops does)."""
    try:
        for _ in range(count):
            yield await anext(events)
    finally:
        await events.aclose()


def test_a_request_read_up_to_its_final_event_is_not_aborted() -> None:
    fake = FakeInstance()
    events = run(fake, stop_after=3)  # two deltas, then Finished: the caller stops there
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
    assert fake.aborted == []


def test_a_request_left_before_its_end_is_aborted_by_its_attempt() -> None:
    fake = FakeInstance()
    run(fake, stop_after=1)
    assert fake.aborted == [("m0", "r", fake.attempt)]
