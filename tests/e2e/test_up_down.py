"""`pdserve up`, the OpenAI API it serves, `pdserve generate --cluster` and `pdserve down`, as an
operator runs them."""

import subprocess
from pathlib import Path

import openai
import ray
from pdserve_up import CLI, pdserve_up


def test_up_generate_down_on_a_running_ray_cluster(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 128\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-e2e\n  state_dir: {tmp_path}\n"
    )
    with pdserve_up(config, tmp_path, ray.get_runtime_context().gcs_address) as up:
        assert sorted((name, role) for name, (role, _) in up.instances.items()) == [
            ("decode-0", "decode"),
            ("prefill-0", "prefill"),
        ]
        assert (tmp_path / "cluster.json").is_file()
        client = openai.OpenAI(base_url=up.router_url, api_key="unused", max_retries=0)
        completion = client.completions.create(
            model=tiny_model_dir.name, prompt="hello", max_tokens=8, temperature=0
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        generate = [*CLI, "generate", "hello", "--cluster", "--config", str(up.config)]
        on_cluster = subprocess.run(
            [*generate, "--max-tokens", "8"],
            capture_output=True,
            text=True,
            env=up.env,
            timeout=120,
        )
        assert on_cluster.returncode == 0, on_cluster.stderr
        local = subprocess.run(
            [*CLI, "generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "8"],
            capture_output=True,
            text=True,
            env=up.env,
            timeout=120,
        )
        assert on_cluster.stdout == local.stdout and local.stdout.strip()
        assert completion.choices[0].text == local.stdout.rstrip("\n")
        down = subprocess.run(
            [*CLI, "down", "--config", str(up.config)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert down.returncode == 0, down.stderr
        assert up.process.wait(timeout=60) == 0
        assert not (tmp_path / "cluster.json").exists()
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if "e2e" in str(a)]
        assert alive == []
