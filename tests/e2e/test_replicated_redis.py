"""A replicated Redis under a serving cluster: `pdserve up` names the storage tier's Redis
through its Sentinel (an ACL user, a Sentinel password), the primary is killed under a steady
load, the Sentinel promotes the replica. Serving goes on throughout with the undisturbed texts,
and every instance's tier follows the promoted replica."""

from pathlib import Path

import httpx
import ray
from chaos_load import CLIENTS, PROMPTS, Load, check_lost_nothing, request
from pdserve_up import UpCluster, pdserve_up
from redis_replicas import ReplicatedRedis, wait_for_failover
from waiting import wait_for


def tiers_available(up: UpCluster) -> bool:
    return all(up.stats(info.address).storage.available for info in up.list_instances().values())


def blocks_written(up: UpCluster) -> int:
    return sum(up.stats(i.address).storage.blocks_written for i in up.list_instances().values())


def test_serving_goes_on_through_a_redis_failover(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "redis").mkdir()
    with ReplicatedRedis(tmp_path / "redis") as group:
        config = (
            f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n"
            f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
            f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
            f"storage:\n  redis_url: '{group.url}'\n  device_write_policy: write_through\n"
            f"  reconnect_interval_s: 0.2\n"
            f"cluster:\n  namespace: pdserve-sentinel\n  state_dir: {tmp_path}\n"
        )
        address = ray.get_runtime_context().gcs_address
        with pdserve_up(config, tmp_path, address) as up:
            assert group.password not in (tmp_path / "up.log").read_text()
            model = tiny_model_dir.name
            reference = {p: request(up, model, p, streamed=False) for p in range(len(PROMPTS))}
            primary = group.client("primary")
            assert primary.dbsize() > 0  # the index is in use
            with Load(up, model) as load:
                load.wait_for_more(2 * CLIENTS)
                old = group.primary_port()
                group.kill("primary")
                failover_s = wait_for_failover(group, old)
                load.wait_for_more(2 * CLIENTS)
                written = blocks_written(up)
                fresh = {"model": model, "prompt": "A fresh prompt, never served before:",
                         "max_tokens": 40, "temperature": 0}  # fmt: skip
                assert httpx.post(f"{up.router_url}/completions", json=fresh, timeout=60).is_success
                wait_for(lambda: blocks_written(up) > written and tiers_available(up), 30)
                load.wait_for_more(2 * CLIENTS)
            print(f"Sentinel failover took {failover_s:.1f} s")
            check_lost_nothing(up, load.outcomes, reference, migrated=False)
            promoted = group.client("replica")
            assert promoted.info("replication")["role"] == "master"
            assert promoted.dbsize() > 0
            for info in up.list_instances().values():
                assert up.stats(info.address).storage.read_errors == 0, info.name
