"""Attention over a paged KV cache.

Cache layout: one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` so that
each block (all layers, K and V) is one contiguous byte range: moving a block to another instance
or to storage is a single copy. A layer sees the view ``kv_cache[:, layer]``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the batch's new tokens go and what each sequence attends to.

    The batch is the concatenation of one chunk of new tokens per sequence.
    """

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token's KV slot
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # tokens attended per sequence (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with block 0
    context_lens_tensor: torch.Tensor  # [num_seqs]
    decode_only: bool  # every sequence has exactly one new token


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the new tokens' K and V (`[num_tokens, kv_heads, head_dim]`) into their slots."""
    kv_layer[:, 0][meta.slot_blocks, meta.slot_offsets] = k
    kv_layer[:, 1][meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of `q` (`[num_tokens, heads, head_dim]`) over each sequence's cache."""
    if meta.decode_only:
        return _decode_attention(q, kv_layer, meta, scale)
    outputs = []
    start = 0
    for seq, (query_len, context_len) in enumerate(
        zip(meta.query_lens, meta.context_lens, strict=True)
    ):
        num_blocks = -(-context_len // kv_layer.shape[2])
        table = meta.block_tables[seq, :num_blocks]
        outputs.append(
            _sequence_attention(q[start : start + query_len], kv_layer, table, context_len, scale)
        )
        start += query_len
    return torch.cat(outputs)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`[blocks..., block_size, kv_heads, head_dim]` -> `[..., tokens, kv_heads, head_dim]`."""
    blocks = cache[table]
    return blocks.reshape(*blocks.shape[:-4], -1, *blocks.shape[-2:])


def _sequence_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    query_len = q.shape[0]
    k = _gather(kv_layer[:, 0], table)[:context_len].transpose(0, 1)
    v = _gather(kv_layer[:, 1], table)[:context_len].transpose(0, 1)
    mask = None
    if query_len > 1:
        first_pos = context_len - query_len
        q_pos = torch.arange(first_pos, context_len, device=q.device)[:, None]
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One new token per sequence: gather every sequence padded to the longest and mask."""
    k = _gather(kv_layer[:, 0], meta.block_tables).transpose(1, 2)  # [seqs, kv_heads, L, dim]
    v = _gather(kv_layer[:, 1], meta.block_tables).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < meta.context_lens_tensor[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]
