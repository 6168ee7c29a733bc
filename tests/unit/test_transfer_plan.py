"""How direct writes are planned: runs of blocks consecutive on both sides become one transfer,
cut at a size limit; anything that breaks a run on either side starts a new one. Transfers are
dealt round-robin over a sender's Mooncake engines, as many as the config or its cores say."""

import os

import pytest

from pdserve.config import TransferConfig
from pdserve.errors import ConfigError
from pdserve.transfer.base import KVEndpoints, KVTarget
from pdserve.transfer.direct import address_of
from pdserve.transfer.mooncake import check_memory_kind, deal, plan_writes, sender_engines

SIZE = 4096
BASE = 1 << 40  # decode's KV cache address (never dereferenced: only planned)


def target(block_ids: list[int]) -> KVTarget:
    endpoints = KVEndpoints(mooncake_session="peer:1", mooncake_base=BASE, kv_bytes=64 * SIZE)
    return KVTarget("decode:1", "r", 0, tuple(block_ids), SIZE, endpoints)


def contiguous(num_blocks: int) -> list[memoryview]:
    view = memoryview(bytearray(num_blocks * SIZE))
    return [view[i * SIZE : (i + 1) * SIZE] for i in range(num_blocks)]


def addresses(blocks: list[memoryview]) -> list[int]:
    return [address_of(b) for b in blocks]


def test_runs_follow_decode_block_ids() -> None:
    blocks = contiguous(6)
    source = address_of(blocks[0])
    writes = plan_writes(target([3, 4, 5, 9, 2, 3]), addresses(blocks))
    assert writes == [
        (source, BASE + 3 * SIZE, 3 * SIZE),
        (source + 3 * SIZE, BASE + 9 * SIZE, SIZE),
        (source + 4 * SIZE, BASE + 2 * SIZE, 2 * SIZE),
    ]


def test_separate_source_buffers_break_runs() -> None:
    blocks = [memoryview(bytearray(SIZE)) for _ in range(3)]
    writes = plan_writes(target([0, 1, 2]), addresses(blocks))
    assert [w[0] for w in writes] == [address_of(b) for b in blocks]
    assert [w[1] for w in writes] == [BASE, BASE + SIZE, BASE + 2 * SIZE]


def test_long_runs_are_cut_at_the_size_limit() -> None:
    blocks = contiguous(10)
    source = address_of(blocks[0])
    writes = plan_writes(target(list(range(10, 20))), addresses(blocks), max_bytes=4 * SIZE)
    assert [(w[0] - source, w[1] - BASE, w[2]) for w in writes] == [
        (0, 10 * SIZE, 4 * SIZE),
        (4 * SIZE, 14 * SIZE, 4 * SIZE),
        (8 * SIZE, 18 * SIZE, 2 * SIZE),
    ]
    # a limit under one block still writes whole blocks
    assert len(plan_writes(target(list(range(10, 20))), addresses(blocks), max_bytes=1)) == 10


def test_transfers_are_dealt_round_robin_from_the_given_engine() -> None:
    assert deal(5, 2, 0) == [0, 1, 0, 1, 0]
    assert deal(3, 3, 2) == [2, 0, 1]
    assert deal(4, 1, 0) == [0, 0, 0, 0]
    assert deal(0, 4, 1) == []


@pytest.mark.parametrize(("cores", "engines"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (96, 4)])
def test_auto_runs_one_sending_engine_per_four_cores_up_to_four(
    cores: int, engines: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert sender_engines(TransferConfig()) == engines
    assert sender_engines(TransferConfig(mooncake_protocol="rdma")) == 1
    assert sender_engines(TransferConfig(mooncake_engines=3)) == 3


def test_a_negative_engine_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mooncake_engines"):
        TransferConfig(mooncake_engines=-1)


def test_the_non_cuda_mooncake_build_is_refused_for_a_gpu_kv_cache() -> None:
    check_memory_kind("cpu")  # host memory: either build
    check_memory_kind("cuda", installed=lambda name: False)  # the CUDA build
    with pytest.raises(ConfigError, match=r"install mooncake-transfer-engine \(its CUDA build\)"):
        check_memory_kind("cuda")  # this machine has the non-CUDA wheel
