"""The SLA planner in the latency simulator: the real planner reshapes a simulated cluster as a
trace's mix shifts, its moves taking simulated time."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.config import ClusterConfig, PlannerConfig, RouterConfig
from pdserve.engine.perf_model import FEATURES
from pdserve.errors import ConfigError
from services.controller.cli import main
from services.planner.simulated import Moves, PlannedSimulation
from services.simulator.latency import InstanceProfile
from services.simulator.latency_report import summarize
from services.simulator.trace import TraceRecord

# a slow instance (10 ms a step, 1 ms a prefill token, 2 ms a decode row): loads of a few
# requests per second keep it busy, and the test's simulations stay small
COEFFICIENTS = dict.fromkeys(FEATURES, 0.0) | {"constant": 0.010, "prefill_tokens": 0.001,
                                               "decode_rows": 0.002}  # fmt: skip
PROFILE = InstanceProfile(num_blocks=2048, block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=256, coefficients=COEFFICIENTS,
                          kv_block_bytes=100_000, max_model_len=4096)  # fmt: skip
PLANNER = PlannerConfig(enabled=True, ttft_p90_s=1.0, itl_p90_s=0.016, interval_s=2.0,
                        history_s=10.0, cooldown_s=4.0, confirm_intervals=2, min_instances=3,
                        max_instances=3, max_prefill=2, max_decode=2)  # fmt: skip


def phases() -> list[TraceRecord]:
    """30 s of long prompts and 2-token answers at 2/s, then 30 s of 16-token prompts and
    60-token answers at 4/s; every prompt its own."""
    records, ids = [], iter(range(10**9))
    for n in range(60):
        records.append(TraceRecord(n * 500.0, 400, 2, tuple(next(ids) for _ in range(25))))
    for n in range(120):
        records.append(TraceRecord(30_000 + n * 250.0, 16, 60, (next(ids),)))
    return records


def planned(**overrides: object) -> PlannedSimulation:
    """Strictly disaggregated: what these tests ask of the planner is which roles it needs."""
    always = RouterConfig(disaggregation="always")
    config = ClusterConfig(router=always, planner=replace(PLANNER, **overrides))
    profiles = {"prefill": PROFILE, "decode": PROFILE}
    moves = Moves(role_change_s=0.5, start_s=5.0)
    return PlannedSimulation(config, profiles, {"prefill": 2, "decode": 1}, block_tokens=16,
                             moves=moves, vocab_size=262)  # fmt: skip


def test_the_planner_moves_a_prefill_instance_to_decode_when_answers_grow() -> None:
    run = planned()
    result = run.run(phases())
    changes = [d for d in run.decisions if d.action == "change"]
    assert [(str(d.current), str(d.target)) for d in changes][:1] == [("2P1D", "1P2D")]
    assert changes[0].at > 30.0  # not before the answers grew
    assert not any(r.failed for r in result.requests)
    # the moved instance decodes: samples after the move show two decode instances busy
    after = [s for s in result.samples if s.at > changes[0].at + 5]
    decoding = [sum(1 for row in s.instances.values() if row[0] == "decode" and row[1])
                for s in after]  # fmt: skip
    assert max(decoding) == 2
    # role changes only: three instances all along
    assert result.instance_seconds == pytest.approx(3 * (result.ended - result.started))
    fixed = summarize(planned(max_prefill=2, min_decode=1, max_decode=1, min_instances=3)
                      .run(phases()), 1.0, 0.016)  # fmt: skip
    assert summarize(result, 1.0, 0.016)["goodput"] > fixed["goodput"]


def test_an_elastic_planner_adds_an_instance_that_counts_from_its_start() -> None:
    run = planned(min_instances=2, max_instances=4, max_prefill=2, max_decode=2, min_decode=1)
    result = run.run(phases())
    added = [d for d in run.decisions if d.action == "change" and d.target.total > d.current.total]
    assert added, [d.reason for d in run.decisions]
    at = added[0].at
    before = {n for s in result.samples if s.at < at for n in s.instances}
    [new] = {n for s in result.samples if at <= s.at < at + 1 for n in s.instances} - before
    # routed 5 s after its start (Moves.start_s): nothing runs there before
    starting = [s.instances[new][1] for s in result.samples if at <= s.at < at + 4.9]
    assert starting and not any(starting)
    # instance-seconds: every instance from its start to its stop or the end, as the samples
    # (one each stats interval) saw them
    interval = result.spec.router.stats_interval_s
    seen = sum(len(s.instances) for s in result.samples) * interval
    changes = sum(1 for d in run.decisions if d.action == "change")
    assert result.instance_seconds == pytest.approx(seen, abs=(changes + 2) * 2 * interval)
    assert not any(r.failed for r in result.requests)


def test_a_mixed_cluster_is_not_planned() -> None:
    config = replace(ClusterConfig(), planner=PLANNER)
    with pytest.raises(ConfigError, match="mixed"):
        PlannedSimulation(config, {"mixed": PROFILE}, {"mixed": 2})


def test_pdserve_simulate_plans_with_the_configs_planner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, out = tmp_path / "cluster.yaml", tmp_path / "report.json"
    config.write_text("planner:\n  interval_s: 1\n  cooldown_s: 2\n  history_s: 5\n"
                      "prefill:\n  replicas: 2\ndecode:\n  replicas: 1\n")  # fmt: skip
    args = ["simulate", "shifting", "--latency", "--planner", "--config", str(config),
            "--requests", "300", "--block-tokens", "16", "--time-scale", "0.1", "--quiet",
            "--ttft-slo-s", "0.05", "--start-s", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["failed"] == 0
    assert f"the planner's moves ({len(report['planner_moves'])})" in printed
    assert report["planner_moves"] and "2P1D -> " in report["planner_moves"][0]
    with pytest.raises(SystemExit):
        main([*args[:-2], "--planner-sizing", "median"])
    assert main([*args[:-2], "--start-s", "-1"]) != 0
    assert "must be >= 0" in capsys.readouterr().err
