"""An OTLP/gRPC trace collector for tests: the receiving side of pdserve's span exporters,
built on opentelemetry-proto's service definition. It keeps every span it is sent."""

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # empty for a root span
    service: str  # the sending process's service.name
    instance: str  # its service.instance.id (empty for the router)
    pid: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), resource.get("service.name", ""),
                        resource.get("service.instance.id", ""), int(resource["process.pid"]),
                        span.start_time_unix_nano, span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes},
                    ))  # fmt: skip
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 60.0
    ) -> list[ReceivedSpan]:
        """The spans received once `condition` holds of them (spans come in batches from
        other processes, on their exporters' schedule); fails after `timeout_s`."""
        with self._changed:
            reached = self._changed.wait_for(lambda: condition(list(self.spans)), timeout_s)
            assert reached, f"spans never satisfied the condition: {self.spans}"
            return list(self.spans)


@contextmanager
def otlp_collector() -> Iterator[tuple[Collector, str]]:
    """A collector on 127.0.0.1 (a free port) and its endpoint URL."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
