"""Tensor parallelism on CPU: two ranks (rank 0 in this process, rank 1 a worker process) over
gloo, against one rank and against transformers — logits, greedy tokens with prefix hits (the
mixture-of-experts families too, experts sliced or whole per rank), preemption and storage
restores, PD mode through the router, and a rank that dies or hangs."""

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from credentials import SECRET
from reference import hf_greedy, hf_model
from stacks import Stack, routed
from test_storage import GREEDY as LONG_GREEDY
from test_storage import make_tier, storage_config
from test_storage import prompts as storage_prompts
from waiting import wait_for

from pdserve.config import (
    ClusterConfig,
    DecodeConfig,
    EngineConfig,
    MixedConfig,
    PrefillConfig,
    StorageConfig,
    TransferConfig,
)
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.tensor_parallel import LocalWorkers, Rendezvous
from pdserve.errors import ConfigError, TensorParallelError
from pdserve.model.runner import SequenceChunk
from pdserve.model.shm_segments import segment_path
from pdserve.storage import StorageTier
from services.controller.cluster import Cluster

MakeStack = Callable[..., Stack]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[(seed + 31 * i + 7 * j * j) % 250 for j in range(length)] for i in range(count)]


@pytest.fixture
def engines(tiny_model_dir: Path) -> Iterator[dict[int, LLMEngine]]:
    """A TP=1 and a TP=2 engine on the tiny model, same settings (64 blocks); checked and
    closed at the end."""
    made = {
        size: LLMEngine.from_config(
            EngineConfig(
                model=str(tiny_model_dir),
                num_kv_blocks=64,
                tensor_parallel_size=size,
                torch_threads=1,
            )
        )
        for size in (1, 2)
    }
    yield made
    for engine in made.values():
        engine.check_integrity()
        engine.close()


def test_tp2_logits_equal_tp1_on_ragged_batches_with_cached_prefixes(
    engines: dict[int, LLMEngine],
) -> None:
    """A prefill of two prompts, then a mixed step (a chunk after a cached prefix beside a
    decode row): rank 0's gathered logits equal one rank's within 1e-5 of their scale."""
    steps = [
        [
            SequenceChunk(list(range(5, 45)), 0, [0, 1, 2], True),
            SequenceChunk(list(range(60, 83)), 0, [3, 4], True),
        ],
        [
            SequenceChunk(list(range(100, 120)), 40, [0, 1, 2, 5], True),
            SequenceChunk([7], 23, [3, 4], True),
        ],
    ]
    for chunks in steps:
        one, two = (engines[size].runner.execute(chunks) for size in (1, 2))
        assert two.shape == one.shape == (2, engines[1].loaded.config.vocab_size)
        scale = one.abs().max().item()
        assert (two - one).abs().max().item() <= 1e-5 * scale
        assert torch.equal(two.argmax(-1), one.argmax(-1))
    for size in (1, 2):
        assert engines[size].runner.kv_cache.shape[-2] == 4 // size  # each rank: its KV heads


def test_a_step_too_large_for_the_shared_memory_slots_goes_through_gloo_with_the_same_logits(
    tiny_model_dir: Path,
) -> None:
    """Two prompts of 2,100 tokens in one step: every activation (4,200 x 256 fp32) exceeds a
    4 MiB slot."""
    made = [
        LLMEngine.from_config(
            EngineConfig(model=str(tiny_model_dir), num_kv_blocks=300, tensor_parallel_size=size)
        )
        for size in (1, 2)
    ]
    try:
        first, second = prompts(2, 2100, seed=6)
        chunks = [
            SequenceChunk(first, 0, list(range(132)), True),
            SequenceChunk(second, 0, list(range(132, 264)), True),
        ]
        group = made[1].runner.tp.group  # type: ignore[union-attr]
        before = dataclasses.replace(group.stats)
        fast, paths = group._fast, []  # each collective's path: shared memory, or None (gloo)

        def counted(x: torch.Tensor) -> Any:
            paths.append(fast(x))
            return paths[-1]

        group._fast = counted  # type: ignore[method-assign]
        one, two = (engine.runner.execute(chunks) for engine in made)
        assert (two - one).abs().max().item() <= 1e-5 * one.abs().max().item()
        assert torch.equal(two.argmax(-1), one.argmax(-1))
        calls = group.stats.calls - before.calls
        shared = sum(path is not None for path in paths)
        assert calls == len(paths) == 11 and shared == 2  # the payload and the logits gather only
    finally:
        for engine in made:
            engine.close()


