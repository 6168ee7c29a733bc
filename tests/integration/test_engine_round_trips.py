"""How often one PD request waits on each instance's engine thread: every `EngineLoop.call`
waits for the engine's current step to end (hundreds of ms on a busy engine), so the request
path keeps them to two per instance: prefill's admission and queueing, decode's reservation
and first-token handoff. Building the request runs on the handler thread, the KV-ready output
carries the block table, and prefill's release is not awaited. The request goes through the
router (`tests/stacks.py`), whose own calls on the instances are kept out of the count: its
decode-load poll is set far beyond the test (each poll is a stats call on decode's engine
thread), and its KV-event subscription to prefill (one call) is taken before counting."""

from collections import Counter
from collections.abc import Callable
from typing import Any

from stacks import Stack
from waiting import wait_for

from pdserve.engine.request import SamplingParams

MakeStack = Callable[..., Stack]


def count_calls(instance: Any, counts: Counter[str], name: str) -> None:
    """Count the awaited engine-thread calls of `instance` (and still make them)."""
    loop = instance.runtime.loop
    call = loop.call

    def counted(fn: Callable[[Any], Any], timeout_s: float | None = 30.0) -> Any:
        counts[name] += 1
        return call(fn, timeout_s)

    loop.call = counted


def test_a_pd_request_waits_on_each_engine_thread_at_most_twice(make_stack: MakeStack) -> None:
    stack = make_stack(engine={"num_kv_blocks": 256}, router={"stats_interval_s": 3600.0})
    prefill, decode = stack.prefill[0], stack.decode[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    stack.generate(list(range(40, 120)), params)  # warm
    index = stack.router.kv_events.index  # the router follows prefill's KV events
    wait_for(lambda: index.num_blocks(prefill.address) > 0)
    counts: Counter[str] = Counter()
    count_calls(prefill.instance, counts, "prefill")
    count_calls(decode.instance, counts, "decode")
    final = stack.generate(list(range(50, 150)), params).final
    assert final.num_output_tokens == 8
    assert counts == {"prefill": 2, "decode": 2}
