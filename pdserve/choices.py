"""The names a choice setting may take: one StrEnum per list, each the key type of the registry
that implements it.

`pdserve.config` validates settings against these lists, and sits below the packages that
implement them (`kvcache`, `model`, `transfer`) and may not import `services` at all; so the
names live here, below every one of them. Each implementing registry is keyed by its enum and
checked against it when its module is imported (`registry`, or an exhaustive `match` that mypy
checks):

* `DTypeName`: `engine.dtype`, `pdserve.model.config.parse_dtype` (every name but `auto`);
* `EvictionPolicyName`: `engine.eviction_policy`, built by
  `pdserve.kvcache.eviction.make_eviction_policy`;
* `AttentionBackendName`: `engine.attention_backend`, `pdserve.model.attention.make_backend`;
* `TransportName`: `transfer.transport`, `pdserve.transfer.select.TransportSelector`;
* `PrefillPolicyName`: `router.prefill_policy`, `services.router.policies.POLICIES`;
* `ToolParserName`: `router.tool_parser`, `services.router.tool_calls.PARSERS`.

A member is its name as a string (a StrEnum), so it compares equal to the setting's value and is
usable as a metric label.
"""

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar


class DTypeName(StrEnum):
    """The dtype of a model's weights and KV cache; `auto` takes the checkpoint's."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class KVCacheDTypeName(StrEnum):
    """The KV cache's element type: `auto`, the model's dtype; `fp8_e4m3`, 8-bit floats with a
    scale per layer and plane (half a 16-bit cache's bytes)."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"


class EvictionPolicyName(StrEnum):
    """Which cached block a full KV pool reuses."""

    LRU = "lru"
    LRFU = "lrfu"


class AttentionBackendName(StrEnum):
    """The attention implementation an engine runs."""

    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"
    TRITON = "triton"


class TransportName(StrEnum):
    """How KV blocks move from a prefill to a decode instance."""

    AUTO = "auto"
    GRPC = "grpc"
    SHM = "shm"
    MOONCAKE = "mooncake"
    CUDA_IPC = "cuda_ipc"


class PrefillPolicyName(StrEnum):
    """How the router picks a prefill (or mixed) instance."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"


class ToolParserName(StrEnum):
    """The format `tool_choice: "auto"` answers are parsed in for tool calls."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


_E = TypeVar("_E", bound=StrEnum)
_T = TypeVar("_T")


def registry(names: type[_E], entries: Mapping[_E, _T]) -> dict[str, _T]:
    """`entries` as a dict by name, after checking that they implement exactly the members of
    `names`. Raises TypeError (at the registry's import) naming what is missing or extra."""
    missing = sorted(str(key) for key in set(names) - set(entries))
    extra = sorted(str(key) for key in set(entries) - set(names))
    if missing or extra:
        raise TypeError(
            f"the registry of {names.__name__} must implement exactly its members: "
            f"missing {missing}, extra {extra}"
        )
    return {str(key): value for key, value in entries.items()}
