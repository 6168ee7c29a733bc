"""The metrics reference (docs/reference/metrics.md) is generated from pdserve/metrics.py's
registries: the committed page must be what the generator writes today, and it must name every
series a scrape of the router or an instance can show."""

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.config import ROLES
from pdserve.metrics import InstanceCollector, PlannerMetrics, RouterMetrics, StageMetrics
from pdserve.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("_bucket", "_sum", "_count")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "metrics_reference", ROOT / "scripts" / "metrics_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exported_names() -> set[str]:
    """Every name in the `# TYPE` lines of a router's and each role's instance scrape
    (counters as `_total`), the storage tier's families included, and prometheus-client's
    `_created` gauges left out (the page describes them once)."""
    stats = common_pb2.InstanceStats(role="decode")
    stats.storage.SetInParent()
    instance = CollectorRegistry(auto_describe=False)
    instance.register(InstanceCollector(lambda: stats))
    router = RouterMetrics()
    PlannerMetrics(router.registry)  # `pdserve up` serves them on the router's /metrics
    registries = [router.registry, instance, *(StageMetrics(r).registry for r in ROLES)]
    names = set()
    for registry in registries:
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.add(f"{name.removesuffix('_total')}_total" if kind == "counter" else name)
    created = {name for name in names if name.endswith("_created")}
    assert created and all(
        name.removesuffix("_created") in names or name.replace("_created", "_total") in names
        for name in created
    )
    return names - created


def test_the_committed_page_is_current() -> None:
    generator = _generator()
    page = generator.PAGE.read_text() if generator.PAGE.exists() else ""
    assert page == generator.render(), (
        f"{generator.PAGE.relative_to(ROOT)} is stale: run `{generator.COMMAND}` and commit it"
    )


def test_every_exported_metric_has_a_row() -> None:
    page = _generator().render()
    names = _exported_names()
    assert "pdserve_router_queue_seconds" in names  # the scrape covers the router,
    assert "pdserve_prompt_tokens_by_source_total" in names  # the instances,
    assert "pdserve_storage_errors_total" in names  # their storage tier
    assert "pdserve_kv_transfer_duration_seconds" in names  # and the stage histograms
    for name in names:
        assert f"| `{name}` |" in page, f"{name} is exported but not on the reference page"
    rows = re.findall(r"^\| `(pdserve_[a-z0-9_]+)` \|", page, re.MULTILINE)
    assert sorted(rows) == sorted(names), "a row names no exported metric, or one appears twice"


def test_the_stage_histograms_name_the_roles_that_observe_them() -> None:
    page = _generator().render()
    rows = {
        row.split(" | ")[0].strip("| `"): row for row in page.splitlines() if "_seconds`" in row
    }
    assert rows["pdserve_reservation_wait_seconds"].endswith("| prefill |")
    assert rows["pdserve_request_kv_wait_seconds"].endswith("| decode |")
    # a decode instance computes a prompt itself when the router chose local prefill
    assert rows["pdserve_request_prefill_seconds"].endswith("| prefill, decode, mixed |")
    assert rows["pdserve_request_first_decode_step_seconds"].endswith("| decode, mixed |")


def test_every_metric_the_dashboard_queries_is_on_the_page() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}
    page = _generator().PAGE.read_text()
    assert used
    for name in used:
        base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
        assert f"| `{base}` |" in page, f"the dashboard queries {name}, which no process exports"
