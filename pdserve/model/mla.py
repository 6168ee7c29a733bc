"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a paged latent cache.

Each token caches one latent per layer (`KVLayout` kind ``latent``): `kv_lora_rank` values
`c` (the normalised compressed KV) followed by the `qk_rope_head_dim` rotated key `k_pe` that
every head shares. Head h's key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``, where
`W_UK` and `W_UV` are the two halves of each head's rows of `kv_b_proj`.

- **Decode rows** (one new token) attend in the latent space: the query's no-rotary part is
  absorbed into the latent (``q_c = W_UK[h]^T q_nope``), so scores are ``<[q_c, q_pe], latent>``
  and the output ``W_UV[h] (sum_t p_t c_t)``: one multi-query attention over the latents, which
  reads only the cache (the backend's `latent_decode`: a CPU or Triton kernel), whatever the
  number of heads.
- **Prefill chunks** expand their sequence's cached latents into per-head keys and values and
  attend as usual (fewer multiplies per cached token than the absorbed form when many queries
  share them).

Both are the same function of the cache; they differ in rounding only. A tensor-parallel rank
holds its share of the heads (`q_b_proj`/`q_proj`, `kv_b_proj` by rows, `o_proj` by columns)
and the whole latent (`q_a_proj` and `kv_a_proj_with_mqa` are replicated).

The rotary part: DeepSeek's checkpoints pair rotary dimensions as (0, 1), (2, 3), ...
(`rope_interleave`). `fuse` reorders the rotary rows of the projections that produce them
(evens, then odds) once after loading, after which the half-split rotation of the rest of
pdserve gives bit for bit the same values.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionStep, gather_context
from pdserve.model.config import ModelConfig
from pdserve.model.kv_quant import dequantize, quantize
from pdserve.model.layers import RMSNorm, Rotation
from pdserve.model.linear import Fp8Linear
from pdserve.model.parallel import Shard, TPGroup

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepSeek's default, not rms_norm_eps


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("LatentAttention needs a model with latent attention (config.mla)")
        self.mla = mla
        self.num_heads = shard.split(config.num_heads, "attention heads")[1]
        self.qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, heads = config.hidden_size, self.num_heads
        self.q_proj: nn.Linear | Fp8Linear | None = None
        self.q_a_proj: nn.Linear | Fp8Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | Fp8Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=config.o_bias)
        self.w_uk: torch.Tensor  # [heads, nope, kv_lora_rank] (`fuse`)
        self.w_uv: torch.Tensor  # [heads, kv_lora_rank, v_head_dim]
        self.group: TPGroup | None = None
        self.kv_scales: tuple[float, ...] | None = None  # an FP8 cache's latent scale

    def fuse(self) -> None:
        """After loading: split `kv_b_proj` into the per-head `w_uk` and `w_uv` (the absorbed
        and the expanded forms both use them; the projection itself is dropped), and put
        interleaved rotary rows in half-split order."""
        mla, heads = self.mla, self.num_heads
        weight = self.kv_b_proj.weight.detach()
        if isinstance(self.kv_b_proj, Fp8Linear):  # FP8 weights: dequantized once, model dtype
            weight = self.kv_b_proj.dequantized(self.kv_a_layernorm.weight.dtype)
        per_head = weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = per_head[:, : mla.qk_nope_head_dim].contiguous()
        self.w_uv = per_head[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()
        del self.kv_b_proj
        if mla.interleaved_rope:
            for query in (self.q_proj, self.q_b_proj):  # the one there is
                if query is not None:
                    _deinterleave_rows(query, heads, self.qk_dim, mla.qk_nope_head_dim)
            _deinterleave_rows(self.kv_a_proj_with_mqa, 1, mla.latent_dim, mla.kv_lora_rank)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_layer: torch.Tensor, step: AttentionStep
    ) -> torch.Tensor:
        mla, heads, count = self.mla, self.num_heads, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(count, heads, self.qk_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent_kv = self.kv_a_layernorm(compressed[:, : mla.kv_lora_rank])
        # q's rotary part and the shared rotary key are rotated together
        k_pe = compressed[:, None, mla.kv_lora_rank :]
        pe = rotation(torch.cat((q[..., mla.qk_nope_head_dim :], k_pe), dim=1))
        q_nope, q_pe = q[..., : mla.qk_nope_head_dim], pe[:, :heads]
        latent = torch.cat((latent_kv, pe[:, heads]), dim=-1)
        scale = 1.0 if self.kv_scales is None else self.kv_scales[0]
        step.write_latent(kv_layer, latent if self.kv_scales is None else quantize(latent, scale))
        if step.meta.decode_only:
            out = self._absorbed(q_nope, q_pe, kv_layer, step, scale)
        else:
            out = self._mixed(q_nope, q_pe, kv_layer, step, scale)
        projected: torch.Tensor = self.o_proj(out.reshape(count, -1))
        return projected if self.group is None else self.group.all_reduce(projected)

    def _mixed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_layer: torch.Tensor,
        step: AttentionStep,
        kv_scale: float,
    ) -> torch.Tensor:
        """A batch with prefill chunks: those expanded, sequence by sequence; decode rows
        absorbed, together. `kv_scale`: an FP8 cache's latent scale (else 1)."""
        rows = step.rows
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.mla.v_head_dim)
        if rows.decode_rows.numel():
            index = rows.decode_rows
            out[index] = self._absorbed(q_nope[index], q_pe[index], kv_layer, step, kv_scale)
        for chunk in rows.prefill:
            span = slice(chunk.start, chunk.start + chunk.count)
            table = step.meta.block_tables[chunk.seq]
            cached = gather_context(kv_layer, table, chunk.context)[:, 0]
            latent = dequantize(cached, kv_scale, q_nope.dtype)
            out[span] = self._expanded(q_nope[span], q_pe[span], latent)
        return out

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_layer: torch.Tensor,
        step: AttentionStep,
        kv_scale: float,
    ) -> torch.Tensor:
        """Decode rows in the latent space: `[rows, heads, v_head_dim]` (an FP8 latent's
        scale folded into the softmax scale and the output)."""
        absorbed = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [n, h, c]
        query = torch.cat((absorbed, q_pe), dim=-1)
        scale = self.mla.scale * kv_scale
        latent_out = step.latent_decode(query, kv_layer, scale, self.mla.kv_lora_rank)
        if kv_scale != 1.0:
            latent_out = latent_out * kv_scale
        return torch.bmm(latent_out.transpose(0, 1), self.w_uv).transpose(0, 1)

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        """One prefill chunk (the last `len(q)` of the context) over its context's latents
        (`[context, latent_dim]`), keys and values expanded per head: `[len(q), heads, v]`."""
        mla, heads = self.mla, self.num_heads
        context, count = latent.shape[0], q_nope.shape[0]
        latent_kv, k_pe = latent[:, : mla.kv_lora_rank], latent[:, mla.kv_lora_rank :]
        k_nope = torch.matmul(latent_kv, self.w_uk.transpose(1, 2))  # [heads, context, nope]
        keys = torch.cat((k_nope, k_pe[None].expand(heads, context, -1)), dim=-1)
        values = torch.matmul(latent_kv, self.w_uv)  # [heads, context, v]
        query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [heads, count, qk]
        mask = None
        if count > 1:
            positions = torch.arange(context - count, context, device=latent.device)[:, None]
            mask = torch.arange(context, device=latent.device)[None, :] <= positions
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=mla.scale)
        return out.transpose(0, 1)


def _deinterleave_rows(
    linear: nn.Linear | Fp8Linear, heads: int, per_head: int, rotary_from: int
) -> None:
    """Reorder each head's rotary rows (`rotary_from ... per_head`) of `linear`'s output:
    evens, then odds. An FP8 weight's rows move within their scale block (ValueError if a
    head's rotary rows span two)."""
    rotary = torch.arange(rotary_from, per_head)
    order = torch.cat((torch.arange(rotary_from), rotary[0::2], rotary[1::2]))
    index = (torch.arange(heads)[:, None] * per_head + order[None]).reshape(-1)
    if isinstance(linear, Fp8Linear) and not torch.equal(
        index // linear.block[0], torch.arange(len(index)) // linear.block[0]
    ):
        raise ValueError("a head's rotary rows span two FP8 scale blocks: cannot reorder them")
    index = index.to(linear.weight.device)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[index])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[index])
