"""Every attention backend equals the reference (fp32 tolerance) on ragged batches: GQA, decode
rows of different lengths, prefill chunks after a prefix hit, prefill and decode mixed."""

import random
from pathlib import Path

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    CpuBackend,
    ReferenceBackend,
    make_backend,
)
from pdserve.model.cpu_kernels import paged_ops
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, SequenceChunk

BLOCK = 16


def cpu_backend() -> AttentionBackend:
    backend = make_backend("cpu", torch.device("cpu"))  # the kernel builds here, or this fails
    assert isinstance(backend, CpuBackend)
    return backend


def metadata(
    chunks: list[tuple[int, int]], tables: list[list[int]], block: int = BLOCK
) -> AttentionMetadata:
    """(start position, new tokens) per sequence, and its block table."""
    blocks, offsets = [], []
    for (start, count), table in zip(chunks, tables, strict=True):
        for position in range(start, start + count):
            blocks.append(table[position // block])
            offsets.append(position % block)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    contexts = [start + count for start, count in chunks]
    return AttentionMetadata(
        torch.tensor(blocks),
        torch.tensor(offsets),
        [count for _, count in chunks],
        contexts,
        torch.tensor(padded),
        torch.tensor(contexts),
        all(count == 1 for _, count in chunks),
    )


def batch(
    chunks: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = 32,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random cache (one layer's view of a 2-layer cache), queries and shuffled block tables."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-(s + n) // block) for s, n in chunks]
    ids = list(range(1, sum(needed) + 8))
    random.Random(seed).shuffle(ids)
    tables, used = [], 0
    for count in needed:
        tables.append(ids[used : used + count])
        used += count
    cache = torch.randn(len(ids) + 1, 2, 2, block, kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(n for _, n in chunks), heads, head_dim, generator=generator)
    return q.to(dtype), cache.to(dtype)[:, 1], metadata(chunks, tables, block)


CASES = {
    "decode_ragged": [(0, 1), (37, 1), (15, 1), (200, 1), (64, 1)],
    "prefill_after_hit": [(32, 40)],
    "prefill_and_decode": [(0, 23), (90, 1), (16, 17), (5, 1), (47, 1)],
}


# (heads, kv heads, head size): the kernel's register-resident value pass takes groups of 1, 2
# and 4 at 32 and 64; a group of 8 at 128 (64 accumulators) and of 3 at 48 take the general loop
SHAPES = [(4, 4, 32), (8, 2, 32), (16, 4, 64), (8, 1, 128), (6, 2, 48)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_the_cpu_backend_equals_the_reference(
    case: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, kv_layer, meta = batch(CASES[case], heads, kv_heads, torch.float32, heads, head_dim)
    expected = ReferenceBackend().plan(meta).attend(q, kv_layer, head_dim**-0.5)
    got = cpu_backend().plan(meta).attend(q, kv_layer, head_dim**-0.5)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [8, 24])
def test_blocks_that_do_not_hold_whole_groups_of_16_positions(block: int) -> None:
    """The kernels score 16 positions at a time: with 8- or 24-token blocks a group spans two
    blocks (each position's block is looked up)."""
    q, kv_layer, meta = batch(CASES["prefill_and_decode"], 8, 2, torch.float32, 5, block=block)
    expected = ReferenceBackend().plan(meta).attend(q, kv_layer, 32**-0.5)
    got = cpu_backend().plan(meta).attend(q, kv_layer, 32**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_kernel_reads_bfloat16_caches() -> None:
    q, kv_layer, meta = batch(CASES["decode_ragged"], 8, 2, torch.bfloat16, seed=3)
    expected = ReferenceBackend().plan(meta).attend(q.float(), kv_layer.float(), 32**-0.5)
    got = cpu_backend().plan(meta).attend(q, kv_layer, 32**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_model_gives_the_same_logits_with_either_backend(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    runner = ModelRunner.create(loaded.model, 64, BLOCK, loaded.dtype)
    prompt = list(range(3, 60))
    table = list(range(1, 9))
    steps = [
        [SequenceChunk(prompt[:40], 0, table, True)],
        [SequenceChunk(prompt[40:], 40, table, True), SequenceChunk([7], 0, [20], True)],
        [SequenceChunk([9], len(prompt), table, True), SequenceChunk([8], 1, [20], True)],
    ]
    outputs = {}
    for backend in (ReferenceBackend(), cpu_backend()):
        loaded.model.attention = backend
        runner.kv_cache.zero_()
        outputs[backend.name] = [runner.execute(chunks) for chunks in steps]
    for reference, cpu in zip(outputs["reference"], outputs["cpu"], strict=True):
        torch.testing.assert_close(cpu, reference, rtol=1e-4, atol=1e-4)  # after 4 layers
        assert torch.equal(cpu.argmax(-1), reference.argmax(-1))


def test_auto_takes_the_kernel_on_cpu_and_the_reference_elsewhere() -> None:
    assert paged_ops() is not None
    assert make_backend("auto", torch.device("cpu")).name == "cpu"
    assert make_backend("auto", torch.device("cuda")).name == "triton"  # triton is installed
    assert make_backend("reference", torch.device("cpu")).name == "reference"
    with pytest.raises(ConfigError, match="attention_backend is cpu"):
        make_backend("cpu", torch.device("cuda"))
    with pytest.raises(ConfigError, match="attention_backend is triton"):
        make_backend("triton", torch.device("cpu"))
