"""The router's explicit concurrency limit over real PD instances: past
`router.max_concurrent_requests` running generations a request gets 503 with Retry-After (and
is counted), never a silent queue; the generations it runs are unaffected, and once one ends the
next request is served."""

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from credentials import SECRET
from stacks import Stack, pd_stack
from waiting import wait_for

from pdserve.config import EngineConfig
from pdserve.engine.request import SamplingParams
from pdserve.instance.convert import generate_request
from pdserve.rpc.aio import AioChannelPool, AioClients
from pdserve.rpc.server import instance_workers
from services.mixed.servicer import serve_mixed


def limited(
    tiny_model_dir: Path, max_num_seqs: int, max_concurrent_requests: int = 4096
) -> contextlib.AbstractContextManager[Stack]:
    """One prefill and one decode instance of `max_num_seqs`."""
    return pd_stack(
        tiny_model_dir,
        engine={"num_kv_blocks": 1024, "max_num_seqs": max_num_seqs},
        router={"max_concurrent_requests": max_concurrent_requests},
    )


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    with limited(tiny_model_dir, 64, max_concurrent_requests=2) as stack:
        yield stack


def test_past_the_limit_requests_get_503_and_the_running_ones_finish(stack: Stack) -> None:
    url = f"{stack.url}/v1/completions"
    long = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as a,
        httpx.Client(timeout=60) as b,
        a.stream("POST", url, json=long) as first,
        b.stream("POST", url, json=long) as second,
    ):
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:  # both are generating
            assert next(line for line in lines if line.startswith("data: {"))
        refused = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "no_capacity" and "max_concurrent_requests" in error["message"]
        two = httpx.post(url, json={**long, "stream": False, "n": 2, "max_tokens": 4})
        assert two.status_code == 503  # choices count as generations
        events = [json.loads(line[6:]) for line in streams[0] if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: stack.router.num_running == 0)  # the closed stream is aborted
    served = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=30)
    assert served.status_code == 200
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert "pdserve_router_rejected_requests_total 2.0" in metrics


def concurrently(
    stack: Stack, count: int, max_tokens: int, until: Callable[[], bool], first: int = 0
) -> list[str]:
    """`count` greedy completions at once (prompts `go {first}` ...); returns their texts once
    all are done and `until` held while they ran."""
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    async def clients() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            url = f"{stack.url}/v1/completions"

            async def one(n: int) -> str:
                reply = await http.post(url, json={**body, "prompt": f"go {first + n}"})
                assert reply.status_code == 200, reply.text
                return str(reply.json()["choices"][0]["text"])

            tasks = [asyncio.ensure_future(one(n)) for n in range(count)]
            await asyncio.to_thread(wait_for, until, 60)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(clients())


def test_a_decode_instance_runs_max_num_seqs_streams_not_a_thread_pools_worth(
    tiny_model_dir: Path,
) -> None:
    """40 concurrent streams (more than the 32 handler threads servers used to have) all run
    on the decode engine at once: its `max_num_seqs` (40) is the limit."""
    with limited(tiny_model_dir, 40) as stack:
        decode = stack.decode[0].instance
        texts = concurrently(stack, 40, 300, lambda: decode.stats().num_running == 40)
    assert len(texts) == 40


def test_handoffs_beyond_max_num_seqs_wait_their_turn_with_unchanged_output(
    tiny_model_dir: Path,
) -> None:
    """16 requests on a decode of max_num_seqs 8: 8 run, the others' KV waits (counted as
    waiting) and they join as places free up; every text equals the one it has alone."""
    with limited(tiny_model_dir, 8) as stack:
        decode = stack.decode[0].instance
        peak = 0

        def queued() -> bool:
            nonlocal peak
            stats = decode.stats()
            peak = max(peak, stats.num_running)
            return stats.num_running == 8 and stats.num_waiting >= 1

        together = concurrently(stack, 16, 120, queued)
        alone = {n: concurrently(stack, 1, 120, lambda: True, first=n)[0] for n in (0, 9, 15)}
    assert peak == 8
    assert all(together[n] == text for n, text in alone.items()) and len(set(together)) > 1


def test_requests_beyond_the_server_threads_all_run_and_a_lost_subscription_aborts_them(
    tiny_model_dir: Path,
) -> None:
    """More requests than the instance server has threads all reach the engine at once on one
    output subscription (it holds no thread), which carries each step's outputs of its requests
    in one message; when the subscription ends (its router went away) every request on it is
    aborted and unregistered."""
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=1024, max_num_seqs=2)
    streams = instance_workers(config.max_num_seqs) + 12
    instance, server, port = serve_mixed(config, secret=SECRET)
    clients = AioClients(AioChannelPool(SECRET))
    address = f"127.0.0.1:{port}"
    params = SamplingParams(max_tokens=900, ignore_eos=True)

    def in_engine() -> int:
        stats = instance.stats()
        return stats.num_running + stats.num_waiting

    async def hold_then_leave() -> None:
        outputs = clients.subscribe_outputs(address, "router-1")
        assert not (await anext(outputs)).outputs  # open
        try:
            for n in range(streams):
                message = generate_request(
                    f"held-{n}", [1, 2, 3 + n], params, subscriber="router-1"
                )
                await clients.submit(address, message)
            await asyncio.to_thread(wait_for, lambda: in_engine() == streams, 60)
            steps = [await anext(outputs) for _ in range(5)]
            # a step's 2 requests in one message (a lagging reader gets several steps in one:
            # everything pushed since its last)
            assert max(len(step.outputs) for step in steps) >= 2
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            await clients.channels.close()

    try:
        asyncio.run(hold_then_leave())
        wait_for(lambda: in_engine() == 0 and not instance.runtime._streams, 30)
    finally:
        server.stop(0)
        instance.check_integrity()
        instance.stop()
