"""The `triton` attention backend: paged decode, varlen causal prefill and latent-attention
(MLA) decode as Triton kernels (`triton_kernels`) that read K/V or latents in place from
pdserve's cache layout (a layer's strided view).

`TritonBackend.plan` turns the batch into what the kernels index, once per step and in one
asynchronous host-to-device copy: the decode rows (sequences with one new token) and the prefill
tiles (up to `prefill_block_m` consecutive new tokens of one sequence each, with their first
position). Each layer's `attend` then launches at most three kernels (prefill; decode; the merge
of a decode's context splits) and never waits on the device. Sequences with more than one new
token go through the prefill kernel, whose causal mask is by absolute position: prefix hits and
later chunks of a prompt need nothing else. `latent_decode` takes the same decode rows (the
plan's, not `rows`: no copy of their tables) and launches at most two kernels (the decode; the
merge of its splits). `write_kv` is the shared index_put. Every kernel reads an FP8 cache
(``float8_e4m3fn``, from compute capability 8.9: `fp8_supported`) as its values, upcast as they
are loaded, with queries and output of another type; its scales are folded by the caller
(`pdserve.model.kv_quant`).

Importing this module does not import triton: the kernels are imported (and compiled, or set up
for triton's interpreter under ``TRITON_INTERPRET=1``) when a `TritonBackend` is made.
"""

import importlib
import itertools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pdserve.model.attention import AttentionBackend, AttentionMetadata, AttentionStep

LOG2E = math.log2(math.e)


def triton_available() -> bool:
    """Whether triton imports here. Its kernels need a CUDA GPU (or ``TRITON_INTERPRET=1``)."""
    try:
        importlib.import_module("triton.language")
    except Exception:  # not installed (ImportError), or an install that fails to load
        return False
    return True


