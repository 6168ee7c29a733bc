"""Write the metrics reference, `docs/reference/metrics.md`, from the registries of
`pdserve/metrics.py`: every metric a router or an instance exports, with its type, labels, help
text and buckets, read from a `RouterMetrics` registry, an `InstanceCollector` fed a snapshot with
a storage section, and each role's `StageMetrics`. No list is kept here.

    .venv/bin/python -m scripts.metrics_reference          # rewrite the page
    .venv/bin/python -m scripts.metrics_reference --check  # exit 1 when the page is stale

`tests/unit/test_metrics_reference.py` fails when the committed page differs from `render()`.
"""

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample

from pdserve.config import ROLES
from pdserve.engine.request import StageTimes
from pdserve.instance.runtime import InstanceRuntime
from pdserve.metrics import InstanceCollector, PlannerMetrics, RouterMetrics, StageMetrics
from pdserve.v1 import common_pb2
from scripts.reference_page import one_line, write_or_check
from services.prefill.instance import PrefillInstance, PrefillOutcome, PrefillTimings

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.md"
COMMAND = ".venv/bin/python -m scripts.metrics_reference"

INTRO = """\
# Metrics reference

<!-- Generated from pdserve/metrics.py by `{command}`; do not edit. -->

Every Prometheus metric pdserve exports, generated from the registries of `pdserve/metrics.py`.
The router serves its metrics at `/metrics` on its HTTP port; every instance serves its own on
a port of its own ([where to scrape](../operations/metrics.md)). Names are as scraped:

- a **counter**'s series is its name, ending in `_total`;
- a **histogram** `NAME` is the series `NAME_bucket` (one per upper bound `le`, `+Inf`
  included), `NAME_sum` and `NAME_count`: `rate(NAME_sum[5m]) / rate(NAME_count[5m])` is the
  mean, `histogram_quantile(0.99, sum by (le) (rate(NAME_bucket[5m])))` the 99th percentile;
- the counters and histograms of the router and of the request stages also have a
  `NAME_created` series (when the series started), as prometheus-client adds to its own.

Times are in seconds. [Observability](../operations/observability.md) shows how the stage
histograms add up to a request's time to first token.
"""


@dataclass(frozen=True, slots=True)
class MetricDoc:
    """One metric family as the page lists it."""

    name: str  # as registered: a counter's without `_total`
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, `+Inf` left out
    observed_on: tuple[str, ...] = ()  # a stage histogram: the roles whose instances fill it

    @property
    def scraped(self) -> str:
        """The name a scrape shows (a histogram's, before its suffixes)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    intro: str
    metrics: tuple[MetricDoc, ...]


def _planner_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    PlannerMetrics(registry)
    return registry


def sections() -> list[Section]:
    """The page's sections, one per group of processes that exports the same families."""
    engine, storage = _instance_metrics()
    return [
        Section(
            "Router",
            "Exported by the router, in `pdserve up`'s process; the supervisor, which runs "
            "there too, reports its restarts and dead instances here.",
            tuple(_registry_metrics(RouterMetrics().registry)),
        ),
        Section(
            "SLA planner",
            "Exported on the router's `/metrics` when `planner.enabled`: one decision per "
            "`planner.interval_s`.",
            tuple(_registry_metrics(_planner_registry())),
        ),
        Section(
            "Every instance",
            "Exported by every prefill, decode and mixed instance, built from the same "
            "snapshot as its `GetStats` reply at each scrape.",
            engine,
        ),
        Section(
            "Instances with the storage tier",
            "Exported by the instances that run the storage tier (`storage.enabled`).",
            storage,
        ),
        Section(
            "Request stages",
            "Where an instance's requests spent their time: one histogram per stage, observed "
            "once per request when it ends (on prefill: after its handoff). Every instance "
            "exports them; **observed on** names the roles that record each one (on the "
            "others its series stay at zero, or are absent).",
            _stage_metrics(),
        ),
    ]


def render() -> str:
    """The page. Pure but for building throwaway registries."""
    parts = [INTRO.format(command=COMMAND)]
    for section in sections():
        parts.append(_section(section))
    return "\n".join(parts)


def _section(section: Section) -> str:
    staged = any(metric.observed_on for metric in section.metrics)
    header = "| metric | type | labels | meaning |" + (" observed on |" if staged else "")
    rows = []
    for m in section.metrics:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        row = f"| `{m.scraped}` | {_kind(m)} | {labels} | {one_line(m.help)} |"
        rows.append(row + (f" {', '.join(m.observed_on)} |" if staged else ""))
    return "\n".join(
        [
            f"## {section.title}",
            "",
            one_line(section.intro),
            "",
            header,
            "| --- " * header.count(" |") + "|",
            *rows,
            "",
        ]
    )


