"""Llama-family decoder (Llama 2/3, Qwen2 via bias switches, Qwen3 with per-head q/k norms, and
the mixture-of-experts Qwen3-MoE and Mixtral, whose sparse layers are `pdserve.model.moe`'s) over
a paged KV cache; DeepSeek-V3 is the same decoder with latent attention (`pdserve.model.mla`)
and grouped-routing experts with shared experts.

Module and parameter names mirror Hugging Face's so a checkpoint's state dict loads unchanged,
but for the experts: stacked per layer here, one tensor per expert in a checkpoint (the loader
maps them, and Mixtral's `block_sparse_moe` is this `mlp`).
"""

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionStep,
    ReferenceBackend,
)
from pdserve.model.config import ModelConfig
from pdserve.model.kv_layout import KVLayout, kv_layout
from pdserve.model.kv_quant import KVScales, quantize
from pdserve.model.layers import RMSNorm, RotaryEmbedding, Rotation
from pdserve.model.linear import Fp8Linear, PackedLinear, quantize_linears, silu_and_mul
from pdserve.model.mla import LatentAttention
from pdserve.model.moe import SparseMoE
from pdserve.model.parallel import SINGLE, Shard, TPGroup, VocabParallelEmbedding


class Attention(nn.Module):
    """This rank's heads (`shard`); with a group, o_proj's partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads = shard.split(config.num_heads, "attention heads")[1]
        self.num_kv_heads = shard.split(config.num_kv_heads, "KV heads")[1]
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = self.num_heads * config.head_dim
        kv_size = self.num_kv_heads * config.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None  # Qwen3: each q and k head normalized
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qkv_proj: nn.Linear | Fp8Linear | None = None  # q, k and v in one multiply
        self.group: TPGroup | None = None  # tensor parallel: sums o_proj over the ranks
        self.kv_scales: tuple[float, ...] | None = None  # an FP8 cache's K and V scales

    def fuse(self) -> None:
        """One weight for q, k and v (after loading, which fills the checkpoint's three)."""
        self.qkv_proj = _fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        kv_layer: torch.Tensor,
        step: AttentionStep,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        qk_size = self.sizes[0] + self.sizes[1]
        # q and k side by side are rotated together (one rotation's ops for both)
        heads = (self.num_heads, self.num_kv_heads)
        qk = qkv[:, :qk_size].view(num_tokens, sum(heads), self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = torch.split(qk, list(heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = rotation(qk)
        q, k = torch.split(qk, list(heads), dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_scales is None:
            step.write_kv(kv_layer, k, v)
            out = step.attend(q, kv_layer, self.scale)
        else:  # the scales folded outside the backend (`pdserve.model.kv_quant`)
            k_scale, v_scale = self.kv_scales
            step.write_kv(kv_layer, quantize(k, k_scale), quantize(v, v_scale))
            out = step.attend(q, kv_layer, self.scale * k_scale) * v_scale
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, -1))
        return projected if self.group is None else self.group.all_reduce(projected)


class MLP(nn.Module):
    """This rank's MLP columns (`shard`); with a group, down_proj's partial sums are
    all-reduced."""

    def __init__(self, config: ModelConfig, shard: Shard, width: int | None = None) -> None:
        super().__init__()
        bias = config.mlp_bias
        total = config.intermediate_size if width is None else width
        width = shard.split(total, "MLP width (intermediate_size)")[1]
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=bias)
        self.gate_up_proj: nn.Linear | Fp8Linear | None = None  # gate and up: one multiply
        self.group: TPGroup | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            hidden = silu_and_mul(self.gate_up_proj(x))
        else:
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        out: torch.Tensor = self.down_proj(hidden)
        return out if self.group is None else self.group.all_reduce(out)


def _fused(*parts: nn.Linear | Fp8Linear) -> nn.Linear | Fp8Linear:
    """One Linear computing `parts` side by side (their outputs concatenated, in order); FP8
    parts stay FP8 (`Fp8Linear.stacked`)."""
    if isinstance(parts[0], Fp8Linear):
        return Fp8Linear.stacked(parts)  # type: ignore[arg-type]
    weight = torch.cat([p.weight for p in parts])
    with torch.device("meta"):  # its own parameters are replaced: no allocation
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        bias = torch.cat([p.bias for p in parts if p.bias is not None])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, index: int) -> None:
        super().__init__()
        self.self_attn: Attention | LatentAttention = (
            Attention(config, shard) if config.mla is None else LatentAttention(config, shard)
        )
        moe = config.moe
        self.mlp: MLP | SparseMoE = MLP(config, shard)
        if moe is not None and config.is_sparse(index):
            shared = MLP(config, shard, moe.shared_width) if moe.shared_width else None
            self.mlp = SparseMoE(config.hidden_size, moe, shard, shared, config.weight_block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        kv_layer: torch.Tensor,
        step: AttentionStep,
    ) -> torch.Tensor:
        attn: torch.Tensor = self.self_attn(self.input_layernorm(x), rotation, kv_layer, step)
        x = x + attn
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if shard.size == 1
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, None)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, shard, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]


