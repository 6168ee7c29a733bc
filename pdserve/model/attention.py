"""Attention over a paged KV cache, behind one interface: a backend plans once per step from the
batch's metadata (`AttentionBackend.plan`), and each layer calls the plan's `write_kv` and
`attend`.

Cache layout (`pdserve.model.kv_layout`): one tensor ``[num_blocks, num_layers, planes,
block_size, heads, dim]`` so that each block (all layers) is one contiguous byte range: moving a
block to another instance or to storage is a single copy. A layer sees the view
``kv_cache[:, layer]``. Per-head K and V are two planes of `num_kv_heads` heads; a latent-attention
model (DeepSeek's MLA) caches one plane of one "head": each token's latent, whose first
`value_dim` values are also its value (`AttentionStep.write_latent`, `latent_decode`).

Backends: `reference` (gathers each sequence's K/V and runs SDPA: simple, the test oracle),
`cpu` (decode rows through pdserve's C++ kernel, which reads K/V in place from the blocks;
prefill chunks through torch's CPU flash kernel) and `triton` (paged decode and varlen prefill
kernels for CUDA: `triton_attention.py`). `auto` takes `cpu` on CPU where its kernel builds and
`triton` on CUDA where triton imports.
"""

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import assert_never

import torch
import torch.nn.functional as F

