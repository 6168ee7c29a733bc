"""Router retries and exactly-once load accounting, against a fake PD client (the instances'
side of the interface): random failures before and after the first token, and cancellations."""

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import EngineConfig, RouterConfig
from pdserve.engine.request import SamplingParams
from pdserve.errors import (
    DecodeUnavailableError,
    DuplicateRequestError,
    InstanceUnavailableError,
    InvalidRequestError,
    KVTransferError,
    NoCapacityError,
    PdserveError,
    RequestAbortedError,
    ResourceExhaustedError,
)
from services.router.membership import Membership, Role
from services.router.model_info import ModelInfo, model_info
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router

PREFILL = ["p0", "p1", "p2"]
DECODE = ["d0", "d1"]
OUTCOMES = ["ok", "transfer_error", "refused", "mid_stream_error", "invalid"]


class FakePDClient:
    """Plays scripted outcomes, one per attempt, and records what the router asked for."""

    outputs = SimpleNamespace(subscriber="router")  # the id its load reports would name

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = list(outcomes)
        self.routes: list[tuple[str, str]] = []
        self.aborted: list[str] = []

    async def generate(
        self, prefill: str, decode: str, ids: list[int], params: SamplingParams, request_id: str,
        hashes: object = None, metadata: object = (), route_seq: int = 0, source: object = None,
    ) -> AsyncIterator[TokenDelta | Finished]:  # fmt: skip
        self.routes.append((prefill, decode))
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        errors: dict[str, PdserveError] = {
            "transfer_error": KVTransferError("prefill died"),
            "refused": ResourceExhaustedError("decode full", 50),
            "invalid": InvalidRequestError("bad prompt"),
            "aborted": RequestAbortedError("aborted by an operator"),
            "decode_down": DecodeUnavailableError("decode d0 is gone"),
            "prefill_down": InstanceUnavailableError("prefill p0 is gone"),
            "duplicate": DuplicateRequestError("request id 'r' is already in flight"),
        }
        if outcome in errors:
            raise errors[outcome]
        yield TokenDelta((1,), "a")
        if outcome == "mid_stream_error":
            raise KVTransferError("decode died mid-stream")
        yield TokenDelta((2,), "b")
        yield Finished("length", "", len(ids), 2, None)  # type: ignore[arg-type]

    def abort(self, prefill: str, decode: str, request_id: str) -> None:
        self.aborted.append(request_id)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> ModelInfo:
    return model_info(EngineConfig(model=str(tiny_model_dir)), "tiny")


def make_router(model: ModelInfo, outcomes: list[str], attempts: int = 3) -> Router:
    config = RouterConfig(max_attempts=attempts, retry_backoff_s=0.0, prefill_policy="round_robin")
    membership = Membership(PREFILL, DECODE)
    return Router(config, model, membership, FakePDClient(outcomes))  # type: ignore[arg-type]


def unhealthy(router: Router) -> set[str]:
    """The instances the router avoids now."""
    routable = {*router.membership.routable(Role.PREFILL), *router.membership.routable(Role.DECODE)}
    return {*PREFILL, *DECODE} - routable


def run(router: Router, request_id: str, stop_after: int | None = None) -> list[object]:
    events: list[object] = []

    async def drive() -> None:
        stream = router.generate(request_id, [5, 6, 7], SamplingParams())
        async for event in stream:
            events.append(event)
            if stop_after is not None and len(events) >= stop_after:
                router.abort(request_id)  # what the HTTP layer does on disconnect
                break
        await stream.aclose()

    asyncio.run(drive())
    return events


def test_failure_before_first_token_is_retried_elsewhere(model: ModelInfo) -> None:
    router = make_router(model, ["transfer_error", "ok"])
    events = run(router, "r")
    routes = router.client.routes  # type: ignore[attr-defined]
    assert isinstance(events[-1], Finished)
    assert len(routes) == 2 and routes[0][0] != routes[1][0] and routes[0][1] != routes[1][1]


def test_refusal_excludes_only_the_decode_instance(model: ModelInfo) -> None:
    router = make_router(model, ["refused", "ok"])
    run(router, "r")
    (p0, d0), (_, d1) = router.client.routes  # type: ignore[attr-defined]
    assert d0 != d1
    assert p0 not in unhealthy(router)


