"""KV cache sizing (pdserve.model.memory): explicit sizes win, else what a (fake) device report
leaves of gpu_memory_utilization, else the CPU budget; max_model_len against the pool."""

from collections.abc import Callable

import pytest

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.errors import ConfigError
from pdserve.model.memory import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    GIB,
    KVPlan,
    MemoryReport,
    check_context,
    describe,
    plan_kv_cache,
)

BLOCK = 2 * 2**20  # a Llama-3-8B block of 16 tokens
GPU = MemoryReport(
    total=80 * GIB,
    free_at_start=79 * GIB,
    weights=16 * GIB,
    activation_peak=2 * GIB,
    non_torch=GIB,
)


def plan(memory: MemoryReport | None = GPU, utilization: float = 0.9, **explicit: int) -> KVPlan:
    return plan_kv_cache(
        block_bytes=BLOCK,
        block_size=16,
        num_kv_blocks=explicit.get("num_kv_blocks"),
        kv_cache_bytes=explicit.get("kv_cache_bytes"),
        gpu_memory_utilization=utilization,
        memory=memory,
    )


def test_the_kv_cache_takes_what_the_fraction_leaves_after_weights_activations_and_cuda() -> None:
    sized = plan()
    expected = int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB - GIB
    assert sized.num_blocks == expected // BLOCK and sized.source == "gpu_memory_utilization"
    assert sized.kv_bytes <= expected < sized.kv_bytes + BLOCK
    assert sized.max_tokens == sized.num_blocks * 16
    assert plan(utilization=0.5).num_blocks == (40 * GIB - 19 * GIB) // BLOCK


def test_explicit_sizes_win_over_the_device_and_the_cpu_budget_applies_without_one() -> None:
    assert plan(num_kv_blocks=7, kv_cache_bytes=GIB) == KVPlan(7, BLOCK, 16, "num_kv_blocks")
    assert plan(kv_cache_bytes=GIB).num_blocks == GIB // BLOCK
    assert plan(kv_cache_bytes=1).num_blocks == 1  # never an empty pool
    cpu = plan(memory=None)
    assert (cpu.num_blocks, cpu.source) == (DEFAULT_CPU_KV_CACHE_BYTES // BLOCK, "cpu_default")


def test_a_share_larger_than_the_free_memory_is_refused() -> None:
    crowded = MemoryReport(80 * GIB, 40 * GIB, 16 * GIB, 2 * GIB, GIB)  # another process: 40
    with pytest.raises(ConfigError, match="lower gpu_memory_utilization"):
        plan(crowded)
    assert plan(crowded, utilization=0.5).num_blocks > 0  # its half fits


def test_weights_that_leave_no_room_for_a_block_are_refused_with_what_took_the_memory() -> None:
    full = MemoryReport(24 * GIB, 24 * GIB, 20 * GIB, 2 * GIB, GIB)
    with pytest.raises(ConfigError, match=r"weights 20\.00 GiB, activation peak 2\.00 GiB"):
        plan(full)


def test_max_model_len_is_checked_against_the_pool() -> None:
    pool = KVPlan(64, BLOCK, 16, "kv_cache_bytes")  # 1,024 tokens
    assert check_context(pool, 1024, explicit=True) == 1024
    with pytest.raises(ConfigError, match="max_model_len is 2048 but the KV cache holds 1024"):
        check_context(pool, 2048, explicit=True)
    assert check_context(pool, 2048, explicit=False) == 1024  # the model's own: capped


def test_the_startup_line_names_every_figure() -> None:
    line = describe(plan(), GPU, 16 * GIB, 8192)
    for part in ("weights 16.00 GiB", "activation peak 2.00 GiB", "blocks", "max_model_len 8192"):
        assert part in line
    assert "activation" not in describe(plan(memory=None), None, GIB, 1024)


def test_an_engine_whose_max_model_len_exceeds_its_kv_cache_does_not_start(
    make_engine: Callable[..., LLMEngine],
) -> None:
    with pytest.raises(ConfigError, match="max_model_len is 128 but the KV cache holds 64"):
        make_engine(num_kv_blocks=4, max_model_len=128)
    engine = make_engine(num_kv_blocks=4)  # the model's context, capped to the pool
    assert engine.max_model_len == 64
    assert engine.kv_plan == KVPlan(4, engine.runner.stager.block_bytes, 16, "num_kv_blocks")


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_must_be_a_fraction(value: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
