"""ModelConfig: the architecture of a supported checkpoint (Llama-family decoders, their
mixture-of-experts variants and DeepSeek's latent-attention models), parsed from its
`config.json`."""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.choices import DTypeName, registry
from pdserve.errors import ModelLoadError

_DTYPES = registry(
    DTypeName,
    {
        DTypeName.AUTO: None,  # resolved from the checkpoint before parsing
        DTypeName.FLOAT32: torch.float32,
        DTypeName.BFLOAT16: torch.bfloat16,
        DTypeName.FLOAT16: torch.float16,
    },
)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts model's sparse layers: each token's `top_k` of `num_experts` experts
    (SwiGLU MLPs of width `intermediate_size`), weighted by the router's scores (renormalised
    over the chosen `top_k` when `normalize_top_k`).

    `routing` (`pdserve.model.moe.route`): `softmax`, the softmax over every expert (Qwen3-MoE,
    Mixtral, DeepSeek-V2's `greedy`); `softmax_groups`, the same but chosen among the
    `top_groups` best of `num_groups` groups, a group scoring its best expert (DeepSeek-V2's
    `group_limited_greedy`); `sigmoid_groups`, each expert's sigmoid, chosen by score plus a
    per-expert correction bias among the best groups, a group scoring its two best (DeepSeek-V3's
    `noaux_tc`). The chosen weights are multiplied by `routed_scaling`; `shared_width` columns of
    always-on shared experts are added (0: none)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    round_weights: bool  # the top-k weights rounded to the model's dtype (else kept in float32)
    sparse_layers: frozenset[int]  # the layers with experts; the others have a dense MLP
    routing: str = "softmax"  # softmax | softmax_groups | sigmoid_groups
    float32_router: bool = False  # the router's weight kept in float32 (DeepSeek)
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    shared_width: int = 0


_DEEPSEEK_ROUTING = {  # topk_method -> MoEConfig.routing
    "noaux_tc": "sigmoid_groups",
    "greedy": "softmax",
    "group_limited_greedy": "softmax_groups",
}


def _deepseek_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig:
    """DeepSeek-V2/V3: experts in every layer from `first_k_dense_replace` on, shared experts,
    the family's routing (`topk_method`; V3's default `noaux_tc`). V2 weights its choice
    unnormalised whatever `norm_topk_prob` says (as transformers does)."""
    v3 = raw["architectures"][0] == "DeepseekV3ForCausalLM"
    method = str(raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
    routing = _DEEPSEEK_ROUTING.get(method)
    if routing is None or (routing == "sigmoid_groups") != v3:
        raise ModelLoadError(f"unsupported topk_method {method!r} for {raw['architectures'][0]}")
    num_experts = int(raw["n_routed_experts"])
    groups = int(raw.get("n_group") or 1)
    least = 2 if routing == "sigmoid_groups" else 1  # a V3 group scores its two best
    if num_experts % groups or num_experts // groups < least:
        raise ModelLoadError(
            f"n_group {groups} must divide n_routed_experts ({num_experts}) into groups of "
            f"{least} or more experts"
        )
    width = int(raw["moe_intermediate_size"])
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=width,
        normalize_top_k=v3 and bool(raw.get("norm_topk_prob", True)),
        round_weights=False,
        sparse_layers=frozenset(range(int(raw.get("first_k_dense_replace") or 0), num_layers)),
        routing=routing,
        float32_router=True,
        num_groups=groups,
        top_groups=int(raw.get("topk_group") or 1),
        routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
        shared_width=width * int(raw.get("n_shared_experts") or 0),
    )


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token's keys and values are expanded
    from one cached latent of `kv_lora_rank` values plus a `qk_rope_head_dim` rotary key shared
    by every head; queries come from a `q_lora_rank` bottleneck (None: a plain projection)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool  # the rotary dimensions pair up as (0, 1), (2, 3), ...
    scale: float  # the softmax scale: qk_head_dim ** -0.5, times YaRN's mscale squared

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _parse_mla(raw: dict[str, Any], rope: "RopeConfig") -> MLAConfig:
    q_lora = raw.get("q_lora_rank")
    nope, rotary = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    scale = (nope + rotary) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rotary,
        v_head_dim=int(raw["v_head_dim"]),
        interleaved_rope=bool(raw.get("rope_interleave", True)),  # V2: always
        scale=scale,
    )


