"""An instance that is alive but fails every step: its circuit breaker takes it out of routing
although its KV-event stream (and so its liveness) stays up."""

from collections.abc import Callable

from stacks import Stack

from pdserve.engine.request import SamplingParams
from services.router.breakers import BreakerState
from services.router.membership import Role


def test_an_instance_whose_steps_fail_stops_taking_requests(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(
        mixed=2,
        router={"prefill_policy": "round_robin", "breaker_failures": 2,
                "breaker_cooldown_s": 600, "retry_backoff_s": 0.01},
    )  # fmt: skip
    sick, well = stack.mixed
    runner = sick.instance.runtime.engine.runner
    execute = runner.execute_all
    failed_steps = []

    def failing(chunks: object) -> object:
        failed_steps.append(chunks)
        raise RuntimeError("injected: this instance's device fails every step")

    runner.execute_all = failing  # type: ignore[method-assign,assignment]
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        for n in range(8):  # round robin would send every other one to the sick instance
            generation = stack.generate([4 + n] * 20, params)
            assert generation.final.num_output_tokens == 3  # retried on the well instance
        router = stack.router
        breakers = router.attempts.routing.breakers
        assert breakers.state(sick.address) == BreakerState.OPEN
        assert breakers.state(well.address) == BreakerState.CLOSED
        assert len(failed_steps) == 2  # after two failures in a row it got no request
        # alive all along: its stream marks it healthy, only the breaker keeps it out
        assert sick.address in router.membership.routable(Role.PREFILL)
        registry = router.metrics.registry
        labels = {"backend": sick.address}
        assert registry.get_sample_value("pdserve_router_circuit_opens_total", labels) == 1
        assert registry.get_sample_value("pdserve_router_circuit_state", labels) == 1
    finally:
        runner.execute_all = execute  # type: ignore[method-assign]