def test_every_attempt_failing_is_no_capacity_with_a_retry_hint(model: ModelInfo) -> None:
    router = make_router(model, ["refused"] * 3)
    with pytest.raises(NoCapacityError, match="3 attempts") as failed:
        run(router, "r")
    assert failed.value.retry_after_ms == 50
    assert router.attempts.load.snapshot() == {}


def test_invalid_request_is_not_retried(model: ModelInfo) -> None:
    router = make_router(model, ["invalid", "ok"])
    with pytest.raises(InvalidRequestError):
        run(router, "r")
    assert len(router.client.routes) == 1  # type: ignore[attr-defined]
    assert router.attempts.load.snapshot() == {}


def test_an_earlier_attempt_still_in_flight_is_waited_out_not_a_client_error(
    model: ModelInfo,
) -> None:
    """An instance still holds the request's previous attempt (its node was lost under it):
    the router's own id collides there. Retried after the backoff, nobody blamed; never a 400
    for the client."""
    router = make_router(model, ["duplicate", "ok"])
    events = run(router, "r")
    assert isinstance(events[-1], Finished)
    assert len(router.client.routes) == 2  # type: ignore[attr-defined]
    assert unhealthy(router) == set()
    assert router.attempts.load.snapshot() == {}


@pytest.mark.parametrize(
    ("outcome", "side"), [("decode_down", 1), ("prefill_down", 0)], ids=["decode", "prefill"]
)
def test_only_the_side_that_failed_is_blamed(model: ModelInfo, outcome: str, side: int) -> None:
    router = make_router(model, [outcome, "ok"])
    events = run(router, "r")
    assert isinstance(events[-1], Finished)
    first, second = router.client.routes  # type: ignore[attr-defined]
    blamed = first[side]
    assert unhealthy(router) == {blamed}  # the healthy side stays in rotation
    assert second[side] != blamed


def test_an_aborted_request_is_not_retried_and_blames_nobody(model: ModelInfo) -> None:
    router = make_router(model, ["aborted", "ok"])
    with pytest.raises(RequestAbortedError):
        run(router, "r")
    assert len(router.client.routes) == 1  # type: ignore[attr-defined]
    assert unhealthy(router) == set()
    assert router.attempts.load.snapshot() == {}


@settings(max_examples=60, deadline=None)
@given(
    scripts=st.lists(
        st.tuples(st.lists(st.sampled_from(OUTCOMES), max_size=4), st.sampled_from([None, 1, 2])),
        min_size=1,
        max_size=12,
    ),
    threads=st.integers(1, 4),
)
def test_leases_return_to_zero_after_random_failures_and_cancellations(
    model: ModelInfo, scripts: list[tuple[list[str], int | None]], threads: int
) -> None:
    outcomes = [o for script, _ in scripts for o in script]
    router = make_router(model, outcomes)

    def worker(index: int) -> None:
        for n, (_, stop_after) in enumerate(scripts):
            if n % threads != index:
                continue
            with contextlib.suppress(PdserveError):
                run(router, f"r{n}", stop_after)
            assert router.attempts.load.load_of("never-used").in_flight_requests == 0

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert router.attempts.load.snapshot() == {}
    assert all(load.in_flight_requests == 0 for load in router.attempts.load.snapshot().values())
    router.attempts.load.check_integrity()
    assert router.attempts.active() == set()


class FakeMixedClient(FakePDClient):
    def generate_mixed(
        self, address: str, ids: list[int], params: SamplingParams, request_id: str,
        hashes: object = None, metadata: object = (), on_decode: bool = False,
        route_seq: int = 0,
    ) -> AsyncIterator[TokenDelta | Finished]:  # fmt: skip
        return self.generate(address, "", ids, params, request_id)


def test_a_mixed_instance_sheds_prefill_load_at_the_first_token(model: ModelInfo) -> None:
    """Once the prompt is computed only the request counts: its prefill tokens no longer weigh
    on cache_aware's choice for the next prompts."""
    config = RouterConfig(retry_backoff_s=0.0)
    membership = Membership(["m0"], mixed=True)
    router = Router(config, model, membership, FakeMixedClient([]))  # type: ignore[arg-type]

    async def drive() -> None:
        stream = router.generate("r", list(range(5, 50)), SamplingParams())
        await anext(stream)
        load = router.attempts.load.load_of("m0")
        assert (load.in_flight_requests, load.in_flight_prefill_tokens) == (1, 0)
        _ = [event async for event in stream]

    asyncio.run(drive())
    assert router.attempts.load.snapshot() == {}
