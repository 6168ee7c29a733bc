"""Mixture-of-experts layers (Qwen3-MoE, Mixtral, DeepSeek-V3): a router picks each token's top-k
experts (`route`: a softmax, or DeepSeek's group-limited choices), and the experts run grouped —
the token rows sorted by expert, one matrix multiply per *active* expert and projection, never a
loop over tokens nor a multiply by every expert. DeepSeek-V3 adds shared experts every token
runs through.

An instance's ranks split the experts one of two ways (`pdserve.model.parallel.ExpertPart`):
tensor parallel (every rank holds every expert, a `1 / size` slice of each one's width) or
expert parallel (every rank holds `num_experts / size` whole experts). Either way every rank has
every token (attention ends in an all-reduce), computes what its experts contribute, and one
all-reduce sums the partial outputs: the dispatch is free, the combine one collective, as the
dense MLP's.

On CPU, pdserve's kernel (`csrc/paged_attention.cpp`, `moe_experts`) streams each chosen
expert's weights once for all of its rows, the gate and up rows together, over the threads: the
decode regime, bound by memory bandwidth (top 4 of 32 experts of hidden 1024 and width 512, 2
threads: 1.7-3x faster than a oneDNN-packed multiply per expert from 1 to 16 tokens, equal at
128). Past `KERNEL_ROWS` rows per expert, where a multiply is compute-bound, one `F.linear` per
expert (MKL: within 6 % of the packed multiply at 512 tokens, with one copy of the weights).
On CUDA one Triton grouped-GEMM kernel (`triton_moe`) runs each projection for every expert at
once.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.config import MoEConfig
from pdserve.model.linear import cpu_kernels_for, dequantize_blocks, silu_and_mul
from pdserve.model.parallel import ExpertPart, Shard, TPGroup, expert_part

KERNEL_ROWS = 32  # the CPU kernel up to this many (token, choice) rows per expert on average


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), `[tokens, top_k]` each: the softmax over every expert in float32,
    its `top_k` largest, renormalised to sum to one when `normalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_groups(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited choice (float32 `logits` `[tokens, experts]`), times
    `routed_scaling`. V3 (`sigmoid_groups`): each expert scores its sigmoid; a group scores the
    sum of its two best scores plus the correction `bias`; the experts are chosen by score plus
    bias among the `top_groups` best groups, weighted by their plain scores (renormalised when
    `normalize_top_k`). V2 (`softmax_groups`): softmax scores, a group scores its best, the
    experts are the best scores among the best groups."""
    v3 = moe.routing == "sigmoid_groups"
    scores = logits.sigmoid() if v3 else torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores + bias if v3 and bias is not None else scores
    per_group = moe.num_experts // moe.num_groups
    groups = choice.view(-1, moe.num_groups, per_group)
    group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1) if v3 else groups.amax(dim=-1)
    best = torch.topk(group_scores, moe.top_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    outside = ~kept.repeat_interleave(per_group, dim=1)
    choice = choice.masked_fill(outside, float("-inf") if v3 else 0.0)
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.normalize_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


class Float32Gate(nn.Module):
    """DeepSeek's router: its weight (and V3's per-expert correction bias), kept in float32
    whatever the model's dtype (`keep_float32`, as the checkpoints store them); float32 logits."""

    keep_float32 = True

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class Experts(nn.Module):
    """This rank's experts, stacked: `gate_up` `[count, 2 x width, hidden]` (each expert's gate
    rows, then its up rows) and `down` `[count, hidden, width]`. The loader fills them expert by
    expert from the checkpoint's per-expert tensors. With FP8 block-quantized weights (`block`:
    DeepSeek-V3's checkpoints) both are float8 e4m3 with a float32 scale per block,
    `gate_up_scale` and `down_scale`, kept as stored and dequantized as they are used."""

    def __init__(self, part: ExpertPart, hidden: int, block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.part = part
        self.block = block
        dtype = None if block is None else torch.float8_e4m3fn
        self.gate_up = nn.Parameter(torch.empty(part.count, 2 * part.width, hidden, dtype=dtype))
        self.down = nn.Parameter(torch.empty(part.count, hidden, part.width, dtype=dtype))
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        if block is not None:
            rows, columns = block
            gate_up = (part.count, 2 * part.width // rows, -(-hidden // columns))
            down = (part.count, -(-hidden // rows), part.width // columns)
            self.gate_up_scale = nn.Parameter(torch.empty(gate_up), requires_grad=False)
            self.down_scale = nn.Parameter(torch.empty(down), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts held here of weight x expert(token): `[tokens,
        hidden]` (zero rows for tokens none of whose experts are here). CUDA: the fused Triton
        kernel; CPU in float32 with at most `KERNEL_ROWS` rows per expert on average: pdserve's
        CPU kernel; else the grouped path."""
        if x.is_cuda:
            from pdserve.model.triton_moe import fused_experts

            if self.block is None:
                return fused_experts(x, self.gate_up, self.down, ids, weights, self.part.first)
            return fused_experts(
                x, self.gate_up, self.down, ids, weights, self.part.first,
                gate_up_scale=self.gate_up_scale, down_scale=self.down_scale,
                weight_block=self.block,
            )  # fmt: skip
        kernel = cpu_kernels_for(x) if self.block is None else None
        if kernel is not None and ids.numel() <= KERNEL_ROWS * self.part.count:
            out: torch.Tensor | None = kernel.moe_experts(
                x.contiguous(), self.gate_up, self.down, ids, weights.float(), self.part.first
            )
            if out is not None:  # None: a dtype or layout it has no path for
                return out
        return self._grouped(x, ids, weights)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same sum in torch ops: the (token, choice) rows sorted by expert, each active
        expert's rows multiplied at once, the weighted results added into their tokens' rows."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # every (token, choice) grouped by expert
        rows = order // top_k  # the token of each
        scales = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=self.part.num_experts).tolist()
        out = torch.zeros_like(x)
        start = sum(counts[: self.part.first])
        for local in range(self.part.count):
            n = counts[self.part.first + local]
            if n == 0:
                continue
            tokens = rows[start : start + n]
            hidden = silu_and_mul(self._project(local, 0, x[tokens]))
            y = self._project(local, 1, hidden) * scales[start : start + n]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        return out

    def _project(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gate/up (`which` 0) or down (1) projection of rows `x` (an FP8
        weight dequantized into `x`'s dtype first)."""
        weight = (self.gate_up if which == 0 else self.down)[expert]
        scale = self.gate_up_scale if which == 0 else self.down_scale
        if self.block is not None and scale is not None:
            weight = dequantize_blocks(weight, scale[expert], self.block, x.dtype)
        return F.linear(x, weight)


class SparseMoE(nn.Module):
    """A mixture-of-experts block in place of a layer's MLP: the router (`gate`, replicated on
    every rank), this rank's experts, the `shared` experts every token runs through (DeepSeek;
    this rank's columns of them, as a dense MLP's), and with a group the one all-reduce of their
    partial sums."""

    def __init__(
        self,
        hidden: int,
        moe: MoEConfig,
        shard: Shard,
        shared: nn.Module | None = None,
        block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.gate: nn.Module = (
            Float32Gate(hidden, moe.num_experts, moe.routing == "sigmoid_groups")
            if moe.float32_router
            else nn.Linear(hidden, moe.num_experts, bias=False)
        )
        self.experts = Experts(expert_part(shard, moe), hidden, block)
        self.shared_experts = shared
        self.moe = moe
        self.group: TPGroup | None = None

    def fuse(self) -> None:
        """The shared experts' gate and up in one multiply (the experts are stacked already)."""
        if self.shared_experts is not None:
            self.shared_experts.fuse()  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, logits = self.moe, self.gate(x)
        if moe.routing == "softmax":
            weights, ids = route(logits, moe.top_k, moe.normalize_top_k)
            if moe.routed_scaling != 1.0:
                weights = weights * moe.routed_scaling
        else:
            bias = getattr(self.gate, "e_score_correction_bias", None)
            weights, ids = route_groups(logits, bias, moe)
        if moe.round_weights:
            weights = weights.to(x.dtype)
        out: torch.Tensor = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.group is None else self.group.all_reduce(out)
