"""`pdserve top`: snapshots built from real ListInstances replies and real router metrics text
(a `RouterMetrics` registry exported by prometheus-client), and the view rendered from them."""

import io
import re

from prometheus_client import generate_latest
from rich.console import Console, RenderableType

from pdserve.metrics import LATENCY_BUCKETS, RouterMetrics
from pdserve.v1 import admin_pb2, common_pb2
from services.controller.top import (
    Histogram,
    Latency,
    Snapshot,
    rate,
    render,
    requests_per_s,
    tokens_per_s,
)


def reply(prefill_computed: int, decode_computed: int) -> admin_pb2.ListInstancesReply:
    """prefill-0: 25 of 100 blocks used, 80 of 200 prompt tokens hit (50 device, 30 storage);
    decode-0 drained, 2 reservations; mixed-0 dead (no stats)."""
    prefill = common_pb2.InstanceStats(
        role="prefill",
        num_blocks=100,
        num_free_blocks=75,
        num_running=3,
        num_waiting=4,
        prefix_cache_queries=200,
        device_hit_tokens=50,
        storage=common_pb2.StorageStats(storage_hit_tokens=30),
        num_computed_tokens=prefill_computed,
    )
    decode = common_pb2.InstanceStats(
        role="decode",
        num_blocks=400,
        num_free_blocks=300,
        num_running=5,
        num_reservations=2,
        num_computed_tokens=decode_computed,
    )
    return admin_pb2.ListInstancesReply(
        instances=[
            admin_pb2.InstanceInfo(name="decode-0", role="decode", alive=True, drained=True,
                                   stats=decode),
            admin_pb2.InstanceInfo(name="mixed-0", role="mixed", alive=False, restarts=2),
            admin_pb2.InstanceInfo(name="prefill-0", role="prefill", alive=True, restarts=1,
                                   stats=prefill),
        ]
    )  # fmt: skip


