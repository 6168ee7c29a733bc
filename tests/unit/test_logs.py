"""Log lines as text and JSON: the request a line is about, from the call or its context."""

import asyncio
import json
import logging
import threading

import pytest

from pdserve.observability.logs import (
    JsonFormatter,
    RequestIds,
    TextFormatter,
    configure_logging,
    request_context,
)


def record(message: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    line = logging.LogRecord("pdserve.test", logging.INFO, __file__, 1, message, args or ("x",),
                             None)  # fmt: skip
    for key, value in extra.items():
        setattr(line, key, value)
    RequestIds().filter(line)
    return line


def test_a_line_outside_any_request_carries_no_ids() -> None:
    line = record()
    assert TextFormatter().format(line).endswith("pdserve.test: hello x")
    entry = json.loads(JsonFormatter().format(line))
    assert entry["message"] == "hello x" and entry["level"] == "INFO"
    assert entry["logger"] == "pdserve.test" and entry["time"].endswith("+00:00")
    assert "request_id" not in entry and "trace_id" not in entry


def test_the_context_names_the_request_and_extra_fields_become_json_fields() -> None:
    with request_context("req-1", "abc123"):
        line = record(status="stop", stages={"route": 0.001})
    assert TextFormatter().format(line).endswith(" request_id=req-1 trace_id=abc123")
    entry = json.loads(JsonFormatter().format(line))
    assert entry["request_id"] == "req-1" and entry["trace_id"] == "abc123"
    assert entry["status"] == "stop" and entry["stages"] == {"route": 0.001}
    after = record()  # the context ended with its block
    assert not after.request_id and not after.trace_id  # type: ignore[attr-defined]


def test_an_explicit_request_id_wins_over_the_context() -> None:
    with request_context("outer"):
        line = record(request_id="inner")
    assert json.loads(JsonFormatter().format(line))["request_id"] == "inner"


def test_contexts_stay_with_their_thread_and_task() -> None:
    seen: dict[str, str] = {}

    def worker() -> None:
        seen["thread"] = record().request_id  # type: ignore[attr-defined]

    with request_context("main"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()

        async def task() -> None:
            seen["task"] = record().request_id  # type: ignore[attr-defined]

        asyncio.run(task())  # a task copies the context it was started in
    assert seen == {"thread": "", "task": "main"}


def test_an_exception_is_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("json", logging.INFO)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("pdserve.test").exception("failed")
        logging.getLogger("pdserve.test").debug("below the level")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["level"] == "ERROR" and "ValueError: boom" in entry["exception"]
