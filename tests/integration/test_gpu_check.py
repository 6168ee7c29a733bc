"""`benchmarks/gpu_check.py --smoke` on CPU: every section runs, CUDA-only figures are marked
skipped, pdserve agrees with `transformers` in float32 (every family) and TP=2 with TP=1 (two
CPU ranks), so the GPU run has no silly failure left to find."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SECTIONS = (
    "environment",
    "correctness",
    "decode",
    "cuda_graphs",
    "staging",
    "cuda_ipc",
    "memory",
    "tensor_parallel",
    "families",
    "fp8_kv",
)
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
        timeout=240,
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


def test_tensor_parallel_runs_two_cpu_ranks_in_smoke_mode(
    smoke: tuple[dict[str, Any], str],
) -> None:
    """On CPU the section's path runs with both ranks on CPU (gloo): TP=2 agrees with TP=1 in
    float32, and its step split is there (2 layers: the embedding's all-reduce, two per layer,
    the logits gather and the step broadcast)."""
    tp = smoke[0]["results"]["tensor_parallel"]
    assert tp["ranks"] == ["cpu", "cpu"] and tp["backend"] == "gloo"
    assert tp["exact"] is True and tp["greedy_agree"] == 1.0 and tp["top1_agree"] == 1.0
    assert tp["logit_maxdiff"] <= 1e-5 * tp["logit_absmax"]
    for batch in ("1", "4"):
        assert tp["tp1"]["tok_s"][batch] > 0 and tp["tp2"]["tok_s"][batch] > 0
        assert 0 < tp["tp2"]["comm_ms"][batch] < tp["tp2"]["decode_ms"][batch]
        assert tp["tp2"]["collectives_per_step"][batch] == 1 + 2 * 2 + 1 + 1
        assert tp[f"tok_s_ratio_b{batch}"] > 0
    round_trip = tp["tp2"]["kv_round_trip"]
    assert round_trip["ranks"] == 2
    assert round_trip["whole_equal"] and round_trip["ranks_equal"] and round_trip["copy_out_equal"]


def test_every_family_matches_transformers_in_float32(smoke: tuple[dict[str, Any], str]) -> None:
    """Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3: greedy tokens identical to transformers',
    decode steps timed; the fused MoE kernel needs CUDA; DeepSeek-V3's latent decode (here the
    CPU kernel) equals the reference."""
    families = dict(smoke[0]["results"]["families"])
    del families["seconds"]
    assert list(families) == [
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "DeepseekV3ForCausalLM",
    ]
    for name, figures in families.items():
        assert figures["greedy"]["exact"] is True, name
        assert figures["decode_ms"]["1"] > 0 and figures["decode_ms"]["4"] > 0
        assert ("fused_moe" in figures) == (name != "Qwen3ForCausalLM")
        assert figures.get("fused_moe", NO_CUDA) == NO_CUDA
        assert ("latent_decode" in figures) == (name == "DeepseekV3ForCausalLM")
    for case in families["DeepseekV3ForCausalLM"]["latent_decode"].values():
        assert case["maxdiff"] <= 1e-5 * case["absmax"] and case["kernel_ms"] > 0
    assert "qwen3moe_fused_moe_speedup=na" in smoke[1]


def test_the_fp8_cache_section_compares_it_with_full_precision(
    smoke: tuple[dict[str, Any], str],
) -> None:
    """A quarter of float32's bytes per token; logits close, not equal; both engines timed."""
    figures = smoke[0]["results"]["fp8_kv"]
    assert figures["kv_bytes_per_token_fp8_e4m3"] * 4 == figures["kv_bytes_per_token_auto"]
    assert 0 < figures["logit_reldiff"] < 0.1 and figures["scales"] == "calibrated"
    assert 0 <= figures["greedy_agree"] <= 1
    assert all(ms > 0 for each in figures["decode_ms"].values() for ms in each.values())


def test_tensor_parallel_is_skipped_without_two_gpus(tmp_path: Path) -> None:
    """Outside --smoke, fewer than two GPUs skip the section with the reason."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    args = module.parse_args(["--device", "cpu"])
    ctx = module.Context(args, module.FULL, torch.device("cpu"), tmp_path, 0.0, 1.0)
    assert module.tensor_parallel(ctx) == {"skipped": "needs 2 GPUs, found 0"}


def test_last_line_is_the_result_line(smoke: tuple[dict[str, Any], str]) -> None:
    document, stdout = smoke
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT gpu_check ")
    pairs = dict(item.split("=", 1) for item in last.split()[2:])
    assert list(pairs) == list(document["metrics"])
    assert pairs["load_peak_ratio"] == "na" and pairs["d2d_gbps"] == "na"
    assert pairs["greedy_agree"] == "1"
    assert {"logit_maxdiff", "decode_ms_b1", "decode_ms_b4", "roofline_frac_b4"} <= set(pairs)
    assert pairs["tp_greedy_agree"] == "1" and "tp_tok_s_ratio_b4" in pairs
    assert pairs["fp8_kv_bytes_ratio"] == "0.25" and "deepseekv3_latent_reldiff" in pairs
