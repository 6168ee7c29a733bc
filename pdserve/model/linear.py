"""The dense compute primitives every layer shares: the fused SiLU-and-multiply, and linear
weights packed once for oneDNN's CPU matrix kernels."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.cpu_kernels import paged_ops


def cpu_kernels_for(like: torch.Tensor) -> Any:
    """pdserve's compiled CPU kernels for float32 CPU tensors like `like` (None elsewhere, or
    where they cannot be built)."""
    if like.device.type != "cpu" or like.dtype != torch.float32:
        return None
    return paged_ops()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up output `[..., 2 x width]`: one pass of pdserve's CPU
    kernel where it has a path (float32, AVX-512), else torch's ops."""
    kernel = cpu_kernels_for(gate_up)
    if kernel is not None and gate_up.dim() == 2:
        fused: torch.Tensor | None = kernel.silu_and_mul(gate_up)
        if fused is not None:
            return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN packed for this CPU's matrix kernels once, at load: 2-4x
    faster here than `F.linear` (MKL) from one row to a 512-token chunk (measured). The packed
    weight is an opaque oneDNN tensor, used only through `_linear_pointwise`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.shape = tuple(weight.shape)
        self.packed: torch.Tensor
        self.register_buffer("packed", pack_weight(weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight)
    return packed


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear is there for `dtype`: a CPU torch built with it, and for 16-bit
    weights a CPU with their instructions (bf16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not AVX2)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32
