"""OpenTelemetry traces of requests, one per request across the router and its instances.

Every process configures tracing once (`configure`): with no collector configured it stays off,
and then `start` returns None and every caller skips its span (no span object, no attribute
built, no metadata sent). On, spans go to an OTLP/gRPC collector through OpenTelemetry's SDK
(batched on the SDK's own thread). A request's context crosses processes as W3C `traceparent`
metadata: the router reads it from the HTTP request (`extract`) and every gRPC call of the
request carries its caller's span (`metadata`).

Stages are measured where they happen with `time.perf_counter()` (the timings pdserve keeps
anyway) and recorded afterwards as spans with those times (`record`): the engine thread is
never asked to open or close a span.
"""

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACE_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

Span = trace.Span
Context = otel_context.Context
Attributes = Mapping[str, str | int | float | bool]

_PROPAGATOR = TraceContextTextMapPropagator()
# time.perf_counter() + _WALL_OFFSET_S = seconds since the epoch (spans carry wall-clock times)
_WALL_OFFSET_S = time.time() - time.perf_counter()
_tracer: trace.Tracer | None = None  # None: tracing is off in this process
_provider: Any = None


def trace_endpoint(configured: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The collector spans go to: the configured one, else the standard variables'."""
    if configured:
        return configured
    return next((env[name] for name in TRACE_ENDPOINT_VARIABLES if env.get(name)), None)


def configure(
    endpoint: str | None, sample_ratio: float, service: str, attributes: Attributes | None = None
) -> bool:
    """Turn tracing on in this process when `endpoint` is set (see `trace_endpoint`); returns
    whether it is on. `service`: the process's `service.name` (pdserve-router,
    pdserve-prefill...); `attributes`: more of its resource (the instance's address...)."""
    global _tracer, _provider
    if not endpoint or _tracer is not None:
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {"service.name": service, "process.pid": os.getpid(), **(attributes or {})}
    )
    sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    _provider = TracerProvider(resource=resource, sampler=sampler)
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("pdserve")
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Send the spans still batched and stop (at the process's end; idempotent)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer, _provider = None, None


def extract(carrier: Mapping[str, str] | Iterable[Any]) -> Context | None:
    """The caller's context from HTTP headers or gRPC metadata (None: none came, or tracing is
    off here)."""
    if _tracer is None:
        return None
    items: Iterable[Any] = (
        carrier.items() if isinstance(carrier, Mapping) else carrier  # gRPC: (key, value)s
    )
    parent = next((value for key, value in items if key.lower() == TRACEPARENT), None)
    if not isinstance(parent, str):
        return None
    return _PROPAGATOR.extract({TRACEPARENT: parent})


def metadata(span: Span | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes `span` the parent of the callee's spans (empty: no span)."""
    if span is None or not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def start(
    name: str,
    parent: "Span | Context | None" = None,
    attributes: Attributes | None = None,
    *,
    at: float | None = None,
    server: bool = False,
) -> Span | None:
    """Open a span under `parent` (a span of this process, or a caller's context; None: a new
    trace) from perf-counter time `at` (default: now); None when tracing is off. End it with
    `end`."""
    if _tracer is None:
        return None
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return _tracer.start_span(
        name,
        context=context,
        kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
        attributes=attributes,
        start_time=_wall_ns(at if at is not None else time.perf_counter()),
    )


def end(span: Span | None, at: float | None = None, error: BaseException | None = None) -> None:
    """Close `span` at perf-counter time `at` (default: now), marked failed with `error`."""
    if span is None:
        return
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=_wall_ns(at if at is not None else time.perf_counter()))


def record(
    name: str,
    parent: Span | None,
    start_s: float,
    end_s: float,
    attributes: Attributes | None = None,
) -> None:
    """A finished stage of `parent`, from perf-counter time `start_s` to `end_s`."""
    if parent is None:
        return
    end(start(name, parent, attributes, at=start_s), at=max(start_s, end_s))


def trace_id(span: Span | None) -> str:
    """The span's trace id in hex (empty: no span)."""
    if span is None:
        return ""
    return format(span.get_span_context().trace_id, "032x")


def _wall_ns(perf: float) -> int:
    return int((perf + _WALL_OFFSET_S) * 1e9)