@pytest.mark.parametrize(
    ("family", "expert_parallel_size"),
    [
        ("llama", 1),
        ("qwen3-moe", 1),
        ("qwen3-moe", 2),
        ("mixtral", 2),
        ("deepseek-v3", 2),
        ("deepseek-v3-fp8", 1),
        ("deepseek-v3-fp8", 2),
    ],
    ids=[
        "llama",
        "qwen3-moe-sliced-experts",
        "qwen3-moe-ep2",
        "mixtral-ep2",
        "deepseek-v3-ep2",
        "deepseek-v3-fp8-weights-sliced-experts",
        "deepseek-v3-fp8-weights-ep2",
    ],
)
def test_tp2_greedy_equals_tp1_and_transformers_with_prefix_hits(
    family: str,
    expert_parallel_size: int,
    family_dirs: Callable[[str], Path],
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Two ranks, experts sliced by width (tensor parallel) or whole on each (expert
    parallel): logits within 1e-5 of their scale, and greedy tokens, equal one rank's and
    transformers'."""
    model_dir = family_dirs(family)
    engines = {
        size: make_engine(
            model=str(model_dir),
            num_kv_blocks=64,
            tensor_parallel_size=size,
            expert_parallel_size=min(size, expert_parallel_size),
            torch_threads=1,
        )
        for size in (1, 2)
    }
    chunks = [SequenceChunk(list(range(5, 45)), 0, [0, 1, 2], True)]
    one, two = (engines[size].runner.execute(chunks) for size in (1, 2))
    assert (two - one).abs().max().item() <= 1e-5 * one.abs().max().item()
    shared = prompts(1, 48, seed=5)[0]
    batch = [[*shared, 1, 2, 3], [*shared, 9], prompts(1, 30, seed=9)[0]]
    first = {size: engine.generate(batch[:1], GREEDY) for size, engine in engines.items()}
    rest = {size: engine.generate(batch[1:], GREEDY) for size, engine in engines.items()}
    assert [c.token_ids for c in first[2]] == [c.token_ids for c in first[1]]
    assert [c.token_ids for c in rest[2]] == [c.token_ids for c in rest[1]]
    assert rest[2][0].num_cached_tokens == 48  # the shared prefix hit rank 0's prefix cache
    model = hf_model(model_dir)
    assert list(rest[2][0].token_ids) == hf_greedy(model, batch[1], GREEDY.max_tokens)


def test_tp2_samples_once_on_rank_0_as_one_rank_does(engines: dict[int, LLMEngine]) -> None:
    """Seeded sampling at temperature 1 (top-p, logprobs): rank 0 samples from the gathered
    logits exactly what one rank samples."""
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, logprobs=2)
    batch = prompts(3, 25, seed=3)
    one, two = (engines[size].generate(batch, params) for size in (1, 2))
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    assert len({c.token_ids for c in one}) == 3  # distinct prompts, distinct samples


def test_tp2_preempts_and_resumes_from_storage_with_identical_output(
    tiny_model_dir: Path, engines: dict[int, LLMEngine], redis_url: str, tmp_path: Path
) -> None:
    """20 blocks for 3 x 138 tokens: preemption; the storage tier holds the blocks as both
    ranks' slices under a tag of the TP layout, and the restored requests end identically."""
    batch = storage_prompts(3, 90)
    expected = [c.token_ids for c in engines[1].generate(batch, LONG_GREEDY)]
    tiers: list[StorageTier] = []
    tags: list[str] = []
    config: StorageConfig = storage_config(redis_url, tmp_path)

    def tier(tag: str) -> StorageTier:
        tags.append(tag)
        return make_tier(config, tiers, tag)

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=20, tensor_parallel_size=2),
        storage_tier=tier,
    )
    try:
        assert [c.token_ids for c in engine.generate(batch, LONG_GREEDY)] == expected
        connector = engine.storage_connector
        assert connector is not None and tags[0].endswith("/tp2")  # never a TP=1 engine's
        assert engine.scheduler.stats.num_preemptions > 0
        assert connector.tier.counters.blocks_read > 0 and connector.staged.loaded_tokens > 0
        assert engine.runner.stager.block_bytes == 2 * engine.runner.kv_cache[0].nbytes
        connector.tier.flush()
        engine.check_integrity()
        # one rank, the same store: the TP=2 blocks are another layout, never read
        one = LLMEngine.from_config(
            EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64),
            storage_tier=lambda tag: make_tier(config, tiers, tag),
        )
        try:
            assert [c.token_ids for c in one.generate(batch[:1], LONG_GREEDY)] == expected[:1]
            assert one.scheduler.stats.storage_hit_tokens == 0
        finally:
            one.close()
    finally:
        engine.close()
        for tier in tiers:
            tier.flush()
            tier.close()


