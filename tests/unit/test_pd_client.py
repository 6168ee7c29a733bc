"""PDClient's attempt ends: a finished request is never aborted (the caller may stop reading at
its final event), an unfinished one is, by its attempt. The instances' side is a fake."""

import asyncio
from typing import Any

import pytest

from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2, prefill_pb2
from services.router.outputs import RequestReplies
from services.router.pd_client import Finished, PDClient, _Prefilled


class FakeInstance:
    """Submit queues the request's first step; its second (ending it) comes one loop turn
    later, so that the caller reads them one at a time. Abort records."""

    def __init__(self) -> None:
        self.replies = RequestReplies()
        self.subscriber = "router-1"
        self.aborted: list[tuple[str, str, str]] = []

    async def register(self, address: str, request_id: str, attempt: str) -> RequestReplies:
        self.attempt = attempt
        return self.replies

    def unregister(self, address: str, request_id: str, attempt: str) -> None:
        pass

    async def submit(
        self,
        address: str,
        message: common_pb2.GenerateRequest,
        metadata: object = (),
        on_decode: bool = False,
    ) -> None:
        self.replies.push(self._output(message.request_id, 1))
        asyncio.get_running_loop().call_soon(
            self.replies.push, self._output(message.request_id, 2, last=True)
        )

    def _output(self, request_id: str, token: int, last: bool = False) -> common_pb2.RequestOutputs:
        output = common_pb2.RequestOutputs(request_id=request_id, attempt=self.attempt)
        output.chunk.token_ids.append(token)
        if last:
            output.final.finish_reason = common_pb2.FINISH_REASON_LENGTH
            output.final.num_output_tokens = 2
        return output

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


def test_a_reader_behind_takes_its_backlog_at_once_and_an_error_after_it_next() -> None:
    async def drive() -> tuple[list[list[int]], Exception | None]:
        replies = RequestReplies()
        for token in (1, 2):
            output = common_pb2.RequestOutputs(request_id="r")
            output.chunk.token_ids.append(token)
            replies.push(output)
        replies.push(common_pb2.RequestOutputs(error=common_pb2.Error(message="step failed")))
        taken = [[t for o in await replies.get() for t in o.chunk.token_ids]]
        try:
            await replies.get()
        except Exception as e:  # the error reply, raised once the outputs before it are out
            return taken, e
        return taken, None

    taken, error = asyncio.run(drive())
    assert taken == [[1, 2]]
    assert error is not None and "step failed" in str(error)


def test_outputs_read_together_make_one_delta_with_every_token_and_its_text() -> None:
    fake = FakeInstance()

    async def drive() -> list[Any]:
        events = client_over(fake).generate_mixed("m0", [5, 6], SamplingParams(), "r")
        await asyncio.sleep(0)  # nothing read yet: the generator has not started
        return [event async for event in events]

    async def submit(
        address: str,
        message: common_pb2.GenerateRequest,
        metadata: object = (),
        on_decode: bool = False,
    ) -> None:
        for token, text, last in ((1, "a", False), (2, "b", False), (3, "c", True)):
            output = fake._output(message.request_id, token, last)
            output.chunk.text = text
            fake.replies.push(output)  # all three before the reader wakes

    fake.submit = submit  # type: ignore[method-assign]
    events = asyncio.run(drive())
    assert [(e.token_ids, e.text) for e in events[:-1]] == [((1, 2, 3), "abc")]
    assert isinstance(events[-1], Finished) and events[-1].num_output_tokens == 2


def test_a_message_is_half_the_prefill_call_less_the_stages_prefill_reported() -> None:
    timings = prefill_pb2.PrefillTimings(reserve_s=0.01, queue_s=0.002, compute_s=0.03,
                                         transfer_s=0.004, handoff_s=0.005)  # fmt: skip
    result = prefill_pb2.PrefillResult(timings=timings)
    assert _Prefilled(result, 0.057).message_s() == pytest.approx(0.003)
    assert _Prefilled(result, 0.04).message_s() == 0.0  # never negative
