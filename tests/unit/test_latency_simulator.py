"""The latency simulator: pdserve's scheduler, caches and routing in simulated time, with
step times from a step time model. Each expectation is worked out from the model by hand."""

import json
import math
from pathlib import Path

import pytest

from pdserve.config import RouterConfig
from pdserve.engine.perf_model import FEATURES
from pdserve.errors import ConfigError
from services.controller.cli import _build_parser, main
from services.simulator.cli import latency_spec
from services.simulator.latency import ClusterSpec, InstanceProfile, Simulation, TokenSource
from services.simulator.latency_report import summarize
from services.simulator.trace import TraceRecord

C0, PER_TOKEN, PER_ROW = 0.010, 0.001, 0.002  # seconds per step, prefill token, decode row


def profile(**overrides: object) -> InstanceProfile:
    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients.update(constant=C0, prefill_tokens=PER_TOKEN, decode_rows=PER_ROW)
    settings: dict[str, object] = dict(
        num_blocks=1024, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
        coefficients=coefficients, kv_block_bytes=1_000_000, max_model_len=4096,
    )  # fmt: skip
    settings.update(overrides)
    return InstanceProfile(**settings)  # type: ignore[arg-type]


def record(at_s: float, prompt: int, output: int, first_id: int) -> TraceRecord:
    blocks = -(-prompt // 16)
    return TraceRecord(at_s * 1000, prompt, output, tuple(range(first_id, first_id + blocks)))


def run(spec: ClusterSpec, records: list[TraceRecord]):  # type: ignore[no-untyped-def]
    return Simulation(spec, block_tokens=16).run(records)


def mixed(**overrides: object) -> ClusterSpec:
    return ClusterSpec({"mixed": profile(**overrides)}, prefill=0, decode=0, mixed=1)


def test_a_lone_request_takes_its_chunked_prefill_then_one_step_per_token() -> None:
    result = run(mixed(), [record(0, 100, 5, 0)])
    [r] = result.requests
    # 100 tokens in chunks of 64 and 36: two steps; then 4 decode steps of one row
    assert r.ttft == pytest.approx(2 * C0 + 100 * PER_TOKEN)
    assert list(result.itl) == pytest.approx([C0 + PER_ROW] * 4)
    assert r.tokens == 5 and r.path == "mixed" and not r.failed


def test_each_step_takes_the_fit_times_a_ratio_drawn_from_the_measured_ones() -> None:
    doubled = run(mixed(step_ratios=(2.0,)), [record(0, 100, 5, 0)])
    assert doubled.requests[0].ttft == pytest.approx(2 * (2 * C0 + 100 * PER_TOKEN))
    assert list(doubled.itl) == pytest.approx([2 * (C0 + PER_ROW)] * 4)
    spread = mixed(step_ratios=(0.5, 1.0, 3.0))
    records = [record(0, 100, 200, 0)]
    gaps = set(round(gap / (C0 + PER_ROW), 6) for gap in run(spread, records).itl)
    assert gaps == {0.5, 1.0, 3.0}  # every ratio drawn, none other
    assert list(run(spread, records).itl) == list(run(spread, records).itl)  # seeded
    with pytest.raises(ConfigError, match="ratios must be positive"):
        profile(step_ratios=(1.0, 0.0))


def test_requests_decode_in_one_batch_and_queue_behind_max_num_seqs() -> None:
    together = run(mixed(), [record(0, 10, 3, 0), record(0, 10, 3, 100)])
    first, second = together.requests
    # the first arrival starts a step alone; the second prompt joins the next one, which
    # also carries the first's decode row; then both decode in one step of two rows
    assert first.ttft == pytest.approx(C0 + 10 * PER_TOKEN)
    assert second.ttft == pytest.approx(first.ttft + C0 + 10 * PER_TOKEN + PER_ROW)
    assert sorted(together.itl).count(pytest.approx(C0 + 2 * PER_ROW)) == 2
    queued = run(mixed(max_num_seqs=1), [record(0, 10, 3, 0), record(0, 10, 3, 100)])
    first, second = queued.requests
    assert first.last_token is not None and second.first_token is not None
    assert second.first_token > first.last_token  # it waited for the only place


def test_a_disaggregated_request_pays_its_transfer_and_decode_hands_out_prefills_token() -> None:
    always = RouterConfig(disaggregation="always")  # an idle decode would compute it (auto)

    def ttft(gbps: float) -> float:
        spec = ClusterSpec({"prefill": profile(), "decode": profile()}, router=always,
                           transfer_gbps=gbps)  # fmt: skip
        [r] = run(spec, [record(0, 32, 4, 0)]).requests
        assert r.path == "remote" and r.tokens == 4 and r.ttft is not None
        return r.ttft

    # 32 tokens: one prefill step, then two 1 MB blocks over the link
    assert ttft(1.0) == pytest.approx(C0 + 32 * PER_TOKEN + 2e6 / 1e9)
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, router=always, rpc_s=0.001)
    [r] = run(spec, [record(0, 32, 4, 0)]).requests
    step = C0 + 32 * PER_TOKEN
    # client -> router -> prefill; -> decode (Reserve) and back; computed; the KV and
    # StartDecode
    assert r.marks == pytest.approx({"at_prefill": 0.002, "reserved": 0.004,
                                     "computed": 0.004 + step,
                                     "handed_off": 0.005 + step + 2e6 / 1e9})  # fmt: skip
    # to the router, on to the client
    assert r.first_token == pytest.approx(r.marks["handed_off"] + 0.002)
    assert ttft(0.1) - ttft(1.0) == pytest.approx(2e6 / 1e8 - 2e6 / 1e9)


