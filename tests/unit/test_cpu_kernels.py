"""pdserve's fused CPU kernels against the torch ops they replace: the rotary embedding bit for
bit, silu(gate) * up within float32 rounding, the mixture-of-experts kernel against the grouped
path, latent (MLA) decode attention against its torch reference (float and FP8 caches), and the
shapes and dtypes they leave to torch."""

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.attention import latent_decode_reference
from pdserve.model.cpu_kernels import paged_ops
from pdserve.model.layers import Rotation, _rotate_half
from pdserve.model.linear import silu_and_mul
from pdserve.model.moe import Experts, route
from pdserve.model.parallel import ExpertPart


def kernels() -> object:
    ops = paged_ops()
    if ops is None:
        raise AssertionError("the CPU kernels must build here (make test installs g++)")
    return ops


def built_for_avx512() -> bool:
    """The kernels are built with -march=native: their AVX-512 paths exist where this CPU has
    AVX-512F (else each case they would take is left to torch's ops)."""
    return "avx512f" in Path("/proc/cpuinfo").read_text().split()


def test_the_rotation_kernel_rounds_exactly_as_torch() -> None:
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 20, 64, generator=generator)
    x = qkv[:, :12]  # q and k of a fused projection: a strided view
    cos, sin = (torch.randn(9, 1, 64, generator=generator) for _ in range(2))
    expected = x * cos + _rotate_half(x) * sin
    got = Rotation(cos, sin)(x)
    assert got.is_contiguous() and torch.equal(got, expected)
    taken = kernels().rotate(x, cos[:, 0], sin[:, 0]) is not None  # type: ignore[attr-defined]
    assert taken == built_for_avx512()


def test_silu_and_mul_matches_torch_and_leaves_other_shapes_to_it() -> None:
    generator = torch.Generator().manual_seed(1)
    gate_up = torch.randn(33, 2 * 704, generator=generator) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(silu_and_mul(gate_up), expected, rtol=1e-6, atol=1e-6)
    ops = kernels()
    odd = torch.randn(3, 2 * 40, generator=generator)  # width 40: not a multiple of 16
    assert ops.silu_and_mul(odd) is None  # type: ignore[attr-defined]
    torch.testing.assert_close(silu_and_mul(odd), F.silu(odd[:, :40]) * odd[:, 40:])
    half = gate_up.bfloat16()
    assert ops.silu_and_mul(half) is None  # type: ignore[attr-defined]
    assert silu_and_mul(half).dtype == torch.bfloat16


def test_the_attention_kernel_lets_other_threads_run() -> None:
    """paged_decode runs without the GIL: a Python thread keeps counting while one long call
    computes. Held, the counter would stop for the whole call (a gap as long as the call)."""
    ops = kernels()
    generator = torch.Generator().manual_seed(2)
    seqs, heads, dim, block, blocks_per_seq = 256, 4, 64, 32, 128
    q = torch.randn(seqs, heads, dim, generator=generator)
    kv = torch.randn(blocks_per_seq, 2, block, heads, dim, generator=generator)
    tables = torch.arange(blocks_per_seq).repeat(seqs, 1)  # every sequence reads the same blocks
    lens = torch.full((seqs,), block * blocks_per_seq)
    ticks: list[float] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        while not ticks:  # the counter runs
            time.sleep(0.001)
        began = time.perf_counter()
        ops.paged_decode(q, kv, tables, lens, dim**-0.5)  # type: ignore[attr-defined]
        ended = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    during = [began, *(t for t in ticks if began < t < ended), ended]
    longest_gap = max(b - a for a, b in itertools.pairwise(during))
    assert ended - began > 0.02  # long enough to tell (a held GIL: one gap of all of it)
    assert longest_gap < (ended - began) / 2


