"""How often one PD request waits on each instance's engine thread: every `EngineLoop.call`
waits for the engine's current step to end (hundreds of ms on a busy engine), so the request
path keeps them to two per instance: prefill's admission and queueing, decode's reservation
and first-token handoff. Building the request runs on the handler thread, the KV-ready output
carries the block table, and prefill's release is not awaited."""

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from credentials import SECRET

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig
from pdserve.engine.request import SamplingParams
from pdserve.rpc.channels import ChannelPool
from services.decode.servicer import serve_decode
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, PDClient


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[tuple[Any, Any, str, str]]:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256)
    p, p_server, p_port = serve_prefill(config, PrefillConfig(), secret=SECRET)
    d, d_server, d_port = serve_decode(config, DecodeConfig(), secret=SECRET)
    yield p, d, f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    for instance, server in ((p, p_server), (d, d_server)):
        server.stop(0)
        instance.check_integrity()
        instance.stop()


def count_calls(instance: Any, counts: Counter[str], name: str) -> None:
    """Count the awaited engine-thread calls of `instance` (and still make them)."""
    loop = instance.runtime.loop
    call = loop.call

    def counted(fn: Callable[[Any], Any], timeout_s: float | None = 30.0) -> Any:
        counts[name] += 1
        return call(fn, timeout_s)

    loop.call = counted


def test_a_pd_request_waits_on_each_engine_thread_at_most_twice(
    pair: tuple[Any, Any, str, str],
) -> None:
    prefill, decode, prefill_address, decode_address = pair
    client = PDClient(ChannelPool(SECRET))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    list(client.generate(prefill_address, decode_address, list(range(40, 120)), params))  # warm
    counts: Counter[str] = Counter()
    count_calls(prefill, counts, "prefill")
    count_calls(decode, counts, "decode")
    events = list(client.generate(prefill_address, decode_address, list(range(50, 150)), params))
    client.close()
    assert isinstance(events[-1], Finished) and events[-1].num_output_tokens == 8
    assert counts == {"prefill": 2, "decode": 2}