@pytest.mark.parametrize(
    ("transport", "family", "expert_parallel_size", "kv_cache_dtype"),
    [
        ("grpc", "llama", 1, "auto"),
        ("shm", "llama", 1, "auto"),
        ("mooncake", "llama", 1, "auto"),
        ("shm", "qwen3-moe", 2, "auto"),
        ("grpc", "mixtral", 2, "auto"),
        ("mooncake", "deepseek-v3", 2, "auto"),
        ("shm", "llama", 1, "fp8_e4m3"),
    ],
)
def test_tp2_prefill_to_tp2_decode_equals_one_rank_over_every_transport(
    transport: str,
    family: str,
    expert_parallel_size: int,
    kv_cache_dtype: str,
    family_dirs: Callable[[str], Path],
    make_stack: MakeStack,
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Decode's Reserve reply names each rank's cache; over shm and Mooncake prefill writes
    each rank's slice into decode's same rank (then commits once), over gRPC decode's rank 0
    spreads the slices. The mixture-of-experts models with their experts spread (EP=2); an
    FP8 cache whose ranks agree on one rank's scales (the largest of each layer's)."""
    model = str(family_dirs(family))
    stack = make_stack(
        engine={
            "model": model,
            "num_kv_blocks": 128,
            "tensor_parallel_size": 2,
            "expert_parallel_size": expert_parallel_size,
            "kv_cache_dtype": kv_cache_dtype,
            "torch_threads": 1,
        },
        transfer=TransferConfig(transport=transport),
    )
    one_rank = make_engine(model=model, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    prefill, decode = stack.prefill[0].instance, stack.decode[0].instance
    shared = prompts(1, 64, seed=11)[0]
    for prompt in ([*shared, 4, 5], [*shared, 6]):
        result = stack.generate(prompt, GREEDY)
        assert result.final.prefill is not None and result.final.prefill.transport == transport
        [expected] = one_rank.generate([prompt], GREEDY)
        assert result.tokens == list(expected.token_ids)
    assert decode.runtime.kv_tag == prefill.runtime.kv_tag
    assert decode.runtime.engine.loaded.model.kv_scales == one_rank.loaded.model.kv_scales
    ranks = decode.endpoints.ranks
    assert len(ranks) == 2 and decode.endpoints.shm_name == ""  # no write into the whole
    assert ranks[0].kv_bytes == ranks[1].kv_bytes == decode.runtime.stager.total_bytes // 2
    stats = decode.stats()
    assert stats.kv_blocks_received == 5 + 1  # the second prompt: its new block
    assert stats.tensor_parallel_size == 2  # and its collectives, for /metrics
    assert stats.tp_collective_seconds > 0 and stats.tp_collectives >= 11 * 9  # 9 steps each
    assert prefill.stats().device_hit_tokens == 64  # the second prompt's shared prefix
    wait_for(lambda: decode.stats().num_running == 0)
    prefill.check_integrity()
    decode.check_integrity()


def _worker(engine: LLMEngine) -> int:
    workers = engine.runner.tp.workers  # type: ignore[union-attr]
    assert isinstance(workers, LocalWorkers)
    return workers.processes[0].pid


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_failing_rank_fails_the_requests_with_a_typed_error_never_hangs(
    tiny_model_dir: Path, fault: str
) -> None:
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), num_kv_blocks=32, tensor_parallel_size=2, tp_timeout_s=3.0
        )
    )
    pid = _worker(engine)
    segments = [segment_path(name) for name in engine.runner.rank_segments]
    assert segments and all(path.exists() for path in segments)
    try:
        assert engine.generate(prompts(1, 20), GREEDY)[0].finish_reason == "length"
        os.kill(pid, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
        for _ in range(2):  # the failed step, then a request on the broken group: both fail
            engine.add_request(prompts(1, 20, seed=4)[0], GREEDY)
            [output] = engine.step()
            assert output.finished and output.finish_reason == "abort"
            assert output.error is not None and "TensorParallelError" in output.error
        engine.check_integrity()
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.close()
    assert not any(path.exists() for path in segments)  # the killed worker's KV too


class NeverJoins:
    """A worker that never joins rank 0 (the other side of rank 0's start-up wait): a process
    running `code`."""

    def __init__(self, code: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", code])

    def alive(self) -> bool:
        return self.process.poll() is None

    def pids(self) -> list[int]:
        return [self.process.pid]

    def stop(self, timeout_s: float) -> None:
        self.process.kill()
        self.process.wait()


@pytest.mark.parametrize(
    ("code", "limit_s", "message"),
    [
        ("raise SystemExit(3)", 600.0, "a tensor-parallel rank exited before it started"),
        ("import signal; signal.pause()", 1.0, "not every tensor-parallel rank started within 1 s"),
    ],
)
def test_a_worker_that_exits_or_never_starts_fails_the_start_with_a_typed_error(
    tiny_model_dir: Path, code: str, limit_s: float, message: str
) -> None:
    """Start-up waits `tp_start_timeout_s`, not a collective's timeout (a slow machine takes
    seconds to import torch), and stops waiting as soon as a worker exits."""
    launched: list[NeverJoins] = []

    def launch(config: EngineConfig, rendezvous: Rendezvous) -> NeverJoins:
        launched.append(NeverJoins(code))
        return launched[-1]

    config = EngineConfig(
        model=str(tiny_model_dir),
        tensor_parallel_size=2,
        tp_timeout_s=0.5,
        tp_start_timeout_s=limit_s,
    )
    with pytest.raises(TensorParallelError, match=message):
        LLMEngine.from_config(config, tp_workers=(launch, "127.0.0.1"))
    assert len(launched) == 1 and not launched[0].alive()  # stopped by the failed start


def test_a_size_that_does_not_split_the_heads_is_refused_before_any_worker_starts(
    tiny_model_dir: Path,
) -> None:
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=3))


def _mixed_tokens(engine: EngineConfig, address: str, prompt: list[int]) -> list[int]:
    """The greedy tokens of `prompt` through a router over the mixed instance at `address`."""
    with routed(engine, mixed=[address]) as stack:
        return stack.generate(prompt, GREEDY).tokens


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone, or not ours to read
        return ""


def _ray_worker_rank(rank0: int) -> int:
    """The process of rank 1 of the tensor-parallel instance whose rank 0 is the actor process
    `rank0`: a `TPWorkerActor` (Ray titles its process `ray::TPWorkerActor...`) started by the
    same raylet (this test session's own Ray; this instance is its only tensor-parallel one)."""
    raylet = psutil.Process(rank0).parent()
    assert raylet is not None
    workers = [p.pid for p in raylet.children() if _title(p).startswith("ray::TPWorkerActor")]
    assert len(workers) == 1, workers
    return workers[0]


def test_a_tp2_instance_on_ray_takes_a_bundle_per_rank_and_restarts_when_a_rank_dies(
    ray_session: None, tiny_model_dir: Path, engines: dict[int, LLMEngine]
) -> None:
    engine = EngineConfig(
        model=str(tiny_model_dir), num_kv_blocks=64, torch_threads=1, tensor_parallel_size=2
    )
    config = ClusterConfig(
        engine=engine,
        prefill=PrefillConfig(replicas=0),
        decode=DecodeConfig(replicas=0),
        mixed=MixedConfig(replicas=1, num_cpus=1),
        namespace="pdserve-tp-test",
    )
    cluster = Cluster(config, SECRET)
    [info] = cluster.up()
    prompt = prompts(1, 40, seed=8)[0]
    [expected] = engines[1].generate([prompt], GREEDY)
    try:
        assert _mixed_tokens(engine, info.address, prompt) == list(expected.token_ids)
        group = cluster._instance_groups[info.name]  # its own: rank 0's bundle, rank 1's
        assert cluster._placement_group is None and len(group.bundle_specs) == 2
        worker = _ray_worker_rank(info.pid)
        assert worker != info.pid
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: cluster.dead_instances() == [info.name], timeout_s=60)
        restarted = cluster.restart_instance(info.name)
        assert _mixed_tokens(engine, restarted.address, prompt) == list(expected.token_ids)
    finally:
        cluster.down()
