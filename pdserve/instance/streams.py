"""OutputStream: one request's outputs, from the engine thread to the RPC that serves them.

Every role uses it: a prefill instance waits on it for the request's KV to be ready, a decode
instance's StreamTokens and a mixed instance's Generate read its tokens. Any thread may `put` or
`fail` (never blocking); one reader iterates, blocking (`get`, `for`) or on an event loop
(`aget`, `async for`: it holds no thread while it waits). A stream ends after its finished
output or its error. Thread-safe.
"""

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from pdserve.engine.request import RequestOutput
from pdserve.errors import PdserveError, StepFailedError


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


class OutputStream:
    def __init__(self, request_id: str, attempt: str = "") -> None:
        self.request_id = request_id
        self.attempt = attempt  # the router's attempt it serves (GenerateRequest.attempt)
        self._items: queue.SimpleQueue[RequestOutput | PdserveError] = queue.SimpleQueue()
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
        if output.error is not None:
            self.fail(StepFailedError(output.error))
            return
        with self._lock:
            if self._ended:
                return
            self._ended = output.finished
            self._items.put(output)
            waiter, self._waiter = self._waiter, None
        wake(waiter)

    def fail(self, error: PdserveError) -> None:
        """End the stream with `error` (the reader raises it). Ignored once ended."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._items.put(error)
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


def wake(waiter: "asyncio.Future[None] | None") -> None:
    """Resolve a waiting coroutine's future from any thread (on its own loop)."""
    if waiter is None:
        return
    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
        waiter.get_loop().call_soon_threadsafe(_resolve, waiter)


def _resolve(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():  # a cancelled reader's future stays cancelled
        waiter.set_result(None)
