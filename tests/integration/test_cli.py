"""`pdserve generate` as a user runs it: a real subprocess, real stdout and stderr."""

import os
import subprocess
import sys
from pathlib import Path

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
