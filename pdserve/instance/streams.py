"""OutputStream: one request's outputs, from the engine thread to the RPC that serves them.

Every role uses it: a prefill instance waits on it for the request's KV to be ready, a decode
instance's StreamTokens and a mixed instance's Generate read its tokens. Any thread may `put` or
`fail` (never blocking); one reader iterates. A stream ends after its finished output or its
error. Thread-safe.
"""

import queue
import threading
from collections.abc import Iterator

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
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue[RequestOutput | PdserveError] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = False

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

    def fail(self, error: PdserveError) -> None:
        """End the stream with `error` (the reader raises it). Ignored once ended."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._items.put(error)

    def get(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output; raises the stream's error, or queue.Empty after `timeout_s`."""
        item = self._items.get(timeout=timeout_s)
        if isinstance(item, PdserveError):
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self.get()
            yield output
            if output.finished:
                return
