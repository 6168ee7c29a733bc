"""KVEventBroadcaster: numbered events, a replay buffer for short gaps, and a digest that equals
the published set's."""

import queue

from pdserve.kvcache.events import (
    BlockRemoved,
    BlockStored,
    KVDigest,
    KVEventBroadcaster,
    LoadReport,
    Numbered,
)
from pdserve.kvcache.hashing import BlockHash

H = [BlockHash(bytes([i]) * 32) for i in range(8)]


def drain(subscriber: "queue.Queue[Numbered | None]") -> list[Numbered | None]:
    items = []
    while not subscriber.empty():
        items.append(subscriber.get_nowait())
    return items


def test_events_are_numbered_and_reports_carry_the_last_number() -> None:
    events = KVEventBroadcaster()
    replay, subscriber = events.subscribe()
    assert replay is None  # a new subscription starts from a snapshot
    events.publish(BlockStored((H[0], H[1])))
    events.report(LoadReport(num_running=1))
    events.publish(BlockRemoved((H[0],)))
    assert [(n.seq, type(n.item).__name__) for n in drain(subscriber)] == [
        (1, "BlockStored"),
        (1, "LoadReport"),
        (2, "BlockRemoved"),
    ]
    assert events.seq == 2


def test_a_resumed_subscription_replays_what_the_buffer_holds_else_asks_for_a_snapshot() -> None:
    events = KVEventBroadcaster(replay_events=3)
    for block_hash in H[:5]:
        events.publish(BlockStored((block_hash,)))
    replay, _ = events.subscribe(events.epoch, 3)
    assert replay is not None and [n.seq for n in replay] == [4, 5]
    assert events.subscribe(events.epoch, 5)[0] == []  # up to date: nothing to replay
    assert events.subscribe(events.epoch, 1)[0] is None  # event 2 left the buffer
    assert events.subscribe(events.epoch + 2, 4)[0] is None  # another epoch: a restart
    assert events.subscribe(events.epoch, 9)[0] is None  # ahead of the instance: start over


def test_the_digest_follows_the_published_set() -> None:
    events = KVEventBroadcaster()
    events.publish(BlockStored((H[0], H[1], H[2])))
    events.publish(BlockRemoved((H[1],)))
    events.publish(BlockStored((H[3],)))
    assert events.digest == KVDigest.of([H[0], H[2], H[3]])
    assert events.digest.num_blocks == 3
    assert events.digest != KVDigest.of([H[0], H[2]])
    assert KVDigest.of([H[2], H[0]]) == KVDigest.of([H[0], H[2]])  # order-free


def test_every_subscription_ends_when_the_instance_disconnects_them() -> None:
    events = KVEventBroadcaster(max_backlog=2)
    _, slow = events.subscribe()
    for block_hash in H[:3]:  # the third does not fit: the subscriber is dropped
        events.publish(BlockStored((block_hash,)))
    assert drain(slow)[-1] is None
    assert not events.has_subscribers()
