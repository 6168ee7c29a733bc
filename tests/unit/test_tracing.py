"""Tracing's switch: where the collector comes from, and that off means no span at all."""

import pytest

from pdserve.config import ObservabilityConfig
from pdserve.errors import ConfigError
from pdserve.observability import tracing


def test_the_configured_endpoint_wins_then_the_standard_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317"}  # fmt: skip
    assert tracing.trace_endpoint("http://mine:4317", env) == "http://mine:4317"
    assert tracing.trace_endpoint(None, env) == "http://traces:4317"
    assert tracing.trace_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317"}) == (
        "http://all:4317"
    )
    assert tracing.trace_endpoint(None, {}) is None


def test_off_makes_no_span_sends_no_metadata_and_reads_no_parent() -> None:
    assert not tracing.configure(None, 1.0, "pdserve-test")
    assert not tracing.enabled()
    span = tracing.start("request", None, {"pdserve.request_id": "r"})
    assert span is None
    assert tracing.metadata(span) == ()
    assert tracing.trace_id(span) == ""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert tracing.extract({"traceparent": traceparent}) is None
    tracing.record("stage", span, 0.0, 1.0)  # nothing to record under no span
    tracing.end(span)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace_sample_ratio": 1.5}, "trace_sample_ratio must be in [0, 1]"),
        ({"otlp_endpoint": "collector:4317"}, "must be an http:// or https:// URL"),
        ({"log_format": "yaml"}, "observability.log_format"),
        ({"recent_requests": -1}, "recent_requests must be >= 0"),
    ],
)
def test_bad_observability_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ObservabilityConfig(**settings)  # type: ignore[arg-type]
