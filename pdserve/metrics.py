"""Every Prometheus metric pdserve exports, defined once (DESIGN.md §7).

Counters end in `_total`, times are in seconds. Each process exposes its own registry.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """The router's metrics, in a registry of their own (tests build several routers)."""

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
        self.retries = Counter(
            "pdserve_router_retries",
            "Attempts that failed before the first token and were retried.",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdserve_router_in_flight_requests",
            "Requests holding a load lease, by instance.",
            ["instance"],
            registry=self.registry,
        )
        self.indexed_blocks = Gauge(
            "pdserve_router_indexed_blocks",
            "KV blocks the router's index believes each prefill or mixed instance holds.",
            ["instance"],
            registry=self.registry,
        )
