"""The FP8 KV cache (`engine.kv_cache_dtype: fp8_e4m3`): what is cached is each value divided by
its layer's and plane's scale, rounded to float8 e4m3 (saturating at +-448).

Nothing else changes for the attention backends: they read the 8-bit cache as values (their
kernels convert as they load) and the scales are folded outside them — a layer's K scale into
the softmax scale (``q . (s k) = s (q . k)``), its V scale into the output
(``sum p (s v) = s sum p v``); a latent's one scale into both. So no full-precision copy of the
cache is ever made.

Scales (`KVScales`) come from the checkpoint (`...self_attn.k_scale` / `v_scale`, or one
`kv_scale`, as FP8 checkpoints store them) or are measured at start (`calibrate`): one forward
over a fixed batch into a temporary full-precision cache, then per layer and plane a power of two
above twice the largest magnitude over 448 — a power of two so that the rescaling is exact and
so that instances measuring on like devices agree, and 2-4x headroom for prompts unlike the
calibration batch. Tensor-parallel ranks take the largest over every rank. The scales' digest is
part of the KV layout's tag: blocks never move between caches quantised differently.
"""

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 2.0  # the calibrated scale covers twice the largest magnitude measured
CALIBRATION_SEQS = 4
CALIBRATION_LEN = 128
CALIBRATION_SEED = 0


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per plane (K and V; a latent's one), per layer: the scale each cached value was divided
    by. `source`: `checkpoint` or `calibrated`."""

    planes: tuple[tuple[float, ...], ...]
    source: str

    def layer(self, index: int) -> tuple[float, ...]:
        return tuple(plane[index] for plane in self.planes)

    def digest(self) -> str:
        text = ",".join(repr(scale) for plane in self.planes for scale in plane)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @classmethod
    def from_amax(cls, amax: torch.Tensor) -> "KVScales":
        """Calibrated scales from the largest magnitudes, `[layers, planes]`."""
        planes = tuple(tuple(_power_of_two(float(a)) for a in column) for column in amax.T)
        return cls(planes, "calibrated")


def _power_of_two(amax: float) -> float:
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / FP8_MAX))


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x / scale` as float8 e4m3, saturated at +-448."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached values `x` back in `dtype` (unchanged but for the dtype when not 8-bit)."""
    return x.to(dtype) * scale if x.dtype == FP8 else x.to(dtype)


def checkpoint_scales(
    found: dict[tuple[int, str], float], num_layers: int, planes: int
) -> KVScales | None:
    """The checkpoint's scales (`found`: (layer, `k_scale` | `v_scale` | `kv_scale`) -> value),
    or None when it has none; a latent's one plane takes `k_scale` (or `kv_scale`)."""
    if not found:
        return None
    names = ("k_scale", "v_scale")[:planes]

    def scale(layer: int, name: str) -> float:
        value = found.get((layer, name), found.get((layer, "kv_scale")))
        if value is None:
            raise ValueError(f"the checkpoint has KV scales but none for layer {layer} ({name})")
        return value

    return KVScales(
        tuple(tuple(scale(layer, n) for layer in range(num_layers)) for n in names), "checkpoint"
    )


def calibration_batch(vocab_size: int) -> Sequence[list[int]]:
    """The fixed token sequences every instance calibrates on."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    tokens = torch.randint(vocab_size, (CALIBRATION_SEQS, CALIBRATION_LEN), generator=generator)
    return tokens.tolist()