from pdserve.choices import AttentionBackendName
from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)


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
    """Causal attention of `q` (`[num_tokens, heads, head_dim]`) over each sequence's cache
    (an FP8 cache read as its values: the scales are folded outside)."""
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
    k = _gather(kv_layer[:, 0], table)[:context_len].transpose(0, 1).to(q.dtype)
    v = _gather(kv_layer[:, 1], table)[:context_len].transpose(0, 1).to(q.dtype)
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
    # [seqs, kv_heads, L, dim]
    k = _gather(kv_layer[:, 0], meta.block_tables).transpose(1, 2).to(q.dtype)
    v = _gather(kv_layer[:, 1], meta.block_tables).transpose(1, 2).to(q.dtype)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < meta.context_lens_tensor[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A sequence with more than one new token: rows `start ... start + count` of the batch,
    the last `count` of its `context` tokens."""

    seq: int
    start: int
    count: int
    context: int


@dataclass(frozen=True, slots=True)
class RowSplit:
    """A batch's rows by kind: decode rows (one new token) and prefill chunks."""

    decode_rows: torch.Tensor  # [n] the decode rows' indices in the batch
    decode_tables: torch.Tensor  # [n, max_blocks] their block tables
    decode_lens: torch.Tensor  # [n] their context lengths
    prefill: tuple[PrefillChunk, ...]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "RowSplit":
        if meta.decode_only:
            rows = torch.arange(len(meta.query_lens), device=meta.block_tables.device)
            return cls(rows, meta.block_tables, meta.context_lens_tensor, ())
        decode, prefill, start = [], [], 0
        for seq, (count, context) in enumerate(
            zip(meta.query_lens, meta.context_lens, strict=True)
        ):
            if count == 1:
                decode.append((seq, start))
            else:
                prefill.append(PrefillChunk(seq, start, count, context))
            start += count
        device = meta.block_tables.device
        seqs = torch.tensor([s for s, _ in decode], dtype=torch.long, device=device)
        rows = torch.tensor([r for _, r in decode], dtype=torch.long, device=device)
        tables, lens = meta.block_tables[seqs], meta.context_lens_tensor[seqs]
        return cls(rows, tables, lens, tuple(prefill))


def gather_context(kv_layer: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """One sequence's first `context` cached tokens of plane 0, `[context, heads, dim]`: its
    own blocks only (no padding to another sequence's length)."""
    blocks = -(-context // kv_layer.shape[2])
    return _gather(kv_layer[:, 0], table[:blocks])[:context]


def latent_decode_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Latent attention of one new token per sequence, in torch, sequence by sequence: `q`
    (`[n, heads, dim]`) against each cached latent (`kv_layer` `[blocks, 1, block_size, 1,
    dim]`), the softmax over the context weighting the latents' first `value_dim` values.
    `[n, heads, value_dim]` in `q`'s dtype; scores and sums in float32."""
    out = torch.empty((*q.shape[:2], value_dim), dtype=q.dtype, device=q.device)
    for i, context in enumerate(lens.tolist()):
        latent = gather_context(kv_layer, tables[i], context)[:, 0].float()  # [context, dim]
        weights = torch.softmax((q[i].float() @ latent.T) * scale, dim=-1)
        out[i] = (weights @ latent[:, :value_dim]).to(q.dtype)
    return out


class AttentionStep(ABC):
    """One step's plan: what every layer's attention needs, computed once."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    @functools.cached_property
    def rows(self) -> RowSplit:
        """The batch's decode rows and prefill chunks (latent attention treats them apart)."""
        return RowSplit.of(self.meta)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(kv_layer, k, v, self.meta)

    def write_latent(self, kv_layer: torch.Tensor, latent: torch.Tensor) -> None:
        """Store the new tokens' latents (`[num_tokens, dim]`) into their slots."""
        kv_layer[:, 0][self.meta.slot_blocks, self.meta.slot_offsets] = latent[:, None, :]

    def latent_decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, value_dim: int
    ) -> torch.Tensor:
        """Latent attention of the decode rows (`rows.decode_rows`; `q` is theirs,
        `[n, heads, dim]`) over their cached latents: `[n, heads, value_dim]`. Backends with a
        kernel override this; here the torch reference."""
        rows = self.rows
        return latent_decode_reference(
            q, kv_layer, rows.decode_tables, rows.decode_lens, scale, value_dim
        )

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of `q` (`[num_tokens, heads, head_dim]`) over each sequence's
        cache (its new tokens' K/V already written)."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> AttentionStep: ...


class _ReferenceStep(AttentionStep):
    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(q, kv_layer, self.meta, scale)


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def plan(self, meta: AttentionMetadata) -> AttentionStep:
        return _ReferenceStep(meta)


class _CpuStep(AttentionStep):
    """Decode rows (one new token) through the decode kernel in one call, and every prefill
    chunk through the prefill kernel in another (where it has a path for the dtype and head
    size; else chunk by chunk through torch's flash kernel)."""

    def __init__(self, meta: AttentionMetadata, ops: object) -> None:
        super().__init__(meta)
        self._ops = ops
        self._prefill_args: tuple[torch.Tensor, ...] = ()  # tables, first rows, counts, contexts
        if self.rows.prefill:
            chunks = ((c.seq, c.start, c.count, c.context) for c in self.rows.prefill)
            seqs, *rest = (torch.tensor(c, dtype=torch.long) for c in zip(*chunks, strict=True))
            self._prefill_args = (meta.block_tables[seqs], *rest)

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        decode_ops, rows = self._ops.paged_decode, self.rows  # type: ignore[attr-defined]
        if not rows.prefill:
            return decode_ops(q, kv_layer, rows.decode_tables, rows.decode_lens, scale)  # type: ignore[no-any-return]
        out = torch.empty_like(q)
        prefill = self._ops.paged_prefill  # type: ignore[attr-defined]
        if not prefill(q, kv_layer, *self._prefill_args, scale, out):
            self._flash_prefill(q, kv_layer, scale, out)
        if rows.decode_rows.numel():
            index = rows.decode_rows
            out[index] = decode_ops(q[index], kv_layer, rows.decode_tables, rows.decode_lens, scale)
        return out

    def latent_decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, value_dim: int
    ) -> torch.Tensor:
        """The decode rows' latent attention in one kernel call (`latent_decode`): each
        latent read in place once for all heads of a group."""
        rows = self.rows
        kernel = self._ops.latent_decode  # type: ignore[attr-defined]
        out: torch.Tensor = kernel(
            q.contiguous(), kv_layer, rows.decode_tables, rows.decode_lens, scale, value_dim
        )
        return out

    def _flash_prefill(
        self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        for chunk in self.rows.prefill:
            blocks = -(-chunk.context // kv_layer.shape[2])
            table = self.meta.block_tables[chunk.seq, :blocks]
            k = _gather(kv_layer[:, 0], table)[: chunk.context].to(q.dtype)
            v = _gather(kv_layer[:, 1], table)[: chunk.context].to(q.dtype)
            span = slice(chunk.start, chunk.start + chunk.count)
            out[span] = flash_prefill(q[span], k, v, scale)


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk `q` (`[n, heads, dim]`, the last n positions) over `k`/`v`
    (`[context, kv_heads, dim]`) with torch's CPU flash kernel, which takes no offset causal
    mask: the cached prefix (no mask) and the chunk itself (causal) are two flash calls whose
    outputs are merged by their log-sum-exps."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    count, prefix = q.shape[0], k.shape[0] - q.shape[0]
    groups = q.shape[1] // k.shape[1]
    query = q.transpose(0, 1)[None]
    keys = k.transpose(0, 1).repeat_interleave(groups, 0)[None]
    values = v.transpose(0, 1).repeat_interleave(groups, 0)[None]
    new, new_lse = flash(
        query, keys[:, :, prefix:], values[:, :, prefix:], is_causal=True, scale=scale
    )
    if prefix == 0:
        chunk: torch.Tensor = new[0].transpose(0, 1)
        return chunk
    old, old_lse = flash(query, keys[:, :, :prefix], values[:, :, :prefix], scale=scale)
    top = torch.maximum(old_lse, new_lse)
    old_weight, new_weight = (old_lse - top).exp()[..., None], (new_lse - top).exp()[..., None]
    merged = (old.float() * old_weight + new.float() * new_weight) / (old_weight + new_weight)
    result: torch.Tensor = merged.to(q.dtype)[0].transpose(0, 1)
    return result.reshape(count, *q.shape[1:])


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, ops: object) -> None:
        self._ops = ops

    def plan(self, meta: AttentionMetadata) -> AttentionStep:
        return _CpuStep(meta, self._ops)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend `engine.attention_backend` names (an `AttentionBackendName`); `auto`: `cpu` on
    CPU when its kernel builds, `triton` on CUDA when triton imports, else the reference (logged).
    Raises ConfigError for an unknown name, or a forced backend the device cannot run."""
    try:
        choice = AttentionBackendName(name)
    except ValueError:
        choices = ", ".join(AttentionBackendName)
        raise ConfigError(
            f"engine.attention_backend must be one of {choices}, got {name!r}"
        ) from None
    match choice:
        case AttentionBackendName.REFERENCE:
            return ReferenceBackend()
        case AttentionBackendName.CPU:
            return _cpu_backend(device, forced=True)
        case AttentionBackendName.TRITON:
            return _triton_backend(device, forced=True)
        case AttentionBackendName.AUTO:
            if device.type == "cuda":
                return _triton_backend(device, forced=False)
            if device.type == "cpu":
                return _cpu_backend(device, forced=False)
            return ReferenceBackend()
        case _:
            assert_never(choice)


def _cpu_backend(device: torch.device, *, forced: bool) -> AttentionBackend:
    from pdserve.model.cpu_kernels import paged_ops

    ops = paged_ops() if device.type == "cpu" else None
    if ops is None:
        if forced:
            raise ConfigError(
                f"engine.attention_backend is cpu but its kernel is not available on {device} "
                "(no C++ compiler, or not a CPU device): use auto or reference"
            )
        return ReferenceBackend()
    return CpuBackend(ops)


def _triton_backend(device: torch.device, *, forced: bool) -> AttentionBackend:
    from pdserve.model.triton_attention import TritonBackend, triton_available

    if device.type == "cuda" and triton_available():
        return TritonBackend()
    if forced:
        raise ConfigError(
            f"engine.attention_backend is triton but triton is not installed or {device} is not "
            "a CUDA device: use auto or reference"
        )
    logger.warning("triton is not installed: attention on %s uses the reference backend", device)
    return ReferenceBackend()
