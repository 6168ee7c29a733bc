"""`pdserve up`, the OpenAI API it serves, `pdserve generate --cluster` and `pdserve down`, as an
operator runs them."""

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import openai
import psutil
import ray
from pdserve_up import CLI, pdserve_up
from waiting import wait_for


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
        log = tmp_path / "up.log"
        up.process.send_signal(signal.SIGUSR1)  # every thread's stack to stderr; serving goes on
        # The main thread's watch loop; faulthandler writes it last, so wait for it, not the first.
        wait_for(lambda: "_serve_cluster" in log.read_text(), timeout_s=10)
        again = client.completions.create(
            model=tiny_model_dir.name, prompt="hello", max_tokens=8, temperature=0
        )
        assert again.choices[0].text == completion.choices[0].text
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


def test_sigterm_while_up_places_its_instances_stops_it_and_leaves_nothing(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The prefill instance asks for more CPUs than the cluster has: its placement waits.
    config = tmp_path / "pdserve.yaml"
    config.write_text(
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n"
        f"prefill:\n  num_cpus: 64\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-e2e-stopped\n  state_dir: {tmp_path}\n"
    )
    address = ray.get_runtime_context().gcs_address
    up = subprocess.Popen(
        [*CLI, "up", "--config", str(config), "--address", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:

        def redis_started() -> bool:  # in `Cluster.up`, after Ray is joined
            return any("redis" in child.name() for child in psutil.Process(up.pid).children())

        wait_for(redis_started, 120)
        wait_for(lambda: unplaceable_groups() > 0, 60)
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, err
    assert "pdserve up: stopped while starting" in err and "pdserve is down" in out
    assert not (tmp_path / "cluster.json").exists() and not (tmp_path / "admin_token").exists()
    assert unplaceable_groups() == 0  # nothing stays reserved on the cluster


def unplaceable_groups() -> int:
    """Placement groups on the test's Ray cluster that reserve (or wait for) 64 CPUs."""
    table: dict[str, dict[str, Any]] = ray.util.placement_group_table()
    return sum(
        1
        for group in table.values()
        if group["state"] != "REMOVED"
        and any(bundle.get("CPU") == 64 for bundle in group["bundles"].values())
    )