def test_messages_draw_their_times_and_a_stream_keeps_its_order() -> None:
    """Each message takes a measured time drawn at random; a token whose two messages were
    quicker than its predecessor's arrives with it, as one chunk: no gap of 0 or below."""
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, rpc_draws_s=(0.0, 0.02))
    result = run(spec, [record(0, 32, 60, 0)])
    [r] = result.requests
    assert r.tokens == 60 and not r.failed
    gaps = list(result.itl)
    assert all(gap > 0 for gap in gaps)
    assert len(gaps) < 59  # some tokens came together
    assert len({round(gap, 9) for gap in gaps}) > 2  # drawn, not fixed: the gaps vary
    assert list(run(spec, [record(0, 32, 60, 0)]).itl) == gaps  # seeded
    with pytest.raises(ConfigError, match="message times"):
        ClusterSpec({"prefill": profile(), "decode": profile()}, rpc_draws_s=(-0.001,))


def test_a_repeated_prompt_hits_the_cache_the_router_routed_it_to() -> None:
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, prefill=2)
    first, again = run(spec, [record(0, 160, 2, 0), record(10, 160, 2, 0)]).requests
    assert first.cached_tokens == 0
    assert again.cached_tokens == 144  # every full block but the one holding the last token
    assert again.ttft is not None and first.ttft is not None and again.ttft < first.ttft


def test_a_full_decode_refuses_reservations_and_the_request_fails_after_its_attempts() -> None:
    spec = ClusterSpec({"prefill": profile(), "decode": profile(num_blocks=4)},
                       router=RouterConfig(max_attempts=2))  # fmt: skip
    result = run(spec, [record(0, 200, 2, 0)])  # 13 blocks: never fits decode's 4
    [r] = result.requests
    assert r.failed.startswith("refused on 2 attempts") and r.attempts == 2
    assert summarize(result, 1.0, 1.0)["failures"] == {"refused on 2 attempts": 1}


def test_a_prompt_longer_than_the_window_is_refused_like_the_router_refuses_it() -> None:
    [r] = run(mixed(max_model_len=64), [record(0, 60, 10, 0)]).requests
    assert r.failed.startswith("refused") and "context length" in r.failed


