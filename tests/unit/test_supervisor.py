"""The supervisor's restart budget: `cluster.max_restarts` restarts of an instance within
`cluster.restart_window_s`; a crash loop is given up, a loss long after the last one is healed.
A real router; the cluster side (Ray) is a fake whose instances die when told."""

from dataclasses import replace
from pathlib import Path

from credentials import SECRET

from pdserve.config import ClusterConfig, EngineConfig, RouterConfig
from pdserve.rpc.channels import ChannelPool
from services.controller.cluster import InstanceInfo
from services.controller.supervisor import Supervisor
from services.router.membership import Membership, Role
from services.router.model_info import model_info
from services.router.pd_client import PDClient
from services.router.router import Router


class FakeCluster:
    """One decode instance; `die()` makes it dead until the next restart."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.instances = [InstanceInfo("decode-0", "decode", "d:0")]
        self.dead: set[str] = set()

    def die(self) -> None:
        self.dead.add("decode-0")

    def dead_instances(self) -> list[str]:
        return sorted(self.dead)

    def info(self, name: str) -> InstanceInfo | None:
        return next((i for i in self.instances if i.name == name), None)

    def restart_instance(self, name: str) -> InstanceInfo:
        old = self.info(name)
        assert old is not None
        new = replace(old, address=f"d:{old.restarts + 1}", restarts=old.restarts + 1)
        self.instances = [new]
        self.dead.discard(name)
        return new


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Supervised = tuple[FakeCluster, Router, Supervisor, Clock, list[str]]  # and its reports


def supervised(tiny_model_dir: Path, window_s: float | None) -> Supervised:
    config = ClusterConfig(max_restarts=2, restart_window_s=window_s, restart_backoff_s=0.0)
    cluster = FakeCluster(config)
    model = model_info(EngineConfig(model=str(tiny_model_dir)), "tiny")
    client = PDClient(ChannelPool(SECRET))  # connects to nobody
    router = Router(RouterConfig(), model, Membership([], ["d:0"]), client)
    clock, reports = Clock(), []
    supervisor = Supervisor(cluster, router, lambda: None, reports.append, clock)  # type: ignore[arg-type]
    return cluster, router, supervisor, clock, reports


def lose_and_check(
    cluster: FakeCluster, supervisor: Supervisor, clock: Clock, after_s: float
) -> None:
    clock.now += after_s
    cluster.die()
    supervisor.check()


def test_losses_spread_over_more_than_the_window_are_always_healed(tiny_model_dir: Path) -> None:
    cluster, router, supervisor, clock, reports = supervised(tiny_model_dir, window_s=600.0)
    try:
        for _ in range(5):  # more losses than max_restarts, each 10 minutes after the last
            lose_and_check(cluster, supervisor, clock, after_s=600.0)
            assert cluster.dead == set()
        assert cluster.instances[0].restarts == 5
        assert router.membership.members(Role.DECODE) == ("d:5",)
        assert not any("budget is spent" in line for line in reports)
    finally:
        router.stop()


def test_a_crash_loop_within_the_window_is_given_up(tiny_model_dir: Path) -> None:
    cluster, router, supervisor, clock, reports = supervised(tiny_model_dir, window_s=600.0)
    try:
        for _ in range(2):
            lose_and_check(cluster, supervisor, clock, after_s=60.0)
            assert cluster.dead == set()
        lose_and_check(cluster, supervisor, clock, after_s=60.0)  # the third in 3 minutes
        assert cluster.dead == {"decode-0"} and router.membership.members(Role.DECODE) == ()
        assert "restart budget is spent (2 restarts tried in the last 600 s" in reports[-1]
    finally:
        router.stop()


def test_without_a_window_the_budget_is_for_the_instance_s_lifetime(tiny_model_dir: Path) -> None:
    cluster, router, supervisor, clock, reports = supervised(tiny_model_dir, window_s=None)
    try:
        for _ in range(2):
            lose_and_check(cluster, supervisor, clock, after_s=86400.0)
        lose_and_check(cluster, supervisor, clock, after_s=86400.0)
        assert cluster.dead == {"decode-0"}
        assert "restart budget is spent (2 restarts tried, cluster.max_restarts)" in reports[-1]
    finally:
        router.stop()
