"""The instance runtime's seams over real gRPC: an error keeps its type from decode to the HTTP
client, and a router's KV-event view survives a cut subscription (snapshot on subscribe)."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from credentials import SECRET, channels
from waiting import wait_for

from pdserve.config import EngineConfig, RouterConfig, load_cluster_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.errors import PromptTooLongError, StepFailedError
from pdserve.rpc.clients import InstanceClient
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.mixed.servicer import serve_mixed
from services.prefill.instance import PrefillInstance
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, PDClient
from services.router.server import RunningRouter, serve_router

MODEL = "tiny"
DECODE_BLOCKS = 8  # 128 tokens of context on decode; prefill has 1024


@dataclass
class Stack:
    router: RunningRouter
    prefill: PrefillInstance
    prefill_address: str
    decode: DecodeInstance
    decode_address: str


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One prefill and one small decode instance, their engines from one config file with a
    per-role `decode.engine` section."""
    path = tmp_path_factory.mktemp("config") / "cluster.yaml"
    document = {
        "engine": {"model": str(tiny_model_dir), "num_kv_blocks": 64, "max_model_len": 1024},
        # decode's context is smaller: an explicit max_model_len must fit the KV pool
        "decode": {"engine": {"num_kv_blocks": DECODE_BLOCKS, "max_model_len": DECODE_BLOCKS * 16}},
    }
    path.write_text(yaml.safe_dump(document))
    config = load_cluster_config(path, env={})
    assert config.engine_for("decode").num_kv_blocks == DECODE_BLOCKS
    prefill, prefill_server, prefill_port = serve_prefill(
        config.engine_for("prefill"), config.prefill, secret=SECRET
    )
    decode, decode_server, decode_port = serve_decode(
        config.engine_for("decode"), config.decode, secret=SECRET
    )
    prefill_address, decode_address = f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}"
    router = serve_router(
        RouterConfig(port=0, model_name=MODEL, stats_interval_s=0.1),
        config.engine_for("prefill"),
        [prefill_address],
        [decode_address],
        secret=SECRET,
    )
    yield Stack(router, prefill, prefill_address, decode, decode_address)
    router.stop()
    for server, instance in ((prefill_server, prefill), (decode_server, decode)):
        server.stop(0)
        instance.check_integrity()
        instance.stop()


def test_prompt_too_long_for_decode_is_a_400_without_retry_or_blame(stack: Stack) -> None:
    router = stack.router.router
    prompt = list(range(5, 5 + 200))  # fits prefill's 1024-token context, not decode's 128
    with httpx.Client(base_url=stack.router.url, timeout=60) as http:
        reply = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "128" in error["message"]  # decode's own limit, as decode worded it
        ok = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [7] * 20, "max_tokens": 2}
        )
        assert ok.status_code == 200, ok.text
    assert router.metrics.registry.get_sample_value("pdserve_router_retries_total") == 0
    assert router._unhealthy_until == {}
    wait_for(lambda: router.load.num_live_leases() == 0)
    router.load.check_integrity()


def test_decode_error_reaches_the_client_with_its_class(stack: Stack) -> None:
    client = stack.router.router.client
    with pytest.raises(PromptTooLongError, match="context window is 128 tokens"):
        client.prefill(
            stack.prefill_address,
            stack.decode_address,
            list(range(5, 205)),
            SamplingParams(),
            "too-long",
        )


def test_router_view_after_a_cut_subscription_equals_the_instance_prefix_match(
    stack: Stack,
) -> None:
    router = stack.router.router
    address = stack.prefill_address
    prompt = [11 + (i * 7) % 50 for i in range(70)]  # 4 full blocks of 16, then 6 tokens
    with httpx.Client(base_url=stack.router.url, timeout=60) as http:
        reply = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert reply.status_code == 200, reply.text
    runtime = stack.prefill.runtime
    request = runtime.make_request(prompt, None, "probe")
    own_blocks = runtime.loop.call(lambda e: e.admission.device_hit_blocks(request))
    assert own_blocks == 4
    hashes = router.model.hasher.hash_tokens(prompt)
    wait_for(lambda: router.index.overlaps(hashes, [address]).get(address, 0) == own_blocks)

    runtime.events.disconnect_all()  # the instance cuts every subscription (e.g. a backlog)
    wait_for(lambda: address not in router.index.instances())  # the router dropped its view
    # ... resubscribed, and the snapshot alone rebuilds it: nothing new was published since
    wait_for(lambda: router.index.overlaps(hashes, [address]).get(address, 0) == own_blocks)


def test_kv_event_subscription_starts_with_a_snapshot_of_published_blocks(stack: Stack) -> None:
    runtime = stack.prefill.runtime
    published = runtime.loop.call(LLMEngine.published_hashes)
    assert published  # the earlier tests' prompts
    pool = channels()
    try:
        events = InstanceClient(stack.prefill_address, pool).kv_events()
        first = next(iter(events))
        events.cancel()
    finally:
        pool.close()
    assert first.WhichOneof("event") == "snapshot"
    assert list(first.snapshot.block_hashes) == published


def test_a_failed_step_ends_a_mixed_stream_with_step_failed_and_the_instance_serves_on(
    tiny_model_dir: Path,
) -> None:
    instance, server, port = serve_mixed(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), secret=SECRET
    )
    client = PDClient(channels())
    address = f"127.0.0.1:{port}"
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        runner = instance.runtime.engine.runner
        execute = runner.execute_all
        failures = [RuntimeError("injected fault")]

        def faulty(chunks: object) -> object:  # the model runner fails once
            if failures:
                raise failures.pop()
            return execute(chunks)  # type: ignore[arg-type]

        runner.execute_all = faulty  # type: ignore[method-assign,assignment]
        with pytest.raises(StepFailedError, match="injected fault"):
            list(client.generate_mixed(address, [5] * 20, params, "faulted"))
        events = list(client.generate_mixed(address, [5] * 20, params, "after"))
        assert isinstance(events[-1], Finished) and events[-1].num_output_tokens == 3
        wait_for(lambda: instance.stats().num_running == 0)
        assert instance.stats().num_free_blocks == instance.stats().num_blocks  # all freed
        instance.check_integrity()
    finally:
        client.close()
        server.stop(0)
        instance.stop()
