"""Decode graphs (`engine.cuda_graphs`): static buffers, padding up to a captured size, the
scratch block. Recorded with `eager_capture` here (the same forward on the same buffers at
every replay); `benchmarks/gpu_check.py` records real CUDA graphs on a GPU."""

from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import ConfigError
from pdserve.model.attention import make_backend
from pdserve.model.graphs import Forward, Replay, capture_sizes, eager_capture
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, SequenceChunk

BLOCK = 16


class CountingCapture:
    """`eager_capture`, counting the sizes recorded and the replays."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.replays = 0

    def __call__(self, forward: Forward) -> tuple[Replay, torch.Tensor]:
        replay, output = eager_capture(forward)
        self.sizes.append(output.shape[0])

        def counted() -> None:
            self.replays += 1
            replay()

        return counted, output


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert capture_sizes(64)[-3:] == (32, 48, 64)


def runner_on(tiny_model_dir: Path, backend: str, blocks: int = 40) -> ModelRunner:
    loaded = load_model(tiny_model_dir)
    loaded.model.attention = make_backend(backend, torch.device("cpu"))
    return ModelRunner.create(loaded.model, blocks, BLOCK, loaded.dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_padded_decode_replay_equals_the_eager_forward(
    tiny_model_dir: Path, backend: str
) -> None:
    """Batches of 5, 3 and 1 replay the graphs of 8, 4 and 1. Between them s3's blocks go to a
    new sequence s5: a padding row that kept s3's slot from the step before would overwrite
    s5's prompt KV."""
    eager, graphed = runner_on(tiny_model_dir, backend), runner_on(tiny_model_dir, backend)
    capture = CountingCapture()
    graphed.capture_graphs((1, 4, 8), max_blocks=4, capture=capture)
    assert capture.sizes == [8, 4, 1]  # the largest first
    prompts = [[(7 * i + s) % 200 + 3 for i in range(20 + 9 * s)] for s in range(6)]
    prompts[5] = prompts[5][:50]  # s3 decodes at position 47: s5's prompt covers that slot
    tables = [[4 * s + b for b in range(1, 5)] for s in range(5)]  # block 39 is the scratch
    tables.append(tables[3])
    first = [SequenceChunk(p, 0, t, False) for p, t in zip(prompts[:5], tables[:5], strict=True)]

    def decode(seqs: list[int]) -> list[SequenceChunk]:
        return [SequenceChunk([11 + s], len(prompts[s]), tables[s], True) for s in seqs]

    s5 = [SequenceChunk(prompts[5], 0, tables[5], False)]
    for runner in (eager, graphed):
        runner.execute(first)
    for step in ([decode([0, 1, 2, 3, 4])], [s5, decode([0, 1, 5])], [decode([5])]):
        for chunks in step:
            expected = eager.execute(chunks)
            assert torch.allclose(graphed.execute(chunks), expected, atol=1e-5, rtol=1e-5)
    assert capture.replays == 3
    assert torch.equal(graphed.kv_cache[:39], eager.kv_cache[:39])  # only the scratch differs


def test_prefill_and_oversized_batches_run_without_a_graph(tiny_model_dir: Path) -> None:
    runner = runner_on(tiny_model_dir, "cpu")
    capture = CountingCapture()
    runner.capture_graphs((2,), max_blocks=2, capture=capture)
    runner.execute([SequenceChunk(list(range(3, 40)), 0, [1, 2, 3], True)])  # prefill
    runner.execute([SequenceChunk([5], 37, [1, 2, 3], True)])  # 3 blocks: wider than captured
    decode = [SequenceChunk([5], 3, [4], True), SequenceChunk([6], 3, [5], True)]
    runner.execute([*decode, SequenceChunk([7], 3, [6], True)])  # 3 rows: larger than 2
    assert capture.replays == 0
    runner.execute(decode)
    assert capture.replays == 1


def test_an_engine_with_decode_graphs_gives_the_same_greedy_tokens(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=24, max_num_seqs=6)
    prompts = [[(5 * i + 7 * s) % 250 + 3 for i in range(10 + 13 * s)] for s in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLMEngine.from_config(config).generate(prompts, params)
    capture = CountingCapture()
    engine = LLMEngine.from_config(config, graph_capture=capture)
    assert engine.kv_cache.num_blocks == 23  # block 23 is the padding's, never a request's
    graphed = engine.generate(prompts, params)  # 24 blocks: preemptions, batches of 1 to 6
    assert [c.token_ids for c in graphed] == [c.token_ids for c in plain]
    assert engine.scheduler.stats.num_preemptions > 0 and capture.replays > 20
    engine.check_integrity()


def test_cuda_graphs_on_a_cpu_device_are_refused() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(cuda_graphs=True)
    assert EngineConfig(cuda_graphs=False).cuda_graphs is False
