"""Where a latency simulation's instances come from: a running cluster's instances (each one's
step time fit and KV pool, as `pdserve admin list --json` prints them) or a cluster config with
a step time model (a built-in one, or a JSON file of coefficients)."""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.perf_model import FEATURES
from pdserve.errors import InvalidRequestError
from services.simulator.latency import ClusterSpec, InstanceProfile


def _preset(
    coefficients: tuple[float, ...], kv_bytes_per_token: int, context: int
) -> dict[str, Any]:
    return {"coefficients": dict(zip(FEATURES, coefficients, strict=True)),
            "kv_bytes_per_token": kv_bytes_per_token, "max_model_len": context}  # fmt: skip


# Step time fits measured by `benchmarks/perf_model.py` (2 torch threads on a 2-core AMD EPYC,
# AVX2; benchmarks/results/perf_model.json): the built-in tiny model, and the ~156M-parameter
# random Llama of `vs_vllm.py` (8 layers). Seconds per step, per prefill token, per 1k token
# pairs of prefill attention, per decode row, per 1k KV tokens decode rows attend.
STEP_MODELS: dict[str, dict[str, Any]] = {
    "tiny-cpu": _preset((3.45e-3, 6.88e-5, 4.64e-5, 1.85e-4, 1.44e-4), 2_048, 4_096),
    "156m-cpu": _preset((2.37e-2, 1.29e-3, 3.26e-4, 1.63e-3, 1.88e-3), 8_192, 2_048),
}


def step_model(name_or_path: str) -> dict[str, Any]:
    """A built-in step model, or a JSON file: `{"coefficients": {feature: seconds}}` (a
    `StepTimeFit` as GetStats exports it; `kv_bytes_per_token`, `max_model_len` optional)."""
    if name_or_path in STEP_MODELS:
        return STEP_MODELS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise InvalidRequestError(
            f"--step-model {name_or_path!r}: not a file nor a built-in model "
            f"({', '.join(STEP_MODELS)})"
        )
    try:
        model = json.loads(path.read_text())
        coefficients = {name: float(model["coefficients"][name]) for name in FEATURES}
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequestError(
            f"{path}: not a step time model: needs coefficients {', '.join(FEATURES)} ({e})"
        ) from e
    return {**model, "coefficients": coefficients}


def from_config(
    config: ClusterConfig, model: Mapping[str, Any], kv_blocks: int | None
) -> dict[str, InstanceProfile]:
    """Each role's profile: its engine settings, the step model, a KV pool of `kv_blocks`
    (default: `engine.num_kv_blocks`, else the KV cache bytes over the model's block
    bytes)."""
    profiles = {}
    for role in ("prefill", "decode", "mixed"):
        engine = config.engine_for(role)
        block_bytes = int(model.get("kv_bytes_per_token", 2_048)) * engine.block_size
        blocks = kv_blocks or engine.num_kv_blocks or (engine.kv_cache_bytes or 256 * 2**20)
        if not (kv_blocks or engine.num_kv_blocks):
            blocks = int(blocks) // block_bytes
        context = engine.max_model_len or int(model.get("max_model_len", 2_048))
        profiles[role] = _profile(engine, model["coefficients"], blocks, block_bytes, context)
    return profiles


