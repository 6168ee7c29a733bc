"""The triton backend's kernels against the reference (fp32 tolerance) in triton's interpreter:
run only by tests/unit/test_triton_attention.py, in a fresh process with TRITON_INTERPRET=1 (this
file is not named test_*, so the session never collects it: triton must not be imported there
in interpreter mode). Decode rows of ragged lengths (one context split or several), prefill
chunks after a prefix hit (block-aligned or not), a prompt prefilled in two chunks, prefill and
decode mixed, GQA and MHA, head sizes 32, 64 and 48 (padded), strided queries, bfloat16 and
float16, an FP8 cache under float32 and bfloat16 queries. The latent (MLA) decode kernel against
its torch reference: one head and a head block, a latent of 576 = 512 + 64 and a small one
(40 = 32 + 8), split contexts, decode rows after prefill rows, an FP8 cache and its scale. And
the fused mixture-of-experts kernel against the grouped CPU path, also over FP8 block-quantized
weights (against the weights they stand for)."""

import dataclasses
import os
import random

import pytest
import torch
from test_attention_backends import BLOCK, metadata

from pdserve.model.attention import (
    AttentionMetadata,
    ReferenceBackend,
    latent_decode_reference,
)
from pdserve.model.moe import Experts, route
from pdserve.model.parallel import ExpertPart
from pdserve.model.triton_attention import TritonBackend, TritonConfig
from pdserve.model.triton_moe import Tiles, fused_experts

assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/unit/test_triton_attention.py"

# Small tiles for the interpreter (it runs every program in Python); contexts above 32 tokens are
# split into up to 4 when there are few decode rows, which `ONE_SPLIT` turns off.
SMALL = TritonConfig(prefill_block_m=16, block_n=16, split_tokens=32, target_programs=64)
ONE_SPLIT = TritonConfig(prefill_block_m=16, block_n=32, split_tokens=4096)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_the_kernels_run_in_the_interpreter() -> None:
    assert TritonBackend()._kernels.INTERPRET


