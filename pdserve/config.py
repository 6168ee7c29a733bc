"""Typed, validated configuration.

Sources, each later one winning:

1. the YAML file: sections `engine`, `prefill`, `decode`, `mixed`, `router`, `storage`,
   `transfer`, `admin`, `cluster`;
2. `PDSERVE_<SETTING>` variables for engine and cluster settings, `PDSERVE_<SECTION>_<SETTING>`
   for the other sections (e.g. `PDSERVE_DECODE_REPLICAS=2`);
3. explicit overrides (CLI flags).

Per-role engine settings: `prefill:`, `decode:` and `mixed:` may hold an `engine:` mapping, and
`PDSERVE_<ROLE>_ENGINE_<SETTING>` variables (e.g. `PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS=40`) set
one engine setting for that role only. A role's engine is the base engine (`engine:` section, then
`PDSERVE_<SETTING>`), then its `<role>.engine` mapping, then its `PDSERVE_<ROLE>_ENGINE_*`
variables; `ClusterConfig.engine_for(role)` returns it. The settings that shape a KV block or the
router's prefix hashes (SHARED_ENGINE_FIELDS) are the base engine's only.

Unknown sections, keys and `PDSERVE_*` variables, values of the wrong type and invalid choices are
ConfigErrors that name the setting and its source (a misspelt key or variable gets the closest
known name), so a typo in a deployment fails at start-up, not at the first request.

Every setting is a dataclass field followed by its docstring (first sentence: what it is; the
rest: detail); `docs/reference/configuration.md` is generated from them
(`python -m scripts.config_reference`). A choice setting lists its values in the field's
metadata (`_choice`); the lists that a registry implements are its `pdserve.choices` enum.
"""

import dataclasses
import difflib
import functools
import os
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints
from urllib.parse import parse_qsl, unquote, urlsplit

import yaml

from pdserve.choices import (
    AttentionBackendName,
    DTypeName,
    EvictionPolicyName,
    KVCacheDTypeName,
    PrefillPolicyName,
    ToolParserName,
    TransportName,
)
from pdserve.errors import ConfigError

ENV_PREFIX = "PDSERVE_"
ROLES = ("prefill", "decode", "mixed")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")
# Choice lists. The first five are implemented by registries (pdserve.choices says which);
# the others are checked here only.
EVICTION_POLICIES = tuple(EvictionPolicyName)
ATTENTION_BACKENDS = tuple(AttentionBackendName)
TRANSPORTS = tuple(TransportName)
PREFILL_POLICIES = tuple(PrefillPolicyName)
TOOL_PARSERS = tuple(ToolParserName)
DTYPES = tuple(DTypeName)
KV_CACHE_DTYPES = tuple(KVCacheDTypeName)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
STORES = ("directory", "memory")
DEVICE_WRITE_POLICIES = ("on_eviction", "write_through", "off")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
REDIS_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES)
LOG_FORMATS = ("text", "json")
DISAGGREGATION_MODES = ("always", "never", "auto")
# Engine settings a role may not change: KV blocks move between prefill and decode instances
# byte for byte, and the router hashes prompt blocks with the base engine's model, block size
# and dtype, so every role must agree with the base engine on them.
SHARED_ENGINE_FIELDS = ("model", "block_size", "dtype", "kv_cache_dtype", "tensor_parallel_size")
# PDSERVE_* variables read outside this module, so known even though no setting is loaded from
# them: services/controller/admin_cli.py reads PDSERVE_ADMIN_TOKEN without loading a config, and
# services/controller/admin.py falls back to it when admin.token is unset;
# pdserve/model/cpu_kernels.py reads PDSERVE_KERNEL_CACHE (where compiled kernels are cached),
# pdserve/engine/profiling.py PDSERVE_STEP_TIME_CACHE (where step time fits are saved).
EXTERNAL_VARIABLES = frozenset(
    {"PDSERVE_ADMIN_TOKEN", "PDSERVE_KERNEL_CACHE", "PDSERVE_STEP_TIME_CACHE"}
)


def _choice(default: str | None, choices: Iterable[str]) -> Any:
    """A dataclass field whose value must be one of `choices` (or None, when `default` is):
    `_check_choices` enforces it, the configuration reference lists them."""
    return dataclasses.field(default=default, metadata={"choices": tuple(map(str, choices))})


