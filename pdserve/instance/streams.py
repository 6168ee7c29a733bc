"""OutputStream: one request's outputs, from the engine thread to the RPC that serves them;
Subscription: the outputs of every request one router named, batched per engine step.

A prefill instance waits on a request's OutputStream for its KV to be ready (`get`). On a
decode or mixed instance the stream is bound to the router's Subscription: each output goes on
to it, and the runtime hands a whole step's outputs to a subscription at once (`push`), so the
subscription's reader (`InstanceService.SubscribeOutputs`) sends one message per step. Any
thread may `put`, `fail` or `push` (never blocking); one reader iterates a stream (`get`, `for`,
`aget`, `async for`) or a subscription (`batches`), holding no thread while it waits on an event
loop. A stream ends after its finished output or its error. Thread-safe.
"""

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

from pdserve.engine.request import RequestOutput
from pdserve.errors import PdserveError, StepFailedError
from pdserve.observability import tracing


def aborted_output(request_id: str) -> RequestOutput:
    """The final output of a request that was aborted (it produced no tokens in this step)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=(),
        new_text="",
        finished=True,
        kv_ready=False,
        finish_reason="abort",
        stop_reason=None,
        num_prompt_tokens=0,
        num_output_tokens=0,
        num_cached_tokens=0,
    )


Item = RequestOutput | PdserveError


def stage_names(role: str, prefills: bool) -> tuple[str, str, str, str]:
    """The names of a stream's StageTimes (wait, prefill, admission, first step) as spans: a
    request whose KV came from prefill waited for it (`kv_wait`) and computed nothing."""
    if not prefills:
        return (f"{role}.kv_wait", "", f"{role}.admission", f"{role}.first_step")
    return (f"{role}.queue", f"{role}.compute", f"{role}.admission", f"{role}.first_step")


class StreamTrace:
    """The span of a request's part on a decode or mixed instance: opened with its stream,
    ended with it, its stages recorded from the final output's StageTimes (they follow each
    other from the stream's opening)."""

    def __init__(
        self, role: str, prefills: bool, parent: tracing.Context | None, request_id: str
    ) -> None:
        self.names = stage_names(role, prefills)
        self.opened = time.perf_counter()
        self.span = tracing.start(
            role, parent, {"pdserve.request_id": request_id}, at=self.opened, server=True
        )

    def end(self, item: Item) -> None:
        span = self.span
        if span is None:
            return
        if isinstance(item, PdserveError):
            tracing.end(span, error=item)
            return
        times = item.stage_times
        if times is not None:
            durations = (times.wait_s, times.prefill_s, times.admission_s, times.first_step_s)
            at = self.opened
            for name, duration in zip(self.names, durations, strict=True):
                if name:
                    tracing.record(name, span, at, at + duration)
                at += duration
            span.set_attribute("pdserve.device_hit_tokens", times.device_hit_tokens)
            span.set_attribute("pdserve.storage_hit_tokens", times.storage_hit_tokens)
        span.set_attribute("pdserve.output_tokens", item.num_output_tokens)
        span.set_attribute("pdserve.finish_reason", item.finish_reason or "")
        tracing.end(span)


class OutputStream:
    def __init__(
        self,
        request_id: str,
        attempt: str = "",
        subscription: "Subscription | None" = None,
        trace: StreamTrace | None = None,
    ) -> None:
        self.request_id = request_id
        self.attempt = attempt  # the router's attempt it serves (GenerateRequest.attempt)
        self.subscription = subscription  # None: read here (`get`, `aget`)
        self.trace = trace  # ended with the stream
        self._items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None  # an `aget` waiting for an item

    @property
    def ended(self) -> bool:
        """Whether its last item (a finished output or an error) has been put."""
        return self._ended

    def put(self, output: RequestOutput) -> None:
        """Add an output; a final one (finished) ends the stream. An output whose engine step
        failed (`output.error`) ends it with StepFailedError. Ignored once ended."""
        item = self.accept(output)
        if item is not None:
            self._hand_on(item)

    def fail(self, error: PdserveError) -> None:
        """End the stream with `error` (the reader raises it). Ignored once ended."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        if self.trace is not None:
            self.trace.end(error)
        self._hand_on(error)

    def accept(self, output: RequestOutput) -> Item | None:
        """Mark the stream ended when `output` ends it, and return what its reader gets (None
        once the stream has ended). The caller hands it on: `put` does, and the runtime
        pushes a whole step's to a subscription at once."""
        item: Item = output if output.error is None else StepFailedError(output.error)
        with self._lock:
            if self._ended:
                return None
            self._ended = isinstance(item, PdserveError) or output.finished
        if self._ended and self.trace is not None:
            self.trace.end(item)
        return item

    def _hand_on(self, item: Item) -> None:
        if self.subscription is not None:
            self.subscription.push([(self, item)])
            return
        with self._lock:
            self._items.put(item)
            waiter, self._waiter = self._waiter, None
        wake(waiter)

    def get(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output; raises the stream's error, or queue.Empty after `timeout_s`."""
        item = self._items.get(timeout=timeout_s)
        if isinstance(item, PdserveError):
            raise item
        return item

    async def aget(self) -> RequestOutput:
        """`get` on the running event loop: awaits the next output, holding no thread."""
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                future = asyncio.get_running_loop().create_future()
                with self._lock:  # a `put` after this check sees the waiter and wakes it
                    if not self._items.empty():
                        continue
                    self._waiter = future
                await future
                continue
            if isinstance(item, PdserveError):
                raise item
            return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self.get()
            yield output
            if output.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self.aget()
            yield output
            if output.finished:
                return


class Subscription:
    """The outputs of the requests bound to one router's subscription, in batches."""

    def __init__(self, subscriber: str) -> None:
        self.subscriber = subscriber
        self._pending: list[tuple[OutputStream, Item]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, items: list[tuple[OutputStream, Item]]) -> None:
        """Queue items for the reader (dropped once the subscription is closed)."""
        with self._lock:
            if self._closed:
                return
            self._pending.extend(items)
            waiter, self._waiter = self._waiter, None
        wake(waiter)

    async def batches(self) -> AsyncIterator[list[tuple[OutputStream, Item]]]:
        """Everything pushed since the last batch, as soon as there is some; ends at `close`."""
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    if self._closed:
                        return
                    future = asyncio.get_running_loop().create_future()
                    self._waiter = future
            if batch:
                yield batch
            else:
                await future

    def close(self) -> None:
        """No more items: the reader's `batches` ends (after what is queued)."""
        with self._lock:
            self._closed = True
            waiter, self._waiter = self._waiter, None
        wake(waiter)


def wake(waiter: "asyncio.Future[None] | None") -> None:
    """Resolve a waiting coroutine's future from any thread (on its own loop)."""
    if waiter is None:
        return
    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
        waiter.get_loop().call_soon_threadsafe(_resolve, waiter)


def _resolve(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():  # a cancelled reader's future stays cancelled
        waiter.set_result(None)