def test_auto_disaggregation_prefills_where_the_first_token_comes_sooner() -> None:
    def paths(mode: str, prompt: int, gbps: float) -> tuple[set[str], float]:
        router = RouterConfig(disaggregation=mode)
        spec = ClusterSpec({"prefill": profile(), "decode": profile()}, router=router,
                           transfer_gbps=gbps)  # fmt: skip
        records = [record(i * 2.0, prompt, 2, 1000 * i) for i in range(6)]
        result = run(spec, records)
        ttfts = [r.ttft for r in result.requests if r.ttft is not None]
        return {r.path for r in result.requests}, sorted(ttfts)[len(ttfts) // 2]

    # short prompts over a slow link: computing them on decode beats moving their KV
    auto_paths, auto_ttft = paths("auto", 20, 0.01)
    always_paths, always_ttft = paths("always", 20, 0.01)
    assert always_paths == {"remote"} and "local" in auto_paths
    assert auto_ttft < always_ttft
    # a long prompt over a fast link while decode runs a batch: its chunks there would
    # carry the batch's rows, on prefill they do not; moving 94 blocks costs ~1 ms
    spec = ClusterSpec({"prefill": profile(), "decode": profile()},
                       router=RouterConfig(disaggregation="auto"), transfer_gbps=100.0)  # fmt: skip
    batch = [record(0, 20, 3000, 1000 * i) for i in range(8)]
    result = run(spec, [*batch, record(2.0, 1500, 2, 50_000)])
    assert result.requests[-1].path == "remote"


def test_goodput_counts_requests_within_both_slos() -> None:
    result = run(mixed(), [record(0, 100, 5, 0), record(1, 10, 1, 100)])
    ttfts = sorted(r.ttft for r in result.requests)  # type: ignore[type-var]
    summary = summarize(result, ttft_slo_s=ttfts[0], itl_slo_s=1.0)
    assert summary["goodput"] == 0.5
    assert summarize(result, ttft_slo_s=1.0, itl_slo_s=(C0 + PER_ROW) / 2)["goodput"] == 0.5
    assert summary["instance_seconds"] == pytest.approx(result.ended - result.started)


def test_bad_cluster_specs_are_refused() -> None:
    with pytest.raises(ConfigError, match="prefill \\+ decode"):
        ClusterSpec({"mixed": profile(), "prefill": profile()}, prefill=1, decode=0, mixed=1)
    with pytest.raises(ConfigError, match="lacks coefficients"):
        profile(coefficients={"constant": 1.0})


def test_the_cli_reports_json_and_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "latency.json", tmp_path / "timeline.png"
    args = ["simulate", "documents", "--latency", "--requests", "40", "--block-tokens", "16",
            "--quiet", "--json", str(out), "--plot", str(png), "--time-scale", "0.5"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 40 and report["failed"] == 0
    assert math.isfinite(report["ttft_s"]["p90"]) and report["instances"] == {
        "prefill": 1,
        "decode": 1,
    }
    assert png.stat().st_size > 10_000
    assert "TTFT" in capsys.readouterr().out


def test_the_cli_names_a_bad_step_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "fit.json"
    bad.write_text('{"coefficients": {"constant": 0.01}}')
    code = main(["simulate", "documents", "--latency", "--requests", "5", "--step-model", str(bad)])
    assert code != 0
    assert "not a step time model" in capsys.readouterr().err


def test_a_prompt_is_as_long_as_its_record_says_whatever_its_ids_cover() -> None:
    """A record's hash ids may cover less than its length (a question under one id, a trace of
    coarser blocks): the prompt still has every token, shared ids giving shared tokens."""
    source = TokenSource(block_tokens=32, vocab_size=262)
    long, short = TraceRecord(0, 300, 4, (7, 8)), TraceRecord(0, 40, 4, (7, 9))
    tokens = source.prompt(long)
    assert len(tokens) == 300 and all(1 <= t < 262 for t in tokens)
    assert source.prompt(short)[:32] == tokens[:32]  # the same first id
    assert source.prompt(short)[32:40] != tokens[32:40]
    assert source.prompt(long) == tokens


def test_a_live_clusters_listing_gives_the_profiles_and_the_routers_message_time(
    tmp_path: Path,
) -> None:
    """`--from-cluster` (`pdserve admin list --json`): each role's fit and pool, and the
    router's measured message time unless `--rpc-ms` says otherwise."""
    fit = {"coefficients": dict.fromkeys(FEATURES, 0.001), "samples": "100",
           "ratio_quantiles": [0.9, 1.25]}  # fmt: skip
    stats = {"step_time": fit, "num_blocks": 256, "block_size": 16, "kv_block_bytes": 4096}
    listing = {"instances": [{"name": f"{role}-0", "role": role, "stats": stats}
                             for role in ("prefill", "decode")],
               "message_s": 0.0025, "message_quantiles": [0.001, 0.004]}  # fmt: skip
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(listing))
    parser = _build_parser()

    def spec(*extra: str) -> ClusterSpec:
        argv = ["simulate", "documents", "--latency", "--from-cluster", str(path), *extra]
        return latency_spec(parser.parse_args(argv))

    measured = spec()
    assert measured.rpc_s == 0.0025 and (measured.prefill, measured.decode) == (1, 1)
    assert measured.profiles["decode"].num_blocks == 256
    assert measured.profiles["prefill"].step_ratios == (0.9, 1.25)
    assert measured.rpc_draws_s == (0.001, 0.004)
    assert spec("--rpc-ms", "1").rpc_draws_s == ()  # a fixed time asked for
    assert spec("--rpc-ms", "1").rpc_s == 0.001
    del listing["message_s"]  # a listing from before the router measured any
    path.write_text(json.dumps(listing))
    assert spec().rpc_s == 0.0


def steady(duration_s: float, per_s: float, output: int) -> list[TraceRecord]:
    """One request every 1/per_s seconds, each its own prompt of 32 tokens."""
    count = int(duration_s * per_s)
    return [record(n / per_s, 32, output, 1000 * n) for n in range(count)]


def roles_at(result, at_s: float) -> dict[str, str]:  # type: ignore[no-untyped-def]
    sample = min(result.samples, key=lambda s: abs(s.at - at_s))
    return {name: row[0] for name, row in sample.instances.items()}


def test_a_role_change_drains_the_instance_then_routes_it_in_its_new_role() -> None:
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, prefill=2, decode=1)
    sim = Simulation(spec, block_tokens=16)
    sim.at(2.0, lambda: sim.change_role("prefill-1", "decode", 0.5))
    result = sim.run(steady(6.0, 10, 20))
    assert not any(r.failed for r in result.requests)
    assert roles_at(result, 1.0)["prefill-1"] == "prefill"
    assert roles_at(result, 4.0)["prefill-1"] == "decode"
    assert result.instance_names == {"prefill-0": "prefill", "prefill-1": "decode",
                                     "decode-0": "decode"}  # fmt: skip
    # in its new role it decodes: some request that came after the switch ran there
    later = [s for s in result.samples if s.at > 3.0]
    assert max(s.instances["prefill-1"][1] for s in later) > 0
    assert result.instance_seconds == pytest.approx(3 * (result.ended - result.started))