@dataclass(frozen=True, slots=True)
class MoELayout:
    """How a family writes its experts: the layer's MoE module in the checkpoint, each expert's
    gate, up and down weights, and the config keys (`parse`)."""

    block: str
    projections: tuple[str, str, str]
    parse: Callable[[dict[str, Any], int], MoEConfig]


def _qwen3_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig:
    """Qwen3-MoE: experts in every `decoder_sparse_step`-th layer but `mlp_only_layers`."""
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = int(raw[key])
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        normalize_top_k=bool(raw.get("norm_topk_prob", False)),
        round_weights=True,
        sparse_layers=frozenset(
            i for i in range(num_layers) if i not in dense and num_experts and (i + 1) % step == 0
        ),
    )


def _mixtral(raw: dict[str, Any], num_layers: int) -> MoEConfig:
    """Mixtral: experts in every layer, the top-k weights always renormalised."""
    return MoEConfig(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["intermediate_size"]),
        normalize_top_k=True,
        round_weights=False,
        sparse_layers=frozenset(range(num_layers)),
    )


@dataclass(frozen=True, slots=True)
class ArchitectureTraits:
    """What distinguishes a supported architecture from plain Llama."""

    qkv_bias_key: str | None  # config key that switches q/k/v bias, None = always on
    o_bias_key: str | None  # config key that switches o_proj bias, None = always off
    qk_norm: bool = False  # an RMSNorm over each q and k head before the rotation (Qwen3)
    moe: MoELayout | None = None
    sliding_window_key: str = "use_sliding_window"  # set (truthy): refused
    latent_attention: bool = False  # DeepSeek's MLA (`MLAConfig`) instead of per-head K and V
    extra_layers: bool = False  # layers past num_hidden_layers (multi-token prediction): unused