class CausalLM(nn.Module):
    """The decoder plus its LM head; `forward` returns final hidden states of the new tokens.

    Tensor parallel (`shard.size > 1`): this rank's part of every split weight
    (`pdserve.model.parallel`); `set_group` gives the layers their collectives."""

    def __init__(self, config: ModelConfig, max_positions: int, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.group: TPGroup | None = None
        self.model = DecoderModel(config, shard)
        if config.weight_block is not None:  # FP8 checkpoint: every layer's projections
            quantize_linears(self.model.layers, config.weight_block)
        vocab_rows = shard.vocab_rows(config.vocab_size)[1]
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(config, max_positions)
        self.attention: AttentionBackend = ReferenceBackend()  # the engine sets its own
        self.kv_scales: KVScales | None = None  # an FP8 cache's (`set_kv_scales`)

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """What this rank's KV cache holds per block: elements `dtype` (the model's), or 8-bit
        floats once `set_kv_scales` made the cache FP8."""
        return kv_layout(self.config, self.shard, dtype, self.kv_scales)

    def set_kv_scales(self, scales: KVScales) -> None:
        """Cache K and V (or the latent) as FP8 divided by `scales` from the next forward on."""
        self.kv_scales = scales
        for index, layer in enumerate(self.model.decoder_layers()):
            layer.self_attn.kv_scales = scales.layer(index)

    def set_group(self, group: TPGroup) -> None:
        """Sum the row-parallel projections and the embedding over `group`; gather logits."""
        self.group = group
        embed = self.model.embed_tokens
        if isinstance(embed, VocabParallelEmbedding):
            embed.group = group
        for layer in self.model.decoder_layers():
            layer.self_attn.group = group
            layer.mlp.group = group

    def fuse(self) -> None:
        """Fuse every layer's q/k/v and gate/up weights (after loading the checkpoint's)."""
        for layer in self.model.decoder_layers():
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def pack(self) -> None:
        """Pack every projection (and an untied LM head) for oneDNN (`PackedLinear`); CPU."""
        for layer in self.model.decoder_layers():
            for module in (layer.self_attn, layer.mlp):
                for name, child in list(module.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(module, name, PackedLinear(child))
        if not self.config.tie_word_embeddings:
            self.lm_head = PackedLinear(self.lm_head)  # type: ignore[assignment]

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | None = None,
        *,
        step: AttentionStep | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the new tokens; attention by `step`, else planned from
        `meta` (one of them is given)."""
        x = self.model.embed_tokens(input_ids)
        if step is None:
            if meta is None:
                raise ValueError("the forward needs the batch's attention metadata or plan")
            step = self.attention.plan(meta)
        rotation = self.rotary.tables(positions, x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, rotation, kv_cache[:, index], step)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]`. Tensor parallel: every rank's vocabulary part gathered
        on rank 0 (the only rank that samples); the other ranks get their own part back."""
        local: torch.Tensor = self.lm_head(hidden).float()
        if self.group is None:
            return local
        gathered = self.group.gather_columns(local)
        return local if gathered is None else gathered[:, : self.config.vocab_size]
