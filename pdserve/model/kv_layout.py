"""KVLayout: what one KV block holds, a property of the model (and of the cache's element type),
not a constant.

A cache is one tensor ``[num_blocks, num_layers, planes, block_size, heads, dim]``: each block
(every layer) one contiguous byte range, so that everything that moves blocks — the block pool,
the stager, every transport, the storage tier — works from the layout's bytes per block alone.

- ``heads``: per-head attention caches K and V, two planes of this rank's `num_kv_heads` heads of
  `head_dim` values (a tensor-parallel rank holds its share of the heads).
- ``latent``: DeepSeek's multi-head latent attention caches one plane of one "head": each token's
  `kv_lora_rank + qk_rope_head_dim` latent, from which every head's keys and values are expanded
  (or into which the queries are absorbed). Every tensor-parallel rank holds the whole latent.

`tag` names the layout in the storage tier's tag: blocks are shared only between engines whose
layouts (and so bytes) agree.
"""

from dataclasses import dataclass

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.kv_quant import FP8, KVScales
from pdserve.model.parallel import Shard


@dataclass(frozen=True, slots=True)
class KVLayout:
    kind: str  # "heads" | "latent"
    num_layers: int
    planes: int  # 2 (K and V) or 1 (a latent)
    heads: int  # this rank's KV heads (1 for a latent)
    dim: int  # values per head and token
    dtype: torch.dtype  # the cache's element type
    scales: str = ""  # an FP8 cache's scales' digest (`KVScales.digest`)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, self.planes, block_size, self.heads, self.dim)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self) -> int:
        """One rank's bytes for one token, every layer."""
        return self.num_layers * self.planes * self.heads * self.dim * self.element_size

    def block_bytes(self, block_size: int) -> int:
        return self.bytes_per_token() * block_size

    @property
    def tag(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        tag = f"{self.kind}{self.planes}x{self.heads}x{self.dim}-{dtype}"
        return f"{tag}-s{self.scales}" if self.scales else tag

    def describe(self) -> str:
        """For messages: what a block holds per layer and token."""
        if self.kind == "latent":
            return f"a {self.dim}-value latent per token and layer ({self.dtype})"
        return f"K and V of {self.heads} heads of {self.dim} per token and layer ({self.dtype})"


def kv_layout(
    config: ModelConfig, shard: Shard, dtype: torch.dtype, scales: KVScales | None = None
) -> KVLayout:
    """The layout of one rank's (`shard`) cache for `config`'s model: of elements `dtype`, or
    8-bit floats quantised by `scales`."""
    digest = ""
    if scales is not None:
        dtype, digest = FP8, scales.digest()
    if config.mla is not None:
        return KVLayout("latent", config.num_layers, 1, 1, config.mla.latent_dim, dtype, digest)
    heads = shard.split(config.num_kv_heads, "KV heads")[1]
    return KVLayout("heads", config.num_layers, 2, heads, config.head_dim, dtype, digest)
