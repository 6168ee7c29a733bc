"""The router's internals over real in-process PD instances: an instance that dies and returns,
and the metrics. The API itself is tested against a `pdserve up` cluster in
tests/e2e/test_openai_api.py."""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from credentials import SECRET
from pdserve_up import scrape_metrics
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig
from pdserve.instance.runtime import INSTANCE_SERVICE, InstanceServicer
from pdserve.rpc.auth import AioBearerTokenInterceptor
from pdserve.rpc.server import create_aio_server
from pdserve.v1 import common_pb2_grpc, prefill_pb2_grpc
from services.decode.servicer import serve_decode
from services.prefill.servicer import SERVICE_NAME, PrefillServicer, serve_prefill
from services.router.server import RunningRouter, serve_router

MODEL = "tiny"


@dataclass
class Stack:
    router: RunningRouter
    client: openai.OpenAI
    prefill: list
    decode: list

    @property
    def url(self) -> str:
        return self.router.url


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, max_model_len=1024)
    prefill = [serve_prefill(engine, PrefillConfig(), secret=SECRET) for _ in range(2)]
    decode = [serve_decode(engine, DecodeConfig(), secret=SECRET)]
    config = RouterConfig(port=0, model_name=MODEL, stats_interval_s=0.1)
    router = serve_router(
        config,
        engine,
        [f"127.0.0.1:{port}" for _, _, port in prefill],
        [f"127.0.0.1:{port}" for _, _, port in decode],
        secret=SECRET,
    )
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    yield Stack(router, client, prefill, decode)
    client.close()
    router.stop()
    for instance, server, _ in [*prefill, *decode]:
        server.stop(0)
        instance.check_integrity()
        instance.stop()


@pytest.fixture(autouse=True)
def nothing_leaks(stack: Stack) -> Iterator[None]:
    yield
    wait_for(lambda: stack.router.router.load.num_live_leases() == 0)
    stack.router.router.load.check_integrity()
    for instance, _, _ in stack.decode:
        wait_for(lambda instance=instance: instance.stats().num_running == 0)


def test_dead_prefill_is_routed_around_and_rejoins_when_it_returns(stack: Stack) -> None:
    """Runs last: stops one prefill server, then brings it back on the same port."""
    instance, server, port = stack.prefill[0]
    address = f"127.0.0.1:{port}"
    router = stack.router.router
    server.stop(0).wait()
    try:
        for n in range(4):  # whichever instance the policy picks, every request succeeds
            result = stack.client.completions.create(
                model=MODEL, prompt=f"request {n} " * 4, max_tokens=4, temperature=0
            )
            assert result.choices[0].finish_reason == "length"
        wait_for(lambda: address not in router.index.instances())
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
            port=port,
            interceptors=[AioBearerTokenInterceptor(SECRET)],
        )
        stack.prefill[0] = (instance, revived, port)
    # Its KV events flow again: a prompt prefilled there shows up in the router's index.
    wait_for(lambda: router._unhealthy_until.get(address, 0) < time.monotonic(), 10)
    for n in range(4):
        stack.client.completions.create(
            model=MODEL, prompt=f"after {n} " * 8, max_tokens=2, temperature=0
        )
    wait_for(lambda: router.index.num_blocks(address) > 0)


def test_metrics_count_requests_and_latencies(stack: Stack) -> None:
    def scrape() -> dict[str, float]:
        return scrape_metrics(stack.url)

    ok = 'pdserve_router_requests_total{endpoint="/v1/completions",status="200"}'
    before = scrape()
    stack.client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    httpx.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    after = scrape()
    assert after[ok] - before.get(ok, 0) == 1
    assert after['pdserve_router_requests_total{endpoint="/v1/completions",status="404"}'] >= 1
    ttft = "pdserve_router_time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == 1
    itl = "pdserve_router_inter_token_latency_seconds_count"
    assert after[itl] - before.get(itl, 0) == 2
