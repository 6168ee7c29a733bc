"""Traces, timelines and logs of a `pdserve up` cluster with tracing on and JSON logs: one trace
per request across the router, prefill and decode processes, correctly parented; a migrated
request's trace holds both decode instances; `pdserve admin trace` prints the same stages."""

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from otlp import Collector, ReceivedSpan, otlp_collector
from pdserve_up import CLI, UpCluster, pdserve_up
from waiting import wait_for

from pdserve.v1 import admin_pb2

MODEL = "tiny"  # the fixture's model directory's name (see `traced`)
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(
    ray_session: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UpCluster, Collector]]:
    workdir = tmp_path_factory.mktemp("observability")
    with otlp_collector() as (collector, endpoint):
        config = (
            f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 256\n"
            f"prefill:\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
            f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
            f"observability:\n  otlp_endpoint: {endpoint}\n  log_format: json\n"
            f"cluster:\n  namespace: pdserve-observe\n  state_dir: {workdir}\n"
            f"  drain_timeout_s: 0.5\n"
        )
        address = ray.get_runtime_context().gcs_address
        with pdserve_up(config, workdir, address, "--health-interval", "0.5") as up:
            yield up, collector


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def parent_of(spans: list[ReceivedSpan], span: ReceivedSpan) -> ReceivedSpan:
    [parent] = [s for s in spans if s.span_id == span.parent_id]
    return parent


def streamed(up: UpCluster, body: dict[str, Any], on_chunk: Any) -> list[dict[str, Any]]:
    """A streamed completion's chunks; `on_chunk(count)` after each."""
    chunks = []
    with httpx.stream("POST", f"{up.router_url}/completions", json={**body, "stream": True},
                      timeout=300) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                on_chunk(len(chunks))
    return chunks


def serving_decode(up: UpCluster) -> str:
    [name] = [name for name, info in up.list_instances().items()
              if info.role == "decode" and up.stats(info.address).num_running > 0]  # fmt: skip
    return name


def request_trace(up: UpCluster, request_id: str) -> admin_pb2.RequestTrace:
    return up.admin().GetRequestTrace(
        admin_pb2.RequestTraceRequest(request_id=request_id), metadata=up.admin_auth, timeout=30
    )


