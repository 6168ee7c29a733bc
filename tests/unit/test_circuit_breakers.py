"""CircuitBreakers: consecutive failures open an instance's breaker for a cool-down, then one
probe decides whether it closes or opens again for longer."""

from services.router.breakers import MAX_COOLDOWN_FACTOR, BreakerState, CircuitBreakers

A, B = "10.0.0.1:50051", "10.0.0.2:50051"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


Changes = list[tuple[str, BreakerState]]


def breakers(clock: Clock, changes: Changes | None = None) -> CircuitBreakers:
    """Three failures in a row open a breaker for 10 s; `changes` records its transitions."""
    seen: Changes = changes if changes is not None else []
    return CircuitBreakers(3, 10.0, lambda a, s: seen.append((a, s)), clock)


def test_consecutive_failures_open_the_breaker_and_a_success_resets_the_count() -> None:
    clock, changes = Clock(), Changes()
    b = breakers(clock, changes)
    b.failed(A)
    b.failed(A)
    b.succeeded(A)  # not in a row: the count starts over
    b.failed(A)
    b.failed(A)
    assert b.admitted([A, B]) == [A, B]
    b.failed(A)
    assert b.state(A) == BreakerState.OPEN
    assert b.admitted([A, B]) == [B]
    assert b.retry_after_s([A]) == 10.0
    assert changes == [(A, BreakerState.OPEN)]


def test_after_the_cool_down_one_probe_goes_through_and_its_success_closes_the_breaker() -> None:
    clock, changes = Clock(), Changes()
    b = breakers(clock, changes)
    for _ in range(3):
        b.failed(A)
    clock.now += 10.0
    assert b.admitted([A]) == [A]  # the cool-down ended
    b.sent(A)  # the probe
    assert b.state(A) == BreakerState.HALF_OPEN
    assert b.admitted([A, B]) == [B]  # one probe at a time
    b.succeeded(A)
    assert b.state(A) == BreakerState.CLOSED
    assert b.admitted([A, B]) == [A, B]
    assert [state for _, state in changes] == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_a_failed_probe_opens_it_again_for_twice_as_long_up_to_a_limit() -> None:
    clock = Clock()
    b = breakers(clock)
    for _ in range(3):
        b.failed(A)
    cooldowns = []
    for _ in range(6):
        clock.now += 1000.0
        b.sent(A)
        b.failed(A)
        cooldowns.append(b.retry_after_s([A]))
    assert cooldowns == [20.0, 40.0, 80.0, 80.0, 80.0, 80.0]
    assert max(cooldowns) == 10.0 * MAX_COOLDOWN_FACTOR


def test_a_probe_that_never_reports_lets_the_next_request_probe() -> None:
    clock = Clock()
    b = breakers(clock)
    for _ in range(3):
        b.failed(A)
    clock.now += 10.0
    b.sent(A)  # its client went away: no outcome
    assert b.admitted([A]) == []
    clock.now += 10.0
    assert b.admitted([A]) == [A]


def test_a_late_failure_of_a_request_sent_before_it_opened_keeps_the_cool_down() -> None:
    clock = Clock()
    b = breakers(clock)
    for _ in range(3):
        b.failed(A)
    clock.now += 5.0
    b.failed(A)
    assert b.retry_after_s([A]) == 5.0


def test_zero_failures_disables_the_breakers() -> None:
    b = CircuitBreakers(0, 10.0)
    for _ in range(100):
        b.failed(A)
    assert b.admitted([A]) == [A]