def fp8_supported(device: torch.device) -> bool:
    """Whether the kernels can read an FP8 (float8_e4m3fn) cache on `device`: a CUDA GPU of
    compute capability 8.9 or above (triton refuses e4m3 below it, e.g. on an A100). False for
    any other device (triton's interpreter, a test harness, is not a serving device)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Tile sizes and the decode split policy; the defaults are for a GPU and 16-bit queries
    (see `tiles`, `latent_tiles`). Tile sizes are powers of two, at least 16."""

    prefill_block_m: int = 64  # new tokens per prefill tile
    block_n: int = 64  # cached tokens per step of the kernels' inner loop
    split_tokens: int = 512  # the shortest context span worth a decode split of its own
    max_splits: int = 16
    target_programs: int = 512  # decode programs that fill the GPU: fewer, split the contexts
    latent_block_h: int = 16  # query heads per latent decode program (they share its latents)
    latent_max_splits: int = 64  # one sequence's 16 heads (DeepSeek-V3 on 8 GPUs): one program
    num_warps: int = 4
    num_stages: int = 2

    def tiles(
        self, dtype: torch.dtype, cache_dtype: torch.dtype, prefill: bool, head_dim: int
    ) -> tuple[int, int, int]:
        """(block_n, num_warps, num_stages) that keep a kernel's tiles in registers, `dtype` its
        queries' (ptxas for sm_80 and sm_90, an FP8 cache's for sm_89 and sm_90, head sizes 64
        and 128: no spills from 16-bit queries, a few bytes from float32 ones): a prefill tile
        of 128-wide heads takes 8 warps; float32, whose dots run on FMA units at IEEE precision
        (the reference's tolerance), also takes fewer cached tokens per step, and over an FP8
        cache (upcast in registers) one stage (pipelined, it spills up to 664 bytes). 16-bit
        queries over an FP8 cache take their own tiles."""
        block_n, warps, stages = self.block_n, self.num_warps, self.num_stages
        if prefill and (head_dim > 64 or dtype == torch.float32):
            warps = max(warps, 8)
        if dtype == torch.float32:
            block_n = min(block_n, 16 if prefill else 32)
            if cache_dtype.itemsize == 1:
                stages = 1
        return block_n, warps, stages

    def latent_tiles(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[int, int, int]:
        """(block_n, num_warps, num_stages) of the latent decode, `dtype` its queries' (ptxas
        for sm_90, 576-wide latents, 16 heads a program: no spills): 32 latents a step from a
        16-bit cache, 16 from an FP8 one (upcast in registers) or in float32; float32 queries
        over an FP8 cache in one stage (pipelined, they spill 8 KB)."""
        wide = dtype.itemsize == cache_dtype.itemsize == 2
        stages = 1 if dtype.itemsize == 4 and cache_dtype.itemsize == 1 else self.num_stages
        return min(self.block_n, 32 if wide else 16), self.num_warps, stages


def _pow2(value: int) -> int:
    return max(16, 1 << (value - 1).bit_length())


class _TritonStep(AttentionStep):
    def __init__(self, meta: AttentionMetadata, kernels: ModuleType, config: TritonConfig) -> None:
        super().__init__(meta)
        self._kernels, self._config = kernels, config
        decode_seqs, decode_rows, tiles = [], [], []
        starts = itertools.accumulate(meta.query_lens, initial=0)
        for seq, (start, count, context) in enumerate(
            zip(starts, meta.query_lens, meta.context_lens, strict=False)
        ):
            if count == 1:
                decode_seqs.append(seq)
                decode_rows.append(start)
                continue
            for first in range(0, count, config.prefill_block_m):
                rows = min(config.prefill_block_m, count - first)
                tiles += [seq, start + first, rows, context - count + first]
        self._decode = len(decode_seqs)
        self._tiles = len(tiles) // 4
        self._longest_decode = max((meta.context_lens[s] for s in decode_seqs), default=0)
        packed = torch.tensor(decode_seqs + decode_rows + tiles, dtype=torch.int32)
        device = meta.block_tables.device
        if device.type == "cuda":  # a pinned copy does not wait for the device
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        self._decode_seqs = packed[: self._decode]
        self._decode_rows = packed[self._decode : 2 * self._decode]
        self._tile_table = packed[2 * self._decode :]
        self._partials: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads, page = kv_layer.shape[3], kv_layer.shape[2]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common: dict[str, Any] = {
            "GROUP": heads // kv_heads,
            "HEAD_DIM": head_dim,
            "PAGE": page,
            "BLOCK_D": _pow2(head_dim),
            "UPCAST": bool(self._kernels.INTERPRET),
        }
        tables = self.meta.block_tables
        if self._tiles:
            block_n, warps, stages = self._config.tiles(q.dtype, kv_layer.dtype, True, head_dim)
            self._kernels.varlen_prefill[(self._tiles, heads)](
                q, out, kv_layer, tables, self._tile_table, scale * LOG2E,
                q.stride(), out.stride(), kv_layer.stride(), tables.stride(),
                BLOCK_M=self._config.prefill_block_m, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **common,
            )  # fmt: skip
        if self._decode:
            self._launch_decode(q, kv_layer, out, scale, common)
        return out

    def latent_decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, value_dim: int
    ) -> torch.Tensor:
        """Latent attention of the decode rows (`q`: theirs, `[n, heads, dim]`, in the order
        of `rows.decode_rows`) over their cached latents (`kv_layer` `[blocks, 1, block_size,
        1, dim]`): `[n, heads, value_dim]`. Launches at most two kernels and never waits on
        the device (CUDA-graph capturable); allocates the output (and, the first time, the
        split partials). Raises ValueError when `q` is not the plan's decode rows or does not
        match the latents, or `value_dim` is wider than they are."""
        return self._latent_decode(q, kv_layer, scale, value_dim, kv_scale=1.0)

    def _latent_decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, value_dim: int, kv_scale: float
    ) -> torch.Tensor:
        """`latent_decode` over a cache whose real values are its stored ones * `kv_scale`
        (an FP8 cache's scale)."""
        rows, heads, dim = q.shape
        if rows != self._decode:
            raise ValueError(f"{rows} query rows for a plan of {self._decode} decode rows")
        if kv_layer.shape[1] != 1 or kv_layer.shape[3] != 1 or kv_layer.shape[4] != dim:
            raise ValueError(
                f"a latent cache view is [blocks, 1, block_size, 1, {dim}], not {kv_layer.shape}"
            )
        if not 0 < value_dim <= dim:
            raise ValueError(f"a value of {value_dim} values does not fit a latent of {dim}")
        out = torch.empty((rows, heads, value_dim), dtype=q.dtype, device=q.device)
        if not self._decode:
            return out
        block_h = self._config.latent_block_h
        head_blocks = -(-heads // block_h)
        block_n, warps, stages = self._config.latent_tiles(q.dtype, kv_layer.dtype)
        splits, split_tokens = self._splits(head_blocks, block_n, self._config.latent_max_splits)
        block_v = _pow2(value_dim)
        partials = self._partials_for((self._decode, heads, splits, block_v + 2), out)
        tables = self.meta.block_tables
        self._kernels.latent_decode[(self._decode, head_blocks, splits)](
            q, out, kv_layer, tables, self.meta.context_lens_tensor, self._decode_seqs,
            partials, scale * LOG2E * kv_scale, kv_scale, split_tokens, heads,
            q.stride(), out.stride(), kv_layer.stride(), tables.stride(),
            VALUE_DIM=value_dim, ROPE_DIM=dim - value_dim, PAGE=kv_layer.shape[2],
            BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_V=block_v,
            BLOCK_R=_pow2(max(dim - value_dim, 1)), SPLITS=splits,
            UPCAST=bool(self._kernels.INTERPRET), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if splits > 1:
            self._kernels.decode_reduce[(self._decode, heads)](
                out, None, partials, out.stride(),
                HEAD_DIM=value_dim, BLOCK_D=block_v, SPLITS=splits, num_warps=4,
            )  # fmt: skip
        return out

    def _partials_for(self, shape: tuple[int, int, int, int], out: torch.Tensor) -> torch.Tensor:
        """The split partials' float32 buffer (`decode_reduce`'s input), kept while its shape
        holds (every layer's); `out` when there is one split (the kernels then write there)."""
        if shape[2] == 1:
            return out
        if self._partials is None or self._partials.shape != shape:
            self._partials = torch.empty(shape, dtype=torch.float32, device=out.device)
        return self._partials

    def _launch_decode(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        common: dict[str, Any],
    ) -> None:
        heads, kv_heads = q.shape[1], kv_layer.shape[3]
        block_n, warps, stages = self._config.tiles(q.dtype, kv_layer.dtype, False, q.shape[2])
        splits, split_tokens = self._splits(kv_heads, block_n, self._config.max_splits)
        partials = self._partials_for((self._decode, heads, splits, common["BLOCK_D"] + 2), out)
        tables = self.meta.block_tables
        self._kernels.paged_decode[(self._decode, kv_heads, splits)](
            q, out, kv_layer, tables, self.meta.context_lens_tensor, self._decode_seqs,
            self._decode_rows, partials, scale * LOG2E, split_tokens,
            q.stride(), out.stride(), kv_layer.stride(), tables.stride(),
            BLOCK_H=_pow2(common["GROUP"]), BLOCK_N=block_n, SPLITS=splits, num_warps=warps,
            num_stages=stages, **common,
        )  # fmt: skip
        if splits > 1:
            self._kernels.decode_reduce[(self._decode, heads)](
                out, self._decode_rows, partials, out.stride(),
                HEAD_DIM=common["HEAD_DIM"], BLOCK_D=common["BLOCK_D"], SPLITS=splits,
                num_warps=4,
            )  # fmt: skip

    def _splits(self, row_programs: int, block_n: int, max_splits: int) -> tuple[int, int]:
        """(splits, tokens per split) of the decode rows' contexts, when each row takes
        `row_programs` programs a split: a power of two (the merge's arange) up to
        `max_splits`, enough for `target_programs` programs, none shorter than
        `split_tokens`."""
        config = self._config
        wanted = min(
            max_splits,
            -(-config.target_programs // (self._decode * row_programs)),
            -(-self._longest_decode // config.split_tokens),
        )
        splits = 1 << (max(wanted, 1).bit_length() - 1)
        tokens = -(-self._longest_decode // splits)
        return splits, -(-tokens // block_n) * block_n


class TritonBackend(AttentionBackend):
    """Triton kernels on CUDA tensors (or on CPU tensors in triton's interpreter)."""

    name = "triton"

    def __init__(self, config: TritonConfig | None = None) -> None:
        self._config = config or TritonConfig()
        config = self._config
        for size in (config.prefill_block_m, config.block_n, config.latent_block_h):
            if size < 16 or size & (size - 1):
                raise ValueError(f"triton attention tiles are powers of two >= 16, not {size}")
        self._kernels = importlib.import_module("pdserve.model.triton_kernels")

    def plan(self, meta: AttentionMetadata) -> AttentionStep:
        return _TritonStep(meta, self._kernels, self._config)
