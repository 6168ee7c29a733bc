"""LoadTracker: in-flight counters through leases released exactly once, on every path."""

import threading
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.errors import IntegrityError
from services.router.load import IDLE, PENDING_MAX_S, InstanceLoad, Lease, LoadTracker

A, B = "10.0.0.1:50051", "10.0.0.2:50051"


class Boom(Exception):
    """Stands for any error raised while a request holds its lease."""


def total(tracker: LoadTracker) -> InstanceLoad:
    loads = tracker.snapshot().values()
    return InstanceLoad(
        sum(load.in_flight_requests for load in loads),
        sum(load.in_flight_prefill_tokens for load in loads),
    )


@pytest.fixture
def tracker() -> Iterator[LoadTracker]:
    tracker = LoadTracker()
    yield tracker
    tracker.check_integrity()


def test_acquire_counts_requests_and_prefill_tokens_per_instance(tracker: LoadTracker) -> None:
    tracker.acquire(A, 100)
    tracker.acquire(A, 50)
    tracker.acquire(B, 7)
    assert tracker.snapshot() == {A: InstanceLoad(2, 150), B: InstanceLoad(1, 7)}
    assert tracker.load_of(A) == InstanceLoad(2, 150)
    assert tracker.load_of("unknown:1") == IDLE
    assert total(tracker) == InstanceLoad(3, 157)


def test_release_returns_true_only_once_when_called_twice(tracker: LoadTracker) -> None:
    lease = tracker.acquire(A, 100)
    keep = tracker.acquire(A, 10)
    assert lease.release() is True
    assert lease.release() is False
    assert lease.released
    assert tracker.snapshot() == {A: InstanceLoad(1, 10)}
    keep.release()
    assert tracker.snapshot() == {}


def test_context_manager_releases_once_when_body_raises_after_early_release(
    tracker: LoadTracker,
) -> None:
    with pytest.raises(Boom), tracker.acquire(A, 64) as lease:
        assert tracker.load_of(A) == InstanceLoad(1, 64)
        lease.release()  # an error path releasing early; the `with` must not release again
        raise Boom
    assert tracker.snapshot() == {}


def test_finish_prefill_drops_tokens_but_keeps_request_in_flight(tracker: LoadTracker) -> None:
    lease = tracker.acquire(A, 300)
    assert lease.finish_prefill() is True
    assert lease.finish_prefill() is False
    assert tracker.load_of(A) == InstanceLoad(1, 0)
    lease.release()
    assert lease.finish_prefill() is False
    assert tracker.snapshot() == {}


def test_acquire_rejects_negative_prefill_tokens(tracker: LoadTracker) -> None:
    with pytest.raises(ValueError, match="prefill_tokens"):
        tracker.acquire(A, -1)
    assert tracker.snapshot() == {}


def test_snapshot_is_unaffected_by_later_changes(tracker: LoadTracker) -> None:
    lease = tracker.acquire(A, 5)
    snapshot = tracker.snapshot()
    lease.release()
    assert snapshot == {A: InstanceLoad(1, 5)}


def test_check_integrity_raises_when_counter_disagrees_with_leases() -> None:
    tracker = LoadTracker()
    tracker.acquire(A, 5)
    tracker._loads[A] = InstanceLoad(2, 5)  # simulate a bookkeeping bug
    with pytest.raises(IntegrityError, match="sums over live leases"):
        tracker.check_integrity()
    tracker._loads[A] = InstanceLoad(1, -5)
    with pytest.raises(IntegrityError, match="negative"):
        tracker.check_integrity()


def test_concurrent_releases_of_same_leases_release_each_once(tracker: LoadTracker) -> None:
    leases = [tracker.acquire(A if i % 2 else B, i) for i in range(500)]
    wins: list[int] = []
    barrier = threading.Barrier(4)

    def release_all() -> None:
        barrier.wait()
        wins.append(sum(lease.release() for lease in leases))

    threads = [threading.Thread(target=release_all) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(wins) == len(leases)
    assert tracker.snapshot() == {}


# -- property tests --------------------------------------------------------------------------------

INSTANCES = (A, B, "10.0.0.3:50051")
ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from(INSTANCES), st.integers(0, 4096)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("double_release"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("finish_prefill"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("raise_in_with"), st.sampled_from(INSTANCES), st.integers(0, 4096)),
        st.tuples(st.just("ok_in_with"), st.sampled_from(INSTANCES), st.integers(0, 4096)),
    ),
    max_size=60,
)
Op = tuple[str, str | int, int]
Check = Callable[[list[Lease]], None]


