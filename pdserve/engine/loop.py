"""EngineLoop: runs an LLMEngine on a dedicated thread (its owner).

The engine is not thread-safe; gRPC handler threads never touch it directly. They `call` small
functions that run on the loop thread between steps, and receive outputs through `on_outputs`.
The loop thread only schedules, runs and updates: the outputs' text (detokenisation, stop
strings: `OutputProcessor`) and the fan-out (`on_outputs`) run on the loop's output thread,
which hands the requests a stop string ended back to the loop thread to finish.
Blocking I/O (transfers, RPCs to peers) stays on the caller's thread, never on the loop. Other
threads wake an idle loop through its `Mailbox` (built before the engine, so that the engine's
storage connector is given `mailbox.wake` at construction).
"""

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
OutputHandler = Callable[[list[RequestOutput]], None]
Command = tuple[Callable[[LLMEngine], object], "Future[object]"]
Texts = tuple[list[RequestOutput], list[str]]  # a step's outputs, requests ended before them


class Mailbox:
    """Commands for the loop thread; any thread may post. Thread-safe."""

    def __init__(self) -> None:
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def wake(self) -> None:
        """Let an idle loop run a step now (a storage read it waits for has finished)."""
        self.commands.put((lambda _: None, Future()))


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: OutputHandler,
        mailbox: Mailbox | None = None,
        *,
        on_tick: Callable[[LLMEngine], None] | None = None,
        tick_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._commands = (mailbox or Mailbox()).commands
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        engine.inline_text = False  # the output thread adds it
        self._texts: queue.SimpleQueue[Texts | None] = queue.SimpleQueue()
        self._text_thread = threading.Thread(
            target=self._run_texts, name="engine-outputs", daemon=True
        )

    def start(self) -> None:
        self._text_thread.start()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put((lambda _: None, Future()))
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._texts.put(None)  # after the outputs the loop thread queued
        if self._text_thread.is_alive():
            self._text_thread.join(timeout_s)

    def emit(self, outputs: Sequence[RequestOutput]) -> None:
        """Deliver outputs made outside a step (`LLMEngine.admit_prefilled`), through the
        output thread like the steps' own. Call on the loop thread (in a command)."""
        self._texts.put((list(outputs), self.engine.take_ended()))

    def submit(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run `fn(engine)` on the loop thread; the future carries its result or exception."""
        if self._stopped.is_set():
            raise RuntimeError("engine loop is stopped")
        future: Future[T] = Future()
        self._commands.put((fn, future))  # type: ignore[arg-type]
        return future

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = 30.0) -> T:
        """`submit` and wait for the result (re-raising `fn`'s exception)."""
        return self.submit(fn).result(timeout_s)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            self._drain_commands(block=not engine.has_work())
            if self._on_tick is not None:
                self._on_tick(engine)
            if engine.has_work():
                try:
                    outputs = self.engine.step()  # a failed forward pass fails its batch only
                except Exception:  # a bug outside the forward pass: log it, do not spin
                    logger.exception("engine step failed outside the forward pass")
                    self._stopped.wait(self._tick_s)
                    continue
                self._queue_texts(outputs)
            else:
                self._queue_texts([])  # requests the commands ended (aborts, releases)

    def _queue_texts(self, outputs: list[RequestOutput]) -> None:
        ended = self.engine.take_ended()
        if outputs or ended:
            self._texts.put((outputs, ended))

    def _run_texts(self) -> None:
        """The output thread: text, stop strings and fan-out, in the engine's order."""
        processor = self.engine.outputs
        while (item := self._texts.get()) is not None:
            try:
                delivered, stopped = processor.process(*item)
                if stopped:  # their final outputs are out: the engine finishes them
                    self._commands.put((partial(_stop, stopped), Future()))
                if delivered:
                    self._on_outputs(delivered)
            except Exception:  # a bug: log it, keep serving the other requests' outputs
                logger.exception("adding text to the engine's outputs failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=self._tick_s) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._execute(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, fn: Callable[[LLMEngine], object], future: "Future[object]") -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except BaseException as e:  # delivered to the caller's thread
            future.set_exception(e)


def _stop(request_ids: list[str], engine: LLMEngine) -> None:
    engine.stop_requests(request_ids)
