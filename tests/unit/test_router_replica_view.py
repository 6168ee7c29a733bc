"""A router replica follows the primary's view: members per role, drained marks, the policy; and
how an instance shutting down is drained."""

from pathlib import Path

from credentials import SECRET

from pdserve.config import EngineConfig, RouterConfig
from pdserve.rpc.channels import ChannelPool
from services.router.membership import Membership, Role
from services.router.model_info import model_info
from services.router.pd_client import PDClient
from services.router.replicas import View
from services.router.router import Router


def router(tiny_model_dir: Path, prefill: list[str], decode: list[str]) -> Router:
    model = model_info(EngineConfig(model=str(tiny_model_dir)), "tiny")
    client = PDClient(ChannelPool(SECRET))  # connects to nobody until asked
    return Router(RouterConfig(), model, Membership(prefill, decode), client)


def test_a_replica_takes_the_primary_s_members_drained_marks_and_policy(
    tiny_model_dir: Path,
) -> None:
    primary = router(tiny_model_dir, ["p1:1", "p2:1"], ["d1:1"])
    replica = router(tiny_model_dir, ["p1:1", "old:1"], ["d1:1", "d2:1"])
    try:
        primary.membership.set_drained("p2:1", True)
        primary.set_policy("least_load")
        replica.membership.set_drained("d1:1", True)
        View.of(primary).apply(replica)
        assert replica.membership.members(Role.PREFILL) == ("p1:1", "p2:1")
        assert replica.membership.members(Role.DECODE) == ("d1:1",)
        assert replica.membership.is_drained("p2:1") and not replica.membership.is_drained("d1:1")
        assert replica.attempts.policy_name == "least_load"
        assert View.of(replica) == View.of(primary)
    finally:
        primary.stop()
        replica.stop()


def test_a_leaving_instance_is_drained_until_resumed_or_removed() -> None:
    """An instance shutting down (SIGTERM) is drained as if by an operator, but marked leaving,
    so that the one restarted in its place is not; resuming or removing it drops both marks."""
    membership = Membership(["p1:1"], ["d1:1", "d2:1"])
    membership.set_leaving("d1:1")
    assert membership.is_drained("d1:1") and membership.is_leaving("d1:1")
    assert membership.routable(Role.DECODE) == ["d2:1"]
    membership.set_drained("d1:1", False)
    assert not membership.is_drained("d1:1") and not membership.is_leaving("d1:1")
    membership.set_leaving("d2:1")
    membership.remove("d2:1")
    assert not membership.is_leaving("d2:1") and membership.members(Role.DECODE) == ("d1:1",)


def test_a_removed_instance_leaves_no_metric_series(tiny_model_dir: Path) -> None:
    """A restarted instance comes back at another address: the old one's gauges go with it
    (no stale in-flight count, no series per restart)."""
    primary = router(tiny_model_dir, ["p1:1"], ["d1:1", "d2:1"])
    try:
        primary.export_load()
        registry = primary.metrics.registry
        labels = {"backend": "d2:1"}
        assert registry.get_sample_value("pdserve_router_in_flight_requests", labels) == 0
        primary.remove_instance("d2:1")
        assert registry.get_sample_value("pdserve_router_in_flight_requests", labels) is None
        assert (
            registry.get_sample_value("pdserve_router_in_flight_requests", {"backend": "d1:1"}) == 0
        )
    finally:
        primary.stop()
