"""Hugging Face `transformers` as the reference implementation for equality tests."""

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def hf_model(path: Path) -> torch.nn.Module:
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
