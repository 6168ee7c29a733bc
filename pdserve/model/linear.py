"""The dense compute primitives every layer shares: the fused SiLU-and-multiply, and linear
weights packed once for oneDNN's CPU matrix kernels."""

import os
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


ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def limit_kernel_caches(entries: int) -> None:
    """Keep at most `entries` compiled kernels in each of oneDNN's two caches (its own, and
    ideep's in torch), which `_linear_pointwise` fills with one kernel per input shape. Each
    reads its size once per process, at its first use: call this before loading a model."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ[name] = str(entries)


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


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Block-quantized FP8 weights (`[..., out, in]`, float8 e4m3) times their per-block
    `scale` (`[..., ceil(out / block[0]), ceil(in / block[1])]`), in `dtype`."""
    rows, columns = weight.shape[-2:]
    expanded = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block[1], dim=-1)[..., :columns]
    return (weight.to(torch.float32) * expanded).to(dtype)


class Fp8Linear(nn.Module):
    """A linear map whose weight is stored block-quantized in FP8 (DeepSeek-V3's checkpoint
    format: `weight` float8 e4m3 and `weight_scale_inv`, the float32 scale of each
    `block` of it), dequantized per call into the input's dtype. The loader keeps both as
    stored (`keep_stored_dtype`)."""

    keep_stored_dtype = True

    def __init__(self, linear: nn.Linear, block: tuple[int, int]) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        self.block = block
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        blocks = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(blocks), requires_grad=False)
        self.bias = linear.bias

    @classmethod
    def stacked(cls, parts: "tuple[Fp8Linear, ...]") -> "Fp8Linear":
        """One FP8 linear computing `parts` side by side: their weights and block scales
        stacked by rows (each part's rows are whole blocks: `check_divides` sees to it)."""
        block = parts[0].block
        if any(p.weight.shape[0] % block[0] for p in parts[:-1]):
            raise ValueError(f"FP8 parts of {block[0]}-row blocks must have whole blocks of rows")
        weight = torch.cat([p.weight for p in parts])
        with torch.device("meta"):
            fused = cls(nn.Linear(weight.shape[1], weight.shape[0], bias=False), block)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        scale = torch.cat([p.weight_scale_inv for p in parts])
        fused.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if parts[0].bias is not None:
            bias = torch.cat([p.bias for p in parts if p.bias is not None])
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return fused

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def quantize_linears(module: nn.Module, block: tuple[int, int]) -> None:
    """Replace every `nn.Linear` under `module` by an `Fp8Linear` of its shape (on the meta
    device, before loading)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Fp8Linear(child, block))
        else:
            quantize_linears(child, block)