def run_ops(tracker: LoadTracker, script: list[Op], check: Check) -> None:
    """Apply `script`, calling `check(leases held)` after every step; release what is left."""
    held: list[Lease] = []
    for kind, target, tokens in script:
        if kind == "acquire":
            assert isinstance(target, str)
            held.append(tracker.acquire(target, tokens))
        elif kind in ("raise_in_with", "ok_in_with"):
            assert isinstance(target, str)
            with_lease(tracker, target, tokens, raises=kind == "raise_in_with")
        elif held:
            assert isinstance(target, int)
            lease = held[target % len(held)]
            if kind == "finish_prefill":
                lease.finish_prefill()
            else:
                assert lease.release() is True
                if kind == "double_release":
                    assert lease.release() is False
                held.remove(lease)
        check(held)
    for lease in held:
        assert lease.release() is True


def with_lease(tracker: LoadTracker, instance_id: str, tokens: int, *, raises: bool) -> None:
    lease: Lease | None = None
    try:
        with tracker.acquire(instance_id, tokens) as lease:
            assert tracker.load_of(instance_id).in_flight_requests >= 1
            if raises:
                raise Boom
    except Boom:
        pass
    assert lease is not None and lease.released


def expected_loads(leases: list[Lease]) -> dict[str, InstanceLoad]:
    loads: dict[str, InstanceLoad] = {}
    for lease in leases:
        load = loads.get(lease.instance_id, IDLE)
        loads[lease.instance_id] = InstanceLoad(
            load.in_flight_requests + 1,
            load.in_flight_prefill_tokens + lease._outstanding_prefill_tokens,
        )
    return loads


@settings(max_examples=150, deadline=None)
@given(script=ops)
def test_counters_track_live_leases_then_return_to_zero_after_random_script(
    script: list[Op],
) -> None:
    tracker = LoadTracker()

    def check(held: list[Lease]) -> None:
        tracker.check_integrity()
        assert tracker.snapshot() == expected_loads(held)

    run_ops(tracker, script, check)
    assert tracker.snapshot() == {}
    tracker.check_integrity()


@settings(max_examples=25, deadline=None)
@given(scripts=st.lists(ops, min_size=2, max_size=4))
def test_counters_return_to_zero_when_threads_run_random_scripts_concurrently(
    scripts: list[list[Op]],
) -> None:
    tracker = LoadTracker()
    barrier = threading.Barrier(len(scripts))
    errors: list[BaseException] = []

    def check(held: list[Lease]) -> None:
        tracker.check_integrity()
        assert total(tracker).in_flight_requests >= len(held)

    def worker(script: list[Op]) -> None:
        barrier.wait()
        try:
            run_ops(tracker, script, check)
        except BaseException as error:  # surfaced in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(script,)) for script in scripts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert tracker.snapshot() == {}
    tracker.check_integrity()


def test_a_lease_is_pending_until_its_instance_acknowledges_its_route_number(
    tracker: LoadTracker,
) -> None:
    first, second = tracker.next_seq(), tracker.next_seq()
    tracker.acquire(A, 40, first)
    tracker.acquire(A, 8, second)
    assert tracker.pending(A) == InstanceLoad(2, 48)
    tracker.acknowledge(A, first)  # A's report counts the first request now
    assert tracker.pending(A) == InstanceLoad(1, 8)
    tracker.acknowledge(A, first)  # an older report again: nothing changes
    assert tracker.pending(A) == InstanceLoad(1, 8)
    later = tracker.acquire(A, 5, tracker.next_seq())
    tracker.acknowledge(A, second)
    assert tracker.pending(A) == InstanceLoad(1, 5)
    later.release()  # released before its acknowledgement (it failed on the way)
    assert tracker.pending(A) == IDLE
    assert tracker.load_of(A) == InstanceLoad(2, 48)  # the router's own bookkeeping holds both


def test_a_lease_never_acknowledged_stops_counting_after_the_pending_limit(
    tracker: LoadTracker,
) -> None:
    leaked = tracker.acquire(B, 30, tracker.next_seq())  # e.g. a lease a bug never releases
    fresh = tracker.acquire(B, 2, tracker.next_seq())
    assert tracker.pending(B) == InstanceLoad(2, 32)
    leaked.acquired_at -= PENDING_MAX_S  # its request never reached B
    assert tracker.pending(B) == InstanceLoad(1, 2)
    assert tracker.load_of(B) == InstanceLoad(2, 32)
    tracker.acknowledge(B, fresh.seq)
    assert tracker.pending(B) == IDLE
    leaked.release()
    fresh.release()


def test_a_lease_numbered_at_or_below_the_acknowledged_one_is_never_pending(
    tracker: LoadTracker,
) -> None:
    tracker.acknowledge(A, 10)
    lease = tracker.acquire(A, 3, 7)  # reached A before the router took it (reordered)
    assert tracker.pending(A) == IDLE
    lease.release()