def choices_of(field: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The values a choice setting may take; () for a free setting. Pure."""
    return tuple(field.metadata.get("choices", ()))


def _check_choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")


def _check_choices(config: Any, section: str) -> None:
    """Raise ConfigError for the first choice setting of dataclass `config` whose value is not
    one of its choices (None passes where it is the default)."""
    for field in dataclasses.fields(config):
        choices = choices_of(field)
        value = getattr(config, field.name)
        if choices and not (value is None and field.default is None):
            _check_choice(f"{section}.{field.name}", value, choices)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: the model, its KV cache and the scheduler's limits (every instance, and
    `pdserve generate`)."""

    model: str | None = None
    """Hugging Face model directory; null: the built-in tiny model.

    The directory holds `config.json`, `model.safetensors` (or a sharded index),
    `tokenizer.json` and optionally `tokenizer_config.json`. The tiny model is written to the
    user cache directory on first use."""
    dtype: str = _choice("auto", DTYPES)
    """Weight and KV cache dtype; `auto`: the checkpoint's `torch_dtype`."""
    kv_cache_dtype: str = _choice("auto", KV_CACHE_DTYPES)
    """KV cache element type: `auto` (the model's dtype) or `fp8_e4m3`.

    `fp8_e4m3` stores K and V (or a latent-attention model's latent) as 8-bit floats, each layer's
    planes divided by a scale: the checkpoint's `k_scale`/`v_scale` when it has them, else
    measured at start over a fixed calibration batch (a power of two with 2-4x headroom;
    tensor-parallel ranks agree on the largest). Half a 16-bit cache's bytes per block, on the
    device and on every transfer and in the storage tier. Every role shares it."""
    device: str = "cpu"
    """Device: `cpu`, `cuda` or `cuda:N`.

    Inside a Ray actor the GPU Ray assigned is always `cuda` (`pdserve up` refuses `cuda:N`)."""
    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the fraction of the GPU's memory this instance may use, in (0, 1].

    With neither `num_kv_blocks` nor `kv_cache_bytes` set, the KV cache gets this fraction of the
    GPU's memory less the weights, the activation peak of a profiling forward of
    `max_num_batched_tokens` tokens, and what CUDA holds beyond torch's allocator."""
    kv_cache_bytes: int | None = None
    """KV cache size in bytes; null: sized from `gpu_memory_utilization` (CUDA) or 256 MiB (CPU).

    Wins over `gpu_memory_utilization`."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; null: sized from `kv_cache_bytes`.

    Wins over both `kv_cache_bytes` and `gpu_memory_utilization`. A role that inherits it and
    wants to size otherwise sets `num_kv_blocks: null` in its `engine:` mapping."""
    kv_staging_bytes: int = 256 * 2**20
    """CUDA: pinned host memory through which KV blocks move to and from the GPU.

    Used by gRPC sends, storage write-back and storage loads; Mooncake sends straight from the
    registered GPU cache."""
    max_model_len: int | None = None
    """Context window in tokens; null: the model's, capped to the KV pool (logged).

    An explicit value larger than the KV pool stops the instance at start."""
    max_num_seqs: int = 64
    """Running requests per step.

    On decode, handoffs beyond it wait (their KV kept) and join as places free up. An instance's
    gRPC server gets 2 × this + 32 executor threads for blocking work."""
    max_num_batched_tokens: int = 512
    """Token budget per step; longer prompts are prefilled in chunks."""
    attention_backend: str = _choice("auto", ATTENTION_BACKENDS)
    """Attention implementation; `auto`: `cpu` on CPU where its kernel builds, `triton` on CUDA
    where triton imports, else `reference`.

    `cpu` is pdserve's C++ kernels (compiled with the machine's compiler on first use, cached
    under the user cache directory or `PDSERVE_KERNEL_CACHE`); `reference` gathers K/V and runs
    SDPA (the test oracle); `cpu` and `triton` force one and fail where it cannot run."""
    cuda_graphs: bool | None = None
    """CUDA graphs of the decode forward; null: on for CUDA devices, off on CPU.

    Captured at batch sizes 1, 2, 4, 8, 16, 32, … `max_num_seqs` (a batch is padded up to the
    next size; prefill steps run eagerly). Costs one KV block (the padding's scratch). Refused on
    a CPU device and with `tensor_parallel_size` > 1."""
    enable_prefix_caching: bool = True
    """Reuse computed KV blocks across requests."""
    eviction_policy: str = _choice("lrfu", EVICTION_POLICIES)
    """Which cached block a full KV pool reuses.

    `lrfu`: frequency and recency over the prefix tree (scores halve every `lrfu_half_life_s`
    and outlive eviction); `lru`: the least recently released block first."""
    lrfu_half_life_s: float = 60.0
    """`lrfu`: an admission this many seconds older weighs half as much."""
    lrfu_score_capacity: int = 8
    """`lrfu`: scores kept per KV block (at most this × `num_kv_blocks`; they outlive
    eviction)."""
    torch_threads: int | None = None
    """`torch.set_num_threads` per instance; null: torch's default.

    Set 1 when several instances share a small machine: OpenMP threads that spin against each
    other cost 10× or more."""
    onednn_cache_entries: int = 128
    """CPU: compiled matrix kernels oneDNN keeps per process (0: none).

    oneDNN compiles a kernel for each weight shape and number of batch rows, 0.3 to 0.6 MB
    each. torch's default of 1024 grows a CPU instance by up to about 0.5 GB, a little more
    with each new batch size, for hours. 128 was as fast on varied batches
    (`benchmarks/kernel_cache.py`). The first engine of a process sets it for the process."""
    tensor_parallel_size: int = 1
    """Ranks (one device each) one instance's model is split across.

    It must divide the model's attention and KV heads. Every role shares it (a KV block's layout
    depends on it)."""
    expert_parallel_size: int = 1
    """Ranks a mixture-of-experts model's experts are spread over, whole experts each.

    1: every rank holds a `1 / tensor_parallel_size` slice of every expert (as of the dense
    MLPs). Else it must equal `tensor_parallel_size` (the experts share the instance's ranks,
    whose attention stays split by heads) and divide the model's experts."""
    tp_timeout_s: float = 60.0
    """Longest wait of one tensor-parallel collective before the instance's requests fail.

    Covers all-reduces, the logits gather and the step broadcast; the requests fail with
    `TensorParallelError`. An idle worker waits for the next step without limit."""
    tp_start_timeout_s: float = 600.0
    """Longest wait for every rank to start, and again for every rank to load its weights.

    A rank that exits meanwhile fails the start at once. `pdserve up` waits up to twice this
    (at least 10 minutes) for each instance to serve."""
    seed: int = 0
    """Sampler seed for requests without their own `seed`."""
    step_profile_s: float = 10.0
    """Longest profiling pass at an instance's start: synthetic batches that seed its model of
    step times (refined by every served step); skipped when a fit of the same model, device
    and settings is saved from an earlier start. 0: no pass, the model learns from served
    steps only."""

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_staging_bytes",
            "tensor_parallel_size",
            "expert_parallel_size",
        )
        optional = ("kv_cache_bytes", "num_kv_blocks", "max_model_len", "torch_threads")
        for name in (*positive, *optional):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {value}")
        _check_choices(self, "engine")
        if self.onednn_cache_entries < 0:
            raise ConfigError(
                f"engine.onednn_cache_entries must be >= 0, got {self.onednn_cache_entries}"
            )
        if not self.lrfu_half_life_s > 0 or self.lrfu_score_capacity < 1:
            raise ConfigError(
                "engine.lrfu_half_life_s must be positive and engine.lrfu_score_capacity >= 1"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "engine.gpu_memory_utilization is the fraction of the GPU's memory this "
                f"instance may use: (0, 1], got {self.gpu_memory_utilization}"
            )
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"engine.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 <= self.step_profile_s <= 600:
            raise ConfigError(
                f"engine.step_profile_s must be in [0, 600] seconds, got {self.step_profile_s}"
            )
        for name in ("tp_timeout_s", "tp_start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.expert_parallel_size not in (1, self.tensor_parallel_size):
            raise ConfigError(
                f"engine.expert_parallel_size {self.expert_parallel_size} must be 1 or "
                f"engine.tensor_parallel_size ({self.tensor_parallel_size}): the experts are "
                "spread over the instance's tensor-parallel ranks"
            )
        if self.cuda_graphs and self.tensor_parallel_size > 1:
            raise ConfigError(
                "engine.cuda_graphs is not supported with tensor_parallel_size > 1 yet: leave "
                "it unset (off for tensor-parallel instances) or set it to false"
            )
        if self.cuda_graphs and self.device == "cpu":
            raise ConfigError(
                "engine.cuda_graphs needs a CUDA device (engine.device is cpu): leave it unset "
                "or set it to false"
            )


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Prefill instances (PD mode): they compute a prompt's KV and first token and send the KV
    to a decode instance."""

    replicas: int = 1
    """Prefill instances `pdserve up` starts."""
    num_cpus: float = 1.0
    """Ray CPUs of each instance (of each rank with `engine.tensor_parallel_size` > 1)."""
    num_gpus: float = 0.0
    """Ray GPUs of each instance (of each rank); a fraction shares one GPU.

    Checked against `engine.device` before Ray starts: `cuda` needs `num_gpus` > 0, `cpu` needs
    0, and above 1 is refused (more GPUs per instance is `engine.tensor_parallel_size`)."""
    reserve_max_attempts: int = 5
    """Reserve calls to a refusing decode instance before the request fails."""
    reserve_max_backoff_s: float = 1.0
    """Cap on the wait between Reserve attempts (decode suggests one)."""
    transfer_chunk_bytes: int = 2**20
    """Size of the gRPC messages that carry KV blocks."""
    kv_ready_timeout_s: float = 300.0
    """Longest wait for a prompt's prefill to complete."""
    engine: EngineConfig | None = None
    """Engine settings of this role only, over the `engine:` section's.

    Any engine setting but `model`, `block_size`, `dtype`, `kv_cache_dtype` and
    `tensor_parallel_size`, which every role shares. Once loaded, the field holds the role's
    whole engine, or null when the role changes nothing (`ClusterConfig.engine_for` resolves
    either)."""


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Decode instances (PD mode): they reserve KV blocks for a prompt, receive its KV and
    generate the rest of the tokens."""

    replicas: int = 1
    """Decode instances `pdserve up` starts."""
    num_cpus: float = 1.0
    """Ray CPUs of each instance (of each rank with `engine.tensor_parallel_size` > 1)."""
    num_gpus: float = 0.0
    """Ray GPUs of each instance (of each rank); a fraction shares one GPU."""
    reserve_horizon_tokens: int | None = 256
    """Growth a reservation keeps room for, per request, in tokens; null: each request's whole
    `max_tokens`.

    A prompt is accepted only if the free blocks left after its own still cover every running
    and reserved request's growth by min(its remaining `max_tokens`, this) tokens."""
    reservation_timeout_s: float = 30.0
    """A reservation whose KV never completes is freed after this many seconds."""
    retry_after_ms: int = 200
    """Retry-after suggested to a refused prefill instance."""
    engine: EngineConfig | None = None
    """Engine settings of this role only, over the `engine:` section's.

    Any engine setting but `model`, `block_size`, `dtype`, `kv_cache_dtype` and
    `tensor_parallel_size`, which every role shares. Once loaded, the field holds the role's
    whole engine, or null when the role changes nothing (`ClusterConfig.engine_for` resolves
    either)."""


@dataclass(frozen=True, slots=True)
class MixedConfig:
    """Mixed instances (no disaggregation): each runs both phases. Set `replicas` > 0 and the
    prefill and decode replicas to 0."""

    replicas: int = 0
    """Mixed instances `pdserve up` starts."""
    num_cpus: float = 1.0
    """Ray CPUs of each instance (of each rank with `engine.tensor_parallel_size` > 1)."""
    num_gpus: float = 0.0
    """Ray GPUs of each instance (of each rank); a fraction shares one GPU."""
    engine: EngineConfig | None = None
    """Engine settings of this role only, over the `engine:` section's.

    Any engine setting but `model`, `block_size`, `dtype`, `kv_cache_dtype` and
    `tensor_parallel_size`, which every role shares. Once loaded, the field holds the role's
    whole engine, or null when the role changes nothing (`ClusterConfig.engine_for` resolves
    either)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The OpenAI-compatible HTTP router, run by `pdserve up`."""

    host: str = "127.0.0.1"
    """Interface the HTTP API binds to."""
    port: int = 8000
    """Port of the HTTP API; 0: any free port."""
    model_name: str | None = None
    """The id clients send as `model`; null: the model directory's name."""
    prefill_policy: str = _choice("cache_aware", PREFILL_POLICIES)
    """How a prefill (or mixed) instance is chosen for a request.

    `cache_aware`: the longest cached prefix, weighed against load; `least_load`: fewest
    in-flight requests; `round_robin`. `pdserve admin policy` switches it at run time."""
    load_weight: float = 0.3
    """`cache_aware`: score = cached tokens − this × in-flight prefill tokens; 0 ignores load."""
    balance_abs_threshold: int = 32
    """`cache_aware` routes to the least loaded instance when in-flight request counts differ by
    more than this and `balance_rel_threshold` holds too."""
    balance_rel_threshold: float = 1.0001
    """`cache_aware` routes to the least loaded instance when the busiest has more than this ×
    the idlest's in-flight requests and `balance_abs_threshold` holds too."""
    max_attempts: int = 3
    """Attempts a request gets: a failure before the first token is retried on other instances
    up to this many attempts in all."""
    retry_backoff_s: float = 0.1
    """First wait between attempts; it doubles after each."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body; a larger one gets 413."""
    stats_interval_s: float = 0.5
    """How often, with `disaggregation: auto`, the instances' stats (their step time models) are
    polled. Their load needs no polling: it comes on their KV-event streams."""
    migration_limit: int = 3
    """Times one stream may continue on another instance after its own died; 0: never."""
    migration_max_tokens: int | None = None
    """Migrate only while prompt + generated tokens are at most this; null: any length."""
    drain_moves_streams: bool = True
    """A drained decode instance's running streams move to other decode instances (each at a
    block boundary of its context, which the next prefill reads back from the drained instance
    instead of computing), so drains, removals, scale-downs and role changes finish within
    seconds. False: they run to their end there (a removal waits up to
    `cluster.drain_timeout_s`, then what is left migrates by recomputing)."""
    tool_parser: str | None = _choice(None, TOOL_PARSERS)
    """How `tool_choice: "auto"` answers are parsed for tool calls; null: the format the chat
    template teaches.

    `hermes`: `<tool_call>{"name", "arguments"}</tool_call>`; `llama3_json`: a bare
    `{"name", "parameters"}` object. With neither set nor found in the template, `"auto"` is a
    400."""
    max_concurrent_requests: int = 4096
    """Generations the router runs at once (each of `n` choices counts); more wait in its
    admission queue."""
    queue_when_waiting: int = 16
    """A prefill (or mixed) instance counts as saturated once this many requests wait there (by
    its load reports, with the router's requests it has not acknowledged), or when it lacks
    free blocks for the prompt (a decode instance: only then). While every candidate of a role
    is saturated, new requests wait in the router's admission queue, lowest `priority` first,
    users taking turns."""
    queue_max_requests: int = 1024
    """Requests the admission queue holds; more get 429 with `Retry-After`."""
    queue_timeout_s: float = 30.0
    """How long a request may wait in the admission queue before it gets 429."""
    replicas: int = 1
    """Router processes serving `port` (SO_REUSEPORT: the kernel spreads connections over
    them); `pdserve up` restarts a dead one as it does instances. One process serves the API
    on one core: raise it when the router's process is busy (its CPU near one core) and the
    host has cores to spare. A request is never split between replicas; each replica has its
    own metrics port (Prometheus discovery lists them)."""
    api_keys: str | None = None
    """A YAML file of API keys (`keys:` entries of `name`, `key` or `key_sha256`, optional
    `rate_per_s` and `priority`), mode 0600, reloaded when it changes. With it every API call
    needs `Authorization: Bearer KEY` (else 401); fairness, limits and metrics go by key name.
    Null: no keys, any caller is served (bind the router to a trusted network)."""
    disaggregation: str = _choice("always", DISAGGREGATION_MODES)
    """Where a request's prompt is computed: `always` on a prefill instance, its KV then moved
    to the decode instance; `never` on the decode instance itself; `auto`, request by request,
    on the decode instance when nothing decodes there and the instances' step time models
    (`GetStats`) predict its first token sooner there (queue, compute and transfer, the
    prompt's cached tokens on each side), else on a prefill instance: short and mostly-cached
    prompts start sooner, and no running request waits for a prompt in its steps."""
    kv_transfer_gbps: float = 1.0
    """KV transfer speed `auto` assumes (GB/s) until a prefill instance has measured its own."""
    kv_pull_min_tokens: int | None = 64
    """When a decode instance holds at least this many more of a prompt's leading tokens than
    the prefill instance chosen for it (a conversation's earlier answers live where they were
    generated), the prefill instance pulls those blocks from it over gRPC instead of computing
    them; a pull that fails or comes back short computes the rest. Null: never pull."""
    breaker_failures: int = 5
    """Failures in a row that open an instance's circuit breaker: the router sends it nothing
    for `breaker_cooldown_s`, then one probe request (its success closes the breaker, its
    failure opens it for twice as long, up to 8×). Independent of liveness: an instance that is
    alive but fails its requests stops taking them. 0: no breakers."""
    breaker_cooldown_s: float = 10.0
    """How long an opened circuit breaker keeps its instance out of routing."""

    def __post_init__(self) -> None:
        _check_choices(self, "router")
        if not self.kv_transfer_gbps > 0:
            raise ConfigError(
                f"router.kv_transfer_gbps must be positive, got {self.kv_transfer_gbps}"
            )
        if self.max_concurrent_requests < 1:
            raise ConfigError("router.max_concurrent_requests must be at least 1")
        if self.queue_when_waiting < 1 or self.queue_max_requests < 0:
            raise ConfigError(
                "router.queue_when_waiting must be at least 1 and router.queue_max_requests "
                ">= 0 (0: refuse instead of queueing)"
            )
        if self.replicas < 1:
            raise ConfigError("router.replicas must be at least 1")
        if not self.queue_timeout_s > 0:
            raise ConfigError("router.queue_timeout_s must be positive")
        if self.breaker_failures < 0 or not self.breaker_cooldown_s > 0:
            raise ConfigError(
                "router.breaker_failures must be >= 0 (0: no breakers) and "
                "router.breaker_cooldown_s positive"
            )
        if self.migration_limit < 0:
            raise ConfigError("router.migration_limit must be >= 0 (0: never migrate)")
        if self.kv_pull_min_tokens is not None and self.kv_pull_min_tokens < 1:
            raise ConfigError("router.kv_pull_min_tokens must be positive (or null: never pull)")
        if self.migration_max_tokens is not None and self.migration_max_tokens < 1:
            raise ConfigError("router.migration_max_tokens must be positive (or unset)")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How KV blocks move from prefill to decode instances."""

    transport: str = _choice("auto", TRANSPORTS)
    """The transport; `auto`: CUDA IPC between GPUs of one host, else shared memory on the same
    host, else Mooncake, else gRPC.

    `grpc`, `shm`, `mooncake` and `cuda_ipc` force one: a request fails if its pair cannot use
    it."""
    shared_memory: bool = True
    """Decode instances keep a CPU KV cache in shared memory (offering `shm`)."""
    mooncake: bool = True
    """Start a Mooncake transfer engine, and register the KV cache with it, when its package
    loads.

    With `cluster.host` on loopback it starts only when `transport` is `mooncake`."""
    mooncake_protocol: str = _choice("tcp", MOONCAKE_PROTOCOLS)
    """Mooncake's protocol: `tcp` or `rdma`."""
    mooncake_devices: str | None = None
    """RDMA devices, e.g. `mlx5_0,mlx5_1`; null for tcp."""
    mooncake_engines: int = 0
    """Mooncake transfer engines a prefill instance sends with (one I/O thread each); 0: auto,
    one per 4 cores, at most 4, and 1 over rdma."""
    max_batch_entries: int = 1024
    """Mooncake transfers in flight per sending instance (the library's TCP queue per peer is
    bounded)."""
    lease_margin_s: float = 2.0
    """Direct writes stop this many seconds before a reservation's lease ends."""
    stall_timeout_s: float = 10.0
    """A gRPC KV transfer that moves no bytes for this long (the receiver stopped reading, the
    network stalls), or a direct write's commit unanswered for this long, is cut: the request is
    retried on another pair, and both sides free its blocks. A transfer that keeps moving bytes
    is never cut, however long it takes."""

    def __post_init__(self) -> None:
        _check_choices(self, "transfer")
        if not self.stall_timeout_s > 0:
            raise ConfigError("transfer.stall_timeout_s must be positive")
        if self.mooncake_engines < 0:
            raise ConfigError("transfer.mooncake_engines must be 0 (auto) or positive")
        if self.max_batch_entries <= 0:
            raise ConfigError("transfer.max_batch_entries must be positive")


# Query options of a Sentinel URL: TLS files, passed to every connection, and the Sentinels'
# own login.
_SENTINEL_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_LOGIN_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """`storage.redis_url` naming a primary through its Sentinels. A secret (its passwords):
    errors about it never echo it."""

    sentinels: tuple[tuple[str, int], ...]
    primary: str  # the name the Sentinels monitor it by
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_options: tuple[tuple[str, str], ...] = ()
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "SentinelURL":
        parts = urlsplit(url)
        if parts.scheme not in SENTINEL_SCHEMES:
            raise ConfigError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        sentinels = tuple(_host_port(item) for item in hosts.split(",") if item)
        if not sentinels:
            raise ConfigError("storage.redis_url names no Sentinel (host:port[,host:port…])")
        primary, _, db = parts.path.strip("/").partition("/")
        if not primary or not (db == "" or db.isdigit()):
            raise ConfigError(
                "storage.redis_url: a Sentinel URL's path is /primary-name or /primary-name/db"
            )
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(options) - {*_SENTINEL_TLS_OPTIONS, *_SENTINEL_LOGIN_OPTIONS})
        if unknown:
            raise ConfigError(
                f"storage.redis_url: unknown Sentinel URL options {unknown}; known: "
                f"{[*_SENTINEL_TLS_OPTIONS, *_SENTINEL_LOGIN_OPTIONS]}"
            )
        return cls(
            sentinels=sentinels,
            primary=unquote(primary),
            db=int(db or 0),
            username=unquote(username) or None,
            password=unquote(password) or None,
            tls=parts.scheme == "rediss+sentinel",
            tls_options=tuple((k, v) for k, v in options.items() if k in _SENTINEL_TLS_OPTIONS),
            sentinel_username=options.get("sentinel_username") or None,
            sentinel_password=options.get("sentinel_password") or None,
        )