def cache(blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A random 2-layer cache's second layer: the strided view attention gets."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(blocks, 2, 2, BLOCK, kv_heads, head_dim, generator=generator)
    return full.to(dtype)[:, 1]


def tables_for(chunks: list[tuple[int, int]], seed: int) -> list[list[int]]:
    """Shuffled, disjoint block tables (block 0 left out: it pads the tables)."""
    needed = [-(-(start + count) // BLOCK) for start, count in chunks]
    ids = list(range(1, sum(needed) + 4))
    random.Random(seed).shuffle(ids)
    starts = [sum(needed[:i]) for i in range(len(needed))]
    return [ids[s : s + n] for s, n in zip(starts, needed, strict=True)]


def planned_for_longest(meta: AttentionMetadata, width: int) -> AttentionMetadata:
    """`meta` as a plan made for every sequence at `width` blocks (as the CUDA graphs' plan is):
    the kernels must still attend each row's own length."""
    rows = len(meta.query_lens)
    wide = torch.zeros(rows, width, dtype=torch.long)
    wide[:, : meta.block_tables.shape[1]] = meta.block_tables
    return dataclasses.replace(meta, context_lens=[width * BLOCK] * rows, block_tables=wide)


def check(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    config: TritonConfig = SMALL,
) -> None:
    scale = q.shape[-1] ** -0.5
    expected = ReferenceBackend().plan(meta).attend(q.float(), kv_layer, scale)
    got = TritonBackend(config).plan(meta).attend(q, kv_layer, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    tolerance = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def run_case(
    chunks: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    config: TritonConfig = SMALL,
    q_head_stride: int = 1,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """`q_head_stride` > 1: the queries are every so many heads of a wider tensor (strided).
    The cache is in `cache_dtype` (None: the queries' `dtype`)."""
    seed = heads * 7 + head_dim + len(chunks)
    tables = tables_for(chunks, seed)
    blocks = max(max(t) for t in tables) + 1
    kv_layer = cache(blocks, kv_heads, head_dim, cache_dtype or dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, heads * q_head_stride, head_dim, generator=generator)
    check(q.to(dtype)[:, ::q_head_stride], kv_layer, metadata(chunks, tables), config)


CASES = {
    "decode_ragged": [(0, 1), (37, 1), (15, 1), (200, 1), (64, 1)],
    "prefill_after_aligned_hit": [(32, 40)],
    "prefill_after_unaligned_hit": [(37, 29)],
    "prefill_and_decode": [(0, 23), (90, 1), (16, 17), (5, 1), (47, 1), (0, 1)],
}
HEADS = [(8, 2), (4, 4)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_the_kernels_equal_the_reference(case: str, heads: int, kv_heads: int) -> None:
    run_case(CASES[case], heads, kv_heads)


@pytest.mark.parametrize("case", ["decode_ragged", "prefill_and_decode"])
def test_head_size_64_and_one_decode_split(case: str) -> None:
    run_case(CASES[case], 8, 2, head_dim=64, config=ONE_SPLIT)


def test_a_head_size_below_a_power_of_two_and_strided_queries() -> None:
    """Head size 48 (the kernels pad it to 64 and mask) and q with a head stride of 2 heads."""
    run_case(CASES["prefill_and_decode"], 4, 2, head_dim=48, q_head_stride=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_caches(dtype: torch.dtype) -> None:
    run_case([(0, 20), (70, 1), (33, 1), (9, 12)], 8, 2, dtype=dtype)


@pytest.mark.parametrize(
    ("case", "config", "dtype"),
    [
        ("decode_ragged", SMALL, torch.float32),
        ("decode_ragged", ONE_SPLIT, torch.bfloat16),
        ("prefill_and_decode", SMALL, torch.float32),
        ("prefill_after_unaligned_hit", SMALL, torch.bfloat16),
    ],
    ids=["decode-splits-float32", "decode-one-split-bfloat16", "mixed-float32", "chunk-bfloat16"],
)
def test_an_fp8_cache_under_wider_queries(
    case: str, config: TritonConfig, dtype: torch.dtype
) -> None:
    """The kernels upcast float8_e4m3fn K/V as they load them (the reference converts the same
    cache); the output is in the queries' type."""
    run_case(CASES[case], 8, 2, dtype=dtype, config=config, cache_dtype=torch.float8_e4m3fn)


def test_a_prompt_prefilled_in_two_chunks_then_decoded() -> None:
    """Each step writes its new tokens' K/V with the step's write_kv, then attends to them."""
    heads, kv_heads, dim, prompt = 8, 2, 32, 45
    table = tables_for([(0, prompt + 1)], seed=5)
    kv_layer = cache(max(table[0]) + 1, kv_heads, dim, torch.float32, seed=5).zero_()
    generator = torch.Generator().manual_seed(6)
    for start, count in [(0, 19), (19, prompt - 19), (prompt, 1)]:
        meta = metadata([(start, count)], table)
        k, v = (torch.randn(count, kv_heads, dim, generator=generator) for _ in range(2))
        TritonBackend(SMALL).plan(meta).write_kv(kv_layer, k, v)
        check(torch.randn(count, heads, dim, generator=generator), kv_layer, meta)


def test_a_decode_plan_for_the_longest_context_attends_each_rows_own_length() -> None:
    """A decode graph's plan (`DecodeGraphs`) is made once for the longest context, over tables
    as wide as that context; the kernels read each row's length from `context_lens_tensor`."""
    chunks = CASES["decode_ragged"]
    heads, kv_heads, dim = 8, 2, 32
    tables = tables_for(chunks, seed=9)
    kv_layer = cache(max(max(t) for t in tables) + 1, kv_heads, dim, torch.float32, seed=9)
    q = torch.randn(len(chunks), heads, dim, generator=torch.Generator().manual_seed(10))
    meta = metadata(chunks, tables)
    planned = planned_for_longest(meta, width=24)  # blocks: a context of 384 tokens
    scale = dim**-0.5
    expected = ReferenceBackend().plan(meta).attend(q, kv_layer, scale)
    got = TritonBackend(SMALL).plan(planned).attend(q, kv_layer, scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# -- the latent (MLA) decode kernel ---------------------------------------------------------

# Four or more splits of the longest context below (and 16-head blocks for 16 heads).
LATENT = TritonConfig(block_n=16, split_tokens=32, target_programs=64)


def latent_cache(blocks: int, dim: int, seed: int) -> torch.Tensor:
    """A random 2-layer latent cache's second layer, `[blocks, 1, BLOCK, 1, dim]`, strided."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 2, 1, BLOCK, 1, dim, generator=generator)[:, 1]


def check_latent(
    chunks: list[tuple[int, int]],
    heads: int,
    dim: int,
    value_dim: int,
    dtype: torch.dtype = torch.float32,
    config: TritonConfig = LATENT,
    cache_dtype: torch.dtype | None = None,
    kv_scale: float = 1.0,
) -> None:
    """The decode rows of `chunks` (the others are prefill rows the kernel leaves alone) through
    the plan's `latent_decode` (or its `kv_scale` form) against the reference in float32."""
    seed = heads + dim + len(chunks)
    tables = tables_for(chunks, seed)
    stored = latent_cache(max(max(t) for t in tables) + 1, dim, seed).to(cache_dtype or dtype)
    decode = sum(count == 1 for _, count in chunks)
    generator = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(decode, heads, dim, generator=generator).to(dtype)
    step = TritonBackend(config).plan(metadata(chunks, tables))
    scale = dim**-0.5
    rows = step.rows
    expected = latent_decode_reference(
        q.float(), stored.float() * kv_scale, rows.decode_tables, rows.decode_lens, scale, value_dim
    )
    got = step._latent_decode(q, stored, scale, value_dim, kv_scale)  # type: ignore[attr-defined]
    assert got.shape == (decode, heads, value_dim) and got.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


LATENT_DECODE = [(0, 1), (37, 1), (15, 1), (200, 1), (64, 1)]  # contexts 1 .. 201


@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("config", [LATENT, ONE_SPLIT], ids=["splits", "one-split"])
def test_the_latent_decode_equals_the_reference(heads: int, config: TritonConfig) -> None:
    check_latent(LATENT_DECODE, heads, dim=40, value_dim=32, config=config)


def test_the_latent_decode_of_decode_rows_among_prefill_rows() -> None:
    """Rows 23, 41, 42 and 43 of the batch are its decode rows; 20 heads are two head blocks."""
    check_latent(CASES["prefill_and_decode"], 20, dim=40, value_dim=32)


def test_the_latent_decode_of_a_deepseek_latent_in_bfloat16() -> None:
    """576 = 512 values + 64 rotary values, 16 heads, contexts in 32 splits (of 32 tokens: the
    last 15 empty), which the merge takes 16 at a time."""
    config = TritonConfig(block_n=16, split_tokens=16, target_programs=64)
    check_latent([(519, 1), (8, 1)], 16, 576, 512, torch.bfloat16, config)


def test_the_latent_decode_of_an_fp8_cache_and_its_scale() -> None:
    """The kernel upcasts float8_e4m3fn latents as it loads them and applies `kv_scale`."""
    chunks = [(0, 1), (37, 1), (200, 1)]
    check_latent(chunks, 16, 40, 32, cache_dtype=torch.float8_e4m3fn, kv_scale=0.5)


def test_the_latent_decode_plan_for_the_longest_context_and_its_errors() -> None:
    """A decode graph's plan (for the longest context, over wide tables) attends each row's own
    length; q that is not the plan's decode rows, or a value wider than the latent, is refused."""
    chunks = LATENT_DECODE
    heads, dim, value_dim = 4, 40, 32
    tables = tables_for(chunks, seed=11)
    kv_layer = latent_cache(max(max(t) for t in tables) + 1, dim, seed=11)
    q = torch.randn(len(chunks), heads, dim, generator=torch.Generator().manual_seed(12))
    meta = metadata(chunks, tables)
    planned = planned_for_longest(meta, width=24)  # blocks: a context of 384 tokens
    scale = dim**-0.5
    expected = ReferenceBackend().plan(meta).latent_decode(q, kv_layer, scale, value_dim)
    step = TritonBackend(LATENT).plan(planned)
    torch.testing.assert_close(step.latent_decode(q, kv_layer, scale, value_dim), expected)
    with pytest.raises(ValueError, match="decode rows"):
        step.latent_decode(q[1:], kv_layer, scale, value_dim)
    with pytest.raises(ValueError, match="does not fit"):
        step.latent_decode(q, kv_layer, scale, dim + 1)


# -- the fused mixture-of-experts kernel -----------------------------------------------------

MOE_TILES = Tiles(block_m=16, block_n=32, block_k=32)


def experts_of(part: ExpertPart, hidden: int, seed: int) -> Experts:
    """Random experts (the stacked weights the loader fills), unpacked: the grouped reference."""
    experts = Experts(part, hidden)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (experts.gate_up, experts.down):
            weight.copy_(torch.randn(weight.shape, generator=generator) / weight.shape[-1] ** 0.5)
    return experts


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("first", "count"), [(0, 8), (4, 4)], ids=["all-experts", "ep-rank-1"])
def test_the_fused_experts_equal_the_grouped_reference(tokens: int, first: int, count: int) -> None:
    """8 experts of width 48 (not a tile multiple), hidden size 40, each token's top 3; on an
    expert-parallel rank (experts 4-7) the choices of other experts contribute nothing."""
    hidden, width, top_k = 40, 48, 3
    experts = experts_of(ExpertPart(8, first, count, 0, width), hidden, seed=tokens + first)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = route(torch.randn(tokens, 8, generator=generator), top_k, normalize=True)
    expected = experts._grouped(x, ids, weights)
    got = fused_experts(x, experts.gate_up, experts.down, ids, weights, first, MOE_TILES)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if first:
        untouched = ~((ids >= first) & (ids < first + count)).any(dim=1)
        assert not got[untouched].any()


def test_the_fused_experts_in_bfloat16() -> None:
    hidden, width = 64, 32
    experts = experts_of(ExpertPart(4, 0, 4, 0, width), hidden, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(9, hidden, generator=generator)
    weights, ids = route(torch.randn(9, 4, generator=generator), 2, normalize=False)
    expected = experts._grouped(x, ids, weights)
    got = fused_experts(
        x.bfloat16(),
        experts.gate_up.detach().bfloat16(),
        experts.down.detach().bfloat16(),
        ids,
        weights,
        0,
        MOE_TILES,
    )
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


def block_quantized(
    shape: tuple[int, int, int], block: tuple[int, int], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random stacked FP8 weights `[count, rows, columns]`, their float32 scale per `block`
    (partial at the far edges; from 0.5x to 2x each other, so a wrong block's shows) and the
    float32 weights they stand for."""
    count, rows, columns = shape
    bn, bk = block
    fp8 = torch.randn(shape, generator=generator).to(torch.float8_e4m3fn)
    blocks = (count, -(-rows // bn), -(-columns // bk))
    scale = (0.5 + 1.5 * torch.rand(blocks, generator=generator)) / columns**0.5
    spread = scale.repeat_interleave(bn, dim=1)[:, :rows].repeat_interleave(bk, dim=2)
    return fp8, scale, fp8.float() * spread[:, :, :columns]


SMALLEST_TILES = Tiles(block_m=16, block_n=16, block_k=16)
FP8_CASES = {
    # MOE_TILES shrunk to the blocks
    "square-blocks-float32": (64, (16, 16), MOE_TILES, 0, 8, torch.float32),
    # two column tiles per block; hidden 40: gate_up's last column of blocks, down's last row
    # are partial
    "tall-blocks-partial-ep-rank-1-float32": (40, (32, 16), SMALLEST_TILES, 4, 4, torch.float32),
    # two reduction steps per block
    "wide-blocks-bfloat16": (64, (16, 32), SMALLEST_TILES, 0, 8, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_the_fused_experts_of_block_quantized_fp8_weights(case: str) -> None:
    """8 experts of width 32, each token's top 2, FP8 weights with a scale per (rows, columns)
    block, against the grouped reference over the weights they stand for."""
    hidden, block, tiles, first, count, dtype = FP8_CASES[case]
    width, tokens = 32, 9
    experts = Experts(ExpertPart(8, first, count, 0, width), hidden)
    generator = torch.Generator().manual_seed(hidden + first)
    gate_up, gate_up_scale, gate_up_values = block_quantized(
        (count, 2 * width, hidden), block, generator
    )
    down, down_scale, down_values = block_quantized((count, hidden, width), block, generator)
    with torch.no_grad():
        experts.gate_up.copy_(gate_up_values)
        experts.down.copy_(down_values)
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = route(torch.randn(tokens, 8, generator=generator), 2, normalize=True)
    expected = experts._grouped(x, ids, weights)
    got = fused_experts(
        x.to(dtype), gate_up, down, ids, weights, first, tiles,
        gate_up_scale=gate_up_scale, down_scale=down_scale, weight_block=block,
    )  # fmt: skip
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_the_fused_experts_refuse_blocks_and_scales_they_cannot_serve() -> None:
    """Blocks that are not powers of two of at least 16, one scale without the other, a scale of
    the wrong shape: ValueError before any kernel runs."""
    generator = torch.Generator().manual_seed(0)
    gate_up, gate_up_scale, _ = block_quantized((2, 64, 40), (16, 16), generator)
    down, down_scale, _ = block_quantized((2, 40, 32), (16, 16), generator)
    x = torch.randn(3, 40, generator=generator)
    weights, ids = route(torch.randn(3, 2, generator=generator), 1, normalize=True)

    def run(
        gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None, block: tuple[int, int]
    ) -> None:
        fused_experts(
            x, gate_up, down, ids, weights, 0, MOE_TILES,
            gate_up_scale=gate_up_scale, down_scale=down_scale, weight_block=block,
        )  # fmt: skip

    for block in [(8, 16), (16, 48), (24, 24)]:
        with pytest.raises(ValueError, match="powers of two"):
            run(gate_up_scale, down_scale, block)
    with pytest.raises(ValueError, match="both gate_up_scale and down_scale"):
        run(gate_up_scale, None, (16, 16))
    with pytest.raises(ValueError, match=r"expected torch.float32 \[2, 3, 2\]"):
        run(gate_up_scale, down_scale[:, :2], (16, 16))
    with pytest.raises(ValueError, match=r"expected torch.float32 \[2, 4, 3\]"):
        run(gate_up_scale.double(), down_scale, (16, 16))
