"""The same router in mixed mode: a pool of mixed instances behind the same policies."""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from otlp import otlp_collector
from pdserve_up import scrape_metrics
from stacks import MODEL, Stack, pd_stack
from waiting import wait_for

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.observability import tracing
from services.router.membership import Role


@pytest.fixture(scope="module")
def mixed_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    engine = {"num_kv_blocks": 512, "max_model_len": 1024}
    with pd_stack(tiny_model_dir, mixed=2, engine=engine) as stack:
        yield stack


def test_mixed_pool_serves_the_same_tokens_as_one_engine(
    mixed_stack: Stack, tiny_model_dir: Path
) -> None:
    stack = mixed_stack
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    result = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=10, temperature=0
    )
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=1024))
    [expected] = engine.generate(["Hello there"], SamplingParams(max_tokens=10))
    assert result.choices[0].text == expected.text
    assert result.usage is not None and result.usage.completion_tokens == 10


def test_mixed_follow_up_turn_goes_to_the_instance_with_the_prefix(
    mixed_stack: Stack,
) -> None:
    stack, instances = mixed_stack, [m.instance for m in mixed_stack.mixed]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    history = [
        {"role": "system", "content": "Answer briefly. " * 10},
        {"role": "user", "content": "Hi?"},
    ]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6)  # type: ignore[arg-type]
    index = stack.router.kv_events.index
    members = stack.router.membership.members(Role.PREFILL)
    wait_for(lambda: sum(index.num_blocks(a) for a in members) >= 4)
    before = [i.stats().device_hit_tokens for i in instances]
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "More?"},
    ]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=6)  # type: ignore[arg-type]
    gained = sorted(i.stats().device_hit_tokens - b for i, b in zip(instances, before, strict=True))
    assert gained[0] == 0 and gained[1] >= 64


def test_mixed_disconnect_aborts_the_request(
    mixed_stack: Stack,
) -> None:
    stack, instances = mixed_stack, [m.instance for m in mixed_stack.mixed]
    body = {"model": MODEL, "prompt": "stream", "max_tokens": 900, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a discarded iterator closes the connection
        assert next(lines).startswith("data: ")
        assert sum(i.stats().num_running for i in instances) == 1
    wait_for(lambda: sum(i.stats().num_running for i in instances) == 0)
    wait_for(lambda: stack.router.attempts.load.snapshot() == {})


def test_a_non_streaming_client_that_goes_away_aborts_its_request(
    mixed_stack: Stack,
) -> None:
    stack, instances = mixed_stack, [m.instance for m in mixed_stack.mixed]
    before = sum(i.stats().num_computed_tokens for i in instances)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
        httpx.post(f"{stack.url}/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: sum(i.stats().num_running for i in instances) == 0)
    computed = sum(i.stats().num_computed_tokens for i in instances) - before
    assert computed < 1000  # aborted: the 1,000 tokens it asked for were never all generated
    wait_for(lambda: stack.router.attempts.load.snapshot() == {})


def test_instance_metrics_count_exactly_the_hits_of_a_scripted_workload(
    mixed_stack: Stack,
) -> None:
    """Prompt tokens are counted once per request at admission; hits are whole cached blocks."""
    instances = [m.instance for m in mixed_stack.mixed]
    instance = instances[0]
    url = f"http://{instance.runtime.metrics_address}"
    before = scrape_metrics(url)
    first = [(7 * i + 3) % 250 for i in range(70)]
    second = [*first[:50], 9, 9, 9, 9]  # shares 50 tokens: 3 whole blocks of 16
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    other = mixed_stack.mixed[1].address
    mixed_stack.router.membership.set_drained(other, True)  # every request on `instance`
    try:
        for prompt in (first, second, second):
            mixed_stack.generate(prompt, params)
    finally:
        mixed_stack.router.membership.set_drained(other, False)
    after = scrape_metrics(url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta('pdserve_prefix_cache_queries_total{role="mixed"}') == 70 + 54 + 54
    # second: 3 blocks of the first; third (the same 54 tokens): a hit never covers the last
    # token, so floor(53 / 16) = 3 blocks again
    assert delta('pdserve_prefix_cache_hits_total{role="mixed",tier="device"}') == 48 + 48
    assert delta('pdserve_prefix_cache_hits_total{role="mixed",tier="storage"}') == 0
    assert after['pdserve_kv_blocks{role="mixed",state="used"}'] == 0


def test_every_metrics_endpoint_passes_promtool(
    mixed_stack: Stack,
) -> None:
    stack, instances = mixed_stack, [m.instance for m in mixed_stack.mixed]
    urls = [stack.url] + [f"http://{i.runtime.metrics_address}" for i in instances]
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, f"{url}: {check.stdout}{check.stderr}"


def test_a_mixed_request_is_traced_with_its_stages_and_timeline(mixed_stack: Stack) -> None:
    """Tracing on in this process (router and instances alike): the mixed instance's span is
    the attempt's child, with its queue, compute, admission and first step inside it."""
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with otlp_collector() as (collector, endpoint):
        assert tracing.configure(endpoint, 1.0, "pdserve-test")
        try:
            reply = httpx.post(
                f"{mixed_stack.url}/v1/completions",
                json={"model": MODEL, "prompt": "trace me", "max_tokens": 4, "temperature": 0},
                headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
        finally:
            tracing.shutdown()  # sends what is batched
        stages = {"mixed.queue", "mixed.compute", "mixed.admission", "mixed.first_step"}
        spans = [s for s in collector.wait_for(lambda got: len(got) > 0) if s.trace_id == trace_id]
    by_name = {s.name: s for s in spans}
    assert stages | {"request", "route", "attempt", "mixed", "stream"} <= set(by_name)
    mixed, attempt = by_name["mixed"], by_name["attempt"]
    assert mixed.parent_id == attempt.span_id
    assert attempt.parent_id == by_name["request"].span_id
    for stage in stages:
        span = by_name[stage]
        assert span.parent_id == mixed.span_id
        assert mixed.start_ns <= span.start_ns <= span.end_ns <= mixed.end_ns, stage
    request_id = reply.json()["id"].removeprefix("cmpl-")
    record = mixed_stack.router.recent.get(request_id)
    assert record is not None and record.trace_id == trace_id
    assert {"mixed.queue", "mixed.compute", "mixed.first_step"} <= {s.name for s in record.stages}
