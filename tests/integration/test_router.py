"""The router's internals over real in-process PD instances: an instance that dies and returns,
and the metrics. The API itself is tested against a `pdserve up` cluster in
tests/e2e/test_openai_api.py."""

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from credentials import SECRET
from pdserve_up import scrape_metrics
from stacks import MODEL, Member, Stack, pd_stack
from waiting import wait_for

from pdserve.instance.runtime import INSTANCE_SERVICE, InstanceServicer
from pdserve.rpc.auth import AioBearerTokenInterceptor
from pdserve.rpc.server import create_aio_server
from pdserve.v1 import common_pb2_grpc, prefill_pb2_grpc
from services.prefill.servicer import SERVICE_NAME, PrefillServicer
from services.router.membership import Role


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    with pd_stack(
        tiny_model_dir, prefill=2, engine={"num_kv_blocks": 512, "max_model_len": 1024}
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def nothing_leaks(stack: Stack) -> Iterator[None]:
    yield
    stack.check()


def test_dead_prefill_is_routed_around_and_rejoins_when_it_returns(
    stack: Stack, client: openai.OpenAI
) -> None:
    """Stops one prefill server, then brings it back on the same port."""
    member = stack.prefill[0]
    instance, address = member.instance, member.address
    router = stack.router
    index = router.kv_events.index
    member.server.stop(0).wait()
    try:
        for n in range(4):  # whichever instance the policy picks, every request succeeds
            result = client.completions.create(
                model=MODEL, prompt=f"request {n} " * 4, max_tokens=4, temperature=0
            )
            assert result.choices[0].finish_reason == "length"
        wait_for(lambda: address not in index.instances())
    finally:
        servicer = PrefillServicer(instance)

        def register(s: grpc.aio.Server) -> None:
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s)
            common_pb2_grpc.add_InstanceServiceServicer_to_server(
                InstanceServicer(instance, instance.runtime), s
            )

        revived, _ = create_aio_server(
            register,
            [SERVICE_NAME, INSTANCE_SERVICE],
            port=member.port,
            interceptors=[AioBearerTokenInterceptor(SECRET)],
        )
        stack.prefill[0] = Member(instance, revived, member.port)
    # Its KV events flow again: a prompt prefilled there shows up in the router's index.
    wait_for(lambda: address in router.membership.routable(Role.PREFILL), 10)
    for n in range(4):
        client.completions.create(
            model=MODEL, prompt=f"after {n} " * 8, max_tokens=2, temperature=0
        )
    wait_for(lambda: index.num_blocks(address) > 0)


def test_metrics_count_requests_and_latencies(stack: Stack, client: openai.OpenAI) -> None:
    def scrape() -> dict[str, float]:
        return scrape_metrics(stack.url)

    ok = 'pdserve_router_requests_total{endpoint="/v1/completions",status="200"}'
    before = scrape()
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    httpx.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    after = scrape()
    assert after[ok] - before.get(ok, 0) == 1
    assert after['pdserve_router_requests_total{endpoint="/v1/completions",status="404"}'] >= 1
    ttft = "pdserve_router_time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == 1
    itl = "pdserve_router_inter_token_latency_seconds_count"
    # one per streamed chunk after the first: 2 for 3 tokens, 1 when two of them came in one
    # chunk (the instance hands a lagging reader everything since its last message)
    assert 1 <= after[itl] - before.get(itl, 0) <= 2
