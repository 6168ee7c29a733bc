"""The router's limits over real PD instances: past `router.max_concurrent_requests` running
generations a request waits in the admission queue and is served when a place frees; past the
queue's bounds (its size, its wait limit) it gets 429 with Retry-After (and is counted); the
generations that run are unaffected."""

import asyncio
import contextlib
import threading
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
    tiny_model_dir: Path, max_num_seqs: int, **router: object
) -> contextlib.AbstractContextManager[Stack]:
    """One prefill and one decode instance of `max_num_seqs`."""
    return pd_stack(
        tiny_model_dir,
        engine={"num_kv_blocks": 1024, "max_num_seqs": max_num_seqs},
        router=router,
    )


class Gate:
    """Holds an instance's steps until `open` (the engine thread waits in the step)."""

    def __init__(self, instance: object) -> None:
        self.runner = instance.runtime.engine.runner  # type: ignore[attr-defined]
        self.execute = self.runner.execute_all
        self.event = threading.Event()
        self.runner.execute_all = self._gated

    def _gated(self, chunks: object) -> object:
        self.event.wait(60)
        return self.execute(chunks)

    def open(self) -> None:
        self.event.set()
        self.runner.execute_all = self.execute


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    limits = {"max_concurrent_requests": 2, "queue_max_requests": 1, "queue_timeout_s": 1.0}
    with limited(tiny_model_dir, 64, **limits) as stack:
        yield stack


def test_past_the_limit_requests_queue_then_run_and_past_the_queue_get_429(stack: Stack) -> None:
    url = f"{stack.url}/v1/completions"
    body = {"model": "tiny", "prompt": "a story", "max_tokens": 8, "ignore_eos": True}
    router = stack.router

    def post(results: list[httpx.Response], **extra: object) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.append(httpx.post(url, json={**body, **extra}, timeout=60))
        )
        thread.start()
        return thread

    gate = Gate(stack.decode[0].instance)  # decode's steps wait for the test
    try:
        running: list[httpx.Response] = []
        first = [post(running), post(running)]
        wait_for(lambda: router.num_running == 2)  # at the limit
        timed_out: list[httpx.Response] = []
        waiting = post(timed_out)
        wait_for(lambda: len(router.queue) == 1)
        full = httpx.post(url, json=body, timeout=30)  # the queue holds one
        assert full.status_code == 429, full.text
        assert full.headers["retry-after"] == "1"
        error = full.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "queue_max_requests" in error["message"]
        waiting.join()  # router.queue_timeout_s passed
        assert timed_out[0].status_code == 429 and "queue_timeout_s" in timed_out[0].text
        served: list[httpx.Response] = []
        queued = post(served, n=2)  # two choices: two generations
        wait_for(lambda: len(router.queue) == 1)
    finally:
        gate.open()
    for thread in (*first, queued):
        thread.join()
    assert [r.status_code for r in (*running, *served)] == [200, 200, 200]
    assert len(served[0].json()["choices"]) == 2
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'pdserve_router_rejections_total{key="",reason="queue_full"} 1.0' in metrics
    assert 'pdserve_router_rejections_total{key="",reason="queue_timeout"} 1.0' in metrics
    assert "pdserve_router_queue_wait_seconds_count 1.0" in metrics


ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef0"


def test_api_keys_are_required_and_their_owners_take_turns_in_the_queue(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: alice, key: {ALICE}}}\n  - {{name: bob, key: {BOB}}}\n")
    keys.chmod(0o600)
    limits = {"max_concurrent_requests": 1, "api_keys": str(keys)}
    with limited(tiny_model_dir, 64, **limits) as stack:
        url = f"{stack.url}/v1/completions"
        body = {"model": "tiny", "prompt": "a story", "max_tokens": 4, "ignore_eos": True}
        for headers in ({}, {"Authorization": "Bearer sk-not-a-key-0123456789"}):
            refused = httpx.post(url, json=body, headers=headers, timeout=30)
            assert refused.status_code == 401, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert httpx.get(f"{stack.url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200  # open

        # the order the router let them in (the order replies reach their threads can differ:
        # a request's place is free before its reply has reached the client)
        order: list[str] = []
        admit = stack.router.admit

        async def admit_in_order(
            generations: int, prompt_tokens: int, user: str = "", priority: int = 0, key: str = ""
        ) -> None:
            await admit(generations, prompt_tokens, user, priority, key)
            order.append(key)

        stack.router.admit = admit_in_order

        def post(key: str) -> threading.Thread:
            def run() -> None:
                auth = {"Authorization": f"Bearer {key}"}
                reply = httpx.post(url, json=body, headers=auth, timeout=60)
                assert reply.status_code == 200, reply.text

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        gate = Gate(stack.decode[0].instance)
        try:
            threads = [post(ALICE)]
            wait_for(lambda: stack.router.num_running == 1)  # at the limit, held
            for n in range(1, 6):  # alice floods the queue first
                threads.append(post(ALICE))
                wait_for(lambda n=n: len(stack.router.queue) == n)
            for n in range(2):
                threads.append(post(BOB))
                wait_for(lambda n=n: len(stack.router.queue) == 6 + n)
        finally:
            gate.open()
        for thread in threads:
            thread.join()
        assert order == ["alice", "alice", "bob", "alice", "bob", "alice", "alice", "alice"]
        metrics = httpx.get(f"{stack.url}/metrics").text
        assert 'pdserve_router_key_requests_total{key="alice"} 6.0' in metrics
        assert 'pdserve_router_rejections_total{key="",reason="unauthenticated"} 3.0' in metrics


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