def metrics_text(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def text_of(view: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(view)
    return out.getvalue()


def row(text: str, name: str) -> list[str]:
    """The non-empty cells of the table row that starts with `name` (cells are at least two
    spaces apart, words within one a single space)."""
    [line] = [line for line in text.splitlines() if line.strip().startswith(name)]
    return re.split(r"\s{2,}", line.strip())


def test_instances_show_kv_use_hit_rate_and_state_by_role() -> None:
    snapshot = Snapshot.build(reply(1000, 500), metrics_text(RouterMetrics()), taken_at=10.0)
    text = text_of(render(snapshot))
    prefill, decode, mixed = row(text, "prefill-0"), row(text, "decode-0"), row(text, "mixed-0")
    # name, role, state, restarts, running, waiting, KV blocks, hit rate, tokens/s, reservations
    # (no reservations cell on prefill-0: not a decode instance)
    assert prefill == ["prefill-0", "prefill", "alive", "1", "3", "4", "25/100 (25%)", "40.0%",
                       "-"]  # fmt: skip
    assert decode == ["decode-0", "decode", "drained", "0", "5", "0", "100/400 (25%)", "-", "-",
                      "2"]  # fmt: skip
    assert mixed == ["mixed-0", "mixed", "dead", "2", *["-"] * 6]
    lines = text.splitlines()
    order = [next(i for i, line in enumerate(lines) if name in line)
             for name in ("prefill-0", "mixed-0", "decode-0")]  # fmt: skip
    assert order == sorted(order)


def test_tokens_and_requests_per_second_come_from_two_snapshots() -> None:
    metrics = RouterMetrics()
    metrics.requests.labels("/v1/completions", "200").inc(10)
    before = Snapshot.build(reply(1000, 500), metrics_text(metrics), taken_at=10.0)
    metrics.requests.labels("/v1/completions", "200").inc(5)
    metrics.requests.labels("/v1/chat/completions", "400").inc(3)
    after = Snapshot.build(reply(2000, 800), metrics_text(metrics), taken_at=12.0)
    assert tokens_per_s(after, before) == {"prefill-0": 500.0, "decode-0": 150.0}
    assert requests_per_s(after, before) == 4.0
    text = text_of(render(after, before))
    assert row(text, "prefill-0")[8] == "500.0" and row(text, "decode-0")[8] == "150.0"
    assert row(text, "requests/s")[1] == "4.00"


def test_a_counter_that_went_down_counts_from_zero_after_its_reset() -> None:
    assert rate(300.0, 100.0, 2.0) == 100.0
    assert rate(40.0, 100.0, 2.0) == 20.0


def test_latency_quantiles_fall_in_the_bucket_that_holds_them() -> None:
    metrics = RouterMetrics()
    for _ in range(90):
        metrics.ttft.observe(0.02)  # (0.01, 0.025]
    for _ in range(10):
        metrics.ttft.observe(3.0)  # (2.5, 5]
    snapshot = Snapshot.build(reply(0, 0), metrics_text(metrics), taken_at=1.0)
    ttft = snapshot.router.ttft
    assert ttft.count == 100 and ttft.bounds == (*LATENCY_BUCKETS, float("inf"))
    p50, p99 = ttft.quantile(0.5), ttft.quantile(0.99)
    assert p50 is not None and 0.01 < p50 <= 0.025
    assert p99 is not None and 2.5 < p99 <= 5.0
    assert snapshot.router.inter_token.quantile(0.5) is None  # nothing observed
    router = text_of(render(snapshot))
    assert row(router, "TTFT")[1:] == [f"{p50 * 1000:.1f} ms / {p99 * 1000:.1f} ms", "since start"]
    assert row(router, "ITL")[1:] == ["- / -", "since start"]


def test_a_quantile_beyond_the_last_finite_bucket_is_that_bound() -> None:
    metrics = RouterMetrics()
    metrics.inter_token.observe(100.0)
    snapshot = Snapshot.build(reply(0, 0), metrics_text(metrics), taken_at=1.0)
    assert snapshot.router.inter_token.quantile(0.99) == LATENCY_BUCKETS[-1]


def test_recent_latency_is_the_difference_of_two_scrapes_else_cumulative() -> None:
    metrics = RouterMetrics()
    for _ in range(50):
        metrics.ttft.observe(0.02)
    before = Snapshot.build(reply(0, 0), metrics_text(metrics), taken_at=1.0)
    for _ in range(5):
        metrics.ttft.observe(3.0)
    after = Snapshot.build(reply(0, 0), metrics_text(metrics), taken_at=2.5)
    recent = Latency.of(after.router.ttft, before.router.ttft, 1.5)
    assert recent.window == "last 1.5 s"
    assert recent.p50 is not None and 2.5 < recent.p50 <= 5.0  # only the 5 slow ones
    overall = after.router.ttft.quantile(0.5)
    assert overall is not None and overall <= 0.025  # dominated by the 50 fast ones
    idle = Latency.of(after.router.ttft, after.router.ttft, 1.5)  # nothing new: since start
    assert (idle.p50, idle.window) == (overall, "since start")
    assert row(text_of(render(after, before)), "TTFT")[2] == "last 1.5 s"


def test_histogram_since_a_scrape_before_a_reset_is_everything_observed() -> None:
    earlier = Histogram((0.1, float("inf")), (8.0, 10.0))
    later = Histogram((0.1, float("inf")), (2.0, 3.0))  # the router restarted
    assert later.since(earlier) == later
    assert Histogram((0.1, float("inf")), (9.0, 14.0)).since(earlier).counts == (1.0, 4.0)


def test_router_section_shows_running_migrations_retries_queued_and_rejected() -> None:
    metrics = RouterMetrics()
    metrics.running.set(7)
    metrics.migrations.labels("instance_lost").inc(2)
    metrics.migrations.labels("step_failed").inc(1)
    metrics.retries.inc(4)
    metrics.rejections.labels("queue_full", "").inc(4)
    metrics.rejections.labels("rate_limited", "team-a").inc(2)
    metrics.queue_length.set(5)
    text = text_of(render(Snapshot.build(reply(0, 0), metrics_text(metrics), taken_at=1.0)))
    assert row(text, "running generations")[1] == "7"
    assert row(text, "migrations")[1] == "3"
    assert row(text, "retries")[1] == "4"
    assert row(text, "rejected")[1] == "6"
    assert row(text, "queued")[1] == "5"
    assert row(text, "requests/s")[1] == "-"  # one snapshot: no rate yet


def test_router_replicas_metrics_add_up() -> None:
    first, second = RouterMetrics(), RouterMetrics()  # two router processes (router.replicas)
    first.running.set(3)
    second.running.set(4)
    first.retries.inc(2)
    second.rejections.labels("queue_full", "").inc(5)
    for _ in range(10):
        first.ttft.observe(0.02)
    for _ in range(30):
        second.ttft.observe(3.0)
    snapshot = Snapshot.build(reply(0, 0), [metrics_text(first), metrics_text(second)], 1.0)
    router = snapshot.router
    assert (router.running, router.retries, router.rejected) == (7, 2, 5)
    assert router.ttft.count == 40
    p50 = router.ttft.quantile(0.5)
    assert p50 is not None and p50 > 2.0  # three quarters of the observations are the slow ones