def _host_port(item: str) -> tuple[str, int]:
    host, _, port = item.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"storage.redis_url: a Sentinel is host:port, got {item!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """The shared KV storage tier: a Redis index over block stores, shared by every instance."""

    enabled: bool = True
    """Every instance writes blocks back to, and reads them ahead from, the tier."""
    redis_url: str | None = None
    """The index's Redis: `redis://[[user]:password@]host:port/db`, `rediss://` (TLS) or
    `unix://`; a replicated Redis through its Sentinels:
    `redis+sentinel://[[user]:password@]host:port[,host:port…]/primary-name[/db]`
    (`rediss+sentinel://`: TLS to the Sentinels and the Redis servers); null: `pdserve up` starts
    an embedded Redis on the head node. Query options: `ssl_ca_certs=`, `ssl_certfile=`,
    `ssl_keyfile=`, `ssl_cert_reqs=`; for Sentinels that require a login, `sentinel_username=`,
    `sentinel_password=`.

    The URL is printed and logged with its passwords redacted."""
    store: str = _choice("directory", STORES)
    """Where block bytes live: `directory` (one file per block, local disk or a shared
    filesystem) or `memory` (host RAM; peers read it over gRPC)."""
    directory: str | None = None
    """The directory store's root; null: `<user cache dir>/kv-store`, or with the embedded Redis a
    per-run directory deleted at shutdown."""
    shared_directory: bool = False
    """The directory is one filesystem mounted on every node (then every instance reads every
    block)."""
    capacity_bytes: int = 4 * 2**30
    """Bytes per store; the least recently used blocks are evicted beyond it."""
    fsync: bool = True
    """Directory store: a block is durable before it is published."""
    write_back_on_preempt: bool = True
    """A preempted request's computed blocks are written to the tier."""
    device_write_policy: str = _choice("on_eviction", DEVICE_WRITE_POLICIES)
    """Which device blocks are written: those leaving a device cache (`on_eviction`), every
    block as it is computed (`write_through`), or none (`off`)."""
    max_pending_bytes: int = 256 * 2**20
    """Host copies waiting for the writer; beyond, writes are dropped (counted), never waited
    for."""
    grace_period_s: float = 10.0
    """The bytes of a removed entry are deleted this many seconds after (readers never read freed
    bytes)."""
    reconnect_interval_s: float = 2.0
    """While Redis is down, how often to try again."""
    redis_timeout_s: float = 1.0
    """Timeout of one Redis call: a dead Redis must not stall an instance."""

    def __post_init__(self) -> None:
        _check_choices(self, "storage")
        scheme = (self.redis_url or "").partition("://")[0]
        if self.redis_url is not None and scheme not in REDIS_SCHEMES:
            raise ConfigError(  # the URL itself is not echoed: it may hold a password
                "storage.redis_url must start with redis://, rediss://, unix://, "
                f"redis+sentinel:// or rediss+sentinel://, got a URL starting {scheme[:16]!r}"
            )
        if self.redis_url is not None and scheme in SENTINEL_SCHEMES:
            SentinelURL.parse(self.redis_url)
        for name in ("capacity_bytes", "max_pending_bytes", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"storage.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin gRPC API (`pdserve admin`), served by `pdserve up`."""

    host: str = "127.0.0.1"
    """Interface the admin API binds to."""
    port: int = 50050
    """Port of the admin API; 0: any free port."""
    token: str | None = None
    """Bearer token every call must carry; null: a generated one, written (mode 0600) to the
    state directory as `admin_token`."""
    tls_cert: str | None = None
    """PEM certificate: serve TLS instead of plaintext (with `tls_key`)."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The SLA planner: every `interval_s` it forecasts the next interval's load from the
    router's recent requests, predicts each prefill/decode split's latency with the latency
    simulator on the instances' own step time models, and moves the cluster to the smallest
    split that meets the targets (role changes first, then adding or removing instances)."""

    enabled: bool = False
    """Run the planner in `pdserve up` (a disaggregated cluster: prefill + decode instances)."""
    ttft_p90_s: float = 2.0
    """Target: 90 % of requests see their first token within this many seconds."""
    itl_p90_s: float = 0.2
    """Target: 90 % of requests average at most this many seconds per output token after the
    first."""
    interval_s: float = 30.0
    """How often the planner decides; also the window whose arrivals set the forecast rate."""
    history_s: float = 120.0
    """How far back the request lengths it samples from reach (the last 32 served when none
    ended that recently)."""
    min_prefill: int = 1
    """Fewest prefill instances."""
    max_prefill: int = 8
    """Most prefill instances."""
    min_decode: int = 1
    """Fewest decode instances."""
    max_decode: int = 8
    """Most decode instances."""
    min_instances: int = 2
    """Fewest instances in all (a floor of capacity for bursts; with `max_instances` equal,
    the planner only moves instances between the roles)."""
    max_instances: int = 8
    """Most instances in all."""
    cooldown_s: float = 60.0
    """After acting, the planner only watches this long (new instances warm up, the router's
    history fills with the new split's requests)."""
    confirm_intervals: int = 2
    """A change is made once the same split has been chosen this many intervals in a row."""
    headroom: float = 0.15
    """A split the planner moves to must meet the targets at this fraction more load than
    forecast (the forecast's error margin); the current one is kept while it meets them at
    the forecast. The gap between the two keeps a wandering load from toggling splits."""

    def __post_init__(self) -> None:
        positive = {"ttft_p90_s": self.ttft_p90_s, "itl_p90_s": self.itl_p90_s,
                    "interval_s": self.interval_s, "history_s": self.history_s}  # fmt: skip
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"planner.{name} must be > 0, got {value}")
        if self.cooldown_s < 0 or self.confirm_intervals < 1 or not 0 <= self.headroom < 1:
            raise ConfigError(
                "planner.cooldown_s must be >= 0, planner.confirm_intervals >= 1 and "
                "planner.headroom in [0, 1)"
            )
        if not (1 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode
                <= self.max_decode):  # fmt: skip
            raise ConfigError(
                "planner: need 1 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode"
            )
        floor = max(self.min_instances, self.min_prefill + self.min_decode)
        if self.max_instances < floor:
            raise ConfigError(
                f"planner.max_instances ({self.max_instances}) is below min_instances or "
                f"min_prefill + min_decode ({floor})"
            )
        if self.min_instances > self.max_prefill + self.max_decode:
            raise ConfigError("planner.min_instances is above max_prefill + max_decode")


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Traces of every request, the format of log lines, the router's record of recent
    requests (`pdserve admin trace`)."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC collector every process sends its spans to (`http://host:4317`; `https://`
    for TLS); null: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`
    when set, else tracing is off (no span is made, nothing is sent).

    The exporter's other standard variables (`OTEL_EXPORTER_OTLP_HEADERS`, `..._CERTIFICATE`,
    `..._TIMEOUT`, `OTEL_BSP_*`) apply."""
    trace_sample_ratio: float = 1.0
    """Fraction of requests traced when tracing is on (by trace id: every process agrees). A
    request that arrives with a W3C `traceparent` follows its caller's decision instead."""
    log_format: str = _choice("text", LOG_FORMATS)
    """`text`: one human-readable line per record; `json`: one JSON object per line (time,
    level, logger, message, request_id and trace_id when the line is about a request)."""
    request_log: bool = True
    """Log one INFO line per finished request on the router: status, tokens, instances and
    the time of each stage."""
    recent_requests: int = 1024
    """Finished requests whose timeline the router keeps for `pdserve admin trace` (oldest
    dropped first)."""

    def __post_init__(self) -> None:
        _check_choices(self, "observability")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(
                f"observability.trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}"
            )
        if self.recent_requests < 0:
            raise ConfigError("observability.recent_requests must be >= 0 (0: keep none)")
        scheme = (self.otlp_endpoint or "").partition("://")[0]
        if self.otlp_endpoint is not None and scheme not in ("http", "https"):
            raise ConfigError(
                "observability.otlp_endpoint must be an http:// or https:// URL of an OTLP/gRPC "
                f"collector, got one starting {scheme[:16]!r}"
            )


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`pdserve up`: where Ray runs, how instances are placed, secured and kept alive. Holds
    every other section."""

    engine: EngineConfig = EngineConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    mixed: MixedConfig = MixedConfig()
    router: RouterConfig = RouterConfig()
    storage: StorageConfig = StorageConfig()
    transfer: TransferConfig = TransferConfig()
    admin: AdminConfig = AdminConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    planner: PlannerConfig = PlannerConfig()
    ray_address: str | None = None
    """Ray to join: `auto` or `host:port`; null: start a local Ray."""
    namespace: str = "pdserve"
    """Ray namespace of the cluster's named actors."""
    host: str = "127.0.0.1"
    """Interface the instances' gRPC servers (and metrics, and the embedded Redis) bind to.

    On a multi-node cluster set the node's cluster-network address (or `0.0.0.0`: peers then
    dial the node IP)."""
    placement_strategy: str = _choice("PACK", PLACEMENT_STRATEGIES)
    """Ray placement strategy of the placement group that holds every instance.

    With `engine.tensor_parallel_size` > 1 each instance has a STRICT_PACK group of its own
    instead (its ranks on one node)."""
    state_dir: str | None = None
    """Where `up` writes `cluster.json`, the secrets and the scrape targets; null: the user state
    directory.

    It must belong to you and be writable by nobody else."""
    tls_cert: str | None = None
    """PEM certificate of the instance plane's mutual TLS (on every node); set all three
    `tls_*` or none."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    tls_ca: str | None = None
    """PEM CA that signed every instance's and client's certificate."""
    tls_server_name: str = "pdserve-instance"
    """The DNS name the instances' certificate holds."""
    drain_timeout_s: float = 30.0
    """How long shutdown, `admin remove` and scaling down wait for in-flight requests.

    At shutdown new requests get 503 meanwhile."""
    max_restarts: int = 5
    """Times a dead instance (or router replica) is recreated within `restart_window_s`; then
    `up` reports it and serves with what is left."""
    restart_window_s: float | None = 600.0
    """The window `max_restarts` counts restarts in: an instance (or router replica) not
    restarted for this long has its whole budget again (null: a lifetime budget)."""
    restart_backoff_s: float = 1.0
    """Wait before recreating a dead instance (or router replica); it doubles after each failed
    try."""

    def __post_init__(self) -> None:
        _check_choices(self, "cluster")
        if self.max_restarts < 0 or self.restart_backoff_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError(
                "cluster.max_restarts, cluster.restart_backoff_s and cluster.drain_timeout_s "
                "must be >= 0"
            )
        if self.restart_window_s is not None and self.restart_window_s <= 0:
            raise ConfigError("cluster.restart_window_s must be > 0 (null: a lifetime budget)")
        if self.planner.enabled and self.mixed.replicas:
            raise ConfigError(
                "planner.enabled needs a disaggregated cluster (prefill + decode instances): "
                "it splits them between the roles; mixed.replicas must be 0"
            )
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ConfigError(
                "cluster.tls_cert, cluster.tls_key and cluster.tls_ca go together: set all three "
                "(mutual TLS for the instance plane) or none"
            )
        for role in ROLES:
            engine = self.engine_for(role)
            self._check_devices(role, engine)
            for name in SHARED_ENGINE_FIELDS:
                if getattr(engine, name) != getattr(self.engine, name):
                    raise ConfigError(
                        f"{role}.engine.{name} ({getattr(engine, name)!r}) differs from "
                        f"engine.{name} ({getattr(self.engine, name)!r}): every role shares "
                        f"{', '.join(SHARED_ENGINE_FIELDS)}; set them in the engine: section only"
                    )

    def _check_devices(self, role: str, engine: EngineConfig) -> None:
        """A role's `engine.device` must match the GPUs Ray gives its actors (`num_gpus`),
        before Ray starts. Inside an actor the GPU Ray assigns is `cuda` (its first visible
        device); a fraction of one GPU shares it between actors."""
        section: PrefillConfig | DecodeConfig | MixedConfig = getattr(self, role)
        if section.replicas == 0:
            return
        gpus, device = section.num_gpus, engine.device
        if device != "cpu" and gpus == 0:
            raise ConfigError(
                f"{role}.engine.device is {device!r} but {role}.num_gpus is 0: Ray would give "
                f"its actors no GPU; set {role}.num_gpus (1, or a fraction to share one)"
            )
        if device == "cpu" and gpus > 0:
            raise ConfigError(
                f"{role}.num_gpus is {gpus:g} but {role}.engine.device is cpu: the GPUs would "
                f"sit unused; set engine.device: cuda (or num_gpus: 0)"
            )
        if device.startswith("cuda:") and device != "cuda:0":
            raise ConfigError(
                f"{role}.engine.device is {device!r}: inside a Ray actor its GPU is the first "
                "visible one (the controller puts it first in CUDA_VISIBLE_DEVICES); use "
                "device: cuda"
            )
        if gpus > 1:
            raise ConfigError(
                f"{role}.num_gpus is {gpus:g}: it is the GPUs of one rank; to split an instance "
                "across several GPUs set engine.tensor_parallel_size (one GPU per rank)"
            )

    def engine_for(self, role: str) -> EngineConfig:
        """The engine settings of `role` instances: the role's resolved `engine` settings, or the
        base `engine` when the role overrides none. Pure. Raises ConfigError for a role not in
        ROLES."""
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        section: PrefillConfig | DecodeConfig | MixedConfig = getattr(self, role)
        return self.engine if section.engine is None else section.engine


SECTIONS: dict[str, type] = {
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "mixed": MixedConfig,
    "router": RouterConfig,
    "storage": StorageConfig,
    "transfer": TransferConfig,
    "admin": AdminConfig,
    "planner": PlannerConfig,
    "observability": ObservabilityConfig,
}  # the YAML sections set by PDSERVE_<SECTION>_<SETTING>; `engine` and `cluster` have no prefix


def load_cluster_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ClusterConfig:
    """ClusterConfig from a YAML file, then `PDSERVE_*` variables of `env` (default os.environ),
    then `overrides` of cluster fields (None values ignored); see the module docstring. Reads
    `path`; mutates nothing. Raises ConfigError for an unreadable file, an unknown section, key or
    `PDSERVE_*` variable, or an invalid value."""
    env = os.environ if env is None else env
    check_environment(env)
    document = _yaml_document(Path(path)) if path is not None else {}
    unknown = sorted(set(document) - {"engine", "cluster", *SECTIONS})
    if unknown:
        raise ConfigError(
            f"unknown config section(s) in {path}: {', '.join(unknown)}; "
            f"known: engine, {', '.join(SECTIONS)}, cluster"
        )
    engine = _build(EngineConfig, _section(document, "engine", path), env, "engine")
    sections: dict[str, Any] = {"engine": engine}
    for name, cls in SECTIONS.items():
        values = _section(document, name, path)
        section_overrides: dict[str, Any] = {}
        if name in ROLES:
            section_overrides["engine"] = _role_engine(engine, name, values, env, path)
        sections[name] = _build(cls, values, env, name, section_overrides)
    cluster = _section(document, "cluster", path)
    return _build(ClusterConfig, cluster, env, "cluster", {**dict(overrides or {}), **sections})


def load_engine_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Build an EngineConfig from the `engine:` section of a YAML file, then `PDSERVE_<FIELD>`
    variables of `env` (default os.environ), then `overrides` (e.g. CLI flags; None values are
    ignored). Raises ConfigError like load_cluster_config, also for any `PDSERVE_*` variable that
    load_cluster_config would not know."""
    env = os.environ if env is None else env
    check_environment(env)
    document = _yaml_document(Path(path)) if path is not None else {}
    return _build(EngineConfig, _section(document, "engine", path), env, "engine", overrides)


def check_environment(env: Mapping[str, str]) -> None:
    """Raise ConfigError naming every `PDSERVE_*` variable of `env` that is not in
    known_variables(), each with the closest known name. Pure."""
    known = known_variables()
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)
    if not unknown:
        return
    # Compared without the common prefix, which would make every name look close.
    suffixes = [name.removeprefix(ENV_PREFIX) for name in known]
    described = []
    for name in unknown:
        closest = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1)
        described.append(f"{name} (did you mean {ENV_PREFIX}{closest[0]}?)" if closest else name)
    raise ConfigError(
        f"unknown environment variable(s): {'; '.join(described)}. Unset or rename them: engine "
        "and cluster settings are PDSERVE_<SETTING>, other sections PDSERVE_<SECTION>_<SETTING>, "
        "a role's engine settings PDSERVE_<ROLE>_ENGINE_<SETTING>"
    )


@functools.cache
def known_variables() -> frozenset[str]:
    """Every `PDSERVE_*` variable the loaders read, plus EXTERNAL_VARIABLES."""
    sections = {
        "engine": EngineConfig,
        **SECTIONS,
        **{f"{role}.engine": EngineConfig for role in ROLES},
        "cluster": ClusterConfig,
    }
    names = {
        variable_name(where, name) for where, cls in sections.items() for name in settings_of(cls)
    }
    return frozenset(names | EXTERNAL_VARIABLES)


def variable_name(section: str, setting: str) -> str:
    """The `PDSERVE_*` variable that sets `setting` of `section` (`engine`, `cluster`, a
    SECTIONS name, or `<role>.engine`): `PDSERVE_<SETTING>` for engine and cluster settings,
    `PDSERVE_<SECTION>_<SETTING>` for the others, `PDSERVE_<ROLE>_ENGINE_<SETTING>` for a role's
    engine. Pure."""
    unprefixed = section in ("engine", "cluster")
    prefix = "" if unprefixed else section.replace(".", "_").upper() + "_"
    return f"{ENV_PREFIX}{prefix}{setting.upper()}"


def _role_engine(
    base: EngineConfig,
    role: str,
    section: dict[str, Any],
    env: Mapping[str, str],
    path: str | Path | None,
) -> EngineConfig | None:
    """The engine of `role`: `base`, then the `engine` mapping popped from the role's `section`,
    then `PDSERVE_<ROLE>_ENGINE_<FIELD>` variables; None when neither sets anything."""
    mapping = section.pop("engine", None) or {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{role}.engine in {path} must be a mapping of engine settings")
    values = _values(EngineConfig, mapping, env, f"{role}.engine")
    if not values:
        return None
    try:
        return dataclasses.replace(base, **values)
    except ConfigError as e:
        raise ConfigError(f"{role}.engine (over the engine: section): {e}") from e


T = TypeVar("T")


def _build(
    cls: type[T],
    file_values: dict[str, Any],
    env: Mapping[str, str],
    where: str,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Instantiate dataclass `cls` (the `where` section): file values, then its `PDSERVE_*`
    variables (`variable_name`), then `overrides` (None values ignored); each later source
    wins."""
    values = _values(cls, file_values, env, where)
    hints = get_type_hints(cls)
    for name, value in (overrides or {}).items():
        if value is not None:
            if name not in hints:
                raise ConfigError(f"unknown {where} setting: {name}")
            is_section = _is_section(hints[name])
            values[name] = value if is_section else _coerce(value, hints[name], f"{where}.{name}")
    return cls(**values)


def _values(
    cls: type, file_values: dict[str, Any], env: Mapping[str, str], where: str
) -> dict[str, Any]:
    """The settings of `cls` (the `where` section) that `file_values` or their `PDSERVE_*`
    variables set (a variable wins over the file), coerced to their field types."""
    settings = settings_of(cls)
    unknown = sorted(set(file_values) - set(settings))
    if unknown:
        raise ConfigError(_unknown_keys(where, unknown, settings))
    values: dict[str, Any] = {}
    for name, hint in settings.items():
        variable = variable_name(where, name)
        if variable in env:
            values[name] = _coerce(env[variable], hint, f"${variable}")
        elif name in file_values:
            values[name] = _coerce(file_values[name], hint, f"{where}.{name}")
    return values


def _unknown_keys(where: str, unknown: list[str], settings: Mapping[str, Any]) -> str:
    described = []
    for key in unknown:
        closest = difflib.get_close_matches(str(key), settings, n=1)
        hint = f" (did you mean {where}.{closest[0]}?)" if closest else ""
        described.append(f"{where}.{key}{hint}")
    return f"unknown {where} setting(s): {', '.join(described)}"


def settings_of(cls: type) -> dict[str, Any]:
    """Field name -> type of the scalar settings of dataclass `cls` (nested sections excluded)."""
    return {name: hint for name, hint in get_type_hints(cls).items() if not _is_section(hint)}


def _is_section(hint: Any) -> bool:
    """Whether a field of type `hint` holds a config section (a dataclass, optionally None)."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    return any(dataclasses.is_dataclass(option) for option in options)


def _yaml_document(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(document, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections")
    return document


def _section(document: dict[str, Any], section: str, path: str | Path | None) -> dict[str, Any]:
    content = document.get(section) or {}
    if not isinstance(content, dict):
        raise ConfigError(f"section {section!r} of {path} must be a mapping")
    return dict(content)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert `value` (YAML scalar or env string) to the field type `hint`."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
        if type(None) in options:
            return None
        raise ConfigError(f"{where} must be set")
    for option in options:
        if option is type(None):
            continue
        converted = _convert(value, option)
        if converted is not None:
            return converted
    names = "/".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{where} must be {names}, got {value!r}")


def _convert(value: Any, target: type) -> Any:
    if target is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    if target is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
            text
        )
    if target is int and not isinstance(value, bool):
        try:
            return int(value)
        except (TypeError, ValueError):
            return None
    if target is str and isinstance(value, str | int | float):
        return str(value)
    return None
