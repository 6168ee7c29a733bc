"""Where one request's time went: its stages on the router and on every instance it passed.

A `RequestRecord` follows one generation through the router: the routing decision and each
attempt (spans of the request's trace, made here), the stages its prefill and decode (or mixed)
instance reported (`PrefillResult.timings`, the final output's `StageTimings`: those instances
made their own spans), and its end. The same record feeds the trace, the per-request log line,
`pdserve admin trace` (the `RecentRequests` ring) and the router's stage histograms: one source
for all of them.

Times are `time.perf_counter()`; an instance reports durations, laid here one after the other
from the attempt's dispatch (its stages follow each other). Thread-safe where stated.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.observability import tracing
from pdserve.v1 import admin_pb2, common_pb2, prefill_pb2
from services.router.history import Sample


@dataclass(slots=True)
class Stage:
    name: str
    start: float  # time.perf_counter()
    duration_s: float
    instance: str = ""  # host:port; empty: the router
    attributes: dict[str, str] = field(default_factory=dict)


class RequestRecord:
    """One generation's journey (its trace's root span `request`, when traced). Used by the
    request's own task on the router's event loop; `to_proto` may run on any thread (it
    copies)."""

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        arrival: float,
        parent: tracing.Context | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.span = tracing.start(
            "request",
            parent,
            {"pdserve.request_id": request_id, "pdserve.prompt_tokens": prompt_tokens},
            at=arrival,
            server=True,
        )
        self.trace_id = tracing.trace_id(self.span)
        self.stages: list[Stage] = []
        self.status = "running"
        self.output_tokens = 0
        self.attempts = 0
        self.migrations = 0
        self.dispatched: float | None = None  # the first attempt's start
        self.first_token: float | None = None
        self.message_s: float | None = None  # one router <-> instance message (`Finished`)
        self.ended: float | None = None

    def add(
        self,
        name: str,
        start: float,
        end: float,
        instance: str = "",
        attributes: Mapping[str, Any] | None = None,
        *,
        span: bool = True,
    ) -> None:
        """A stage; also a span of this request's trace when `span` (stages an instance
        reported are spans of its own)."""
        attributes = attributes or {}
        self.stages.append(
            Stage(name, start, end - start, instance, {k: str(v) for k, v in attributes.items()})
        )
        if span and self.span is not None:
            traced = {f"pdserve.{k}": v for k, v in attributes.items()}
            tracing.record(name, self.span, start, end, traced)

    def prefill_reported(
        self, result: prefill_pb2.PrefillResult, instance: str, dispatched: float
    ) -> float:
        """The stages prefill reported, from `dispatched`; returns when its handoff ended."""
        t = result.timings
        stages: tuple[tuple[str, float, dict[str, Any]], ...] = (
            ("prefill.reserve", t.reserve_s, {"decode_cached_tokens":
                                              result.num_decode_cached_tokens}),
            ("prefill.queue", t.queue_s, {}),
            ("prefill.compute", t.compute_s, {"device_hit_tokens": result.num_device_hit_tokens,
                                              "storage_hit_tokens": result.num_storage_hit_tokens}),
            ("kv.transfer", t.transfer_s, {"transport": result.transport or "none",
                                           "bytes": result.kv_bytes_sent,
                                           "blocks": result.kv_blocks_sent}),
            ("prefill.handoff", t.handoff_s, {}),
        )  # fmt: skip
        at = dispatched
        for name, duration, attributes in stages:
            self.add(name, at, at + duration, instance, attributes, span=False)
            at += duration
        return at

    def stream_reported(
        self, timings: common_pb2.StageTimings, instance: str, role: str, first_token: float
    ) -> None:
        """The stages the streaming instance (`role`: decode or mixed) reported, around its
        first token at `first_token`: a prompt computed there queued and computed, one whose
        KV came from prefill waited for it (`prefill_s` exactly 0)."""
        waits: tuple[tuple[str, float], ...]
        hits: dict[str, int] = {}
        if timings.prefill_s == 0:
            waits = ((f"{role}.kv_wait", timings.wait_s),)
        else:
            hits = {"device_hit_tokens": timings.device_hit_tokens,
                    "storage_hit_tokens": timings.storage_hit_tokens}  # fmt: skip
            waits = ((f"{role}.queue", timings.wait_s), (f"{role}.compute", timings.prefill_s))
        at = first_token - sum(duration for _, duration in waits)
        for name, duration in waits:
            attributes = hits if name.endswith(".compute") else {}
            self.add(name, at, at + duration, instance, attributes, span=False)
            at += duration
        if timings.first_step_s > 0:
            step = first_token + timings.admission_s
            self.add(f"{role}.admission", first_token, step, instance, span=False)
            self.add(f"{role}.first_step", step, step + timings.first_step_s, instance, span=False)

    def finish(self, status: str, error: BaseException | None = None) -> None:
        self.ended = time.perf_counter()
        self.status = status
        if self.span is not None:
            self.span.set_attribute("pdserve.output_tokens", self.output_tokens)
            self.span.set_attribute("pdserve.status", status)
        tracing.end(self.span, self.ended, error)

    def sample(self) -> Sample:
        """The finished request's shape and latency (`RequestHistory`): its prompt tokens
        found cached where the prompt was computed (the last attempt's), TTFT, and time per
        output token after the first."""
        cached = 0
        for stage in self.stages:
            if stage.name.endswith(".compute"):
                hits = stage.attributes
                cached = int(hits.get("device_hit_tokens", 0)) + int(
                    hits.get("storage_hit_tokens", 0)
                )
        first, ended = self.first_token, self.ended
        tpot = None
        if first is not None and ended is not None and self.output_tokens > 1:
            tpot = (ended - first) / (self.output_tokens - 1)
        ttft = first - self.arrival if first is not None else None
        return Sample(self.arrival, self.prompt_tokens, cached, self.output_tokens, ttft, tpot,
                      ended if ended is not None else time.perf_counter(),
                      self.message_s)  # fmt: skip

    def stage_durations(self) -> dict[str, float]:
        """Seconds per stage name (summed over attempts), for the log line."""
        totals: dict[str, float] = {}
        for stage in self.stages:
            totals[stage.name] = totals.get(stage.name, 0.0) + stage.duration_s
        return totals

    def to_proto(self) -> admin_pb2.RequestTrace:
        end = self.ended if self.ended is not None else time.perf_counter()
        return admin_pb2.RequestTrace(
            request_id=self.request_id,
            trace_id=self.trace_id,
            status=self.status,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            attempts=self.attempts,
            migrations=self.migrations,
            duration_s=end - self.arrival,
            stages=[
                admin_pb2.TraceStage(
                    name=s.name,
                    instance=s.instance,
                    start_s=s.start - self.arrival,
                    duration_s=s.duration_s,
                    attributes=s.attributes,
                )
                for s in list(self.stages)
            ],
        )


class RecentRequests:
    """The running requests' records and the last `capacity` finished ones (oldest dropped
    first). Thread-safe: the event loop adds, the admin API reads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._running: dict[str, RequestRecord] = {}
        self._finished: OrderedDict[str, RequestRecord] = OrderedDict()
        self._lock = threading.Lock()

    def started(self, record: RequestRecord) -> None:
        with self._lock:
            self._running[record.request_id] = record

    def finished(self, record: RequestRecord) -> None:
        with self._lock:
            self._running.pop(record.request_id, None)
            if self.capacity == 0:
                return
            self._finished[record.request_id] = record
            self._finished.move_to_end(record.request_id)
            while len(self._finished) > self.capacity:
                self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        with self._lock:
            return self._running.get(request_id) or self._finished.get(request_id)
