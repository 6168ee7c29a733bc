"""`pdserve generate` as a user runs it: a real subprocess, real stdout and stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from platformdirs import user_cache_dir

KERNELS = os.environ.get("PDSERVE_KERNEL_CACHE", user_cache_dir("pdserve"))


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    """The CLI with its own cache directory (the default model is made there), but the CPU
    kernels this session already built (a build takes a minute)."""
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(cache),
        "PDSERVE_KERNEL_CACHE": KERNELS,
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "services.controller.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_generate_streams_greedy_text_from_the_default_model(tmp_path: Path) -> None:
    result = run_cli("generate", "Once upon a time", "--max-tokens", "12", cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 0
    assert "[finish_reason=length]" in result.stderr
    assert (tmp_path / "pdserve" / "tiny-llama-v2-seed0" / "model.safetensors").is_file()
    again = run_cli("generate", "Once upon a time", "--max-tokens", "12", cache=tmp_path)
    assert again.stdout == result.stdout


def test_generate_with_a_bad_model_path_is_one_clear_line(tmp_path: Path) -> None:
    result = run_cli("generate", "hi", "--model", str(tmp_path / "missing"), cache=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"pdserve: error: model directory '{tmp_path / 'missing'}' does not exist"
    ]


def test_generate_with_an_overlong_prompt_is_one_clear_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    prompt = "a" * 5000
    result = run_cli("generate", prompt, "--model", str(tiny_model_dir), cache=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "5001 tokens" in lines[0] and "context window is 4096" in lines[0]


def test_generate_with_bad_sampling_parameters_is_one_clear_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    result = run_cli(
        "generate", "hi", "--model", str(tiny_model_dir), "--top-p", "2", cache=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pdserve: error: top_p must be in (0, 1], got 2.0"
    ]


@pytest.mark.parametrize(
    ("change", "engine", "reason"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "", "unsupported architecture 'GPT2LMHeadModel'"),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2},
            "",
            "config.json lacks required key 'moe_intermediate_size'",
        ),
        (
            {
                "architectures": ["MixtralForCausalLM"],
                "num_local_experts": 6,
                "num_experts_per_tok": 2,
            },
            "  tensor_parallel_size: 4\n  expert_parallel_size: 4\n",
            "engine.expert_parallel_size 4 does not divide the model's 6 experts",
        ),
        (
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "n_routed_experts": 8,
                "moe_intermediate_size": 64,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
            },
            "",
            "config.json lacks required key 'kv_lora_rank'",
        ),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 4}},
            "",
            "quantized weights (quantization_config: awq, no weight_block_size) are not supported",
        ),
    ],
    ids=[
        "unknown-architecture",
        "missing-field",
        "experts-not-divisible",
        "mla-field-missing",
        "awq-weights",
    ],
)
def test_up_refuses_a_model_it_cannot_serve_in_one_line_before_starting_anything(
    tmp_path: Path, tiny_model_dir: Path, change: dict[str, object], engine: str, reason: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config |= {"num_experts_per_tok": 2, **change}
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "pdserve.yaml").write_text(f"engine:\n  model: {model}\n{engine}")
    state = tmp_path / "state"
    result = run_cli(
        "up", "--config", str(tmp_path / "pdserve.yaml"), "--state-dir", str(state), cache=tmp_path
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("pdserve: error: engine.") and reason in line, line
    assert "starting pdserve" not in result.stdout  # before Ray, Redis, any instance
    assert not state.exists() or not any(state.iterdir())
