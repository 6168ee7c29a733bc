"""Log lines as text or JSON, each line about a request carrying its request id (and trace id).

The request a line is about comes from the logging call's `extra={"request_id": ...}` or, when
absent, from the context the line is logged in (`request_context`: the router's handler task,
an instance's handler thread). Secrets are never passed to a logger; this module adds nothing
but the two ids.
"""

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

_REQUEST_ID: ContextVar[str] = ContextVar("pdserve_request_id", default="")
_TRACE_ID: ContextVar[str] = ContextVar("pdserve_trace_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord's own attributes: anything else on a record came from `extra` and goes in the JSON
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "request_id", "trace_id",
}  # fmt: skip


@contextlib.contextmanager
def request_context(request_id: str, trace_id: str = "") -> Iterator[None]:
    """Lines logged inside (this thread or task, and tasks it starts) name the request."""
    request_token = _REQUEST_ID.set(request_id)
    trace_token = _TRACE_ID.set(trace_id)
    try:
        yield
    finally:
        _TRACE_ID.reset(trace_token)
        _REQUEST_ID.reset(request_token)


class RequestIds(logging.Filter):
    """Sets `record.request_id` and `record.trace_id` (empty when the line is about no
    request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _REQUEST_ID.get()
        if not getattr(record, "trace_id", ""):
            record.trace_id = _TRACE_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, then ` request_id=… trace_id=…` when set."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{name}={getattr(record, name)}" for name in ("request_id", "trace_id")
               if getattr(record, name, "")]  # fmt: skip
        return f"{line} {' '.join(ids)}" if ids else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the ids when
    set, the fields passed as `extra`, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("request_id", "trace_id"):
            if value := getattr(record, name, ""):
                entry[name] = value
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """This process's root logger: one stderr handler in `log_format` (`text` | `json`), at
    `level`. Replaces the handlers set before (a process configures its logging once, a
    Ray worker may be handed a second instance)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIds())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
