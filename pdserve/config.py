"""Typed, validated configuration: YAML file -> PDSERVE_* environment -> explicit overrides.

Each later source wins. Unknown keys and values of the wrong type are ConfigErrors that name the
key and the source, so a typo in a deployment file fails at start-up, not at the first request.
"""

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

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


def load_engine_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Build an EngineConfig from the `engine:` section of a YAML file, then `PDSERVE_<FIELD>`
    variables, then `overrides` (e.g. CLI flags; None values are ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        values |= _yaml_section(Path(path), "engine")
    env = os.environ if env is None else env
    hints = get_type_hints(EngineConfig)
    for name in hints:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _coerce(raw, hints[name], f"${ENV_PREFIX}{name.upper()}")
    values |= {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"unknown engine setting(s): {', '.join(unknown)}")
    for name, value in values.items():
        values[name] = _coerce(value, hints[name], f"engine.{name}")
    return EngineConfig(**values)


def _yaml_section(path: Path, section: str) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(document, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections")
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
