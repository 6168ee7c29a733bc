"""Every Prometheus metric pdserve exports, each defined and exported once.

Counters end in `_total`, times are in seconds. Each process exposes its own registry.
"""

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.v1 import common_pb2

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a step's or a stage's time: from a fraction of a millisecond up
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB


class RouterMetrics:
    """The router's metrics, in a registry of their own (tests build several routers).

    Thread-safe (prometheus-client metrics): request handlers and the router's threads update
    it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests",
            "Requests answered by the router, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Time between consecutive streamed token chunks.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_latency_seconds",
            "Time from request arrival to the last token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "pdserve_router_decisions",
            "Prefill routing decisions, by policy and reason.",
            ["policy", "reason"],
            registry=self.registry,
        )
        self.disaggregation = Counter(
            "pdserve_router_disaggregation",
            "Where PD requests' prompts were computed (router.disaggregation): remote (a "
            "prefill instance, the KV moved to decode) or local (the decode instance itself).",
            ["path"],
            registry=self.registry,
        )
        self.kv_pulls = Counter(
            "pdserve_router_kv_pulls",
            "Attempts whose prefill instance was told to pull the prompt's cached prefix from "
            "a decode instance (router.kv_pull_min_tokens).",
            registry=self.registry,
        )
        self._add_failure_metrics()
        self.in_flight = Gauge(
            "pdserve_router_in_flight_requests",
            "Requests holding a load lease, by instance.",
            ["backend"],
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "pdserve_router_queue_seconds",
            "Time from request arrival to its first attempt's dispatch (edge checks, hashing, "
            "routing).",
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pdserve_router_time_per_output_token_seconds",
            "Per request: (end-to-end time - time to first token) / (output tokens - 1).",
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.message_time = Histogram(
            "pdserve_router_message_seconds",
            "One message between the router and an instance, one way, per PD request: half "
            "its Prefill call's round trip less the time prefill reported spending on it (the "
            "hop the planner's simulations charge each message).",
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self._add_index_metrics()
        self._add_admission_metrics()

    def forget_instance(self, address: str) -> None:
        """Drop the series of an instance no longer routed to (a restarted one comes back at
        another address): no stale gauge, no series left behind by every restart."""
        for metric in (self.in_flight, self.indexed_blocks, self.circuit_state, self.circuit_opens):
            with contextlib.suppress(KeyError):
                metric.remove(address)

    def _add_failure_metrics(self) -> None:
        """Retries, migrations and the supervisor's restarts."""
        self.retries = Counter(
            "pdserve_router_retries",
            "Attempts that failed before the first token and were retried.",
            registry=self.registry,
        )
        self.running = Gauge(
            "pdserve_router_running_generations",
            "Generations the router is running (limit: router.max_concurrent_requests).",
            registry=self.registry,
        )
        # the supervisor of `pdserve up` runs next to the router and reports here
        self.instance_restarts = Counter(
            "pdserve_router_instance_restarts",
            "Dead instances the supervisor recreated, by instance name and role.",
            ["name", "role"],
            registry=self.registry,
        )
        self.dead_instances = Gauge(
            "pdserve_router_dead_instances",
            "Instances out of routing because their actor died (restarting, or out of budget).",
            registry=self.registry,
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Streams that continued on another instance, by reason: instance_lost and "
            "step_failed (theirs failed), moved (moved off a drained decode instance).",
            ["reason"],
            registry=self.registry,
        )
        self.moved_context_tokens = Counter(
            "pdserve_router_moved_context_tokens",
            "Prompt and generated tokens of the streams moved off drained decode instances: the "
            "context whose KV the next prefill reads back instead of computing.",
            registry=self.registry,
        )

    def _add_index_metrics(self) -> None:
        """The router's copy of each instance's cache (its size, resyncs, predicted and
        actual hits) and the instances' circuit breakers."""
        self.indexed_blocks = Gauge(
            "pdserve_router_indexed_blocks",
            "KV blocks the router's index believes each prefill or mixed instance holds.",
            ["backend"],
            registry=self.registry,
        )
        self.circuit_state = Gauge(
            "pdserve_router_circuit_state",
            "Each instance's circuit breaker: 0 closed (routed to), 1 open (skipped after "
            "router.breaker_failures failures in a row), 2 half-open (one probe request out).",
            ["backend"],
            registry=self.registry,
        )
        self.circuit_opens = Counter(
            "pdserve_router_circuit_opens",
            "Times an instance's circuit breaker opened (its failures in a row, or a failed "
            "probe).",
            ["backend"],
            registry=self.registry,
        )
        self.kv_index_resyncs = Counter(
            "pdserve_router_kv_index_resyncs",
            "Times the router resynchronised its copy of an instance's published blocks, by "
            "reason: gap (an event missing), duplicate (one seen twice), reorder (a report "
            "out of order), epoch (the instance restarted), digest (the copy drifted from the "
            "instance's digest), disconnect (the stream broke).",
            ["reason"],
            registry=self.registry,
        )
        self.kv_index_snapshots = Counter(
            "pdserve_router_kv_index_snapshots",
            "Snapshots of an instance's published blocks the router rebuilt its copy from "
            "(every subscription's first, and a resync the instance could not replay).",
            registry=self.registry,
        )
        self.predicted_hit_tokens = Counter(
            "pdserve_router_predicted_hit_tokens",
            "Prompt tokens the router's index predicted the chosen instance held, per routed "
            "attempt that reported back (compare with pdserve_router_actual_hit_tokens).",
            registry=self.registry,
        )
        self.actual_hit_tokens = Counter(
            "pdserve_router_actual_hit_tokens",
            "Prompt tokens the chosen instance found in its device prefix cache, per routed "
            "attempt that reported back.",
            registry=self.registry,
        )

    def _add_admission_metrics(self) -> None:
        """The admission queue and what the edge refuses (429, 401), by API key."""
        self.rejections = Counter(
            "pdserve_router_rejections",
            "Requests refused at the router's edge, by reason (queue_full, queue_timeout: 429 "
            "from the admission queue; rate_limited: 429, the API key's rate; unauthenticated: "
            "401) and API key name (empty without keys).",
            ["reason", "key"],
            registry=self.registry,
        )
        self.queue_length = Gauge(
            "pdserve_router_queue_length",
            "Requests waiting in the router's admission queue (every candidate saturated).",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "pdserve_router_queue_wait_seconds",
            "How long requests that queued waited in the admission queue before routing.",
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.key_requests = Counter(
            "pdserve_router_key_requests",
            "Requests admitted per API key name (with router.api_keys).",
            ["key"],
            registry=self.registry,
        )


class PlannerMetrics:
    """The SLA planner's decisions, in the router's registry (`pdserve up` serves both on the
    router's /metrics). Thread-safe (prometheus-client metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pdserve_planner_decisions",
            "The planner's interval decisions, by action: hold (the split stays), wait "
            "(cooling down, or an instance not serving yet), change (roles or instances "
            "changed), failed (a change stopped part way).",
            ["action"],
            registry=registry,
        )
        self.target = Gauge(
            "pdserve_planner_target_instances",
            "Instances per role of the split the planner chose last.",
            ["role"],
            registry=registry,
        )
        self.predicted = Gauge(
            "pdserve_planner_predicted_p90_seconds",
            "The chosen split's predicted p90 of TTFT (ttft) and of time per output token "
            "(itl) for the next interval.",
            ["metric"],
            registry=registry,
        )
        self.observed = Gauge(
            "pdserve_planner_observed_p90_seconds",
            "The last interval's measured p90 of TTFT (ttft) and of time per output token "
            "(itl), next to the prediction made for it.",
            ["metric"],
            registry=registry,
        )
        self.unreachable = Gauge(
            "pdserve_planner_slo_unreachable",
            "1 when no split within the planner's bounds is predicted to meet the targets (it "
            "holds the best one), else 0.",
            registry=registry,
        )

    def observe(self, decision: Any) -> None:
        """One `services.planner.planner.Decision`."""
        self.decisions.labels(decision.action).inc()
        self.target.labels("prefill").set(decision.target.prefill)
        self.target.labels("decode").set(decision.target.decode)
        self.unreachable.set(1.0 if decision.unreachable else 0.0)
        for gauge, prediction in ((self.predicted, decision.predicted),
                                  (self.observed, decision.observed)):  # fmt: skip
            if prediction is not None:
                gauge.labels("ttft").set(prediction.ttft_p90_s)
                gauge.labels("itl").set(prediction.itl_p90_s)


class StageMetrics:
    """Where an instance's requests spent their time, one histogram per stage, labelled with
    the role the instance serves now (`role`). Prefill: reservation wait, queue, prefill, KV
    transfer (time and bytes, by transport); mixed: queue, prefill, admission, first step;
    decode: KV wait, admission, first step. Thread-safe (prometheus-client metrics); observed
    once per request when it ends (prefill: after its handoff)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()

        def stage(name: str, doc: str) -> Any:
            return Histogram(name, doc, ["role"], buckets=STAGE_BUCKETS, registry=self.registry)

        self._histograms = {
            "reservation_wait": stage(
                "pdserve_reservation_wait_seconds",
                "Prefill: preallocation here and the decode instance's reservation (with its "
                "backoff while decode refuses).",
            ),
            "queue": stage(
                "pdserve_request_queue_seconds",
                "Arrival at the instance until the request's first engine step.",
            ),
            "prefill": stage(
                "pdserve_request_prefill_seconds",
                "The prompt's engine steps, from the first until its first token.",
            ),
            "kv_wait": stage(
                "pdserve_request_kv_wait_seconds",
                "Decode: from the reservation until the first-token handoff (the KV arriving).",
            ),
            "admission": stage(
                "pdserve_request_decode_admission_seconds",
                "From the first token (computed here, or handed over) until the engine step "
                "that makes the next token starts.",
            ),
            "first_step": stage(
                "pdserve_request_first_decode_step_seconds",
                "The engine step that makes a request's second token.",
            ),
        }
        self._transfer_time = Histogram(
            "pdserve_kv_transfer_duration_seconds",
            "Per request: the time its KV blocks took to reach decode, by transport.",
            ["role", "transport"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self._transfer_bytes = Histogram(
            "pdserve_kv_transfer_request_bytes",
            "Per request: the KV bytes sent to decode, by transport.",
            ["role", "transport"],
            buckets=BYTE_BUCKETS,
            registry=self.registry,
        )

    def observe(self, stage: str, seconds: float) -> None:
        """One request's time in `stage` (a key of the histograms above)."""
        self._histograms[stage].labels(self.role).observe(seconds)

    def observe_transfer(self, transport: str, seconds: float, num_bytes: int) -> None:
        self._transfer_time.labels(self.role, transport).observe(seconds)
        self._transfer_bytes.labels(self.role, transport).observe(num_bytes)


StatsSource = Callable[[], common_pb2.InstanceStats]


class InstanceCollector(Collector):
    """An instance's metrics, read from its `GetStats` snapshot at scrape time (the engine's
    counters live on its thread; one snapshot per scrape keeps them consistent).

    Hit rate is exported as counters of prompt tokens, each request counted once at admission:
    rate(pdserve_prefix_cache_hits_total[5m]) / rate(pdserve_prefix_cache_queries_total[5m]).
    """

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: nothing to describe up front

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        for kind, name, doc, labels, values in _families(s):
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, doc, labels=["role", *labels])
            for label_values, value in values.items():
                family.add_metric([s.role, *label_values], value)
            yield family
        if s.HasField("step_time"):
            yield _step_time_errors(s.role, s.step_time)


def _step_time_errors(role: str, fit: common_pb2.StepTimeFit) -> Metric:
    """The step time model's relative errors as a histogram (cumulative buckets)."""
    family = HistogramMetricFamily(
        "pdserve_step_time_error_ratio",
        "Per engine step: |predicted - measured| / measured step time, the prediction made by "
        "the instance's step time model before the step ran.",
        labels=["role"],
    )
    bounds = [*(str(b) for b in fit.error_bounds), "+Inf"]
    cumulative = list(itertools.accumulate(fit.error_counts))
    family.add_metric([role], list(zip(bounds, cumulative, strict=True)), fit.error_sum)
    return family


# (kind, name, help, labels besides role, {label values: value}) of one instance family
Family = tuple[str, str, str, tuple[str, ...], Mapping[tuple[str, ...], float]]


def _families(s: common_pb2.InstanceStats) -> list[Family]:
    """The engine's and transfers' families, and the storage tier's when it runs."""
    storage = _storage_families(s.storage) if s.HasField("storage") else []
    return [*_engine_families(s), *storage]


def _engine_families(s: common_pb2.InstanceStats) -> list[Family]:
    sent: dict[tuple[str, ...], float] = {
        ("sent", t): v for t, v in s.kv_bytes_sent_by_transport.items()
    }
    return [
        ("counter", "pdserve_prefix_cache_queries",
         "Prompt tokens of admitted requests (each request once).", (),
         {(): s.prefix_cache_queries}),
        ("counter", "pdserve_prefix_cache_hits",
         "Of those prompt tokens, the ones found in a cache tier (device, a decode "
         "instance's cache, storage).", ("tier",),
         {("device",): s.device_hit_tokens, ("peer",): s.peer_hit_tokens,
          ("storage",): s.storage.storage_hit_tokens}),
        ("counter", "pdserve_prompt_tokens_by_source",
         "Prompt tokens by where their KV came from: computed here, device_hit (this "
         "instance's prefix cache), peer_hit (pulled from a decode instance), storage_hit (the "
         "storage tier), transferred (received from prefill, in whole blocks).", ("source",),
         {("computed",): max(0, s.prefix_cache_queries - s.device_hit_tokens
                             - s.peer_hit_tokens - s.storage.storage_hit_tokens),
          ("device_hit",): s.device_hit_tokens, ("peer_hit",): s.peer_hit_tokens,
          ("storage_hit",): s.storage.storage_hit_tokens,
          ("transferred",): s.kv_blocks_received * s.block_size}),
        ("counter", "pdserve_kv_pull_failures",
         "Pulls of a prompt's prefix from a decode instance that failed or came back short "
         "(the rest was computed).", (), {(): s.kv_pull_failures}),
        ("counter", "pdserve_kv_blocks_served",
         "KV blocks this instance sent to prefill instances that pulled them (ReadKV).", (),
         {(): s.kv_blocks_served}),
        ("counter", "pdserve_preemptions", "Requests preempted for lack of KV blocks.", (),
         {(): s.num_preemptions}),
        ("counter", "pdserve_computed_tokens", "Tokens run through forward passes.", (),
         {(): s.num_computed_tokens}),
        ("counter", "pdserve_engine_steps", "Engine steps run (one batch each).", (),
         {(): s.num_steps}),
        ("gauge", "pdserve_step_time_coefficient",
         "The step time model's seconds per unit of each feature of a step's batch: constant "
         "(per step), prefill_tokens, prefill_attention (per 1k token pairs), decode_rows, "
         "decode_context (per 1k KV tokens attended).", ("feature",),
         {(name,): value for name, value in s.step_time.coefficients.items()}),
        ("counter", "pdserve_engine_step_seconds",
         "Wall seconds of the engine's steps (schedule, forward pass, update).", (),
         {(): s.step_seconds}),
        ("gauge", "pdserve_kv_blocks",
         "KV blocks: used (referenced by requests), free (reusable, cached ones included), "
         "cached (published in the prefix cache, used or not).", ("state",),
         {("used",): s.num_blocks - s.num_free_blocks, ("free",): s.num_free_blocks,
          ("cached",): s.num_cached_blocks}),
        ("gauge", "pdserve_running_requests", "Requests in the running batch.", (),
         {(): s.num_running}),
        ("gauge", "pdserve_waiting_requests", "Requests waiting for admission.", (),
         {(): s.num_waiting}),
        ("gauge", "pdserve_reservations", "Decode reservations awaiting their KV.", (),
         {(): s.num_reservations}),
        ("counter", "pdserve_kv_transfer_bytes",
         "KV bytes moved between instances, by direction and transport.",
         ("direction", "transport"), {**sent, ("received", "any"): s.kv_bytes_received}),
        ("counter", "pdserve_kv_transfer_seconds",
         "Seconds spent sending KV blocks, by transport.", ("transport",),
         {(t,): v for t, v in s.kv_transfer_seconds_by_transport.items()}),
        ("counter", "pdserve_kv_transfer_failures", "KV transfers that failed, by transport.",
         ("transport",), {(t,): v for t, v in s.kv_transfer_failures_by_transport.items()}),
        ("gauge", "pdserve_tensor_parallel_ranks", "Ranks (devices) this instance runs on.", (),
         {(): s.tensor_parallel_size or 1}),
        ("counter", "pdserve_tp_collective_seconds",
         "Seconds rank 0 spent in tensor-parallel collectives (the step broadcast, all-reduces, "
         "the logits gather), waits for the other ranks included.", (),
         {(): s.tp_collective_seconds}),
    ]  # fmt: skip


def _storage_families(st: common_pb2.StorageStats) -> list[Family]:
    return [
        ("gauge", "pdserve_storage_available", "1 while the storage tier's Redis answers.", (),
         {(): 1.0 if st.available else 0.0}),
        ("counter", "pdserve_storage_blocks_read", "Blocks read from the storage tier.", (),
         {(): st.blocks_read}),
        ("counter", "pdserve_storage_blocks_written", "Blocks written to the storage tier.", (),
         {(): st.blocks_written}),
        ("counter", "pdserve_storage_bytes_read", "Bytes read from the storage tier.", (),
         {(): st.bytes_read}),
        ("counter", "pdserve_storage_bytes_written", "Bytes written to the storage tier.", (),
         {(): st.bytes_written}),
        ("counter", "pdserve_storage_errors",
         "Storage tier failures: read (a stored block with a bad checksum or missing bytes: "
         "recomputed), invalid_entry (an index entry or garbage key refused by its checks: "
         "malformed, another tag or block; never followed), write, redis (unreachable), "
         "dropped (write queue full or tier down).", ("kind",),
         {("read",): st.read_errors, ("invalid_entry",): st.invalid_entries,
          ("write",): st.write_errors, ("redis",): st.redis_errors,
          ("dropped",): st.writes_dropped}),
        ("gauge", "pdserve_storage_queue_depth", "Storage jobs waiting for the writer.", (),
         {(): st.queue_depth}),
    ]  # fmt: skip


def serve_metrics(*collectors: Collector, host: str, port: int = 0) -> tuple[Any, int]:
    """Serve `collectors` at http://host:port/metrics on a thread; returns (server, bound
    port)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
