"""Conditional disaggregation's choice from the instances' step time models."""

import math

import pytest

from pdserve.v1 import common_pb2
from services.router.disaggregation import Disaggregation, prompt_seconds, prompt_work_seconds

FIT = {"constant": 0.004, "prefill_tokens": 1e-4, "prefill_attention": 2e-5,
       "decode_rows": 2e-4, "decode_context": 1e-4}  # fmt: skip
BLOCK = 16


def stats(running: int = 0, used_blocks: int = 0, fit: dict[str, float] = FIT,
          samples: int = 100) -> common_pb2.InstanceStats:  # fmt: skip
    message = common_pb2.InstanceStats(
        num_running=running, num_blocks=4096, num_free_blocks=4096 - used_blocks,
        block_size=BLOCK, max_num_batched_tokens=512, kv_block_bytes=65536,
    )  # fmt: skip
    message.step_time.coefficients.update(fit)
    message.step_time.samples = samples
    return message


def auto(gbps: float = 1.0) -> Disaggregation:
    return Disaggregation("auto", gbps, BLOCK)


def test_prompt_seconds_sums_its_chunks() -> None:
    fit = stats().step_time
    one = (
        FIT["constant"] + FIT["prefill_tokens"] * 512 + FIT["prefill_attention"] * 512 * 256 / 1000
    )
    two = (
        FIT["constant"]
        + FIT["prefill_tokens"] * 488
        + FIT["prefill_attention"] * 488 * (512 + 244) / 1000
    )
    assert prompt_seconds(fit, 512, 1000) == pytest.approx(one + two)
    shared = FIT["decode_rows"] * 8 + FIT["decode_context"] * 4000 / 1000
    assert prompt_seconds(fit, 512, 1000, rows=8, context=4000) == pytest.approx(
        one + two + 2 * shared
    )
    assert prompt_seconds(fit, 512, 0) == 0


def test_fixed_modes_predict_nothing() -> None:
    assert not Disaggregation("always", 1.0, BLOCK).choose(64, stats(), 0, 0, stats(), 0).local
    never = Disaggregation("never", 1.0, BLOCK).choose(64, None, 0, 0, None, 0)
    assert never.local and math.isnan(never.remote_s)


def test_auto_disaggregates_while_a_model_is_unfitted() -> None:
    choice = auto().choose(64, stats(), 0, 0, stats(samples=0), 0)
    assert not choice.local and math.isnan(choice.local_s)
    assert not auto().choose(64, None, 0, 0, stats(), 0).local


def test_a_short_prompt_on_an_idle_decode_is_prefilled_there() -> None:
    choice = auto().choose(40, stats(), 0, 0, stats(), 0)
    assert choice.local and choice.local_s < choice.remote_s


def test_a_prompt_cached_on_prefill_only_goes_through_prefill() -> None:
    """Decode would compute 2,000 tokens; prefill has 1,984 of them: moving their KV is
    cheaper (64 KiB blocks at 10 GB/s)."""
    choice = auto(gbps=10).choose(2000, stats(), 1984, 0, stats(), 0)
    assert not choice.local and choice.remote_s < choice.local_s


def test_a_prompt_is_computed_on_decode_only_while_nothing_decodes_there() -> None:
    """Computed beside a batch, a prompt would delay every request decoding there by its share
    of the steps it rides (predicted and reported): it goes to prefill even when its own first
    token would come sooner on decode, as with 60k prompt tokens queued on prefill."""
    work = prompt_work_seconds(stats().step_time, 512, 40)
    assert work == pytest.approx(FIT["prefill_tokens"] * 40 + FIT["prefill_attention"] * 0.8)
    idle = auto(gbps=0.005).choose(40, stats(), 0, 0, stats(), 0)
    assert idle.local and idle.delay_s == 0
    one = auto(gbps=0.005).choose(40, stats(), 0, 0, stats(running=1, used_blocks=10), 0)
    assert one.local_s < one.remote_s  # sooner for itself ...
    assert not one.local and one.delay_s == pytest.approx(work)  # ... not for the other
    busy = stats(running=4, used_blocks=3000)
    queued = auto(gbps=10).choose(3000, stats(), 0, 60_000, busy, 0)
    assert queued.local_s < queued.remote_s and not queued.local
    assert queued.delay_s == pytest.approx(4 * prompt_work_seconds(busy.step_time, 512, 3000))
    # requests the router sent there since the stats were polled count as decoding there
    routed = auto(gbps=0.005).choose(40, stats(), 0, 0, stats(), 0, decode_in_flight=2)
    assert not routed.local and routed.delay_s == pytest.approx(2 * work)
    # the local prediction still carries the batch's rows in every chunk
    assert queued.local_s > auto(gbps=10).choose(3000, stats(), 0, 60_000, stats(), 0).local_s
