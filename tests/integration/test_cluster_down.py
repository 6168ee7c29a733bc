"""`Cluster.down` on real Ray actors: instances stop all at once, so one slow to stop does not
hold back the others' clean stop. The instance actors are stand-ins (the other side of the
interface: `stop` and `ping`)."""

import logging
import threading
from pathlib import Path

import pytest
import ray
from credentials import SECRET
from waiting import wait_for

from pdserve.config import ClusterConfig, EngineConfig
from services.controller.cluster import Cluster, InstanceInfo


@ray.remote(max_concurrency=2)
class Latch:
    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def wait(self, timeout_s: float) -> bool:
        return self._open.wait(timeout_s)


@ray.remote
class StandIn:
    """An instance whose `stop` either opens the latch or waits for it to open: it stops
    cleanly only if the other instance's stop was asked for while it waits."""

    def __init__(self, latch: ray.actor.ActorHandle, opens: bool) -> None:
        self.latch, self.opens = latch, opens

    def stop(self) -> None:
        if self.opens:
            ray.get(self.latch.open.remote())
        elif not ray.get(self.latch.wait.remote(20.0)):
            raise RuntimeError("the other instance was not asked to stop meanwhile")

    def ping(self) -> bool:
        return True


def dead(actor: ray.actor.ActorHandle) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_down_asks_every_instance_to_stop_at_once_then_kills_each(
    ray_session: None, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = Cluster(ClusterConfig(engine=EngineConfig(model=str(tiny_model_dir))), SECRET)
    latch = Latch.remote()  # type: ignore[attr-defined]
    # the first to be stopped waits for the second: one by one, it could never stop cleanly
    actors = {"decode-0": StandIn.remote(latch, False), "decode-1": StandIn.remote(latch, True)}  # type: ignore[attr-defined]
    cluster._actors = dict(actors)
    cluster.instances = [InstanceInfo(name, "decode", f"host:{n}") for n, name in enumerate(actors)]
    with caplog.at_level(logging.WARNING, logger="services.controller.cluster"):
        cluster.down()
    assert "did not stop cleanly" not in caplog.text
    for actor in actors.values():  # killed once stopped (`ray.kill` takes effect a bit later)
        wait_for(lambda actor=actor: dead(actor), timeout_s=30)
    assert cluster.instances == [] and cluster._actors == {}
    ray.kill(latch)
