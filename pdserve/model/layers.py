"""The building blocks every decoder here shares: RMSNorm and the rotary embedding."""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.config import ModelConfig
from pdserve.model.linear import cpu_kernels_for


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context window, half-split rotation."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = config.rope.inverse_frequencies(config.rotary_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        scaling = config.rope.scaling()  # YaRN's attention factor, else 1
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos() * scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rotation":
        """cos/sin of the batch's positions, once per step for every layer."""
        cos = self.cos[positions].to(dtype)[:, None, :]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return Rotation(cos, sin)


class Rotation:
    """One step's rotary tables (`[num_tokens, 1, head_dim]`). On CPU in float32, pdserve's
    kernel rotates in one pass, rounding as the three torch ops do (bit for bit)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin
        self._kernel = cpu_kernels_for(cos)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            rotated: torch.Tensor | None = self._kernel.rotate(x, self.cos[:, 0], self.sin[:, 0])
            if rotated is not None:
                return rotated
        return x * self.cos + _rotate_half(x) * self.sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
