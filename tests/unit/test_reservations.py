"""ReservationTable: leases, writes in flight, cancellation."""

import pytest

from pdserve.engine.request import Request, SamplingParams
from pdserve.errors import KVTransferError
from pdserve.kvcache.hashing import BlockHasher
from services.decode.reservations import ReservationTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_request(request_id: str) -> Request:
    return Request(request_id, tuple(range(40)), SamplingParams(), BlockHasher.for_model(16, "t"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> ReservationTable:
    return ReservationTable(clock)


def test_lease_expires_after_its_timeout(table: ReservationTable, clock: FakeClock) -> None:
    table.add(make_request("a"), (1, 2, 3), num_cached_blocks=0, lease_s=5.0)
    clock.now += 4.9
    assert table.pop_expired() == []
    clock.now += 0.2
    assert [r.request.request_id for r in table.pop_expired()] == ["a"]
    assert len(table) == 0


def test_lease_does_not_expire_while_a_stream_writes(
    table: ReservationTable, clock: FakeClock
) -> None:
    table.add(make_request("a"), (1, 2, 3), num_cached_blocks=1, lease_s=1.0)
    assert table.begin_write("a", 1, 2) == (2, 3)
    clock.now += 10
    assert table.pop_expired() == []
    assert table.end_write("a", 1, 2, ok=True) is None
    assert table.pop_expired() == []  # the write renewed the lease: one more from its end
    clock.now += 1
    assert table.pop_expired()[0].complete


def test_writes_outside_the_writable_range_are_refused(table: ReservationTable) -> None:
    table.add(make_request("a"), (1, 2, 3), num_cached_blocks=1, lease_s=1.0)
    for first, count in ((0, 1), (2, 2), (1, 0)):
        with pytest.raises(KVTransferError):
            table.begin_write("a", first, count)
    with pytest.raises(KVTransferError, match="no reservation"):
        table.begin_write("b", 1, 1)


def test_release_during_a_write_is_deferred_to_the_write_end(table: ReservationTable) -> None:
    table.add(make_request("a"), (1, 2), num_cached_blocks=0, lease_s=1.0)
    table.begin_write("a", 0, 1)
    assert table.pop("a") is None  # marked cancelled, blocks still being written
    released = table.end_write("a", 0, 1, ok=True)
    assert released is not None and released.request.request_id == "a"
    assert len(table) == 0


def test_failed_write_hands_the_reservation_back(table: ReservationTable) -> None:
    table.add(make_request("a"), (1, 2), num_cached_blocks=0, lease_s=1.0)
    table.begin_write("a", 0, 2)
    released = table.end_write("a", 0, 2, ok=False)
    assert released is not None and not released.complete
    assert len(table) == 0


def test_reserved_block_count_excludes_shared_prefix_blocks(table: ReservationTable) -> None:
    table.add(make_request("a"), (1, 2, 3, 4), num_cached_blocks=3, lease_s=1.0)
    table.add(make_request("b"), (5, 6), num_cached_blocks=0, lease_s=1.0)
    assert table.num_blocks() == 3
