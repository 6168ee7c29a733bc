"""The OpenAI API with the official `openai` client against a router over real PD instances."""

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.rpc.server import create_server
from pdserve.v1 import common_pb2, prefill_pb2_grpc
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
    prefill = [serve_prefill(engine, PrefillConfig()) for _ in range(2)]
    decode = [serve_decode(engine, DecodeConfig())]
    config = RouterConfig(port=0, model_name=MODEL, stats_interval_s=0.1)
    router = serve_router(
        config,
        engine,
        [f"127.0.0.1:{port}" for _, _, port in prefill],
        [f"127.0.0.1:{port}" for _, _, port in decode],
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


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=1024))


def test_models_lists_the_served_model(stack: Stack) -> None:
    assert [m.id for m in stack.client.models.list()] == [MODEL]


def test_completion_equals_mixed_mode_and_reports_usage(stack: Stack, mixed: LLMEngine) -> None:
    prompt = "The quick brown fox"
    result = stack.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0
    )
    [expected] = mixed.generate([prompt], SamplingParams(max_tokens=12))
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(mixed.tokenizer.encode(prompt))
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        prompt_tokens,
        len(expected.token_ids),
    )


def test_streamed_chat_equals_unstreamed_chat(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = stack.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    chunks = list(
        stack.client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert whole.usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_ends_the_completion(stack: Stack) -> None:
    free = stack.client.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0)
    stop = free.choices[0].text[6:9]
    stopped = stack.client.completions.create(
        model=MODEL, prompt="abc", max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def error_of(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "a" * 2000}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "hi", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n > 1"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "batch of prompts"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "token ids"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    stack: Stack, body: dict[str, object], status: int, fragment: str
) -> None:
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    assert fragment in str(error_of(response)["message"])


def test_malformed_json_and_oversized_bodies_are_rejected(stack: Stack) -> None:
    bad = httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "JSON" in str(error_of(bad)["message"])
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 * 2**20)})
    too_big = httpx.post(
        f"{stack.url}/v1/completions", content=huge, headers={"content-type": "application/json"}
    )
    assert too_big.status_code == 413
    assert error_of(too_big)["code"] == "request_too_large"


def test_openai_client_raises_typed_errors(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        stack.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            temperature=-1,
        )


def test_client_disconnect_aborts_the_request_everywhere(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 900, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        decode = stack.decode[0][0]
        assert decode.stats().num_running == 1
    wait_for(lambda: decode.stats().num_running == 0)
    wait_for(lambda: stack.router.router.load.num_live_leases() == 0)


def test_cache_aware_policy_sends_the_next_turn_to_the_instance_with_the_prefix(
    stack: Stack,
) -> None:
    conversation = [{"role": "system", "content": "You are a helpful assistant. " * 8}]
    conversation.append({"role": "user", "content": "First question, about the weather?"})
    first = stack.client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    index = stack.router.router.index
    wait_for(lambda: sum(index.num_blocks(a) for a in stack.router.router.prefill) >= 4)
    before = [prefill_hits(stack, i) for i in range(2)]
    conversation.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    conversation.append({"role": "user", "content": "And a follow-up question?"})
    stack.client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    gained = [prefill_hits(stack, i) - before[i] for i in range(2)]
    assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 64  # all of it on one instance


def prefill_hits(stack: Stack, index: int) -> int:
    port = stack.prefill[index][2]
    channel = stack.router.router.client.channels.get(f"127.0.0.1:{port}")
    stats = prefill_pb2_grpc.PrefillServiceStub(channel).GetStats(common_pb2.StatsRequest())
    return int(stats.prefix_cache_hits)


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
        revived, _ = create_server(
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
            [SERVICE_NAME],
            port=port,
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
        text = httpx.get(f"{stack.url}/metrics").text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

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
