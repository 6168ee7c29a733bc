"""The shipped GPU deploy configs fit the machines deploy/ray/cluster.yaml starts: for every
role, weights + activations + KV cache <= the GPU memory of the node type meant for the config
(per tensor-parallel rank: each rank holds 1/TP of the weights and of every KV block), the KV
cache holds a request of max_model_len tokens, TP divides the model's attention and KV heads,
the ranks of one instance fit one node and the instances fit the node type's nodes, and each
config names a model whose size is known here."""

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import ClusterConfig, EngineConfig, load_cluster_config
from pdserve.errors import ConfigError
from pdserve.model.memory import MemoryReport, check_context, plan_kv_cache

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
}
RESERVED_AT_START = 512 * MIB  # held before an instance starts (driver, ECC pages)
CUDA_CONTEXT = 1024 * MIB  # CUDA context, cuBLAS workspaces: beyond torch's allocator

# The node type of deploy/ray/cluster.yaml each GPU deploy config runs on
NODE_TYPES = {
    "1p1d-8b.yaml": "gpu_worker",
    "2p2d-8b.yaml": "gpu_worker",
    "2p2d-70b-tp4.yaml": "gpu_worker_8x",
}


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """Of one rank: it holds kv_heads / tp heads of every block."""
        return self.layers * 2 * (self.kv_heads // tp) * self.head_dim * dtype_bytes

    def activation_peak(self, tokens: int, seqs: int, dtype_bytes: int, tp: int = 1) -> int:
        """A bound on one forward's transient memory on rank 0: the residual stream (full on
        every rank), the attention and MLP projections of every token (split over the ranks), and
        fp32 logits (plus their softmax) per sequence (rank 0 gathers the full vocabulary)."""
        per_token = (
            2 * self.hidden + (2 * self.hidden + 3 * self.intermediate) // tp
        ) * dtype_bytes
        return tokens * per_token + seqs * self.vocab * 4 * 2


MODELS = {  # by the model directory's name, from its config.json
    "Meta-Llama-3-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 32, 8, 128, 128256),
    "Meta-Llama-3.1-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 32, 8, 128, 128256),
    "Meta-Llama-3-70B-Instruct": ModelShape(70_553_706_496, 80, 8192, 28672, 64, 8, 128, 128256),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
    shape = MODELS.get(Path(engine.model).name)
    assert shape is not None, f"unknown model {engine.model}: add its shape to MODELS"
    tp = engine.tensor_parallel_size
    assert shape.heads % tp == 0 and shape.kv_heads % tp == 0, (
        f"tensor_parallel_size {tp} must divide {shape.heads} attention and "
        f"{shape.kv_heads} KV heads"
    )
    dtype_bytes = DTYPE_BYTES[engine.dtype]
    weights = shape.parameters * dtype_bytes // tp  # norms are replicated: negligible
    peak = shape.activation_peak(
        engine.max_num_batched_tokens, engine.max_num_seqs, dtype_bytes, tp
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
    assert engine.max_model_len is not None, "a GPU deploy config sets max_model_len"
    check_context(plan, engine.max_model_len, explicit=True)  # ConfigError if it cannot fit
    return weights, peak, plan.kv_bytes


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