def from_instances(path: Path, config: ClusterConfig) -> tuple[dict[str, InstanceProfile],
                                                                 dict[str, int]]:  # fmt: skip
    """Each role's profile from a running cluster's instances (`pdserve admin list --json`:
    the first instance of the role whose stats carry a step time fit) and the number of
    instances of each role there."""
    try:
        instances = json.loads(path.read_text())["instances"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidRequestError(
            f"{path}: not the JSON of `pdserve admin list --json` ({e})"
        ) from e
    return from_listing(instances, config, str(path))


def measured_messages(path: Path) -> tuple[float, tuple[float, ...]]:
    """The router's measured time of one message between processes, one way, in a
    `pdserve admin list --json` file: its median (0 when it measured none) and quantiles."""
    try:
        listing = json.loads(path.read_text())
        quantiles = tuple(float(s) for s in listing.get("message_quantiles", ()))
        return float(listing.get("message_s", 0.0)), quantiles
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise InvalidRequestError(
            f"{path}: not the JSON of `pdserve admin list --json` ({e})"
        ) from e


def from_listing(
    instances: Sequence[Mapping[str, Any]], config: ClusterConfig, source: str = "the cluster"
) -> tuple[dict[str, InstanceProfile], dict[str, int]]:
    """`from_instances` of the instances as `ListInstances` describes them (each message as
    JSON with the proto's field names). Raises InvalidRequestError when none has a fit."""
    profiles: dict[str, InstanceProfile] = {}
    counts: dict[str, int] = {}
    for instance in instances:
        role, stats = instance.get("role", ""), instance.get("stats") or {}
        counts[role] = counts.get(role, 0) + 1
        step_time = stats.get("step_time", {})
        fit = step_time.get("coefficients", {})
        if role in profiles or not all(name in fit for name in FEATURES):
            continue
        engine = config.engine_for(role)
        block_size = int(stats.get("block_size", engine.block_size))
        context = engine.max_model_len or int(stats["num_blocks"]) * block_size
        profiles[role] = _profile(
            engine,
            {name: float(fit[name]) for name in FEATURES},
            int(stats["num_blocks"]),
            int(stats.get("kv_block_bytes", 0)),
            context,
            block_size=block_size,
            budget=int(stats.get("max_num_batched_tokens", engine.max_num_batched_tokens)),
            max_num_seqs=int(stats.get("max_num_seqs", engine.max_num_seqs)),
            step_gap_s=float(stats.get("step_gap_seconds", 0.0))
            / max(1, int(stats.get("step_gaps", 0))),
            step_ratios=tuple(float(r) for r in step_time.get("ratio_quantiles", ())),
        )
    if not profiles:
        raise InvalidRequestError(f"{source}: no instance reports a step time fit")
    return profiles, counts


def _profile(
    engine: EngineConfig,
    coefficients: Mapping[str, float],
    num_blocks: int,
    block_bytes: int,
    max_model_len: int,
    *,
    block_size: int | None = None,
    budget: int | None = None,
    max_num_seqs: int | None = None,
    step_gap_s: float = 0.0,
    step_ratios: tuple[float, ...] = (),
) -> InstanceProfile:
    return InstanceProfile(
        num_blocks=num_blocks,
        block_size=block_size or engine.block_size,
        max_num_seqs=max_num_seqs or engine.max_num_seqs,
        max_num_batched_tokens=budget or engine.max_num_batched_tokens,
        coefficients=dict(coefficients),
        kv_block_bytes=block_bytes,
        max_model_len=max_model_len,
        eviction_policy=engine.eviction_policy,
        lrfu_half_life_s=engine.lrfu_half_life_s,
        lrfu_score_capacity=engine.lrfu_score_capacity,
        step_gap_s=step_gap_s,
        step_ratios=step_ratios,
    )


def measured_link_gbps(instances: Sequence[Mapping[str, Any]]) -> float | None:
    """The KV transfer speed (GB/s) prefill instances measured (None: no transfer yet)."""
    sent = seconds = 0.0
    for instance in instances:
        stats = instance.get("stats") or {}
        if instance.get("role") == "prefill":
            sent += sum(float(v) for v in stats.get("kv_bytes_sent_by_transport", {}).values())
            seconds += sum(
                float(v) for v in stats.get("kv_transfer_seconds_by_transport", {}).values()
            )
    return sent / seconds / 1e9 if sent and seconds else None


def cluster_spec(
    config: ClusterConfig,
    profiles: Mapping[str, InstanceProfile],
    counts: Mapping[str, int],
    transfer_gbps: float | None,
    vocab_size: int,
    rpc_s: float = 0.0,
    rpc_draws_s: tuple[float, ...] = (),
) -> ClusterSpec:
    """The simulated cluster: `counts` instances per role (missing roles: none) with the
    config's role, router and transfer settings, `rpc_s` per message between processes (or
    one drawn from `rpc_draws_s`)."""
    return ClusterSpec(
        profiles=dict(profiles),
        prefill=counts.get("prefill", 0),
        decode=counts.get("decode", 0),
        mixed=counts.get("mixed", 0),
        router=config.router,
        prefill_config=config.prefill,
        decode_config=config.decode,
        transfer_gbps=transfer_gbps or config.router.kv_transfer_gbps,
        vocab_size=vocab_size,
        rpc_s=rpc_s,
        rpc_draws_s=rpc_draws_s,
    )
