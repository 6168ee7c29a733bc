"""Reference hit rates for one cache of a given size: unlimited, and Belady's offline optimum.

Both see the same prefix rule as the real cache (a hit is the longest cached prefix of a
request's chain, never its last token) and no concurrency. Belady evicts the block whose next use
is farthest away, ties deepest block first (a deep block is worth least: it is only reachable
through its parents), so the optimum is not understated.
"""

import heapq
import math
from collections.abc import Container, Sequence

from services.simulator.replay import Tally
from services.simulator.trace import TraceRecord


def _chains(records: Sequence[TraceRecord], block_tokens: int) -> list[tuple[tuple[int, ...], int]]:
    """(full-block hash ids, how many of them a hit may cover) per request."""
    chains = []
    for r in records:
        full = r.hash_ids[: r.input_length // block_tokens]
        chains.append((full, max(0, r.input_length - 1) // block_tokens))
    return chains


def unlimited(records: Sequence[TraceRecord], block_tokens: int) -> Tally:
    seen: set[int] = set()
    tally = Tally()
    for chain, hittable in _chains(records, block_tokens):
        tally.add(len(chain), _leading(chain[:hittable], seen), 0)
        seen.update(chain)
    return tally


def belady(records: Sequence[TraceRecord], block_tokens: int, capacity: int) -> Tally:
    chains = _chains(records, block_tokens)
    next_use = _next_uses(chains)
    cached: dict[int, tuple[float, int]] = {}  # hash id -> (next use, depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, hash id), lazily invalidated
    tally = Tally()
    for index, (chain, hittable) in enumerate(chains):
        tally.add(len(chain), _leading(chain[:hittable], cached), 0)
        for depth, h in enumerate(chain):
            key = (next_use[index][depth], depth)
            cached[h] = key
            heapq.heappush(heap, (-key[0], -depth, h))
        while len(cached) > capacity:
            far, deep, h = heapq.heappop(heap)
            if cached.get(h) == (-far, -deep):
                del cached[h]
    return tally


def _leading(chain: Sequence[int], cache: Container[int]) -> int:
    """How many leading blocks of `chain` the cache holds (a prefix hit)."""
    for count, h in enumerate(chain):
        if h not in cache:
            return count
    return len(chain)


def _next_uses(chains: Sequence[tuple[tuple[int, ...], int]]) -> list[list[float]]:
    """For each request and chain position, the index of the next request using that hash."""
    upcoming: dict[int, float] = {}
    result: list[list[float]] = [[] for _ in chains]
    for index in range(len(chains) - 1, -1, -1):
        chain, _ = chains[index]
        result[index] = [upcoming.get(h, math.inf) for h in chain]
        for h in chain:
            upcoming[h] = index
    return result
