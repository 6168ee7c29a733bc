"""Conditional disaggregation's choice from the instances' step time models."""

import math

import pytest

from pdserve.v1 import common_pb2
from services.router.disaggregation import Disaggregation, prompt_seconds

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


def test_a_busy_decode_sends_a_long_prompt_to_prefill_but_a_queued_prefill_keeps_it() -> None:
    busy = stats(running=64, used_blocks=3000)
    long_prompt = auto(gbps=10).choose(3000, stats(), 0, 0, busy, 0)
    assert not long_prompt.local  # every chunk would also carry 64 rows over 48k tokens
    queued = auto(gbps=10).choose(3000, stats(), 0, 60_000, busy, 0)
    assert queued.local and queued.remote_s > long_prompt.remote_s  # prefill has 60k queued
