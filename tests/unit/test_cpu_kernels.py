"""pdserve's fused CPU kernels against the torch ops they replace: the rotary embedding bit for
bit, silu(gate) * up within float32 rounding, and the shapes and dtypes they leave to torch."""

from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.model.cpu_kernels import paged_ops
from pdserve.model.llama import Rotation, _rotate_half, silu_and_mul


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
