"""Router overhead: µs per routing decision, and requests/s the HTTP router proxies.

    python benchmarks/router_overhead.py [--quick]

`decision_us` is one `cache_aware` routing decision for a 4k-token prompt (256 blocks of 16
tokens) among 16 prefill instances whose KV-event index holds ~100k distinct blocks:
`KVEventIndex.overlaps` + `LoadTracker.snapshot` + `CacheAwarePolicy.choose`. The prompt is fully
cached on one instance and partly on others, so the chain walk visits all 256 blocks (the worst
case). Hashing the prompt (`BlockHasher.hash_tokens`) is **excluded** from `decision_us` and
reported on its own row (`hash_us`): the router hashes once per request whatever the policy.
Target: decision_us <= 200. A bare loop of dict lookups over the same 256 hashes is timed as the
machine's baseline.

`proxy_rps` (requests/s through the OpenAI HTTP router with instant fake instances) is reported as
nan until the HTTP router exists; it is never estimated.
"""

import argparse
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from _common import finish, median_seconds, parse_args, print_table, repeats

from pdserve.kvcache.events import BlockRemoved, BlockStored
from pdserve.kvcache.hashing import BlockHash, BlockHasher
from services.router.kv_index import KVEventIndex
from services.router.load import Lease, LoadTracker
from services.router.policies import (
    Decision,
    PolicyConfig,
    RouteReason,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)

NAME = "router_overhead"
BLOCK_SIZE = 16
SYSTEM_TOKENS = 1024  # shared by every conversation, held by every instance
FILLER_CHAIN_BLOCKS = 192  # length of the other conversations filling the index
DECISION_TARGET_US = 200.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=16, help="prefill instances")
    parser.add_argument("--indexed-blocks", type=int, default=100_000, help="distinct blocks")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True, slots=True)
class Setup:
    index: KVEventIndex
    tracker: LoadTracker
    leases: list[Lease]
    instances: tuple[str, ...]
    tokens: list[int]
    hashes: list[BlockHash]
    hasher: BlockHasher


