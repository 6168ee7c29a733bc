"""The shipped GPU deploy configs fit the machines deploy/ray/cluster.yaml starts: for every
role, weights + activations + KV cache <= the GPU memory of the node type meant for the config
(per tensor-parallel rank: each rank holds 1/TP of the weights and of every KV block; of a
mixture-of-experts model, 1/TP of the attention and vocabulary and 1/EP of the experts, with
the router and norms on every rank), the KV cache holds a request of max_model_len tokens, TP
divides the model's attention and KV heads (and EP its experts: pdserve's own check, for a
model whose config.json is here), the ranks of one instance fit one node and the instances fit
the node type's nodes, and each config names a model whose size is known here."""

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.config import ClusterConfig, EngineConfig, load_cluster_config
from pdserve.errors import ConfigError
from pdserve.model.config import ModelConfig
from pdserve.model.kv_layout import kv_layout
from pdserve.model.llama import CausalLM
from pdserve.model.memory import MemoryReport, check_context, plan_kv_cache
from pdserve.model.moe import Experts, SparseMoE
from pdserve.model.parallel import Shard, check_divides

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MIB = 2**20

# GPU memory as the driver reports it (nvidia-smi's total), GPUs and vCPUs, per instance type
INSTANCE_TYPES = {
    "g5.xlarge": (23028 * MIB, 1, 4),  # A10G
    "g5.2xlarge": (23028 * MIB, 1, 8),
    "g6.xlarge": (23034 * MIB, 1, 4),  # L4
    "g6e.xlarge": (46068 * MIB, 1, 4),  # L40S
    "p4d.24xlarge": (40960 * MIB, 8, 96),  # A100 40 GB
    "p5.48xlarge": (81559 * MIB, 8, 192),  # H100 80 GB
    "p5en.48xlarge": (143771 * MIB, 8, 192),  # H200 141 GB
}
RESERVED_AT_START = 512 * MIB  # held before an instance starts (driver, ECC pages)
CUDA_CONTEXT = 1024 * MIB  # CUDA context, cuBLAS workspaces: beyond torch's allocator

# The node type of deploy/ray/cluster.yaml each GPU deploy config runs on
NODE_TYPES = {
    "1p1d-8b.yaml": "gpu_worker",
    "2p2d-8b.yaml": "gpu_worker",
    "2p2d-70b-tp4.yaml": "gpu_worker_8x",
    "2p2d-235b-a22b-tp4-ep4.yaml": "gpu_worker_8x_h200",
    "1p1d-deepseek-v3-tp8-ep8.yaml": "gpu_worker_8x_h200",
}


BLOCK_M = 16  # pdserve.model.triton_moe.Tiles.block_m: each expert's rows padded to a tile
DECODE_SPLITS = 16  # pdserve.model.triton_attention.TritonConfig.max_splits


