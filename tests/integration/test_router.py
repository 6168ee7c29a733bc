"""The router's internals over real in-process PD instances: an instance that dies and returns,
and the metrics. The API itself is tested against a `pdserve up` cluster in
tests/e2e/test_openai_api.py."""

import itertools
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

from pdserve.engine.request import SamplingParams
from pdserve.instance.roles import ServedRole
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
        served = ServedRole(instance)

        def register(s: grpc.aio.Server) -> None:
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(served), s)
            common_pb2_grpc.add_InstanceServiceServicer_to_server(
                InstanceServicer(served, instance.runtime), s
            )

        revived, _ = create_aio_server(
            register,
            [SERVICE_NAME, INSTANCE_SERVICE],
            port=member.port,
            interceptors=[AioBearerTokenInterceptor(SECRET)],
        )
        stack.prefill[0] = Member(instance, revived, member.port)
    # Its KV event stream is back (its snapshot is in the index, which marks it healthy;
    # gRPC's reconnect backoff decides when, not the unhealthy cooldown: routing to it earlier
    # could fail again and send every prompt elsewhere) ...
    wait_for(lambda: address in index.instances(), 60)
    assert address in router.membership.routable(Role.PREFILL)
    # ... and its events flow: a prompt prefilled there shows up in the router's index (new
    # prompts are sent until the policy picks it: with equal loads it may pick the other one)
    prompts = itertools.count()

    def prefilled_there() -> bool:
        prompt = f"after {next(prompts)} " * 8
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return index.num_blocks(address) > 0

    wait_for(prefilled_there)


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


def test_each_stage_of_a_request_is_observed_once_under_bounded_labels(stack: Stack) -> None:
    """One PD request: each stage histogram counts it once, on the process where the stage
    ran; prompt tokens are counted by source; no label carries anything per request."""
    urls = {"router": stack.url}
    urls |= {m.address: f"http://{m.instance.runtime.metrics_address}" for m in stack.members}
    before = {name: scrape_metrics(url) for name, url in urls.items()}
    prompt = list(range(3, 3 + 70))  # 4 whole blocks of 16: KV moves to decode
    stack.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    after = {name: scrape_metrics(url) for name, url in urls.items()}

    def delta(sample: str) -> float:
        """The sample's increase summed over every process."""
        return sum(after[n].get(sample, 0) - before[n].get(sample, 0) for n in urls)

    assert delta("pdserve_router_queue_seconds_count") == 1
    assert delta("pdserve_router_time_per_output_token_seconds_count") == 1
    assert delta("pdserve_router_message_seconds_count") == 1  # measured on its Prefill call
    for stage in ("reservation_wait", "request_queue", "request_prefill"):
        assert delta(f'pdserve_{stage}_seconds_count{{role="prefill"}}') == 1, stage
    for stage in ("request_kv_wait", "request_decode_admission", "request_first_decode_step"):
        assert delta(f'pdserve_{stage}_seconds_count{{role="decode"}}') == 1, stage
    transfers = [
        s
        for n in urls
        for s in after[n]
        if s.startswith("pdserve_kv_transfer_duration_seconds_count")
    ]
    assert sum(delta(s) for s in set(transfers)) == 1
    sizes = {
        s for n in urls for s in after[n] if s.startswith("pdserve_kv_transfer_request_bytes_sum")
    }
    assert sum(delta(s) for s in sizes) > 0
    by_source = 'pdserve_prompt_tokens_by_source_total{{role="prefill",source="{}"}}'
    sources = ("computed", "device_hit", "storage_hit")
    assert sum(delta(by_source.format(source)) for source in sources) == len(prompt)
    transferred = 'pdserve_prompt_tokens_by_source_total{role="decode",source="transferred"}'
    assert delta(transferred) >= 64

    allowed = {"role", "transport", "source", "tier", "state", "direction", "kind", "endpoint",
               "status", "policy", "reason", "backend", "name", "le", "quantile", "path",
               "feature"}  # fmt: skip
    instances = {m.address for m in stack.members}
    for samples in after.values():
        for sample in samples:
            labels = dict(
                pair.split("=", 1) for pair in sample.partition("{")[2].rstrip("}").split(",")
                if pair
            )  # fmt: skip
            assert set(labels) <= allowed, sample
            if "role" in labels:
                assert labels["role"].strip('"') in ("prefill", "decode", "mixed"), sample
            if "backend" in labels:  # the router's per-instance gauges: one per instance
                assert labels["backend"].strip('"') in instances, sample


def test_the_history_records_each_requests_cached_prompt_tokens(stack: Stack) -> None:
    """The planner sizes prefill from the samples' cached tokens: a prompt sent again finds
    its full blocks in the prefix cache where it is computed, and its sample says so (each
    prefill instance computes it at most once cold: the policy sends it back to its holder)."""
    prompt = [3 + (7 * i) % 250 for i in range(100)]  # 6 whole blocks of 16 and 4 tokens
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    since = stack.router.history.served_since(0.0)
    stack.generate(prompt, params)
    stack.generate(prompt, params)
    first, again = stack.router.history.served_since(0.0)[len(since) :]
    assert (first.prompt_tokens, first.cached_tokens, first.output_tokens) == (100, 0, 2)
    assert (again.prompt_tokens, again.cached_tokens) == (100, 96)


def test_the_router_measures_a_message_on_each_prefill_call(stack: Stack) -> None:
    """The planner charges each simulated message between processes what the router measured:
    half a Prefill call's round trip less the stages prefill reported, a part of the TTFT."""
    stack.generate(list(range(5, 5 + 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    sample = stack.router.history.served_since(0.0)[-1]
    assert sample.message_s is not None and sample.ttft_s is not None
    assert 0 < sample.message_s < sample.ttft_s
    recent = stack.router.history.message_s()
    assert recent is not None and recent > 0
