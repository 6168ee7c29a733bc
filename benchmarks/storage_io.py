"""Storage tier I/O: the directory store against plain files, and prefetch latency per block.

    python benchmarks/storage_io.py [--quick] [--blocks N] [--block-bytes B] [--no-fsync]

Write: `DirectoryStore.put` of `--blocks` blocks (256; 64 KiB each, the tiny model's fp32 block of
16 tokens) into a fresh directory (temporary file, fsync, rename: what makes a published block
durable) against plain `open(path, "wb").write(data)` + fsync of the same bytes, one file per
block, into another fresh directory of the same filesystem. `--no-fsync` drops the fsync on both
sides (page-cache speed). Read: `DirectoryStore.get` of those blocks against `Path.read_bytes`
of the plain files (both from the page cache, just written). Sides alternate round by round.
`write_ratio` / `read_ratio` = median over rounds of store GB/s / plain GB/s (target >= 0.7).

Prefetch: `StorageTier.read_chain` of a `--blocks`-block hash chain written through the tier (one
Redis lookup of the whole chain on an embedded Redis, then read + CRC-32 check of every block);
`prefetch_us_per_block` = median seconds / blocks.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import finish, median, parse_args, print_table, repeats

from pdserve.config import StorageConfig
from pdserve.kvcache.hashing import BlockHash
from pdserve.rpc.auth import new_secret
from pdserve.storage import DirectoryStore, StorageTier
from pdserve.storage.redis_server import EmbeddedRedis

NAME = "storage_io"
RATIO_TARGET = 0.7
GB = 1e9


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=256, help="blocks per round")
    parser.add_argument("--block-bytes", type=int, default=64 * 1024, help="bytes per block")
    parser.add_argument("--no-fsync", action="store_true", help="no fsync on either side")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")


def payloads(count: int, size: int) -> list[bytes]:
    seed = os.urandom(size)
    return [bytes([n % 256]) + seed[1:] for n in range(count)]


def plain_write(root: Path, blocks: list[bytes], fsync: bool) -> float:
    start = time.perf_counter()
    for n, data in enumerate(blocks):
        with open(root / f"b{n}", "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - start


def plain_read(root: Path, count: int) -> float:
    start = time.perf_counter()
    for n in range(count):
        (root / f"b{n}").read_bytes()
    return time.perf_counter() - start


def store_write(store: DirectoryStore, blocks: list[bytes]) -> tuple[float, list[str]]:
    keys = [store.new_key(f"{n:064x}") for n in range(len(blocks))]
    start = time.perf_counter()
    for key, data in zip(keys, blocks, strict=True):
        store.put(key, memoryview(data))
    return time.perf_counter() - start, keys


def store_read(store: DirectoryStore, keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        store.get(key)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=3, full=9)
    count = 64 if args.quick else args.blocks
    fsync = not args.no_fsync
    blocks = payloads(count, args.block_bytes)
    base = Path(tempfile.mkdtemp(prefix="pdserve-storage-io-", dir=args.dir))
    try:
        samples = bench_store(base, blocks, repeat, fsync)
        prefetch_us = bench_prefetch(base / "tier", blocks, repeat, fsync)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    pairs = zip(samples["store_w"], samples["plain_w"], strict=True)
    write_ratio = median([s / p for s, p in pairs])
    pairs = zip(samples["store_r"], samples["plain_r"], strict=True)
    read_ratio = median([s / p for s, p in pairs])
    medians = {k: median(v) for k, v in samples.items()}
    verdict = "PASS" if min(write_ratio, read_ratio) >= RATIO_TARGET else "FAIL"
    print_table(
        f"Directory store vs plain files: {count} blocks of {args.block_bytes} bytes, "
        f"fsync {'on' if fsync else 'off'}, median of {repeat}",
        ["path", "write GB/s", "read GB/s"],
        [
            ["DirectoryStore", medians["store_w"], medians["store_r"]],
            ["plain files", medians["plain_w"], medians["plain_r"]],
            ["ratio", write_ratio, read_ratio],
        ],
    )
    print(f"\nprefetch (Redis chain lookup + read + CRC-32): {prefetch_us:.1f} us per block")
    print(f"write_ratio {write_ratio:.3f}, read_ratio {read_ratio:.3f}: target >= 0.7 -> {verdict}")
    finish(
        NAME,
        args,
        {"samples_gbps": samples, "fsync": fsync, "blocks": count, "verdict": verdict},
        {
            "write_ratio": write_ratio,
            "read_ratio": read_ratio,
            "prefetch_us_per_block": prefetch_us,
            "store_write_gbps": medians["store_w"],
            "store_read_gbps": medians["store_r"],
        },
    )


def bench_store(
    base: Path, blocks: list[bytes], repeat: int, fsync: bool
) -> dict[str, list[float]]:
    """GB/s per round of store and plain writes and reads (the order alternates each round)."""
    total = sum(len(b) for b in blocks)
    samples: dict[str, list[float]] = {"store_w": [], "plain_w": [], "store_r": [], "plain_r": []}
    for round_ in range(repeat + 1):  # round 0 warms up
        store = DirectoryStore(base / f"store{round_}", fsync=fsync)
        plain = base / f"plain{round_}"
        plain.mkdir()
        if round_ % 2:
            plain_s = plain_write(plain, blocks, fsync)
            store_s, keys = store_write(store, blocks)
        else:
            store_s, keys = store_write(store, blocks)
            plain_s = plain_write(plain, blocks, fsync)
        reads = (store_read(store, keys), plain_read(plain, len(blocks)))
        if round_:
            samples["store_w"].append(total / store_s / GB)
            samples["plain_w"].append(total / plain_s / GB)
            samples["store_r"].append(total / reads[0] / GB)
            samples["plain_r"].append(total / reads[1] / GB)
        shutil.rmtree(store.root)
        shutil.rmtree(plain)
    return samples


def bench_prefetch(root: Path, blocks: list[bytes], repeat: int, fsync: bool) -> float:
    """Median microseconds per block of `read_chain` over a chain of len(blocks) blocks."""
    redis = EmbeddedRedis().start()
    tier: StorageTier | None = None
    try:
        config = StorageConfig(redis_url=redis.url, directory=str(root), fsync=fsync)
        tier = StorageTier(config, "bench", DirectoryStore(root, fsync=fsync), secret=new_secret())
        hashes = [BlockHash(n.to_bytes(32, "big")) for n in range(len(blocks))]
        tier.write(list(zip(hashes, blocks, strict=True)))
        tier.flush()
        seconds = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            found = tier.read_chain(hashes)
            seconds.append(time.perf_counter() - start)
            if len(found) != len(blocks):
                raise RuntimeError(f"read {len(found)} of {len(blocks)} blocks back")
        return 1e6 * median(seconds[1:]) / len(blocks)
    finally:
        if tier is not None:
            tier.close()
        redis.close()


if __name__ == "__main__":
    main()
