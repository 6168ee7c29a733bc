"""The experts of a mixture-of-experts layer on CUDA: align-by-expert, then one Triton grouped
GEMM per projection for every expert at once.

`align` sorts each (token, choice) assignment by its expert and pads every expert's run to a
whole number of `BLOCK_M` rows, so that each row tile of the kernel belongs to one expert; tiles
past the last expert, and assignments to experts held by another rank, are masked out. It runs
on the device without a host synchronisation (fixed sizes for a given token count), so the
layer can be captured in a CUDA graph.

`grouped_gemm` computes, for each tile of sorted rows, `A[rows] @ W[expert]^T` — gathered from
the tokens for the gate/up projection, from the assignments' activations for the down
projection, whose output rows are scaled by the routing weights. The weighted outputs of a
token's choices are then summed over its `top_k` rows in one reduction.

Block-quantized weights (DeepSeek-V3's FP8 checkpoints: float8_e4m3fn with a float32 scale per
`weight_block` = (bn, bk) block of each expert's matrix) are dequantized as they are loaded:
each weight tile is upcast exactly to the activations' type, and its block's scale multiplies
the tile's float32 partial product. Tiles are capped at the block sizes, so that a tile lies
in one scale block and its scale is one scalar per (expert, column tile, reduction step).

Importing this module imports triton; with ``TRITON_INTERPRET=1`` set before, the kernel runs in
triton's interpreter on CPU tensors (the unit tests).
"""
# mypy: ignore-errors
# (triton ships neither type stubs nor a py.typed marker; this module is triton's kernel language)

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.model.linear import silu_and_mul

INTERPRET = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True, slots=True)
class Tiles:
    """Row, output-column and reduction tile sizes (powers of two, at least 16)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64


@dataclass(frozen=True, slots=True)
class Alignment:
    """The assignments sorted by expert, padded to whole row tiles: `rows` holds each slot's
    assignment (token x top_k + choice), or the assignment count for a padding slot;
    `tile_experts` each tile's local expert, -1 past the last."""

    rows: torch.Tensor
    tile_experts: torch.Tensor