_DEEPSEEK = ArchitectureTraits(
    qkv_bias_key="attention_bias",
    o_bias_key="attention_bias",
    moe=MoELayout("mlp", ("gate_proj", "up_proj", "down_proj"), _deepseek_moe),
    latent_attention=True,
    extra_layers=True,
)
ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(
        qkv_bias_key="attention_bias", o_bias_key="attention_bias"
    ),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias_key=None, o_bias_key=None),
    "Qwen3ForCausalLM": ArchitectureTraits(
        qkv_bias_key="attention_bias", o_bias_key="attention_bias", qk_norm=True
    ),
    "Qwen3MoeForCausalLM": ArchitectureTraits(
        qkv_bias_key="attention_bias",
        o_bias_key="attention_bias",
        qk_norm=True,
        moe=MoELayout("mlp", ("gate_proj", "up_proj", "down_proj"), _qwen3_moe),
    ),
    "MixtralForCausalLM": ArchitectureTraits(
        qkv_bias_key="attention_bias",
        o_bias_key="attention_bias",
        moe=MoELayout("block_sparse_moe", ("w1", "w3", "w2"), _mixtral),
        sliding_window_key="sliding_window",
    ),
    "DeepseekV2ForCausalLM": _DEEPSEEK,  # the routing differs: `_deepseek_moe`
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the rotation counts bounding the interpolation ramp
    beta_slow: float = 1.0
    mscale: float = 0.0  # yarn: with mscale_all_dim, the cos/sin scale's log factors
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn: the cos/sin scale, when given outright
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """Per-pair rotation frequencies (fp32), as the reference implementation computes them."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3_scaled(inv_freq)
        if self.rope_type == "yarn":
            return self._yarn_scaled(head_dim)
        return inv_freq

    def scaling(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    def _yarn_scaled(self, head_dim: int) -> torch.Tensor:
        """YaRN: each pair's frequency interpolated (divided by `factor`) below `beta_slow`
        rotations over the original context, kept above `beta_fast`, a linear ramp between."""
        positions = self.theta ** (torch.arange(0, head_dim, 2).to(torch.float) / head_dim)
        extrapolated, interpolated = 1.0 / positions, 1.0 / (self.factor * positions)

        def dimension(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(self.theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no empty ramp
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
        keep = 1 - torch.clamp(ramp, 0, 1)
        return interpolated * (1 - keep) + extrapolated * keep

    def _llama3_scaled(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # mixture-of-experts layers (None: every MLP dense)
    mla: MLAConfig | None = None  # latent attention (None: per-head K and V)
    weight_block: tuple[int, int] | None = None  # FP8 block-quantized weights' block (rows, cols)

    @property
    def rotary_dim(self) -> int:
        """Dimensions each rotary table covers: a head's, or MLA's rotary part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer` has experts (a mixture-of-experts block) instead of a dense MLP."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def context_window(
        self, max_model_len: int | None = None, kv_cache_tokens: int | None = None
    ) -> int:
        """The longest sequence (prompt + output) served: `max_model_len` (the setting
        `engine.max_model_len`) when given, else the model's `max_position_embeddings`, never
        more than the latter, nor than the tokens an instance's KV cache holds
        (`kv_cache_tokens`; the router does not know them)."""
        window = min(max_model_len or self.max_position_embeddings, self.max_position_embeddings)
        return window if kv_cache_tokens is None else min(window, kv_cache_tokens)

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        config_file = path / "config.json"
        try:
            raw = json.loads(config_file.read_text())
        except FileNotFoundError as e:
            raise ModelLoadError(
                f"{config_file} not found: is {path} a Hugging Face model directory?"
            ) from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        architecture = (raw.get("architectures") or ["?"])[0]
        traits = ARCHITECTURES.get(architecture)
        if traits is None:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        window = raw.get(traits.sliding_window_key)
        if window:
            raise ModelLoadError(
                f"{architecture} with sliding-window attention ({traits.sliding_window_key}: "
                f"{json.dumps(window)}) is not supported: every layer here attends to the whole "
                "context"
            )
        try:
            return cls._parse(raw, architecture, traits)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from e

    @classmethod
    def _parse(
        cls, raw: dict[str, Any], architecture: str, traits: ArchitectureTraits
    ) -> "ModelConfig":
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        eos = raw.get("eos_token_id")
        rope = _parse_rope(raw)
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias_key is None or bool(raw.get(traits.qkv_bias_key, False)),
            o_bias=traits.o_bias_key is not None and bool(raw.get(traits.o_bias_key, False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            dtype=_parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            moe=traits.moe.parse(raw, num_layers) if traits.moe is not None else None,
            mla=_parse_mla(raw, rope) if traits.latent_attention else None,
            weight_block=_parse_weight_block(raw.get("quantization_config")),
        )


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name (`float32`, `bfloat16`, `float16`) to torch; raises ModelLoadError."""
    return _parse_dtype(name)


def _parse_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        names = ", ".join(n for n, d in _DTYPES.items() if d is not None)
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {names}")
    return dtype


def _parse_weight_block(quantization: Any) -> tuple[int, int] | None:
    """The block of FP8 block-quantized weights (`quantization_config` as DeepSeek-V3 writes
    it: `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [rows, cols]`, dynamic
    activations); None without one; ModelLoadError for any other quantization."""
    if not quantization:
        return None
    settings = quantization if isinstance(quantization, dict) else {}
    method, block = settings.get("quant_method"), settings.get("weight_block_size")
    fmt, activations = settings.get("fmt", "e4m3"), settings.get("activation_scheme", "dynamic")
    if method != "fp8" or fmt != "e4m3" or activations != "dynamic" or not block:
        raise ModelLoadError(
            f"quantized weights (quantization_config: {method}"
            f"{'' if block else ', no weight_block_size'}) are not supported: pdserve loads "
            "block-quantized FP8 (DeepSeek-V3's format) or bfloat16/float16 weights"
        )
    rows, columns = (int(size) for size in block)
    return rows, columns


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn"
        )
    if rope_type == "yarn" and "original_max_position_embeddings" not in params:
        raise ModelLoadError(
            "rope type yarn needs original_max_position_embeddings (the pretraining context)"
        )
    attention_factor = params.get("attention_factor")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # the extension DeepSeek's configs imply
        factor = (
            raw.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )
