"""A request's timeline on the router: the stages instances report, laid out in order, and the
bounded record of recent requests that `pdserve admin trace` reads."""

import pytest

from pdserve.v1 import common_pb2, prefill_pb2
from services.router.timeline import RecentRequests, RequestRecord


def test_prefill_stages_follow_each_other_from_the_dispatch() -> None:
    record = RequestRecord("r", 70, arrival=100.0)
    result = prefill_pb2.PrefillResult(
        num_device_hit_tokens=32, kv_bytes_sent=4096, kv_blocks_sent=2, transport="shm",
        timings=prefill_pb2.PrefillTimings(reserve_s=0.01, queue_s=0.02, compute_s=0.03,
                                           transfer_s=0.004, handoff_s=0.001),
    )  # fmt: skip
    end = record.prefill_reported(result, "p:1", dispatched=100.5)
    assert end == pytest.approx(100.565)
    trace = record.to_proto()
    starts = {s.name: (s.start_s, s.duration_s) for s in trace.stages}
    assert starts["prefill.reserve"] == pytest.approx((0.5, 0.01))
    assert starts["prefill.compute"] == pytest.approx((0.53, 0.03))
    assert starts["prefill.handoff"] == pytest.approx((0.564, 0.001))
    [transfer] = [s for s in trace.stages if s.name == "kv.transfer"]
    assert transfer.instance == "p:1"
    assert dict(transfer.attributes) == {"transport": "shm", "bytes": "4096", "blocks": "2"}


def test_decode_stages_sit_around_the_first_token() -> None:
    record = RequestRecord("r", 8, arrival=0.0)
    timings = common_pb2.StageTimings(wait_s=0.2, admission_s=0.01, first_step_s=0.03)
    record.stream_reported(timings, "d:1", "decode", first_token=1.0)
    stages = {s.name: (s.start, s.duration_s) for s in record.stages}
    assert stages["decode.kv_wait"] == pytest.approx((0.8, 0.2))
    assert stages["decode.admission"] == pytest.approx((1.0, 0.01))
    assert stages["decode.first_step"] == pytest.approx((1.01, 0.03))


def test_a_mixed_instance_reports_its_queue_and_compute_with_its_hits() -> None:
    record = RequestRecord("r", 8, arrival=0.0)
    timings = common_pb2.StageTimings(wait_s=0.1, prefill_s=0.3, device_hit_tokens=16)
    record.stream_reported(timings, "m:1", "mixed", first_token=1.0)
    stages = {s.name: s for s in record.stages}
    assert set(stages) == {"mixed.queue", "mixed.compute"}  # no second token: no first step
    assert stages["mixed.queue"].start == pytest.approx(0.6)
    assert stages["mixed.compute"].attributes["device_hit_tokens"] == "16"


def test_the_recent_requests_keep_the_running_and_the_last_finished() -> None:
    recent = RecentRequests(capacity=2)
    records = [RequestRecord(f"r{i}", 1, arrival=0.0) for i in range(4)]
    for record in records:
        recent.started(record)
    assert recent.get("r3") is records[3]  # running
    for record in records[:3]:
        record.finish("stop")
        recent.finished(record)
    assert recent.get("r0") is None  # the oldest finished one went
    assert recent.get("r1") is records[1] and recent.get("r2") is records[2]
    assert recent.get("r3") is records[3]
    assert recent.get("r1").to_proto().status == "stop"  # type: ignore[union-attr]


def test_keeping_none_forgets_a_request_once_it_finishes() -> None:
    recent = RecentRequests(capacity=0)
    record = RequestRecord("r", 1, arrival=0.0)
    recent.started(record)
    recent.finished(record)
    assert recent.get("r") is None
