"""How many KV blocks an engine gets: explicit settings, else what the device has left.

On CUDA (vLLM's method): after the weights are loaded, one profiling forward at the step token
budget (`max_num_batched_tokens`, split over up to `max_num_seqs` sequences that each ask for
logits) measures the activation peak; the KV cache takes what remains of
`gpu_memory_utilization` x the device's memory, less the weights, that peak and what CUDA
itself holds beyond torch's allocator (context, cuBLAS workspaces). The fraction is of the whole
device: two instances sharing one GPU (fractional `num_gpus`) each set their own share, and an
instance that finds less free memory than its share at start is refused.

On CPU the same `plan_kv_cache` sizes from a byte budget: `engine.kv_cache_bytes` (default
`DEFAULT_CPU_KV_CACHE_BYTES`). An explicit `num_kv_blocks` or `kv_cache_bytes` wins everywhere.
"""

import logging
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.errors import ConfigError
from pdserve.model.kv_quant import KVScales, calibration_batch
from pdserve.model.llama import CausalLM
from pdserve.model.loader import LoadedModel
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner, SequenceChunk

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20
GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """A device's memory around the profiling pass (bytes)."""

    total: int
    free_at_start: int  # before this engine loaded anything (other processes hold the rest)
    weights: int
    activation_peak: int  # the profiling forward's peak above weights
    non_torch: int  # held beyond torch's allocator by this process (CUDA context, libraries)


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    block_bytes: int
    block_size: int  # tokens per block
    source: str  # num_kv_blocks | kv_cache_bytes | gpu_memory_utilization | cpu_default

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_cache(
    *,
    block_bytes: int,
    block_size: int,
    num_kv_blocks: int | None,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
    memory: MemoryReport | None,
) -> KVPlan:
    """The KV cache size: `num_kv_blocks`, else `kv_cache_bytes`, else from `memory` (a CUDA
    device, profiled), else the CPU default budget. Raises ConfigError when the device has no
    room for a single block."""
    if num_kv_blocks is not None:
        return KVPlan(num_kv_blocks, block_bytes, block_size, "num_kv_blocks")
    if kv_cache_bytes is not None or memory is None:
        source = "kv_cache_bytes" if kv_cache_bytes is not None else "cpu_default"
        budget = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
        return KVPlan(max(1, budget // block_bytes), block_bytes, block_size, source)
    share = int(memory.total * gpu_memory_utilization)
    if memory.free_at_start < share:
        raise ConfigError(
            f"engine.gpu_memory_utilization {gpu_memory_utilization:g} asks for "
            f"{share / GIB:.2f} GiB of the GPU but only {memory.free_at_start / GIB:.2f} GiB "
            f"of {memory.total / GIB:.2f} GiB was free at start (another process uses the "
            "rest): lower gpu_memory_utilization (instances sharing a GPU split it)"
        )
    available = share - memory.weights - memory.activation_peak - memory.non_torch
    if available < block_bytes:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {share / GIB:.2f} GiB allowed "
            f"(gpu_memory_utilization {gpu_memory_utilization:g}), weights "
            f"{memory.weights / GIB:.2f} GiB, activation peak "
            f"{memory.activation_peak / GIB:.2f} GiB, other {memory.non_torch / GIB:.2f} GiB: "
            "raise gpu_memory_utilization, lower max_num_batched_tokens, or use a GPU with "
            "more memory"
        )
    return KVPlan(available // block_bytes, block_bytes, block_size, "gpu_memory_utilization")


def check_context(plan: KVPlan, max_model_len: int, explicit: bool) -> int:
    """The context window the KV pool allows: `max_model_len` when one request of that length
    fits, else a ConfigError for an explicit `engine.max_model_len` and the pool's size (with
    a warning) for the model's own."""
    if max_model_len <= plan.max_tokens:
        return max_model_len
    if explicit:
        raise ConfigError(
            f"engine.max_model_len is {max_model_len} but the KV cache holds "
            f"{plan.max_tokens} tokens ({plan.num_blocks} blocks, from {plan.source}): one "
            "request of that length could never run; give the KV cache more memory "
            "(gpu_memory_utilization, kv_cache_bytes, num_kv_blocks) or lower max_model_len"
        )
    sized = plan.source == "gpu_memory_utilization"  # else the operator chose the size
    logger.log(
        logging.WARNING if sized else logging.INFO,
        "the model's context (%d tokens) is larger than the KV cache (%d tokens): "
        "max_model_len is %d",
        max_model_len,
        plan.max_tokens,
        plan.max_tokens,
    )
    return plan.max_tokens


def weight_bytes(model: CausalLM) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        key = id(tensor) if tensor.is_mkldnn else tensor.data_ptr()  # oneDNN-packed: no pointer
        if key not in seen:  # tied embeddings count once
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def describe(plan: KVPlan, memory: MemoryReport | None, weights: int, max_model_len: int) -> str:
    """One startup line: where the memory goes."""
    parts = [f"weights {weights / GIB:.2f} GiB"]
    if memory is not None:
        parts.append(f"activation peak {memory.activation_peak / GIB:.2f} GiB")
        parts.append(f"other {memory.non_torch / GIB:.2f} GiB of {memory.total / GIB:.1f} GiB")
    parts.append(
        f"KV cache {plan.kv_bytes / GIB:.2f} GiB = {plan.num_blocks} blocks = "
        f"{plan.max_tokens} tokens ({plan.source})"
    )
    parts.append(f"max_model_len {max_model_len}")
    return "memory: " + ", ".join(parts)


def cuda_free_at_start(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device before anything is loaded."""
    torch.cuda.init()  # type: ignore[no-untyped-call]
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def profile_cuda(
    loaded: LoadedModel, config: EngineConfig, free_at_start: int, total: int
) -> MemoryReport:
    """Run one forward of `max_num_batched_tokens` tokens (over up to `max_num_seqs`
    sequences, each computing logits) on a temporary KV cache just big enough, and measure
    its peak above what was allocated before it."""
    device = loaded.device
    tokens = config.max_num_batched_tokens
    seqs = max(1, min(config.max_num_seqs, tokens))
    per_seq = tokens // seqs
    blocks_per_seq = -(-per_seq // config.block_size)
    layout = loaded.model.kv_layout(loaded.dtype)
    shape = layout.shape(seqs * blocks_per_seq, config.block_size)
    runner = ModelRunner(loaded.model, torch.zeros(shape, dtype=layout.dtype, device=device))
    chunks = [
        SequenceChunk([0] * per_seq, 0, range(i * blocks_per_seq, (i + 1) * blocks_per_seq), True)
        for i in range(seqs)
    ]
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(chunks)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner, chunks
    torch.cuda.empty_cache()
    free_now, _ = torch.cuda.mem_get_info(device)
    held = free_at_start - int(free_now)  # by this process now: weights + CUDA's own
    non_torch = max(0, held - torch.cuda.memory_reserved(device))
    return MemoryReport(total, free_at_start, weight_bytes(loaded.model), peak, non_torch)


def size_kv_cache(
    config: EngineConfig, loaded: LoadedModel, device_memory: tuple[int, int] | None
) -> tuple[KVPlan, MemoryReport | None]:
    """The engine's KV plan; profiles the device (`device_memory`: its free and total bytes
    before loading, CUDA only) when no explicit size is set."""
    block_bytes = loaded.model.kv_layout(loaded.dtype).block_bytes(config.block_size)  # a rank's
    memory = None
    explicit = config.num_kv_blocks is not None or config.kv_cache_bytes is not None
    if device_memory is not None and not explicit:
        memory = profile_cuda(loaded, config, *device_memory)
    plan = plan_kv_cache(
        block_bytes=block_bytes,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_bytes=config.kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        memory=memory,
    )
    return plan, memory


def calibrate_kv_scales(loaded: LoadedModel, block_size: int, group: TPGroup | None) -> KVScales:
    """An FP8 cache's measured scales (`pdserve.model.kv_quant`): one forward of the fixed
    calibration batch into a temporary cache in the model's dtype (this rank's part), then the
    largest magnitude per layer and plane — over every rank of a tensor-parallel instance (every
    rank runs this together)."""
    batch = calibration_batch(loaded.config.vocab_size)
    per_seq = -(-len(batch[0]) // block_size)
    layout = loaded.model.kv_layout(loaded.dtype)  # full precision: no scales yet
    shape = layout.shape(len(batch) * per_seq, block_size)
    cache = torch.zeros(shape, dtype=layout.dtype, device=loaded.device)
    chunks = [
        SequenceChunk(tokens, 0, range(i * per_seq, (i + 1) * per_seq), True)
        for i, tokens in enumerate(batch)
    ]
    ModelRunner(loaded.model, cache).execute(chunks)
    amax = cache.abs().amax(dim=(0, 3, 4, 5)).float()  # [layers, planes]
    del cache
    if group is not None:
        amax = group.max(amax)
    return KVScales.from_amax(amax.cpu())
