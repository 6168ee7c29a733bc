"""Chaos: under a steady load of streaming and non-streaming requests on a 2 + 2 `pdserve up`
cluster, a decode actor, a prefill actor and the embedded Redis are killed in turn (SIGKILL).
Every request must complete with the text of an undisturbed run (0 lost, 0 duplicated tokens,
0 5xx), and every instance's blocks and reservations and the router's leases return to 0."""

from pathlib import Path

import psutil
import ray
from chaos_load import (
    CLIENTS,
    PROMPTS,
    Load,
    a_busy_decode,
    alive_again,
    check_lost_nothing,
    request,
)
from pdserve_up import UpCluster, pdserve_up
from waiting import wait_for


def redis_process(up: UpCluster) -> psutil.Process:
    [redis] = [p for p in psutil.Process(up.process.pid).children() if "redis" in p.name()]
    return redis


def test_kills_under_load_lose_nothing(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 192\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  replicas: 2\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
        f"storage:\n  device_write_policy: write_through\n"
        f"cluster:\n  namespace: pdserve-chaos\n  state_dir: {tmp_path}\n"
        f"  restart_backoff_s: 0.2\n"
    )
    address = ray.get_runtime_context().gcs_address
    with pdserve_up(config, tmp_path, address, "--health-interval", "0.5") as up:
        model = tiny_model_dir.name
        reference = {p: request(up, model, p, streamed=False) for p in range(len(PROMPTS))}
        assert all(r.status == 200 for r in reference.values())
        log = tmp_path / "up.log"
        with Load(up, model) as load:
            for victim in ("a busy decode", "prefill-1", "redis"):
                load.wait_for_more(2 * CLIENTS)
                if victim == "a busy decode":  # one streaming now: its requests must migrate
                    victim = a_busy_decode(up)
                if victim == "redis":
                    redis_process(up).kill()
                    wait_for(lambda: "embedded Redis died: restarted" in log.read_text(), 60)
                else:
                    pid = up.kill(victim)
                    wait_for(lambda v=victim, p=pid: alive_again(up, v, p), 120)
            load.wait_for_more(2 * CLIENTS)
        outcomes = load.outcomes
        assert len(outcomes) >= 8 * CLIENTS
        check_lost_nothing(up, outcomes, reference)
