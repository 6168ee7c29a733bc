"""The shipped GPU deploy configs fit the machines deploy/ray/cluster.yaml starts: for every
role, weights + activations + KV cache <= the GPU memory of the instance type, the KV cache holds
a request of max_model_len tokens, and each config names a model whose size is known here."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pdserve.config import ClusterConfig, EngineConfig, load_cluster_config
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


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def activation_peak(self, tokens: int, seqs: int, dtype_bytes: int) -> int:
        """A bound on one forward's transient memory: the residual stream, attention and MLP
        projections of every token, and fp32 logits (plus their softmax) per sequence."""
        per_token = (4 * self.hidden + 3 * self.intermediate) * dtype_bytes
        return tokens * per_token + seqs * self.vocab * 4 * 2


MODELS = {  # by the model directory's name, from its config.json
    "Meta-Llama-3-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 8, 128, 128256),
    "Meta-Llama-3.1-8B-Instruct": ModelShape(8_030_261_248, 32, 4096, 14336, 8, 128, 128256),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def gpu_instance_type() -> str:
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = [
        node["node_config"]["InstanceType"]
        for name, node in cluster["available_node_types"].items()
        if name != cluster["head_node_type"]
    ]
    assert len(types) == 1, f"one GPU worker type expected, got {types}"
    return types[0]


def gpu_configs() -> list[Path]:
    return sorted(p for p in (DEPLOY / "config").glob("*.yaml") if p.name != "local.yaml")


def test_every_gpu_deploy_config_is_checked() -> None:
    assert [p.name for p in gpu_configs()] == ["1p1d-8b.yaml", "2p2d-8b.yaml"]
    assert gpu_instance_type() in INSTANCE_TYPES


def fit(engine: EngineConfig, gpu_memory: int) -> tuple[int, int, int]:
    """(weights, activation peak, KV bytes) of one instance of `engine` on that GPU."""
    assert engine.model is not None, "a GPU deploy config names its model"
    shape = MODELS.get(Path(engine.model).name)
    assert shape is not None, f"unknown model {engine.model}: add its shape to MODELS"
    dtype_bytes = DTYPE_BYTES[engine.dtype]
    weights = shape.parameters * dtype_bytes
    peak = shape.activation_peak(engine.max_num_batched_tokens, engine.max_num_seqs, dtype_bytes)
    memory = MemoryReport(gpu_memory, gpu_memory - RESERVED_AT_START, weights, peak, CUDA_CONTEXT)
    plan = plan_kv_cache(
        block_bytes=shape.kv_bytes_per_token(dtype_bytes) * engine.block_size,
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
    gpu_memory, gpus, vcpus = INSTANCE_TYPES[gpu_instance_type()]
    for role in ("prefill", "decode", "mixed"):
        section = getattr(config, role)
        if section.replicas == 0:
            continue
        assert 0 < section.num_gpus <= gpus and section.num_cpus <= vcpus
        weights, peak, kv = fit(config.engine_for(role), gpu_memory)
        used = weights + peak + CUDA_CONTEXT + kv
        assert used <= gpu_memory - RESERVED_AT_START, (
            f"{path.name} {role}: {used / 2**30:.1f} GiB on a {gpu_memory / 2**30:.1f} GiB GPU"
        )
        assert kv >= 2 * 2**30  # room for more than a couple of 8k-token requests


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
