"""KV cache manager micro-benchmarks: prefix match of a long cached prompt, allocate + free.

    python benchmarks/kvcache_ops.py [--quick]

`match_us` is the time of `KVCacheManager.match_prefix` for a fully cached 32k-token prompt
(block hashes precomputed, as the engine does when a request is created); target <= 1 ms.
`alloc_free_per_s` counts allocate + free pairs of a 64-block request per second. A plain loop of
dict lookups over the same hashes is timed alongside as the machine's baseline.
"""

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from _common import finish, median_seconds, parse_args, print_table, repeats

from pdserve.kvcache.hashing import BlockHash, BlockHasher
from pdserve.kvcache.manager import KVCacheManager

NAME = "kvcache_ops"
BLOCK_SIZE = 16
MATCH_TARGET_US = 1000.0
MIXED_SIZES = (1, 4, 16, 64, 256)  # blocks per request in the mixed allocate + free run


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """The smallest object satisfying `CacheRequest`."""

    request_id: str
    num_tokens: int
    block_hashes: Sequence[BlockHash] = field(default_factory=list)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=32 * 1024, help="prompt length to match")
    parser.add_argument("--alloc-blocks", type=int, default=64, help="blocks per allocate")


def bench_match(num_tokens: int, repeat: int) -> dict[str, float]:
    """µs to hash the prompt, to match it against the cache, and for a bare dict-lookup loop."""
    tokens = [(i * 7919 + 13) % 50_000 for i in range(num_tokens)]
    hasher = BlockHasher.for_model(BLOCK_SIZE, "bench")
    hash_s = median_seconds(lambda: hasher.hash_tokens(tokens), repeat=repeat)
    hashes = hasher.hash_tokens(tokens)

    num_blocks = len(hashes)
    manager = KVCacheManager(2 * num_blocks + 16, BLOCK_SIZE)
    writer = BenchRequest("writer", num_tokens, hashes)
    manager.allocate(writer, num_tokens)
    published = manager.update_cache_blocks(writer, num_tokens)
    manager.free(writer.request_id)
    assert published == num_blocks, (published, num_blocks)

    reader = BenchRequest("reader", num_tokens, hashes)
    match = manager.match_prefix(reader)
    expected = (num_tokens - 1) // BLOCK_SIZE  # a hit never covers the last token
    assert len(match.block_ids) == expected, (len(match.block_ids), expected)
    number = 50
    match_s = median_seconds(lambda: manager.match_prefix(reader), repeat=repeat, number=number)

    block_of = {h: i for i, h in enumerate(hashes)}
    wanted = hashes[:expected]

    def dict_loop() -> list[int]:
        found = []
        for block_hash in wanted:
            block_id = block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    dict_s = median_seconds(dict_loop, repeat=repeat, number=number)
    manager.check_integrity()
    return {
        "num_tokens": num_tokens,
        "matched_blocks": len(match.block_ids),
        "hash_us": hash_s * 1e6,
        "match_us": match_s * 1e6,
        "baseline_dict_loop_us": dict_s * 1e6,
        "match_vs_baseline": match_s / dict_s,
    }


def bench_alloc_free(sizes: Sequence[int], repeat: int, ops: int) -> float:
    """allocate + free pairs per second, cycling through requests of `sizes` blocks."""
    manager = KVCacheManager(4 * max(sizes) + 16, BLOCK_SIZE)
    requests = [BenchRequest(f"r{i}", n * BLOCK_SIZE) for i, n in enumerate(sizes)]
    cycle = list(itertools.islice(itertools.cycle(requests), ops))

    def run() -> None:
        for request in cycle:
            manager.allocate(request, request.num_tokens)
            manager.free(request.request_id)

    seconds = median_seconds(run, repeat=repeat)
    manager.check_integrity()
    return ops / seconds


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=5, full=11)
    ops = 1_000 if args.quick else 5_000

    match = bench_match(args.tokens, repeat)
    fixed = bench_alloc_free([args.alloc_blocks], repeat, ops)
    mixed = bench_alloc_free(MIXED_SIZES, repeat, ops)
    verdict = "PASS" if match["match_us"] <= MATCH_TARGET_US else "FAIL"

    print_table(
        f"KVCacheManager, block size {BLOCK_SIZE}, median of {repeat}",
        ["operation", "figure", "unit", "note"],
        [
            ["hash_tokens", match["hash_us"], "µs", f"{args.tokens} tokens, for information"],
            [
                "match_prefix",
                match["match_us"],
                "µs",
                f"{match['matched_blocks']} blocks; target <= {MATCH_TARGET_US:.0f} µs: {verdict}",
            ],
            [
                "dict-loop baseline",
                match["baseline_dict_loop_us"],
                "µs",
                f"match is {match['match_vs_baseline']:.2f}x the bare lookup loop",
            ],
            ["allocate+free", fixed, "ops/s", f"{args.alloc_blocks} blocks per request"],
            ["allocate+free", mixed, "ops/s", f"mixed sizes {list(MIXED_SIZES)} blocks"],
        ],
    )
    print(f"\nmatch_prefix of {args.tokens} cached tokens: {match['match_us']:.1f} µs -> {verdict}")
    results = {
        "match": match,
        "match_target_us": MATCH_TARGET_US,
        "match_pass": verdict == "PASS",
        "alloc_free_per_s": {"fixed_blocks": args.alloc_blocks, "fixed": fixed, "mixed": mixed},
        "mixed_sizes_blocks": list(MIXED_SIZES),
        "repeat": repeat,
        "ops_per_sample": ops,
    }
    metrics = {
        "match_us": match["match_us"],
        "alloc_free_per_s": fixed,
        "hash_us": match["hash_us"],
    }
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()
