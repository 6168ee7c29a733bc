"""Subscription: the outputs of one router's requests, handed over in batches (per step)."""

import asyncio
import threading

from pdserve.engine.request import RequestOutput
from pdserve.errors import StepFailedError
from pdserve.instance.streams import Item, OutputStream, Subscription


def output(
    request_id: str, token: int, finished: bool = False, error: str | None = None
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=(token,),
        new_text=str(token),
        finished=finished,
        kv_ready=False,
        finish_reason="length" if finished else None,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=1,
        num_cached_tokens=0,
        error=error,
    )


def names(batch: list[tuple[OutputStream, Item]]) -> list[str]:
    return [f"{stream.request_id}:{item.new_token_ids[0]}" for stream, item in batch]  # type: ignore[union-attr]


def test_a_steps_outputs_come_as_one_batch_and_close_ends_the_reader() -> None:
    subscription = Subscription("router-1")
    streams = [OutputStream(f"r{i}", "a", subscription) for i in range(3)]

    async def run() -> tuple[list[str], list[str], list[object]]:
        batches = subscription.batches()
        step = [(s, item) for s in streams if (item := s.accept(output(s.request_id, 7)))]
        threading.Thread(target=subscription.push, args=(step,)).start()  # the output thread
        first = names(await anext(batches))
        streams[0].put(output("r0", 8, finished=True))  # a stream's own put: pushed alone
        second = names(await anext(batches))
        subscription.close()
        return first, second, [batch async for batch in batches]

    first, second, rest = asyncio.run(run())
    assert first == ["r0:7", "r1:7", "r2:7"] and second == ["r0:8"] and rest == []
    assert streams[0].ended and not streams[1].ended


def test_a_failed_step_ends_the_stream_with_its_error_and_nothing_follows() -> None:
    subscription = Subscription("router-1")
    stream = OutputStream("r", "a", subscription)
    item = stream.accept(output("r", 5, error="boom"))
    assert isinstance(item, StepFailedError) and "boom" in str(item) and stream.ended
    assert stream.accept(output("r", 6)) is None
    stream.put(output("r", 7))  # ended: ignored
    subscription.close()
    subscription.push([(stream, output("r", 9))])  # closed: dropped

    async def read() -> list[object]:
        return [batch async for batch in subscription.batches()]

    assert asyncio.run(read()) == []