def build(args: argparse.Namespace) -> Setup:
    """An index of ~`indexed_blocks` blocks over `instances`; two in-flight requests each."""
    rng = random.Random(args.seed)
    hasher = BlockHasher.for_model(BLOCK_SIZE, "bench-model")
    instances = tuple(f"10.0.{i // 256}.{i % 256}:50051" for i in range(args.instances))
    tokens = [rng.randrange(32_000) for _ in range(args.tokens)]
    tokens[:SYSTEM_TOKENS] = [7 + i % 100 for i in range(SYSTEM_TOKENS)]
    hashes = hasher.hash_tokens(tokens)
    system = hashes[: SYSTEM_TOKENS // BLOCK_SIZE]

    index = KVEventIndex()
    for i, instance_id in enumerate(instances):
        # instance 0 holds the whole prompt, 1 three quarters, 2 half, the others the system part
        held = max(len(system), len(hashes) * (4 - min(i, 4)) // 4)
        index.apply(instance_id, BlockStored(tuple(hashes[:held])))
    while len(index) < args.indexed_blocks:
        filler = tuple(BlockHash(os.urandom(32)) for _ in range(FILLER_CHAIN_BLOCKS))
        for instance_id in rng.sample(instances, rng.randint(1, 3)):
            index.apply(instance_id, BlockStored((*system, *filler)))

    tracker = LoadTracker()
    leases = [tracker.acquire(instance_id, 256) for instance_id in instances for _ in range(2)]
    return Setup(index, tracker, leases, instances, tokens, hashes, hasher)


def decide(setup: Setup, policy: RoutingPolicy, hashes: Sequence[BlockHash]) -> Decision:
    """One routing decision as the router makes it, prompt hashes already computed."""
    request = RouteRequest("bench", len(setup.tokens), BLOCK_SIZE)
    overlaps = setup.index.overlaps(hashes, setup.instances)
    return policy.choose(setup.instances, request, setup.tracker.snapshot(), overlaps)


def bench_decisions(setup: Setup, repeat: int, number: int) -> dict[str, float]:
    """µs per decision for three prompts, per component for the worst case, and a baseline."""
    policy = make_policy("cache_aware", PolicyConfig())
    hit = decide(setup, policy, setup.hashes)
    assert (hit.instance_id, hit.reason) == (setup.instances[0], RouteReason.CACHE_HIT), hit
    miss_hashes = setup.hasher.hash_tokens([t + 1 for t in setup.tokens])
    system_only = [*setup.hashes[: SYSTEM_TOKENS // BLOCK_SIZE], *miss_hashes[64:]]

    def timed(fn: Callable[[], object]) -> float:
        return median_seconds(fn, repeat=repeat, number=number) * 1e6

    request = RouteRequest("bench", len(setup.tokens), BLOCK_SIZE)
    overlaps = setup.index.overlaps(setup.hashes, setup.instances)
    loads = setup.tracker.snapshot()
    holders = {h: 1 for h in setup.hashes}
    return {
        "decision_us": timed(lambda: decide(setup, policy, setup.hashes)),
        "decision_system_prefix_us": timed(lambda: decide(setup, policy, system_only)),
        "decision_miss_us": timed(lambda: decide(setup, policy, miss_hashes)),
        "overlaps_us": timed(lambda: setup.index.overlaps(setup.hashes, setup.instances)),
        "snapshot_us": timed(setup.tracker.snapshot),
        "choose_us": timed(lambda: policy.choose(setup.instances, request, loads, overlaps)),
        "lease_us": timed(lambda: setup.tracker.acquire(setup.instances[0], 100).release()),
        "baseline_dict_loop_us": timed(lambda: [holders.get(h, 0) & 1 for h in setup.hashes]),
        "hash_us": median_seconds(lambda: setup.hasher.hash_tokens(setup.tokens), repeat=repeat)
        * 1e6,
    }


def bench_events(setup: Setup, repeat: int, number: int) -> float:
    """µs to apply one 16-block BlockStored plus its BlockRemoved to the full index."""
    blocks = tuple(BlockHash(os.urandom(32)) for _ in range(16))
    instance_id = setup.instances[-1]

    def store_and_remove() -> None:
        setup.index.apply(instance_id, BlockStored(blocks))
        setup.index.apply(instance_id, BlockRemoved(blocks))

    return median_seconds(store_and_remove, repeat=repeat, number=number) * 1e6


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=5, full=11)
    number = 200 if args.quick else 1000
    setup = build(args)
    figures = bench_decisions(setup, repeat, number)
    event_us = bench_events(setup, repeat, number)
    setup.index.check_integrity()
    for lease in setup.leases:
        lease.release()
    setup.tracker.check_integrity()

    decision_us = figures["decision_us"]
    verdict = "PASS" if decision_us <= DECISION_TARGET_US else "FAIL"
    num_blocks = len(setup.hashes)
    print_table(
        f"cache_aware routing, {args.instances} instances, {len(setup.index):,} indexed blocks, "
        f"{args.tokens}-token prompt ({num_blocks} blocks), median of {repeat}",
        ["operation", "µs", "note"],
        [
            [
                "decision, full hit",
                decision_us,
                f"{num_blocks}-block walk; target <= 200: {verdict}",
            ],
            ["decision, system prefix", figures["decision_system_prefix_us"], "64-block walk"],
            ["decision, miss", figures["decision_miss_us"], "walk stops at block 0"],
            ["  overlaps", figures["overlaps_us"], "KVEventIndex.overlaps, full hit"],
            ["  loads snapshot", figures["snapshot_us"], "LoadTracker.snapshot"],
            ["  policy choose", figures["choose_us"], "CacheAwarePolicy.choose"],
            ["lease acquire+release", figures["lease_us"], "per request, not in decision"],
            ["hash prompt", figures["hash_us"], "BlockHasher.hash_tokens, not in decision"],
            ["dict-loop baseline", figures["baseline_dict_loop_us"], f"{num_blocks} lookups"],
            ["apply KV events", event_us, "16-block store + remove"],
        ],
    )
    print(f"\ndecision (hashing excluded): {decision_us:.1f} µs -> {verdict}")
    print(
        "proxy_rps: not measured (nan) — the HTTP router (services/router/app.py) does not exist "
        "yet; it is measured once it does."
    )
    results = {
        **figures,
        "apply_event_pair_us": event_us,
        "decision_vs_baseline": decision_us / figures["baseline_dict_loop_us"],
        "decision_target_us": DECISION_TARGET_US,
        "decision_pass": verdict == "PASS",
        "hashing_in_decision": False,
        "indexed_blocks": len(setup.index),
        "prompt_blocks": num_blocks,
        "repeat": repeat,
        "calls_per_sample": number,
        "proxy_rps_note": "not measured: the HTTP router does not exist yet",
    }
    finish(NAME, args, results, {"decision_us": decision_us, "proxy_rps": float("nan")})


if __name__ == "__main__":
    main()
