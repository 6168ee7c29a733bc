"""An instance's step time model: profiled at its first start (nothing of the pass left
behind), loaded at the next, refined while serving, exported in GetStats and on /metrics."""

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from credentials import SECRET
from pdserve_up import scrape_metrics

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.perf_model import StepTimeModel
from pdserve.engine.profiling import CACHE_VARIABLE, fit_key, fit_path, profile, seed_step_time
from pdserve.engine.request import SamplingParams
from services.mixed.servicer import serve_mixed


def test_the_first_start_profiles_the_next_loads_and_serving_refines(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, step_profile_s=5.0)
    first, server, _ = serve_mixed(config, secret=SECRET)
    try:
        path = fit_path(fit_key(config, first.runtime.engine))
        assert path.is_file()  # profiled and saved
        stats = first.stats()
        profiled = stats.step_time.samples
        assert profiled >= 20 and stats.step_time.coefficients["constant"] > 0
        # the pass left nothing: no step counted, no block cached or held, no request
        assert stats.num_steps == 0 and stats.prefix_cache_queries == 0
        assert stats.num_cached_blocks == 0 and stats.num_free_blocks == stats.num_blocks
    finally:
        server.stop(0)
        first.stop()
    saved = path.stat().st_mtime_ns

    second, server, _ = serve_mixed(config, secret=SECRET)
    try:
        engine = second.runtime.engine
        assert engine.step_time.samples == profiled  # loaded, not profiled again
        assert path.stat().st_mtime_ns == saved
        prompts = [[5 + i] * (20 + 7 * i) for i in range(8)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        second.runtime.loop.call(lambda e: e.generate(prompts, params))
        stats = second.stats()
        assert stats.step_time.samples > profiled  # every served step refines it
        assert sum(stats.step_time.error_counts) > 0 and stats.step_time.median_error >= 0
        url = f"http://{second.runtime.metrics_address}"
        samples = scrape_metrics(url)
        assert samples['pdserve_step_time_error_ratio_count{role="mixed"}'] == sum(
            stats.step_time.error_counts
        )
        assert 'pdserve_step_time_coefficient{feature="decode_rows",role="mixed"}' in samples
        check = subprocess.run(["promtool", "check", "metrics"], capture_output=True, text=True,
                               input=httpx.get(f"{url}/metrics", timeout=10).text)  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        server.stop(0)
        second.stop()


def test_no_profiling_pass_when_it_is_turned_off(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, step_profile_s=0)
    instance, server, _ = serve_mixed(config, secret=SECRET)
    try:
        assert instance.stats().step_time.samples == 0
        assert not fit_path(fit_key(config, instance.runtime.engine)).exists()
    finally:
        server.stop(0)
        instance.stop()


def test_a_pass_cut_short_by_its_budget_leaves_nothing_running(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256))
    steps = profile(engine, budget_s=0.3)
    assert steps > 0 and engine.step_time.samples == steps
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.kv_cache.num_cached_blocks == 0  # nothing published
    engine.check_integrity()
    [completion] = engine.generate([[7] * 40], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(completion.token_ids) == 3


def test_a_corrupt_saved_fit_is_profiled_again(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, step_profile_s=0.5)
    engine = LLMEngine.from_config(config)
    path = fit_path(fit_key(config, engine))
    for corrupt in ('{"gram": [["x"]], "features": 1}', "not json", '{"features": []}'):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(corrupt)
        assert "profiled" in seed_step_time(engine, config)
        assert StepTimeModel().load(json.loads(path.read_text()))  # replaced by a real fit
