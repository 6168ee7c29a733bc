"""`benchmarks/gpu_check.py --smoke` on CPU: every section runs, CUDA-only figures are marked
skipped, and pdserve agrees with `transformers` in float32 (so the GPU run has no silly failure
left to find)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SECTIONS = ("environment", "correctness", "decode", "cuda_graphs", "staging", "cuda_ipc", "memory")
CUDA_ONLY = ("cuda_ipc",)
NO_CUDA = {"skipped": "no CUDA"}


def errors(value: Any, path: str = "") -> list[str]:
    """Every `error` entry anywhere in a result tree, by path."""
    if isinstance(value, dict):
        found = [f"{path}: {value['error']}"] if "error" in value else []
        for key, child in value.items():
            found += errors(child, f"{path}/{key}")
        return found
    if isinstance(value, list):
        return [e for i, child in enumerate(value) for e in errors(child, f"{path}/{i}")]
    return []


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gpu_check") / "smoke.json"
    command = [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--threads", "1"]
    done = subprocess.run(
        [*command, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


def test_every_section_runs_without_an_error(smoke: tuple[dict[str, Any], str]) -> None:
    document, _ = smoke
    results = document["results"]
    assert list(results) == list(SECTIONS)
    assert errors(results) == []
    assert all("skipped" not in results[name] for name in SECTIONS if name not in CUDA_ONLY)
    assert document["benchmark"] == "gpu_check" and document["args"]["smoke"] is True


def test_cuda_only_figures_are_skipped_on_cpu(smoke: tuple[dict[str, Any], str]) -> None:
    results = smoke[0]["results"]
    assert results["correctness"]["load"]["peak"] == NO_CUDA
    assert results["decode"]["batches"]["4"]["roofline"] == NO_CUDA
    for part in ("pinned", "pageable", "d2d", "peer"):
        assert results["staging"][part] == NO_CUDA
    assert results["memory"]["cuda_after"] == NO_CUDA
    assert results["cuda_ipc"]["skipped"] == NO_CUDA["skipped"]
    stager = results["staging"]["kv_stager"]  # runs on CPU too (views of the cache)
    assert stager["bytes_match"] is True


def test_pdserve_matches_transformers_in_float32(smoke: tuple[dict[str, Any], str]) -> None:
    correctness = smoke[0]["results"]["correctness"]
    assert correctness["model"]["reference_attention"] == "eager"
    assert correctness["prefill"]["logit_maxdiff"] < 1e-4
    assert correctness["prefill"]["top1_agree"] == 1.0
    assert correctness["greedy"]["greedy_agree"] == 1.0 and correctness["greedy"]["exact"]
    assert correctness["batch_variance"]["prefill_maxdiff"] < 1e-4
    assert correctness["batch_variance"]["decode_maxdiff"] < 1e-4


def test_decode_and_memory_figures_are_there(smoke: tuple[dict[str, Any], str]) -> None:
    results = smoke[0]["results"]
    for batch in ("1", "4"):
        figures = results["decode"]["batches"][batch]
        assert figures["engine_ms"] > 0 and figures["bare_ms"] > 0
    assert results["memory"]["num_kv_blocks"] > 0 and results["memory"]["max_model_len"] > 0
    graphs = results["cuda_graphs"]  # on CPU the graphs' buffers are replayed eagerly
    assert graphs["captured"] is False and graphs["greedy_agree"] == 1.0
    assert graphs["graphs"]["decode_ms"]["4"] > 0 and graphs["eager"]["decode_ms"]["4"] > 0


def test_last_line_is_the_result_line(smoke: tuple[dict[str, Any], str]) -> None:
    document, stdout = smoke
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT gpu_check ")
    pairs = dict(item.split("=", 1) for item in last.split()[2:])
    assert list(pairs) == list(document["metrics"])
    assert pairs["load_peak_ratio"] == "na" and pairs["d2d_gbps"] == "na"
    assert pairs["greedy_agree"] == "1"
    assert {"logit_maxdiff", "decode_ms_b1", "decode_ms_b4", "roofline_frac_b4"} <= set(pairs)