def align(ids: torch.Tensor, first: int, count: int, block_m: int) -> Alignment:
    """Sort `ids` (`[tokens, top_k]`, the model's expert ids) by the local expert (experts
    `first .. first + count - 1`; others are left out), each expert's run padded to `block_m`."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    local = flat - first
    local = torch.where((local >= 0) & (local < count), local, count)  # count: not held here
    counts = torch.zeros(count + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[count] = 0  # assignments to other ranks' experts get no slots
    ends = padded.cumsum(0)
    order = torch.argsort(local, stable=True)
    sorted_local = local[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[sorted_local]
    capacity = n + count * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    slots = torch.where(
        sorted_local < count, ends[sorted_local] - padded[sorted_local] + rank, capacity
    )
    rows = torch.full((capacity + 1,), n, dtype=torch.int64, device=ids.device)
    rows.scatter_(0, slots, order)  # the left-out assignments land in the spare last slot
    tile_starts = torch.arange(0, capacity, block_m, device=ids.device)
    tile_experts = torch.searchsorted(ends[:count], tile_starts, right=True)
    tile_experts = torch.where(tile_experts < count, tile_experts, -1)
    return Alignment(rows[:capacity], tile_experts)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    first: int,
    tiles: Tiles = Tiles(),
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """The experts' weighted sum for each token of `x` (`[tokens, hidden]`): this rank's experts
    `first ..` (`gate_up` `[count, 2 x width, hidden]`, `down` `[count, hidden, width]`) for the
    choices `ids` / `weights` (`[tokens, top_k]`); zero where no chosen expert is held here.

    With `gate_up_scale` and `down_scale` (float32, `[count, 2 x width / bn, ceil(hidden / bk)]`
    and `[count, ceil(hidden / bn), width / bk]` for `weight_block` (bn, bk)) the weights are
    float8_e4m3fn, each (bn, bk) block standing for its values times its scale; the tiles are
    then capped at the block sizes. Raises ValueError for one scale without the other, a block
    size that is not a power of two of at least 16, or a scale of another shape or type."""
    tokens, top_k = ids.shape
    count, width = down.shape[0], down.shape[2]
    hidden = x.shape[1]
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("block-quantized experts need both gate_up_scale and down_scale")
    if gate_up_scale is not None:
        tiles = _block_tiles(tiles, weight_block, x.dtype)
        _check_scale(gate_up_scale, gate_up, weight_block)
        _check_scale(down_scale, down, weight_block)
    alignment = align(ids, first, count, tiles.block_m)
    assignments = tokens * top_k
    gate_up_out = torch.zeros(assignments, 2 * width, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, gate_up_out, alignment, top_k, None, tiles, gate_up_scale, weight_block)
    activated = silu_and_mul(gate_up_out)
    out = torch.zeros(assignments, hidden, dtype=x.dtype, device=x.device)
    scales = weights.reshape(-1).to(torch.float32)
    _launch(activated, down, out, alignment, 1, scales, tiles, down_scale, weight_block)
    return out.view(tokens, top_k, hidden).sum(dim=1)


# float32 activations over FP8 weights: the tile upcast to float32 is held in registers for the
# FMA dot, which a reduction tile of 64 spills (ptxas, sm_90: 255 registers, 250 bytes spilled
# with Tiles(); 197, none, with 32)
FLOAT32_FP8_BLOCK_K = 32


def _block_tiles(tiles: Tiles, weight_block: tuple[int, int], dtype: torch.dtype) -> Tiles:
    """`tiles` for FP8 weights in `weight_block` blocks (bn, bk) under activations of `dtype`:
    the column and reduction tiles capped at the block sizes, so that each divides its block
    (all are powers of two); ValueError for a block size that is not a power of two of at
    least 16."""
    for size in weight_block:
        if size < 16 or size & (size - 1):
            raise ValueError(
                f"weight_block {weight_block}: the FP8 experts' kernel needs block sizes that "
                "are powers of two of at least 16; dequantize the weights for other blocks"
            )
    bn, bk = weight_block
    block_k = min(tiles.block_k, bk)
    if dtype == torch.float32:
        block_k = min(block_k, FLOAT32_FP8_BLOCK_K)
    return Tiles(tiles.block_m, min(tiles.block_n, bn), block_k)


def _check_scale(scale: torch.Tensor, w: torch.Tensor, weight_block: tuple[int, int]) -> None:
    """ValueError unless `scale` is float32 with one value per `weight_block` block of each of
    the stacked matrices `w` (the last row and column of blocks may be partial)."""
    count, n, k = w.shape
    expected = (count, triton.cdiv(n, weight_block[0]), triton.cdiv(k, weight_block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(
            f"a weight scale of {scale.dtype} {list(scale.shape)} for weights {list(w.shape)} "
            f"in {weight_block} blocks: expected torch.float32 {list(expected)}"
        )


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    alignment: Alignment,
    a_row_divisor: int,
    scales: torch.Tensor | None,
    tiles: Tiles,
    w_scale: torch.Tensor | None,
    weight_block: tuple[int, int],
) -> None:
    n, k = w.shape[1], w.shape[2]
    w_scale_strides = (0, 0, 0) if w_scale is None else w_scale.stride()
    grid = (alignment.tile_experts.numel(), triton.cdiv(n, tiles.block_n))
    grouped_gemm[grid](
        a, w, c, alignment.rows, alignment.tile_experts, scales if scales is not None else c,
        w_scale if w_scale is not None else w,
        c.shape[0], n, k, a_row_divisor,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        *w_scale_strides,
        SCALE=scales is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, UPCAST=INTERPRET and a.dtype == torch.bfloat16,
        W_SCALE=w_scale is not None, SCALE_BN=weight_block[0], SCALE_BK=weight_block[1],
    )  # fmt: skip


@triton.jit
def grouped_gemm(
    a_ptr, w_ptr, c_ptr, rows_ptr, tile_experts_ptr, scales_ptr, w_scale_ptr,
    num_rows, N, K, a_row_divisor,
    a_st0, a_st1, w_st0, w_st1, w_st2, c_st0, c_st1, ws_st0, ws_st1, ws_st2,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, W_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
):  # fmt: skip
    """Grid (row tile, column tile): `c[row] = a[row // a_row_divisor] @ w[expert]^T` for the
    tile's sorted rows (x `scales[row]` when SCALE), in float32, stored in c's dtype. A tile of
    no expert (-1), and padding rows, store nothing. W_SCALE: `w` is FP8, each (SCALE_BN,
    SCALE_BK) block of it times its `w_scale` (BLOCK_N divides SCALE_BN, BLOCK_K SCALE_BK)."""
    expert = tl.load(tile_experts_ptr + tl.program_id(0))
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    valid = (rows < num_rows) & ((rows * 0 + expert) >= 0)  # the expert, broadcast per row
    a_rows = tl.where(valid, rows // a_row_divisor, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * w_st0
    if W_SCALE:  # the column tile's row of scale blocks
        n_block = tl.program_id(1) * BLOCK_N // SCALE_BN
        ws_base = w_scale_ptr + tl.maximum(expert, 0).to(tl.int64) * ws_st0 + n_block * ws_st1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * a_st0 + ks[None, :] * a_st1,
            mask=valid[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + cols[None, :] * w_st1 + ks[:, None] * w_st2,
            mask=(cols < N)[None, :] & (ks < K)[:, None],
            other=0.0,
        )
        if UPCAST:  # the interpreter's tl.dot mishandles bfloat16
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif W_SCALE:  # float8_e4m3fn upcasts exactly to a's 16- or 32-bit type
            w = w.to(a.dtype)
        if W_SCALE:  # the scale applied in float32, to the tile's partial product
            w_scale = tl.load(ws_base + (k0 // SCALE_BK) * ws_st2)
            acc += tl.dot(a, w, input_precision="ieee") * w_scale
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee")
    if SCALE:
        acc = acc * tl.load(scales_ptr + rows, mask=valid, other=0.0)[:, None]
    c_rows = tl.where(valid, rows, 0)
    tl.store(
        c_ptr + c_rows[:, None] * c_st0 + cols[None, :] * c_st1,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols < N)[None, :],
    )