@dataclass(frozen=True)
class ExpertShape:
    """The experts of a mixture-of-experts model, in every layer (Qwen3-MoE with
    decoder_sparse_step 1 and no mlp_only_layers): `count` SwiGLU MLPs of width `width`, `top_k`
    of them per token, chosen by a router (`hidden x count`, replicated on every rank)."""

    count: int
    top_k: int
    width: int

    def here(self, tp: int, ep: int) -> tuple[int, int]:
        """(experts, width of each) on one rank: `count / ep` whole experts with expert
        parallelism (ep == tp), else a `width / tp` slice of every one (ep == 1)."""
        return (self.count // ep, self.width) if ep > 1 else (self.count, self.width // tp)


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    intermediate: int  # the dense MLP's width (none of a model whose every layer has experts)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: ExpertShape | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm (head_dim) over each q and k head

    def count_parameters(self) -> int:
        """The parameters this shape has (untied embedding and LM head): attention, the MLP or
        the experts and the router, two norms per layer (and Qwen3's q/k norms), the final
        norm."""
        return self.layers * (
            self._attention() + self._mlp() + 2 * self.hidden + self._qk_norms()
        ) + (2 * self.vocab * self.hidden + self.hidden)

    def _qk_norms(self) -> int:
        return 2 * self.head_dim if self.qk_norm else 0

    def _attention(self) -> int:
        """q, k, v and o of one layer."""
        return 2 * (self.heads + self.kv_heads) * self.head_dim * self.hidden

    def _mlp(self) -> int:
        """One layer's dense MLP, or its experts and router."""
        if self.experts is None:
            return 3 * self.hidden * self.intermediate
        experts = self.experts
        return experts.count * 3 * self.hidden * experts.width + self.hidden * experts.count

    def weight_bytes(self, dtype_bytes: int, tp: int = 1, ep: int = 1, context: int = 0) -> int:
        """Of one rank. Dense: 1/tp of every parameter (the replicated norms are negligible).
        With experts, what `pdserve.model.memory.weight_bytes` counts: 1/tp of the attention
        heads and of the vocabulary rows (`ceil(vocab / tp)`) of the embedding and LM head, the
        experts `here` (whole ones or slices: the same bytes), the router and the norms whole,
        and the rotary tables (fp32 cos and sin of `context` positions)."""
        if self.experts is None:
            return self.parameters * dtype_bytes // tp
        count, width = self.experts.here(tp, ep)
        per_layer = (
            self._attention() // tp
            + count * 3 * self.hidden * width
            + self.hidden * self.experts.count
            + 2 * self.hidden
            + self._qk_norms()
        )
        vocab_rows = -(-self.vocab // tp)
        parameters = self.layers * per_layer + 2 * vocab_rows * self.hidden + self.hidden
        return parameters * dtype_bytes + 2 * context * self.head_dim * 4

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """Of one rank: it holds kv_heads / tp heads of every block."""
        return self.layers * 2 * (self.kv_heads // tp) * self.head_dim * dtype_bytes

    def activation_peak(
        self, tokens: int, seqs: int, dtype_bytes: int, tp: int = 1, ep: int = 1
    ) -> int:
        """A bound on one forward's transient memory on rank 0: the residual stream (full on
        every rank), the attention and MLP projections of every token (split over the ranks), and
        fp32 logits (plus their softmax) per sequence (rank 0 gathers the full vocabulary). With
        experts, `moe_activation_peak`."""
        if self.experts is not None:
            return self.moe_activation_peak(tokens, seqs, dtype_bytes, tp, ep)
        per_token = (
            2 * self.hidden + (2 * self.hidden + 3 * self.intermediate) // tp
        ) * dtype_bytes
        return tokens * per_token + seqs * self.vocab * 4 * 2

    def moe_activation_peak(
        self, tokens: int, seqs: int, dtype_bytes: int, tp: int, ep: int
    ) -> int:
        """A bound on one forward's transient memory on rank 0 of a mixture-of-experts model,
        the sum of what is live at different times. Per token: the hidden states before and
        after the attention, the attention's output and the post-attention norm's (all live
        while the experts run; full on every rank), the step's rotary tables, a norm's two fp32
        copies, q/k/v with their normed and rotated copies, the attention output and o_proj's
        (of this rank's heads). One experts block (`moe_layer_bytes`). Per sequence: rank 0's
        fp32 logits (its own part in bf16 and fp32, every rank's part gathered, their
        concatenation: at most 3 x `[seqs, vocab]` in fp32) and the triton decode's split
        partials."""
        d = dtype_bytes
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim // tp
        attention = (2 * qkv + self.heads * self.head_dim // tp + self.hidden) * d
        stream = 4 * self.hidden * d + 2 * self.head_dim * d + 2 * self.hidden * 4
        logits = seqs * self.vocab * 4 * 3
        partials = seqs * (self.heads // tp) * DECODE_SPLITS * (self.head_dim + 2) * 4
        return (
            tokens * (stream + attention)
            + self.moe_layer_bytes(tokens, dtype_bytes, tp, ep)
            + logits
            + partials
        )

    def moe_layer_bytes(
        self, tokens: int, dtype_bytes: int, tp: int, ep: int, path: str = ""
    ) -> int:
        """A bound on what one experts block (`pdserve.model.moe.SparseMoE`) allocates for
        `tokens` tokens on one rank: of `path` ("cuda" or "cpu"), or the larger. Both: the
        router's logits `[tokens, count]` and their fp32 softmax, the top-k weights (fp32, then
        rounded) and ids (int64). CUDA (`triton_moe.fused_experts`), per (token, choice)
        assignment of every token, wherever its expert is (`tokens x top_k` rows, not only this
        rank's): the int64 index arrays of `align` (8 at most, with each local expert's padding
        to a `BLOCK_M` tile), the gate/up output `[rows, 2 x width]`, silu(gate) and its product
        with up (`[rows, width]` each), the down output `[rows, hidden]` and the fp32 scales;
        then the sum over each token's choices `[tokens, hidden]`. CPU (`Experts._grouped`):
        three index arrays per assignment, the output `[tokens, hidden]`, and per expert (at most
        `tokens` rows; the previous expert's last tensors still live while the next one starts,
        so twice) the gathered rows, the gate/up output, silu(gate) and the product, the down
        output, it scaled (fp32 at most) and cast back."""
        assert self.experts is not None
        d, experts = dtype_bytes, self.experts
        count, width = experts.here(tp, ep)
        assignments = tokens * experts.top_k
        router = tokens * experts.count * (d + 4) + assignments * (4 + 8 + d)
        align = (assignments + count * BLOCK_M) * 8 * 8
        fused = assignments * ((4 * width + self.hidden) * d + 4) + tokens * self.hidden * d
        per_expert = tokens * (self.hidden * (3 * d + 4) + 4 * width * d)
        grouped = assignments * (8 + 8 + 4) + tokens * self.hidden * d + 2 * per_expert
        paths = {"cuda": align + fused, "cpu": grouped}
        return router + (paths[path] if path else max(paths.values()))


MODELS = {  # by the model directory's name, from its config.json
    "Meta-Llama-3-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 32, 8, 128, 128256),
    "Meta-Llama-3.1-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 32, 8, 128, 128256),
    "Meta-Llama-3-70B-Instruct": ModelShape(70_553_706_496, 80, 8192, 28672, 64, 8, 128, 128256),
    # 235,093,634,560 parameters: the shape's count (`count_parameters`), and 470,187,269,120
    # bytes in bf16, its checkpoint's model.safetensors.index.json total_size
    "Qwen3-235B-A22B": ModelShape(
        235_093_634_560,
        94,
        4096,
        12288,  # config.json's intermediate_size, unused: every layer has experts
        64,
        4,
        128,
        151936,
        experts=ExpertShape(count=128, top_k=8, width=1536),
        qk_norm=True,
    ),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# config.json of the models whose divisibility pdserve checks itself here (`check_divides`)
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-235B-A22B": {  # Hugging Face Qwen/Qwen3-235B-A22B
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 94,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 1536,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 94,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


# Hugging Face deepseek-ai/DeepSeek-V3's config.json (its quantization_config: `DEEPSEEK_V3_FP8`)
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


DEEPSEEK_V3_FP8 = {
    **DEEPSEEK_V3,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
# the latent-attention models, sized by pdserve's own modules (`latent_fit`), by directory name
LATENT_MODELS = {"DeepSeek-V3": DEEPSEEK_V3_FP8}
DECODE_SPLITS_LATENT = 64  # pdserve.model.triton_attention.TritonConfig.latent_max_splits


def cluster_node_types() -> dict[str, dict[str, Any]]:
    """The GPU worker node types of deploy/ray/cluster.yaml, by name."""
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    return {
        name: node
        for name, node in cluster["available_node_types"].items()
        if name != cluster["head_node_type"]
    }


def instance_type(config_name: str) -> str:
    return str(cluster_node_types()[NODE_TYPES[config_name]]["node_config"]["InstanceType"])


def gpu_configs() -> list[Path]:
    return sorted(p for p in (DEPLOY / "config").glob("*.yaml") if p.name != "local.yaml")


def test_every_gpu_deploy_config_is_checked() -> None:
    assert [p.name for p in gpu_configs()] == sorted(NODE_TYPES)
    assert set(NODE_TYPES.values()) == set(cluster_node_types()), "a node type no config uses"
    for name in NODE_TYPES:
        assert instance_type(name) in INSTANCE_TYPES


def fit(engine: EngineConfig, gpu_memory: int) -> tuple[int, int, int]:
    """(weights, activation peak, KV bytes) of one rank (rank 0) of `engine` on that GPU."""
    assert engine.model is not None, "a GPU deploy config names its model"
    name = Path(engine.model).name
    if name in LATENT_MODELS:
        return latent_fit(engine, ModelConfig.from_hf_dict(LATENT_MODELS[name]), gpu_memory)
    shape = MODELS.get(name)
    assert shape is not None, f"unknown model {engine.model}: add its shape to MODELS"
    tp, ep = engine.tensor_parallel_size, engine.expert_parallel_size
    assert shape.heads % tp == 0 and shape.kv_heads % tp == 0, (
        f"tensor_parallel_size {tp} must divide {shape.heads} attention and "
        f"{shape.kv_heads} KV heads"
    )
    if shape.experts is not None:
        experts = shape.experts
        assert experts.count % ep == 0 and (ep > 1 or experts.width % tp == 0), (
            f"expert_parallel_size {ep} must divide {experts.count} experts (or at 1, "
            f"tensor_parallel_size {tp} their width {experts.width})"
        )
    if name in HF_CONFIGS:  # pdserve's own check, as the engine runs it before loading
        check_divides(Shard(0, tp, ep > 1), ModelConfig.from_hf_dict(HF_CONFIGS[name]))
    dtype_bytes = DTYPE_BYTES[engine.dtype]
    assert engine.max_model_len is not None, "a GPU deploy config sets max_model_len"
    weights = shape.weight_bytes(dtype_bytes, tp, ep, context=engine.max_model_len)
    peak = shape.activation_peak(
        engine.max_num_batched_tokens, engine.max_num_seqs, dtype_bytes, tp, ep
    )
    memory = MemoryReport(gpu_memory, gpu_memory - RESERVED_AT_START, weights, peak, CUDA_CONTEXT)
    plan = plan_kv_cache(
        block_bytes=shape.kv_bytes_per_token(dtype_bytes, tp) * engine.block_size,
        block_size=engine.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        kv_cache_bytes=engine.kv_cache_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        memory=memory,
    )
    check_context(plan, engine.max_model_len, explicit=True)  # ConfigError if it cannot fit
    return weights, peak, plan.kv_bytes


def latent_fit(engine: EngineConfig, config: ModelConfig, gpu_memory: int) -> tuple[int, int, int]:
    """`fit` for a latent-attention model, from pdserve's own module (built on the meta device
    for rank 0: `rank_weight_bytes`), its `KVLayout` and `latent_activation_peak`."""
    tp, ep = engine.tensor_parallel_size, engine.expert_parallel_size
    shard = Shard(0, tp, ep > 1)
    check_divides(shard, config)  # as the engine does before loading
    assert engine.max_model_len is not None, "a GPU deploy config sets max_model_len"
    d = DTYPE_BYTES[engine.dtype]
    weights = rank_weight_bytes(config, shard, engine.max_model_len, d)
    peak = latent_activation_peak(
        config, engine.max_num_batched_tokens, engine.max_num_seqs, d, tp, ep
    )
    dtype = torch.float8_e4m3fn if engine.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    layout = kv_layout(config, shard, dtype)
    memory = MemoryReport(gpu_memory, gpu_memory - RESERVED_AT_START, weights, peak, CUDA_CONTEXT)
    plan = plan_kv_cache(
        block_bytes=layout.block_bytes(engine.block_size),
        block_size=engine.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        kv_cache_bytes=engine.kv_cache_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        memory=memory,
    )
    check_context(plan, engine.max_model_len, explicit=True)
    return weights, peak, plan.kv_bytes


def rank_weight_bytes(config: ModelConfig, shard: Shard, context: int, dtype_bytes: int) -> int:
    """What rank `shard` holds once loaded: every parameter of pdserve's module for it (made on
    the meta device: the same shapes), FP8 weights at 1 byte, their block scales and the
    float32 routers at 4, the rest in the model's dtype; `kv_b_proj` is dequantized into the
    model's dtype after loading (the latent attention's `w_uk` / `w_uv`, its scales dropped);
    the rotary tables (float32 cos and sin of `context` positions)."""
    with torch.device("meta"):
        model = CausalLM(config, context, shard)
    float32 = {
        f"{name}.{leaf}"
        for name, module in model.named_modules()
        if getattr(module, "keep_float32", False)
        for leaf, _ in module.named_parameters(recurse=False)
    }
    total = 0
    for name, parameter in model.named_parameters():
        if "kv_b_proj" in name:
            total += 0 if name.endswith("scale_inv") else parameter.numel() * dtype_bytes
        elif parameter.dtype == torch.float8_e4m3fn:
            total += parameter.numel()
        elif name.endswith(("scale_inv", "_scale")) or name in float32:
            total += parameter.numel() * 4
        else:
            total += parameter.numel() * dtype_bytes
    return total + 2 * context * config.rotary_dim * 4


def latent_activation_peak(
    config: ModelConfig, tokens: int, seqs: int, dtype_bytes: int, tp: int, ep: int
) -> int:
    """A bound on one forward's transient memory on rank 0 of a latent-attention MoE model, the
    sum of what is live at different times. Per token: the residual stream and norms (as
    `moe_activation_peak`), the query bottleneck (and its norm's float32 copy), q, the latent
    and its rotated part, the absorbed query and latent output of a decode row, the attention
    output and o_proj's. A prefill chunk of every token of the step over as long a context: its
    expanded keys and values and (SDPA's math path, the worst case) float32 scores and their
    softmax. The largest FP8 weight dequantized for a multiply (a float32 copy, its expanded
    scales and the result). One experts block (`moe_layer_bytes`, CUDA) and the shared
    experts' outputs. Per sequence: rank 0's logits (3 x fp32) and the latent decode's split
    partials."""
    mla, moe, d = config.mla, config.moe, dtype_bytes
    assert mla is not None and moe is not None
    heads, hidden = config.num_heads // tp, config.hidden_size
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    q_lora = mla.q_lora_rank or 0
    per_token = (
        4 * hidden * d + 2 * hidden * 4  # the stream, a norm's float32 copies
        + q_lora * (2 * d + 4)
        + heads * qk * d * 2
        + mla.latent_dim * d * 3
        + (heads + 1) * mla.qk_rope_head_dim * d * 2
        + heads * mla.kv_lora_rank * d * 2
        + heads * mla.v_head_dim * d
        + hidden * d
    )  # fmt: skip
    expanded = tokens * heads * (qk + mla.v_head_dim) * d + heads * tokens * tokens * 4 * 2
    shared = moe.shared_width // tp
    largest = max(
        heads * qk * max(q_lora, hidden),
        hidden * heads * mla.v_head_dim,
        2 * config.intermediate_size // tp * hidden,
        2 * shared * hidden,
    )
    dequantized = largest * (4 + 4 + d)
    shape = ModelShape(
        0, config.num_layers, hidden, config.intermediate_size, config.num_heads,
        config.num_kv_heads, qk, config.vocab_size,
        experts=ExpertShape(moe.num_experts, moe.top_k, moe.intermediate_size),
    )  # fmt: skip
    experts = shape.moe_layer_bytes(tokens, d, tp, ep, "cuda")
    shared_out = tokens * (3 * shared + hidden) * d
    logits = seqs * config.vocab_size * 4 * 3
    partials = seqs * heads * DECODE_SPLITS_LATENT * (mla.kv_lora_rank + 2) * 4
    return tokens * per_token + expanded + dequantized + experts + shared_out + logits + partials


@pytest.mark.parametrize("path", gpu_configs(), ids=lambda p: p.name)
def test_weights_activations_and_kv_fit_the_gpu_of_the_instance_type(path: Path) -> None:
    config: ClusterConfig = load_cluster_config(path, env={})
    gpu_memory, _, _ = INSTANCE_TYPES[instance_type(path.name)]
    for role in ("prefill", "decode", "mixed"):
        if getattr(config, role).replicas == 0:
            continue
        weights, peak, kv = fit(config.engine_for(role), gpu_memory)
        used = weights + peak + CUDA_CONTEXT + kv
        assert used <= gpu_memory - RESERVED_AT_START, (
            f"{path.name} {role}: {used / 2**30:.1f} GiB on a {gpu_memory / 2**30:.1f} GiB GPU"
        )
        assert kv >= 2 * 2**30  # room for more than a couple of 8k-token requests


@pytest.mark.parametrize("path", gpu_configs(), ids=lambda p: p.name)
def test_the_instances_fit_the_nodes_of_the_node_type(path: Path) -> None:
    """An instance is tensor_parallel_size bundles of {CPU: num_cpus, GPU: num_gpus}, all on
    one node; the instances of every role together fit the node type's max_workers nodes."""
    config: ClusterConfig = load_cluster_config(path, env={})
    node = cluster_node_types()[NODE_TYPES[path.name]]
    _, gpus, vcpus = INSTANCE_TYPES[node["node_config"]["InstanceType"]]
    nodes = 0
    for role in ("prefill", "decode", "mixed"):
        section = getattr(config, role)
        if section.replicas == 0:
            continue
        tp = config.engine_for(role).tensor_parallel_size
        assert 0 < section.num_gpus <= 1, f"{path.name} {role}: num_gpus is per rank"
        assert tp * section.num_gpus <= gpus and tp * section.num_cpus <= vcpus, (
            f"{path.name} {role}: {tp} ranks of one instance do not fit one {gpus}-GPU node"
        )
        per_node = min(gpus // (tp * section.num_gpus), vcpus // (tp * section.num_cpus))
        nodes += math.ceil(section.replicas / per_node)
    assert nodes <= node["max_workers"], f"{path.name}: {nodes} nodes, {node['max_workers']} max"


def test_a_fixed_kv_cache_too_big_for_the_gpu_is_caught() -> None:
    """What the shipped 8B configs did before: 12 GiB of KV next to 16 GB of weights."""
    engine = EngineConfig(
        model="/m/Meta-Llama-3-8B-Instruct",
        dtype="bfloat16",
        kv_cache_bytes=12 * 2**30,
        max_model_len=8192,
        max_num_batched_tokens=4096,
    )
    weights, peak, kv = fit(engine, INSTANCE_TYPES["g5.xlarge"][0])
    assert weights + peak + CUDA_CONTEXT + kv > INSTANCE_TYPES["g5.xlarge"][0]


def test_a_70b_model_needs_tensor_parallelism_on_an_h100() -> None:
    """140 GB of bf16 weights: no room on one 80 GB GPU; a quarter of them per rank at TP 4."""
    gpu_memory = INSTANCE_TYPES["p5.48xlarge"][0]
    engine = EngineConfig(
        model="/m/Meta-Llama-3-70B-Instruct", dtype="bfloat16", device="cuda", max_model_len=8192
    )
    with pytest.raises(ConfigError, match="no GPU memory left"):
        fit(engine, gpu_memory)
    tp4 = EngineConfig(
        model="/m/Meta-Llama-3-70B-Instruct",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        tensor_parallel_size=4,
    )
    weights, _, kv = fit(tp4, gpu_memory)
    assert weights == 70_553_706_496 * 2 // 4 and kv >= 30 * 2**30
    with pytest.raises(AssertionError, match="must divide"):
        fit(replace(tp4, tensor_parallel_size=3), gpu_memory)


def test_the_shapes_count_their_parameters() -> None:
    """Each shape's layers add up to the parameter count given (the checkpoints' own sizes)."""
    for name, shape in MODELS.items():
        assert shape.count_parameters() == shape.parameters, name


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_a_shape_is_what_pdserve_parses_from_its_config(name: str) -> None:
    config, shape = ModelConfig.from_hf_dict(HF_CONFIGS[name]), MODELS[name]
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        shape.layers,
        shape.hidden,
        shape.intermediate,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.vocab,
    )
    assert config.qk_norm == shape.qk_norm and not config.tie_word_embeddings
    assert config.moe is not None and shape.experts is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (
        shape.experts.count,
        shape.experts.top_k,
        shape.experts.width,
    )
    assert config.moe.sparse_layers == frozenset(range(config.num_layers))  # no dense MLP


def test_qwen3_235b_needs_four_h200s_and_cannot_split_wider() -> None:
    """470 GB of bf16 weights: no room on one or two 141 GB GPUs; at TP 4 (with the experts
    whole or sliced: the same bytes) 110 GiB per rank and room for KV. Its 4 KV heads cap TP at
    4: pdserve splits them and never replicates them."""
    gpu_memory = INSTANCE_TYPES["p5en.48xlarge"][0]
    engine = EngineConfig(
        model="/m/Qwen3-235B-A22B",
        dtype="bfloat16",
        device="cuda",
        max_model_len=32768,
        max_num_batched_tokens=8192,
        max_num_seqs=128,
    )
    for tp in (1, 2):
        with pytest.raises(ConfigError, match="no GPU memory left"):
            fit(replace(engine, tensor_parallel_size=tp), gpu_memory)
    sliced = fit(replace(engine, tensor_parallel_size=4), gpu_memory)
    whole = fit(replace(engine, tensor_parallel_size=4, expert_parallel_size=4), gpu_memory)
    assert sliced[0] == whole[0] and 109 * 2**30 < whole[0] < 110 * 2**30
    assert sliced[1] < whole[1]  # a rank's gate/up output is 4x wider with whole experts
    assert whole[2] >= 12 * 2**30
    with pytest.raises(AssertionError, match="must divide"):
        fit(replace(engine, tensor_parallel_size=8, expert_parallel_size=8), gpu_memory)
    with pytest.raises(ConfigError, match="KV heads"):
        check_divides(Shard(0, 8, True), ModelConfig.from_hf_dict(HF_CONFIGS["Qwen3-235B-A22B"]))


def test_experts_that_the_ranks_do_not_divide_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "Qwen3-235B-A22B"
    shape, raw = MODELS[name], HF_CONFIGS[name]
    assert shape.experts is not None
    monkeypatch.setitem(MODELS, name, replace(shape, experts=replace(shape.experts, count=126)))
    monkeypatch.setitem(HF_CONFIGS, name, {**raw, "num_experts": 126})
    engine = EngineConfig(
        model=f"/m/{name}",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        tensor_parallel_size=4,
        expert_parallel_size=4,
    )
    with pytest.raises(AssertionError, match="must divide 126 experts"):
        fit(engine, INSTANCE_TYPES["p5en.48xlarge"][0])
    monkeypatch.setitem(MODELS, name, shape)  # pdserve's own check refuses it too
    with pytest.raises(ConfigError, match="does not divide the model's 126 experts"):
        fit(engine, INSTANCE_TYPES["p5en.48xlarge"][0])


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors allocated by ops while it is active held at once (a storage
    counts until its last tensor is gone; views and in-place results of an op's inputs, and
    tensors made before, do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in self._counted and storage.data_ptr() not in inputs:
                    self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()
        self._counted.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)  # when its last tensor is gone

    def _free(self, key: int, size: int) -> None:
        self._counted.discard(key)
        self.live -= size


@contextmanager
def experts_block(shape: ModelShape, tp: int, ep: int, real: bool) -> Iterator[SparseMoE]:
    """Rank 0's experts block of `shape` in bf16: a real router; real experts or, when not
    `real`, experts on the meta device (only their shapes are read)."""
    assert shape.experts is not None
    moe_config = ModelConfig.from_hf_dict(HF_CONFIGS["Qwen3-235B-A22B"]).moe
    assert moe_config is not None
    moe_config = replace(
        moe_config,
        num_experts=shape.experts.count,
        top_k=shape.experts.top_k,
        intermediate_size=shape.experts.width,
    )
    with torch.device("cpu" if real else "meta"):
        block = SparseMoE(shape.hidden, moe_config, Shard(0, tp, ep > 1)).to(torch.bfloat16)
    block.gate = nn.Linear(shape.hidden, shape.experts.count, bias=False, dtype=torch.bfloat16)
    if real:
        for weight in (block.experts.gate_up, block.experts.down):
            nn.init.normal_(weight, std=0.02)
    with torch.no_grad():
        yield block


@pytest.mark.parametrize("ep", [1, 4], ids=["sliced", "whole"])
def test_the_experts_bound_covers_what_the_fused_experts_allocate(
    ep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path (`fused_experts`) at Qwen3-235B's shape, rank 0 of 4, on CPU tensors with
    the Triton launches left out (they write in place: they allocate nothing)."""
    import pdserve.model.triton_moe as triton_moe  # imports triton (nothing is launched)

    monkeypatch.setattr(triton_moe, "_launch", lambda *args: None)

    def fused(self: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
        return triton_moe.fused_experts(x, self.gate_up, self.down, ids, w, self.part.first)

    monkeypatch.setattr(Experts, "forward", fused)
    shape, tokens = MODELS["Qwen3-235B-A22B"], 1024
    with experts_block(shape, 4, ep, real=False) as block:
        x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16)
        with LiveBytes() as live:
            block(x)
    bound = shape.moe_layer_bytes(tokens, 2, 4, ep, "cuda")
    assert 0.75 * bound < live.peak <= bound, (live.peak, bound)


@pytest.mark.parametrize("ep", [1, 4], ids=["sliced", "whole"])
def test_the_experts_bound_covers_what_the_grouped_experts_allocate(ep: int) -> None:
    """The CPU path (`Experts._grouped`) of a small model of the same kind, rank 0 of 4, whose
    tokens each choose every expert (each expert's rows at their most)."""
    shape = replace(MODELS["Qwen3-235B-A22B"], hidden=256, experts=ExpertShape(8, 8, 96))
    tokens = 256
    with experts_block(shape, 4, ep, real=True) as block:
        x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16)
        with LiveBytes() as live:
            block(x)
    bound = shape.moe_layer_bytes(tokens, 2, 4, ep, "cpu")
    assert 0.25 * bound < live.peak <= bound, (live.peak, bound)


def test_deepseek_v3s_latent_cache_holds_71_times_the_tokens_per_gib() -> None:
    """Its KV layout (pdserve's own, from its config.json): one 576-value latent per token and
    layer instead of 128 heads x (192 + 128) values of K and V; on a 141 GB GPU's 40 GiB of
    KV, pdserve's sizing then fits 71x the tokens."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    layout = kv_layout(config, Shard(0, 8, True), torch.bfloat16)  # a rank of TP=8, EP=8
    assert (layout.kind, layout.planes, layout.heads, layout.dim) == ("latent", 1, 1, 576)
    mla = config.mla
    assert mla is not None
    key = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    per_head = config.num_layers * config.num_heads * (key + mla.v_head_dim) * 2  # bf16 K and V
    latent_tokens, per_head_tokens = (
        plan_kv_cache(
            block_bytes=bytes_per_token * 64,
            block_size=64,
            num_kv_blocks=None,
            kv_cache_bytes=40 * 2**30,
            gpu_memory_utilization=0.9,
            memory=None,
        ).num_blocks
        * 64
        for bytes_per_token in (layout.bytes_per_token(), per_head)
    )
    assert layout.bytes_per_token() == 61 * 576 * 2
    assert 71 <= latent_tokens / per_head_tokens < 71.5  # 40960 / 576, in whole blocks


def test_deepseek_v3_fits_one_8x_h200_node_as_it_ships_in_fp8_not_in_bfloat16() -> None:
    """pdserve's own module for DeepSeek-V3 has its 671,026,419,200 parameters (multi-token
    prediction left out): 1.34 TB in bfloat16, more than the 8 GPUs of one p5en.48xlarge hold
    (1.13 TB), and an instance's ranks share one node; its own FP8 checkpoint, whose weights
    pdserve keeps in FP8, leaves each of 8 ranks ~80 GiB of weights and room for ~35 GiB of
    latent KV (the shipped config)."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    with torch.device("meta"):
        model = CausalLM(config, 4096)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == 671_026_419_200
    gpu_memory, gpus, _ = INSTANCE_TYPES["p5en.48xlarge"]
    assert parameters * 2 > gpus * gpu_memory
    fp8 = ModelConfig.from_hf_dict(DEEPSEEK_V3_FP8)
    assert fp8.weight_block == (128, 128)
    engine = load_cluster_config(DEPLOY / "config" / "1p1d-deepseek-v3-tp8-ep8.yaml", env={})
    weights, peak, kv = fit(engine.engine_for("decode"), gpu_memory)
    assert 79 * 2**30 < weights < 81 * 2**30
    assert kv > 30 * 2**30 and peak < 14 * 2**30
    tokens = kv // kv_layout(fp8, Shard(0, 8, True), torch.bfloat16).bytes_per_token()
    assert tokens > 450_000  # per instance: every rank holds every token's latent
    with pytest.raises(ConfigError, match=r"288 of the model's MLP width.*not whole 128x128"):
        check_divides(Shard(0, 64, True), fp8)  # 18432 / 64: not whole blocks
