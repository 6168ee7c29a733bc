"""`pdserve up`, the OpenAI API it serves, `pdserve generate --cluster` and `pdserve down`, as an
operator runs them."""

import os
import subprocess
import sys
from pathlib import Path

import openai
import ray


def test_up_generate_down_on_a_running_ray_cluster(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "pdserve.yaml"
    config.write_text(
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 128\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-e2e\n  state_dir: {tmp_path}\n"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "services.controller.cli"]
    address = ray.get_runtime_context().gcs_address
    up = subprocess.Popen(
        [*cli, "up", "--config", str(config), "--address", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "pdserve is up" in line:
                break
        endpoints = [line.split() for line in lines if "grpc://" in line]
        assert sorted((name, role) for name, role, _ in endpoints) == [
            ("decode-0", "decode"),
            ("prefill-0", "prefill"),
        ]
        assert (tmp_path / "cluster.json").is_file()
        [router_url] = [line.split()[2] for line in lines if line.startswith("router")]
        client = openai.OpenAI(base_url=router_url, api_key="unused", max_retries=0)
        completion = client.completions.create(
            model=tiny_model_dir.name, prompt="hello", max_tokens=8, temperature=0
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        generate = [*cli, "generate", "hello", "--cluster", "--config", str(config)]
        on_cluster = subprocess.run(
            [*generate, "--max-tokens", "8"], capture_output=True, text=True, env=env, timeout=120
        )
        assert on_cluster.returncode == 0, on_cluster.stderr
        local = subprocess.run(
            [*cli, "generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "8"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert on_cluster.stdout == local.stdout and local.stdout.strip()
        assert completion.choices[0].text == local.stdout.rstrip("\n")
        down = subprocess.run(
            [*cli, "down", "--config", str(config)], capture_output=True, text=True, timeout=180
        )
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
        assert not (tmp_path / "cluster.json").exists()
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if "e2e" in str(a)]
        assert alive == []
    finally:
        if up.poll() is None:
            up.kill()
