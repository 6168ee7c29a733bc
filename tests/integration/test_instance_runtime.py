"""The instance runtime's seams over real gRPC: an error keeps its type from decode to the HTTP
client, and a router's KV-event view survives a cut subscription (snapshot on subscribe)."""

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from credentials import channels
from stacks import MODEL, Stack, pd_stack
from waiting import wait_for

from pdserve.config import load_cluster_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.errors import NoCapacityError, PromptTooLongError
from pdserve.rpc.clients import InstanceClient
from services.router.membership import Role

DECODE_BLOCKS = 8  # 128 tokens of context on decode; prefill has 1024


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
    decode = config.engine_for("decode")
    assert decode.num_kv_blocks == DECODE_BLOCKS
    decode_engine = {"num_kv_blocks": decode.num_kv_blocks, "max_model_len": decode.max_model_len}
    with pd_stack(
        tiny_model_dir,
        engine={"num_kv_blocks": 64, "max_model_len": 1024},
        decode_engine=decode_engine,
        prefill_config=config.prefill,
        decode_config=config.decode,
    ) as stack:
        yield stack


def test_prompt_too_long_for_decode_is_a_400_without_retry_or_blame(stack: Stack) -> None:
    router = stack.router
    prompt = list(range(5, 5 + 200))  # fits prefill's 1024-token context, not decode's 128
    with httpx.Client(base_url=stack.url, timeout=60) as http:
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
    assert router.membership.routable(Role.PREFILL) == [stack.prefill[0].address]
    assert router.membership.routable(Role.DECODE) == [stack.decode[0].address]


def test_decode_error_reaches_the_client_with_its_class(stack: Stack) -> None:
    with pytest.raises(PromptTooLongError, match="context window is 128 tokens"):
        stack.generate(list(range(5, 205)), SamplingParams())


def test_router_view_after_a_cut_subscription_equals_the_instance_prefix_match(
    stack: Stack,
) -> None:
    router = stack.router
    index = router.kv_events.index
    address = stack.prefill[0].address
    prompt = [11 + (i * 7) % 50 for i in range(70)]  # 4 full blocks of 16, then 6 tokens
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        reply = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert reply.status_code == 200, reply.text
    runtime = stack.prefill[0].instance.runtime
    request = runtime.make_request(prompt, None, "probe")
    own_blocks = runtime.loop.call(lambda e: e.admission.device_hit_blocks(request))
    assert own_blocks == 4
    hashes = router.model.hasher.hash_tokens(prompt)
    wait_for(lambda: index.overlaps(hashes, [address]).get(address, 0) == own_blocks)

    runtime.events.disconnect_all()  # the instance cuts every subscription (e.g. a backlog)
    wait_for(lambda: address not in index.instances())  # the router dropped its view
    # ... resubscribed, and the snapshot alone rebuilds it: nothing new was published since
    wait_for(lambda: index.overlaps(hashes, [address]).get(address, 0) == own_blocks)


def test_kv_event_subscription_starts_with_a_snapshot_of_published_blocks(stack: Stack) -> None:
    runtime = stack.prefill[0].instance.runtime
    published = runtime.loop.call(LLMEngine.published_hashes)
    assert published  # the earlier tests' prompts
    pool = channels()
    try:
        events = InstanceClient(stack.prefill[0].address, pool).kv_events()
        first = next(iter(events))
        events.cancel()
    finally:
        pool.close()
    assert first.WhichOneof("event") == "snapshot"
    assert list(first.snapshot.block_hashes) == published
    assert (first.epoch, first.seq) == (runtime.events.epoch, runtime.events.seq)
    assert first.seq > 0  # the earlier tests' events were numbered from 1


def test_a_failed_step_fails_the_request_on_a_mixed_instance_which_serves_on(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(mixed=1, engine={"num_kv_blocks": 64}, router={"max_attempts": 1})
    instance = stack.mixed[0].instance
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    runner = instance.runtime.engine.runner
    execute = runner.execute_all
    failures = [RuntimeError("injected fault")]

    def faulty(chunks: object) -> object:  # the model runner fails once
        if failures:
            raise failures.pop()
        return execute(chunks)  # type: ignore[arg-type]

    runner.execute_all = faulty  # type: ignore[method-assign,assignment]
    with pytest.raises(NoCapacityError, match="injected fault"):  # step failed: not retried
        stack.generate([5] * 20, params)
    after = stack.generate([5] * 20, params)
    assert after.final.num_output_tokens == 3  # the stack's teardown checks every block freed
