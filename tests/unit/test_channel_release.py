"""Channels to peers that are gone are closed: a restarted instance comes back at a new address,
and the old address's channel would hold memory for good and dial it every second for half
an hour.

The blocking pools here are anonymous: a call on a closed channel with the credentials'
interceptor crashes grpcio (which is why a forgotten channel is closed only later)."""

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from credentials import SECRET
from waiting import wait_for

from pdserve.config import EngineConfig, RouterConfig
from pdserve.errors import InstanceUnavailableError
from pdserve.rpc.aio import AioChannelPool
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import InstanceClient
from pdserve.v1 import common_pb2, common_pb2_grpc
from services.router.membership import Membership
from services.router.model_info import model_info
from services.router.pd_client import PDClient
from services.router.router import Router

NOBODY = "127.0.0.1:1"  # nothing listens there
OTHER = "127.0.0.1:2"


def stub(channel: grpc.Channel) -> common_pb2_grpc.InstanceServiceStub:
    """Built while the channel is open: grpcio crashes building one on a closed channel."""
    return common_pb2_grpc.InstanceServiceStub(channel)


def closed(instance: common_pb2_grpc.InstanceServiceStub) -> bool:
    try:
        instance.GetStats(common_pb2.StatsRequest(), timeout=0.01)
    except ValueError:  # "Cannot invoke RPC on closed channel!"
        return True
    except grpc.RpcError:  # open: the call went out and found nobody
        return False
    raise AssertionError("nothing listens there, yet the call succeeded")


def test_a_forgotten_channel_is_closed_later_and_a_new_one_dialled_on_the_next_use() -> None:
    pool = ChannelPool()
    try:
        old, other = stub(pool.get(NOBODY)), stub(pool.get(OTHER))
        pool.close_forgotten_after_s = 3600
        pool.forget(NOBODY)
        assert not closed(old)  # whoever took it just before still calls on it
        fresh = stub(pool.get(NOBODY))
        pool.close_forgotten_after_s = 0
        pool.forget(NOBODY)
        wait_for(lambda: closed(fresh))
        assert not closed(other) and not closed(stub(pool.get(NOBODY)))
        pool.forget("127.0.0.1:3")  # never dialled: nothing to do
        pool.forget(OTHER, keep=lambda: True)  # its peer is back
        assert not closed(other)
    finally:
        pool.close()


def test_an_asyncio_channel_is_forgotten_from_another_thread_on_its_own_loop() -> None:
    async def scenario() -> None:
        pool = AioChannelPool(SECRET)
        old = pool.stubs(NOBODY).instance
        forgetting = threading.Thread(target=pool.forget, args=(NOBODY,))
        forgetting.start()
        forgetting.join()
        await asyncio.sleep(0)  # the loop runs the callback the thread queued, then this
        fresh = pool.stubs(NOBODY).instance
        assert fresh is not old
        pool.forget(NOBODY, keep=lambda: True)  # its peer is back
        await asyncio.sleep(0)
        assert pool.stubs(NOBODY).instance is fresh
        await pool.close()  # also waits for the forgotten channel's close
        with pytest.raises(grpc.aio.UsageError):
            await old.GetStats(common_pb2.StatsRequest(), timeout=1)

    asyncio.run(scenario())
    AioChannelPool().forget(NOBODY)  # no channel, no loop yet: nothing to do


def router(tiny_model_dir: Path, release_after_s: float) -> Router:
    model = model_info(EngineConfig(model=str(tiny_model_dir)), "tiny")
    channels = ChannelPool()
    channels.close_forgotten_after_s = 0
    routed = Router(RouterConfig(), model, Membership([OTHER], [NOBODY]), PDClient(channels))
    routed.release_channels_after_s = release_after_s
    return routed


def test_a_removed_instance_s_channel_is_closed_after_a_while(tiny_model_dir: Path) -> None:
    routed = router(tiny_model_dir, release_after_s=0.05)
    try:
        removed = stub(routed.client.channels.get(NOBODY))
        other = stub(routed.client.channels.get(OTHER))
        routed.remove_instance(NOBODY)
        wait_for(lambda: closed(removed))
        assert not closed(other)
    finally:
        routed.stop()


def test_a_channel_stays_open_while_its_instance_is_back_or_a_request_holds_it(
    tiny_model_dir: Path,
) -> None:
    """The release, when its time comes, leaves alone an instance added back meanwhile (a role
    change), and waits for the requests of this router still on it (a stream moving away)."""
    routed = router(tiny_model_dir, release_after_s=3600)  # released here by hand
    try:
        channel = stub(routed.client.channels.get(NOBODY))
        routed.remove_instance(NOBODY)
        routed.add_instance("decode", NOBODY)
        routed._release_channels(NOBODY)
        assert not closed(channel)

        routed.remove_instance(NOBODY)
        lease = routed.attempts.load.acquire(NOBODY, 0)
        routed._release_channels(NOBODY)
        assert not closed(channel)
        lease.release()
        routed._release_channels(NOBODY)
        wait_for(lambda: closed(channel))
    finally:
        routed.stop()


def test_an_instance_s_pool_forgets_the_channels_nobody_took_for_a_while() -> None:
    now = [0.0]
    pool = ChannelPool(forget_unused_after_s=60, clock=lambda: now[0])
    pool.close_forgotten_after_s = 0
    try:
        gone, busy = stub(pool.get(NOBODY)), stub(pool.get(OTHER))
        now[0] = 50.0
        pool.get(OTHER)  # taken again: its minute starts over
        now[0] = 100.0
        same = stub(pool.get(OTHER))  # the sweep: NOBODY was last taken 100 s ago
        wait_for(lambda: closed(gone))
        assert not closed(busy) and not closed(same)
        assert not closed(stub(pool.get(NOBODY)))  # dialled anew
    finally:
        pool.close()


def test_a_client_kept_across_a_forget_calls_on_a_fresh_channel() -> None:
    """A prefill keeps its decode's client for a whole request: a call it makes after the pool
    forgot and closed the channel goes out on a new one (building a stub on the closed one
    would crash the process)."""
    pool = ChannelPool()
    pool.close_forgotten_after_s = 0
    try:
        client = InstanceClient(NOBODY, pool)
        old = stub(pool.get(NOBODY))
        pool.forget(NOBODY)
        wait_for(lambda: closed(old))
        with pytest.raises(InstanceUnavailableError):
            client.stats()
    finally:
        pool.close()