def test_an_added_instance_counts_from_its_start_and_serves_once_ready() -> None:
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, prefill=1, decode=1)
    sim = Simulation(spec, block_tokens=16)
    sim.at(1.0, lambda: sim.start_instance("decode", 2.0))
    result = sim.run(steady(8.0, 20, 10))
    assert not any(r.failed for r in result.requests)
    starting = [s for s in result.samples if 1.0 < s.at < 3.0]
    assert starting and all(s.instances["decode-1"][1] == 0 for s in starting)
    assert any(s.instances["decode-1"][1] > 0 for s in result.samples if s.at > 3.0)
    duration = result.ended - result.started
    assert result.instance_seconds == pytest.approx(2 * duration + result.ended - 1.0)


def test_a_stopped_instance_finishes_its_requests_and_stops_counting() -> None:
    spec = ClusterSpec({"prefill": profile(), "decode": profile()}, prefill=1, decode=2)
    sim = Simulation(spec, block_tokens=16)
    sim.at(1.0, lambda: sim.stop_instance("decode-1"))
    result = sim.run(steady(5.0, 20, 30))
    assert not any(r.failed for r in result.requests)
    assert set(result.instance_names) == {"prefill-0", "decode-0"}
    gone = min(s.at for s in result.samples if "decode-1" not in s.instances)
    assert gone > 1.0  # it drained first
    duration = result.ended - result.started
    assert result.instance_seconds == pytest.approx(2 * duration + gone - result.started,
                                                    abs=spec.router.stats_interval_s)  # fmt: skip
    with pytest.raises(ConfigError, match="not serving"):
        sim.stop_instance("decode-1")