def test_a_pd_request_is_one_trace_across_three_processes(
    traced: tuple[UpCluster, Collector],
) -> None:
    up, collector = traced
    headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    body = {"model": MODEL, "prompt": "the quick brown fox " * 8, "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{up.router_url}/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["id"].removeprefix("cmpl-")

    expected = {"request", "admission", "route", "attempt", "stream", "prefill", "prefill.reserve",
                "prefill.queue", "prefill.compute", "prefill.handoff", "decode",
                "decode.kv_wait", "decode.admission", "decode.first_step"}  # fmt: skip
    spans = of_trace(
        collector.wait_for(
            lambda s: expected <= {x.name for x in of_trace(s, CALLER_TRACE)}, timeout_s=60
        ),
        CALLER_TRACE,
    )
    services = {s.service for s in spans}
    assert services == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    assert len({s.pid for s in spans}) == 3  # three processes

    [root] = named(spans, "request")
    assert root.parent_id == CALLER_SPAN  # the caller's traceparent was honoured
    assert root.attributes["pdserve.request_id"] == request_id
    [attempt] = named(spans, "attempt")
    [route] = named(spans, "route")
    assert parent_of(spans, attempt) is root and parent_of(spans, route) is root
    [prefill] = named(spans, "prefill")
    assert parent_of(spans, prefill) is attempt  # over the router -> prefill gRPC hop
    [decode] = named(spans, "decode")
    assert parent_of(spans, decode) is prefill  # over the prefill -> decode gRPC hop
    assert route.attributes["pdserve.prefill"] == prefill.instance
    assert route.attributes["pdserve.decode"] == decode.instance
    for stage in ("prefill.reserve", "prefill.queue", "prefill.compute", "prefill.handoff"):
        [span] = named(spans, stage)
        assert parent_of(spans, span) is prefill
        assert prefill.start_ns <= span.start_ns <= span.end_ns <= prefill.end_ns
    for stage in ("decode.kv_wait", "decode.admission", "decode.first_step"):
        [span] = named(spans, stage)
        assert parent_of(spans, span) is decode
    [compute] = named(spans, "prefill.compute")
    assert "pdserve.device_hit_tokens" in compute.attributes
    assert decode.attributes["pdserve.output_tokens"] == 8

    # the router kept the same stages for `pdserve admin trace`
    trace = request_trace(up, request_id)
    assert trace.trace_id == CALLER_TRACE and trace.status == "length"
    assert trace.output_tokens == 8 and trace.attempts == 1
    stages = {s.name: s for s in trace.stages}
    assert {"route", "prefill.compute", "kv.transfer", "decode.first_step", "stream"} <= set(stages)
    assert stages["prefill.compute"].instance == prefill.instance
    assert stages["decode.first_step"].instance == decode.instance
    printed = subprocess.run(
        [*CLI, "admin", "trace", request_id, "--config", str(up.config)],
        capture_output=True, text=True, env=up.env, timeout=60,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert f"request {request_id}: length" in printed.stdout
    assert "prefill.compute" in printed.stdout and decode.instance in printed.stdout


def test_a_migrated_request_shows_both_decode_instances(
    traced: tuple[UpCluster, Collector],
) -> None:
    up, collector = traced
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    removed: list[threading.Thread] = []

    def remove_serving_decode(received: int) -> None:
        if received == 5 and not removed:
            removed.append(threading.Thread(target=remove, args=(serving_decode(up),)))
            removed[0].start()

    def remove(name: str) -> None:
        up.admin().RemoveInstance(
            admin_pb2.InstanceRef(name=name), metadata=up.admin_auth, timeout=60
        )

    chunks = streamed(up, body, remove_serving_decode)
    removed[0].join()
    request_id = chunks[0]["id"].removeprefix("cmpl-")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    trace = request_trace(up, request_id)
    assert trace.migrations == 1 and trace.attempts == 2

    def both_decodes(spans: list[ReceivedSpan]) -> bool:
        mine = of_trace(spans, trace.trace_id)
        return len(named(mine, "decode")) == 2 and len(named(mine, "request")) == 1

    spans = of_trace(collector.wait_for(both_decodes), trace.trace_id)
    decodes = named(spans, "decode")
    assert len({d.instance for d in decodes}) == 2
    assert len(named(spans, "attempt")) == 2 and len(named(spans, "migration")) == 1
    wait_for(lambda: len(up.list_instances()) == 2, 60)  # the removed decode is gone


def test_json_logs_name_each_request_and_hold_no_secret(
    traced: tuple[UpCluster, Collector], tmp_path: Path
) -> None:
    up, _ = traced
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{up.router_url}/completions", json=body, timeout=120)
    request_id = reply.json()["id"].removeprefix("cmpl-")
    log = up.config.parent / "up.log"

    def request_line() -> dict[str, Any] | None:
        for line in log.read_text().splitlines():
            if line.startswith("{") and f'"request_id":"{request_id}"' in line:
                entry: dict[str, Any] = json.loads(line)
                if "stages" in entry:
                    return entry
        return None

    wait_for(lambda: request_line() is not None, 30)
    entry = request_line()
    assert entry is not None
    assert entry["level"] == "INFO" and entry["status"] == "length"
    assert entry["output_tokens"] == 4 and entry["trace_id"]
    assert {"route", "prefill.compute", "stream"} <= set(entry["stages"])
    text = log.read_text()
    for secret in ("admin_token", "cluster_secret"):
        assert (up.config.parent / secret).read_text().strip() not in text
    json_lines = [line for line in text.splitlines() if line.startswith("{")]
    assert all(isinstance(json.loads(line), dict) for line in json_lines)
