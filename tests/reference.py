"""Hugging Face `transformers` as the reference implementation for equality tests."""

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def hf_model(path: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint at `path` (of an FP8 one: of the weights it stands
    for, `dequantized_copy`), float32."""
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        path = dequantized_copy(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits at every position of one sequence."""
    return model(torch.tensor([list(token_ids)])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, token_ids: Sequence[int], steps: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, eos ignored."""
    out = model(torch.tensor([list(token_ids)]), use_cache=True)
    generated = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[generated[-1]]]), cache=out.past_key_values, use_cache=True)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated


def deepseek_v3_config(vocab_size: int, **overrides: object) -> "PretrainedConfig":
    """A tiny DeepSeek-V3 shape (transformers' own config class): latent attention with a query
    bottleneck (`q_lora_rank`; None: a plain projection), YaRN rotary with DeepSeek's mscale,
    one dense layer then grouped-routing experts (4 groups of 2, 2 groups, top 2) with a shared
    expert. Heads, experts and widths split over 2 ranks."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**_deepseek_settings(vocab_size), **overrides})


def deepseek_v2_config(vocab_size: int, **overrides: object) -> "PretrainedConfig":
    """DeepSeek-V2 at the same tiny shape (its routing: `topk_method` greedy or
    group_limited_greedy, softmax scores, no correction bias)."""
    from transformers import DeepseekV2Config

    settings = {**_deepseek_settings(vocab_size), "topk_method": "greedy", **overrides}
    return DeepseekV2Config(**settings)


def _deepseek_settings(vocab_size: int) -> dict[str, object]:

    settings: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 192,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.9,
            "mscale_all_dim": 1.0,
        },
    }
    return settings


def decisive_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw `model`'s weights so that its outputs are far from ties (transformers' initial
    weights make every logit, and every expert's score, nearly alike, and greedy tokens would
    then hang on rounding): projections of unit gain, routers and norms drawn wide, the
    correction biases small."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.empty_like(parameter).uniform_(0.5, 1.5, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("gate.weight") or "embed_tokens" in name or "lm_head" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
            else:
                fan_in = parameter.shape[-1]
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
    return model


def write_with_tokenizer(model: torch.nn.Module, path: Path, tokenizer_dir: Path) -> Path:
    """A model directory: `model`'s checkpoint (by transformers) and `tokenizer_dir`'s
    tokenizer."""
    model.save_pretrained(path)  # type: ignore[operator]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def quantize_checkpoint(path: Path, block: tuple[int, int]) -> Path:
    """Turn the checkpoint at `path` into DeepSeek-V3's FP8 format in place: every decoder
    layer's projection weight (not the norms, not the routers) as float8 e4m3 with a float32
    `weight_scale_inv` per `block` (its largest magnitude / 448), and `quantization_config` in
    config.json."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name, weight in list(weights.items()):
        if not _quantized(name, weight):
            continue
        tiles, shape = _tiles(weight.float(), block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        fp8 = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        weights[name] = fp8.reshape(shape)[: weight.shape[0], : weight.shape[1]].contiguous()
        weights[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(weights, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def dequantized_copy(path: Path) -> Path:
    """The model an FP8 checkpoint stands for, as a float32 checkpoint beside it (written once):
    each weight times its block scales; the config without `quantization_config`."""
    from safetensors.torch import load_file, save_file

    plain = path.parent / f"{path.name}-dequantized"
    if plain.is_dir():
        return plain
    config = json.loads((path / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(".weight_scale_inv")]:
        scale, weight_name = weights.pop(name), name.removesuffix("_scale_inv")
        weight = weights[weight_name]
        tiles, shape = _tiles(weight.float(), tuple(block))
        dequantized = (tiles * scale[:, None, :, None]).reshape(shape)
        weights[weight_name] = dequantized[: weight.shape[0], : weight.shape[1]].contiguous()
    plain.mkdir()
    save_file(weights, str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (plain / name).write_bytes((path / name).read_bytes())
    return plain


def _tiles(weight: torch.Tensor, block: tuple[int, ...]) -> tuple[torch.Tensor, torch.Size]:
    """`weight` zero-padded to whole blocks, viewed `[row blocks, rows, column blocks, cols]`;
    and the padded shape."""
    rows, columns = (-(-size // b) for size, b in zip(weight.shape, block, strict=True))
    padded = torch.zeros(rows * block[0], columns * block[1])
    padded[: weight.shape[0], : weight.shape[1]] = weight
    return padded.view(rows, block[0], columns, block[1]), padded.shape


def _quantized(name: str, weight: torch.Tensor) -> bool:
    """DeepSeek-V3's FP8 checkpoints quantize every decoder-layer linear weight but the
    routers'."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and weight.dim() == 2
        and "norm" not in name
        and not name.endswith("mlp.gate.weight")
    )