@pytest.mark.parametrize(
    ("tokens", "first", "count"), [(1, 0, 8), (5, 0, 8), (13, 4, 4), (40, 0, 8)]
)
def test_the_experts_kernel_equals_the_grouped_path(tokens: int, first: int, count: int) -> None:
    """Widths and hidden sizes that are no multiple of a vector (36, 40), each token's top 3 of
    8 experts, rows of 1 to 4 at a time; on an expert-parallel rank (experts 4-7) the choices of
    other experts contribute nothing. Any CPU: the kernel is portable C++."""
    hidden, width = 40, 36
    experts = Experts(ExpertPart(8, first, count, 0, width), hidden)
    generator = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for weight in (experts.gate_up, experts.down):
            weight.copy_(torch.randn(weight.shape, generator=generator) / weight.shape[-1] ** 0.5)
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = route(torch.randn(tokens, 8, generator=generator), 3, normalize=True)
    got = kernels().moe_experts(x, experts.gate_up, experts.down, ids, weights, first)  # type: ignore[attr-defined]
    torch.testing.assert_close(got, experts._grouped(x, ids, weights), rtol=1e-5, atol=1e-5)
    assert torch.equal(experts(x, ids, weights), got)  # the layer takes the kernel here
    none_here = ~((ids >= first) & (ids < first + count)).any(dim=1)
    assert not got[none_here].any()
    bf16 = kernels().moe_experts(x.bfloat16(), experts.gate_up, experts.down, ids, weights, first)  # type: ignore[attr-defined]
    assert bf16 is None  # float32 only: the rest is the grouped path's