# -- reading the registries -------------------------------------------------------------------

# A family and its label names. prometheus-client lists labels on samples only, and a labelled
# metric has none before its first child: the names are read from the objects that keep them.
Labelled = tuple[Metric, tuple[str, ...]]


def _registry_metrics(registry: CollectorRegistry) -> list[MetricDoc]:
    return [_metric(family, labels) for family, labels in _registry_families(registry)]


def _registry_families(registry: CollectorRegistry) -> list[Labelled]:
    """The families `registry` exports, in the order they were registered."""
    families = []
    for collector in registry._collector_to_names:
        assert isinstance(collector, MetricWrapperBase), collector
        families += [(family, tuple(collector._labelnames)) for family in collector.collect()]
    return families


def _instance_metrics() -> tuple[tuple[MetricDoc, ...], tuple[MetricDoc, ...]]:
    """(every instance's families, the storage tier's): from a snapshot without a storage
    section and one with it."""
    bare = common_pb2.InstanceStats(role="prefill")
    with_storage = common_pb2.InstanceStats(role="prefill")
    with_storage.storage.SetInParent()
    engine = [_metric(*_collected(f)) for f in InstanceCollector(lambda: bare).collect()]
    every = [_metric(*_collected(f)) for f in InstanceCollector(lambda: with_storage).collect()]
    return tuple(engine), tuple(m for m in every if m not in engine)


def _collected(family: Metric) -> Labelled:
    assert isinstance(family, CounterMetricFamily | GaugeMetricFamily), family
    return family, tuple(family._labelnames)


def _stage_metrics() -> tuple[MetricDoc, ...]:
    """StageMetrics' families, each with the roles that fill it: every role's StageMetrics
    after the observers its instances run have seen one request whose stages each took a
    second."""
    by_role = {role: _registry_families(_observed_stages(role)) for role in ROLES}
    metrics = []
    for i, (family, labels) in enumerate(by_role[ROLES[0]]):  # every role: the same families
        families = [by_role[role][i][0] for role in ROLES]
        roles = tuple(role for role, f in zip(ROLES, families, strict=True) if _observed(f))
        samples = [sample for f in families for sample in f.samples]
        metrics.append(_metric(family, labels, samples, roles))
    return tuple(metrics)


def _observed_stages(role: str) -> CollectorRegistry:
    """A `role` instance's StageMetrics registry after its kinds of request:
    `InstanceRuntime._observe` of one whose prompt was computed there (decode and mixed) and one
    whose KV came from prefill (decode: `prefill_s` 0) and, on prefill, `PrefillInstance._observe`
    (after each handoff), each run on a stand-in that holds only what it reads."""
    metrics = StageMetrics(role)
    runtime = SimpleNamespace(role=role, stage_metrics=metrics)
    for prefill_s in (1.0, 0.0) if role == "decode" else (1.0,):
        times = StageTimes(
            wait_s=1.0, prefill_s=prefill_s, admission_s=1.0, first_step_s=1.0,
            device_hit_tokens=0, storage_hit_tokens=0,
        )  # fmt: skip
        InstanceRuntime._observe(cast(InstanceRuntime, runtime), times)
    if role == "prefill":
        outcome = PrefillOutcome(
            first_token_id=0, num_prompt_tokens=1, num_cached_tokens=0,
            num_decode_cached_tokens=0, blocks_sent=1, bytes_sent=1,
            timings=PrefillTimings(1.0, 1.0, 1.0, 1.0, 1.0), transport="grpc",
        )  # fmt: skip
        prefill = SimpleNamespace(runtime=runtime)
        PrefillInstance._observe(cast(PrefillInstance, prefill), outcome)
    return metrics.registry


def _observed(family: Metric) -> bool:
    return any(s.name.endswith("_count") and s.value > 0 for s in family.samples)


def _metric(
    family: Metric,
    labels: tuple[str, ...],
    samples: list[Sample] | None = None,
    observed_on: tuple[str, ...] = (),
) -> MetricDoc:
    """`family` as the page lists it; a histogram's buckets from `samples` (default: its
    own)."""
    samples = family.samples if samples is None else samples
    bounds = {float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")}
    buckets = tuple(sorted(bounds - {float("inf")}))
    return MetricDoc(family.name, family.type, labels, family.documentation, buckets, observed_on)


# -- formatting -------------------------------------------------------------------------------


def _kind(metric: MetricDoc) -> str:
    if not metric.buckets:
        return metric.kind
    low, high = (_number(b) for b in (metric.buckets[0], metric.buckets[-1]))
    return f"histogram, {len(metric.buckets)} buckets from {low} to {high}"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(render, PAGE, COMMAND, __doc__ or "", argv)


if __name__ == "__main__":
    raise SystemExit(main())
