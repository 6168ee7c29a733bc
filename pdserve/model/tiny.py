"""The built-in tiny model: deterministic random Llama weights written as a Hugging Face directory.

Small enough for a fast CPU forward, large enough that the KV cache is non-trivial (4 layers,
4 KV heads of 32 dims: 1 KiB of fp32 KV per token per layer pair). The tokenizer is byte-level:
every UTF-8 byte is a token, plus a few special tokens used by the chat template.
"""

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import platformdirs
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.model.config import ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

TINY_SEED = 0
SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Tools are offered and called in the Hermes format (`<tool_call>{...}</tool_call>`), so the
# router's `auto` tool parser has a family for the tiny model too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>You can call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'To call one, answer <tool_call>{"name": <name>, "arguments": <arguments object>}'
    "</tool_call><|end|>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_ARCH = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# The mixture-of-experts families: 8 experts of width 128, each token's top 2; the Qwen3-MoE
# has a dense MLP in its second layer (`mlp_only_layers`) and experts in the others.
TINY_EXPERTS: dict[str, dict[str, object]] = {
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128},
}


def default_model_dir() -> Path:
    """The tiny model under the user's cache dir, written on first use."""
    path = Path(platformdirs.user_cache_dir("pdserve")) / f"tiny-llama-v2-seed{TINY_SEED}"
    if not (path / "model.safetensors").is_file():
        write_tiny_model(path, seed=TINY_SEED)
    return path


def _byte_level_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", len(alphabet))]
    )
    return tokenizer


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's byte-to-unicode table, so token id == byte value."""
    code = ord(char)
    if code >= 256:  # bytes 0..32, 127..160 and 173 are shifted above 255
        shifted: list[int] = [*range(0, 33), *range(127, 161), 173]
        return shifted[code - 256]
    return code


def _random_weights(
    config: dict[str, int | float | bool], model: ModelConfig, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    head_dim = hidden // int(config["num_attention_heads"])
    kv = int(config["num_key_value_heads"]) * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        weight = torch.randn(out_features, in_features, generator=gen)
        return weight * (1.0 / math.sqrt(in_features))

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    weights = {
        "model.embed_tokens.weight": 0.5
        * torch.randn(int(config["vocab_size"]), hidden, generator=gen)
    }
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": linear(hidden, hidden),
            p + "self_attn.k_proj.weight": linear(kv, hidden),
            p + "self_attn.v_proj.weight": linear(kv, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, hidden),
        }
        if model.is_sparse(i):
            weights |= _random_experts(p, model, linear)
        else:
            weights |= {
                p + "mlp.gate_proj.weight": linear(inter, hidden),
                p + "mlp.up_proj.weight": linear(inter, hidden),
                p + "mlp.down_proj.weight": linear(hidden, inter),
            }
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        }
        if config.get("qkv_bias"):
            weights |= {
                p + "self_attn.q_proj.bias": 0.1 * torch.randn(hidden, generator=gen),
                p + "self_attn.k_proj.bias": 0.1 * torch.randn(kv, generator=gen),
                p + "self_attn.v_proj.bias": 0.1 * torch.randn(kv, generator=gen),
            }
        if config.get("qk_norm"):
            weights |= {
                p + "self_attn.q_norm.weight": 1.0 + 0.1 * torch.randn(head_dim, generator=gen),
                p + "self_attn.k_norm.weight": 1.0 + 0.1 * torch.randn(head_dim, generator=gen),
            }
    weights["model.norm.weight"] = norm()
    if not config.get("tie_word_embeddings", True):
        lm_head = 0.5 * torch.randn(int(config["vocab_size"]), hidden, generator=gen)
        lm_head[32:127] *= 2.0  # favour printable ASCII so demo output is readable
        weights["lm_head.weight"] = lm_head
    return weights


def _random_experts(
    prefix: str, model: ModelConfig, linear: Callable[[int, int], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts, named as the family's checkpoints name them."""
    moe, layout = model.moe, ARCHITECTURES[model.architecture].moe
    if moe is None or layout is None:
        raise ValueError(f"{model.architecture} has no mixture-of-experts layers to write")
    hidden, width = model.hidden_size, moe.intermediate_size
    block = prefix + layout.block
    gate, up, down = layout.projections
    weights = {f"{block}.gate.weight": 4.0 * linear(moe.num_experts, hidden)}  # decisive routes
    for e in range(moe.num_experts):
        weights |= {
            f"{block}.experts.{e}.{gate}.weight": linear(width, hidden),
            f"{block}.experts.{e}.{up}.weight": linear(width, hidden),
            f"{block}.experts.{e}.{down}.weight": linear(hidden, width),
        }
    return weights


def write_tiny_model(
    path: Path, *, seed: int = TINY_SEED, architecture: str = "LlamaForCausalLM", tied: bool = False
) -> Path:
    """Write a complete HF model directory to `path` (atomically) and return `path`.

    `architecture` is `LlamaForCausalLM`, `Qwen2ForCausalLM` (q/k/v biases), `Qwen3ForCausalLM`
    (per-head q and k norms), or a mixture of experts, `Qwen3MoeForCausalLM` or
    `MixtralForCausalLM` (`TINY_EXPERTS`); `tied` shares the embedding with the LM head.
    The same arguments always give byte-identical weights.
    """
    tokenizer = _byte_level_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    model_type = MODEL_TYPES[architecture]
    config: dict[str, int | float | bool] = {
        **TINY_ARCH,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "head_dim": TINY_ARCH["hidden_size"] // TINY_ARCH["num_attention_heads"],
    }
    hf_config = {
        "architectures": [architecture],
        "model_type": model_type,
        **config,
        **TINY_EXPERTS.get(model_type, {}),
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("</s>"),
    }
    traits = {"qkv_bias": model_type == "qwen2", "qk_norm": model_type.startswith("qwen3")}
    weights = _random_weights({**config, **traits}, ModelConfig.from_hf_dict(hf_config), seed)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_ARCH["max_position_embeddings"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"))
    tokenizer.save(str(staging / "tokenizer.json"))
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    try:
        os.rename(staging, path)
    except OSError:  # another process won the race (or path exists): keep theirs
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()
        if not (path / "model.safetensors").is_file():
            raise
    logger.info("wrote tiny model (seed %d) to %s", seed, path)
    return path