def latent_cache(
    lens: list[int], dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer 1 of a 3-layer latent cache `[blocks, layers, 1, block_size, 1, dim]` (a view
    strided across blocks), block size 16, and block tables of shuffled blocks padded past
    each sequence's need: (kv_layer, tables, lens)."""
    generator = torch.Generator().manual_seed(seed)
    block_size, max_blocks = 16, max(-(-n // 16) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 2
    cache = torch.randn(num_blocks, 3, 1, block_size, 1, dim, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: len(lens) * max_blocks]
    return cache[:, 1], tables.view(len(lens), max_blocks), torch.tensor(lens)


TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},  # one rounding of the output apart
    torch.float16: {"rtol": 1e-3, "atol": 1e-5},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "dim", "value_dim"),
    [(1, 576, 512), (16, 576, 512), (16, 40, 32), (20, 40, 32), (5, 44, 37)],
)
def test_latent_decode_matches_the_reference(
    dtype: torch.dtype, heads: int, dim: int, value_dim: int
) -> None:
    """Contexts of 1 token, of part of a block, of several blocks and splits (300: the kernel
    splits a long context over items and merges their softmaxes); 20 heads: two groups of
    items; dims 44 and 37: no multiple of a vector."""
    kv_layer, tables, lens = latent_cache([1, 17, 300, 48], dim, dtype, seed=heads + dim)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    got = kernels().latent_decode(q, kv_layer, tables, lens, scale, value_dim)  # type: ignore[attr-defined]
    expected = latent_decode_reference(q, kv_layer, tables, lens, scale, value_dim)
    assert got.shape == (len(lens), heads, value_dim) and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_reads_an_fp8_cache_as_its_values_times_kv_scale(dtype: torch.dtype) -> None:
    kv_layer, tables, lens = latent_cache([5, 33, 130], 576, torch.float8_e4m3fn, seed=4)
    kv_scale = 0.37
    dequantised = kv_layer.float() * kv_scale
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(len(lens), 16, 576, generator=generator).to(dtype)
    got = kernels().latent_decode(q, kv_layer, tables, lens, 0.05, 512, kv_scale=kv_scale)  # type: ignore[attr-defined]
    expected = latent_decode_reference(q, dequantised, tables, lens, 0.05, 512)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_the_fp8_values_are_torchs_conversion_of_every_byte() -> None:
    """Bit for bit: subnormals, both zeros, 448 and the NaNs 0x7f / 0xff with torch's payload."""
    every_byte = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = kernels().fp8_e4m3fn_values()  # type: ignore[attr-defined]
    assert torch.equal(values.view(torch.int32), every_byte.float().view(torch.int32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(2, 4, 40, dtype=torch.float64)}, "q must be float32"),
        ({"kv_layer": torch.zeros(8, 1, 16, 1, 40, dtype=torch.float16)}, "q's dtype"),
        ({"kv_layer": torch.zeros(8, 1, 16, 1, 48)}, "differ"),
        ({"value_dim": 41}, "value_dim"),
        ({"context_lens": torch.tensor([3, 33])}, "context_lens\\[1\\] = 33"),
        ({"context_lens": torch.tensor([3, 0])}, "context_lens\\[1\\] = 0"),
        ({"block_tables": torch.tensor([[0, 1], [2, 8]])}, "block_tables\\[1, 1\\] = 8"),
    ],
)
def test_latent_decode_rejects_inconsistent_arguments(
    change: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {
        "q": torch.zeros(2, 4, 40),
        "kv_layer": torch.zeros(8, 1, 16, 1, 40),
        "block_tables": torch.tensor([[0, 1], [2, 3]]),
        "context_lens": torch.tensor([3, 20]),
        "scale": 0.1,
        "value_dim": 32,
    }
    with pytest.raises(RuntimeError, match=message):
        kernels().latent_decode(**(args | change))  # type: ignore[attr-defined]


def fp8_kv_cache(
    k_scale: float, v_scale: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer 1 of a 3-layer FP8 K/V cache (`[blocks, 2, block_size, kv_heads, head_dim]`, block
    size 16, 2 kv heads of 64), the same as float32 values (stored x k_scale, x v_scale), and
    tables of 3 sequences of shuffled blocks: (fp8 layer, its float32 values, tables)."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(40, 3, 2, 16, 2, 64, generator=generator) * 3
    kv_layer = cache.to(torch.float8_e4m3fn)[:, 1]
    values = torch.stack((kv_layer[:, 0].float() * k_scale, kv_layer[:, 1].float() * v_scale), 1)
    tables = torch.randperm(40, generator=generator)[:36].view(3, 12)
    return kv_layer, values, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_an_fp8_cache_as_its_values_times_the_scales(dtype: torch.dtype) -> None:
    """Against the same kernel over the dequantised cache in the queries' dtype (scales that are
    powers of two for bfloat16, whose cache then holds the values exactly); 4 heads per kv head."""
    k_scale, v_scale = (0.37, 1.7) if dtype == torch.float32 else (0.5, 4.0)
    kv_layer, values, tables = fp8_kv_cache(k_scale, v_scale, seed=6)
    lens = torch.tensor([1, 77, 190])
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    decode = kernels().paged_decode  # type: ignore[attr-defined]
    got = decode(q, kv_layer, tables, lens, 0.125, k_scale=k_scale, v_scale=v_scale)
    expected = decode(q, values.to(dtype), tables, lens, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_paged_prefill_reads_an_fp8_cache_where_it_has_a_path() -> None:
    """Two chunks, one after 32 cached tokens and one with none: over the FP8 cache as over its
    dequantised values (the kernel's path: AVX-512; elsewhere it returns False and writes
    nothing, and so it does for bfloat16 queries everywhere)."""
    k_scale, v_scale = 0.37, 1.7
    kv_layer, values, tables = fp8_kv_cache(k_scale, v_scale, seed=8)
    prefill = kernels().paged_prefill  # type: ignore[attr-defined]
    q = torch.randn(29, 8, 64, generator=torch.Generator().manual_seed(9))
    chunks = (tables[:2], torch.tensor([0, 8]), torch.tensor([8, 21]), torch.tensor([40, 21]))
    got = torch.full_like(q, float("nan"))
    taken = prefill(q, kv_layer, *chunks, 0.125, got, k_scale=k_scale, v_scale=v_scale)
    assert taken == built_for_avx512()
    if taken:
        expected = torch.empty_like(q)
        assert prefill(q, values, *chunks, 0.125, expected)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert got.isnan().all()
    untouched = torch.full_like(q, float("nan")).bfloat16()
    assert not prefill(q.bfloat16(), kv_layer, *chunks, 0.125, untouched, k_scale=k_scale)
    assert untouched.isnan().all()
