"""`pdserve simulate`: the replay against its references, trace parsing, and the command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.errors import InvalidRequestError
from services.simulator.optimum import belady, unlimited
from services.simulator.replay import SimConfig, Simulation
from services.simulator.trace import conversations, documents, load_trace

INSTANT = {"prefill_tokens_per_s": 1e12, "time_per_output_token_s": 0.0}  # no concurrency


@pytest.mark.parametrize("workload", [conversations, documents])
def test_a_cache_that_never_evicts_hits_what_the_unlimited_reference_hits(workload: object) -> None:
    records = workload(1500, seed=3)  # type: ignore[operator]
    distinct = len({h for r in records for h in r.hash_ids})
    for policy in ("lru", "lrfu"):
        result = Simulation(SimConfig(distinct + 64, eviction=policy, **INSTANT)).run(records)
        assert result.cluster.rates()["total"] == pytest.approx(
            unlimited(records, 512).rates()["total"]
        )


@pytest.mark.parametrize("workload", [conversations, documents])
def test_belady_bounds_every_policy_and_more_cache_never_hurts_it(workload: object) -> None:
    records = workload(1500, seed=4)  # type: ignore[operator]
    optimum = [belady(records, 512, c).rates()["total"] for c in (64, 256, 1024)]
    assert optimum == sorted(optimum) and optimum[0] < optimum[-1]
    for capacity, best in zip((64, 256, 1024), optimum, strict=True):
        for policy in ("lru", "lrfu"):
            rate = Simulation(SimConfig(capacity, eviction=policy, **INSTANT)).run(records)
            assert rate.cluster.rates()["total"] <= best + 1e-9


def test_storage_catches_what_the_device_evicts_and_routing_keeps_prefixes_home() -> None:
    records = conversations(2000, seed=5)
    device_only = Simulation(SimConfig(128)).run(records).cluster.rates()
    tiered = Simulation(SimConfig(128, storage_blocks=100_000)).run(records).cluster.rates()
    # the device side barely moves (faster prefills from storage change only the timing)
    assert tiered["device"] == pytest.approx(device_only["device"], abs=0.01)
    assert tiered["storage"] > 0.1 and tiered["total"] > device_only["total"]
    spread = Simulation(SimConfig(512, instances=4, routing="round_robin")).run(records)
    aware = Simulation(SimConfig(512, instances=4, routing="cache_aware")).run(records)
    assert aware.cluster.rates()["total"] > spread.cluster.rates()["total"]
    assert sum(t.requests for t in aware.per_instance) == aware.cluster.requests


def test_a_trace_round_trips_and_a_bad_line_is_named(tmp_path: Path) -> None:
    records = documents(20, seed=1)
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": r.timestamp_ms, "input_length": r.input_length,
         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
        for r in records
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert load_trace(path) == sorted(records, key=lambda r: r.timestamp_ms)
    path.write_text(path.read_text() + '{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(InvalidRequestError, match=r"t.jsonl:21: not a trace record"):
        load_trace(path)


def test_pdserve_simulate_prints_the_grid_and_writes_json_and_a_plot(tmp_path: Path) -> None:
    report, picture = tmp_path / "r.json", tmp_path / "p.png"
    command = [sys.executable, "-m", "services.controller.cli", "simulate", "documents",
               "--requests", "600", "--device-blocks", "64,256", "--storage-blocks", "0,1024",
               "--instances", "1,2", "--json", str(report), "--plot", str(picture)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Belady" in done.stdout and "vs belady" in done.stdout
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # device x storage x instances x eviction policies
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([*command[:4], "nowhere.jsonl"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no trace file" in bad.stderr and "Traceback" not in bad.stderr
