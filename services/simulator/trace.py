"""Traces: JSON lines in the format public serving traces use, and the built-in workloads.

A record is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
[...]}`; each hash id stands for one block of the prompt (`block_tokens` tokens, 512 in the
published Mooncake traces) and equal ids mean equal blocks with equal prefixes. The last id may
cover a partial block.
"""

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import InvalidRequestError

BUILT_IN = ("conversations", "documents", "shifting")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRecord]:
    """Read a JSON-lines trace, sorted by timestamp. Raises InvalidRequestError naming the first
    bad line."""
    records = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                record = TraceRecord(
                    float(item["timestamp"]),
                    int(item["input_length"]),
                    int(item["output_length"]),
                    tuple(int(h) for h in item["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidRequestError(f"{path}:{number}: not a trace record ({e})") from e
            if record.input_length <= 0 or record.output_length < 0:
                raise InvalidRequestError(f"{path}:{number}: lengths must be positive")
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    return sorted(records, key=lambda r: r.timestamp_ms)


class _Ids:
    def __init__(self) -> None:
        self._next = 0

    def new(self, count: int) -> list[int]:
        start = self._next
        self._next += count
        return list(range(start, start + count))


def conversations(
    requests: int = 12_000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    sessions_per_minute: float = 120.0,
    think_s: float = 30.0,
) -> list[TraceRecord]:
    """Multi-turn conversations with realistic reuse: sessions arrive as a Poisson process, each
    starts from one of a few shared system prompts (Zipf-popular), a third of them attach one of
    many long documents (also Zipf-popular), then run 1-12 turns separated by exponential think
    times; a turn's prompt is the whole conversation so far plus a new message."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.new(rng.randint(1, 4)) for _ in range(8)]
    documents = [ids.new(rng.randint(4, 24)) for _ in range(400)]
    records: list[TraceRecord] = []
    start_s = 0.0
    while len(records) < requests:
        start_s += rng.expovariate(sessions_per_minute / 60)
        chain = list(systems[_zipf(rng, len(systems))])
        if rng.random() < 0.35:
            chain += documents[_zipf(rng, len(documents))]
        tail = 0  # tokens in the chain's partial last block
        at_s = start_s
        for _ in range(rng.randint(1, 12)):
            message = rng.randint(20, 800)
            chain, tail = _extend(chain, tail, message, block_tokens, ids)
            output = rng.randint(16, 600)
            length = (len(chain) - (1 if tail else 0)) * block_tokens + tail
            records.append(TraceRecord(at_s * 1000, length, output, tuple(chain)))
            chain, tail = _extend(chain, tail, output, block_tokens, ids)
            at_s += output * 0.02 + rng.expovariate(1 / think_s)
    records.sort(key=lambda r: r.timestamp_ms)
    return records[:requests]


def documents(
    requests: int = 12_000, *, seed: int = 0, block_tokens: int = 512, rate_per_s: float = 4.0
) -> list[TraceRecord]:
    """Questions over shared documents (retrieval, few-shot templates, tool specifications):
    each request is a popular document (Zipf) plus a fresh question."""
    rng = random.Random(seed)
    ids = _Ids()
    docs = [ids.new(rng.randint(3, 16)) for _ in range(1000)]
    records = []
    at_s = 0.0
    for _ in range(requests):
        at_s += rng.expovariate(rate_per_s)
        chain = docs[_zipf(rng, len(docs))]
        question = rng.randint(64, 448)
        length = len(chain) * block_tokens + question
        records.append(TraceRecord(at_s * 1000, length, rng.randint(16, 256),
                                   (*chain, *ids.new(1))))  # fmt: skip
    return records


def shifting(
    requests: int = 12_000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    phase_s: float = 120.0,
    rag_rate_per_s: float = 4.0,
    chat_rate_per_s: float = 4.0,
) -> list[TraceRecord]:
    """A load whose mix moves: prompt-heavy retrieval (a popular document of 2-7 blocks and a
    fresh question of 64-448 tokens, answers of 16-64 tokens), then output-heavy chat (one of
    a few one-block system prompts and a message of 32-256 tokens, answers of 128-512 tokens),
    then retrieval again, and so on, each phase `phase_s` long with Poisson arrivals at its
    own rate. What a planner must follow: the first phase wants prefill instances, the second
    decode instances."""
    rng = random.Random(seed)
    ids = _Ids()
    docs = [ids.new(rng.randint(2, 7)) for _ in range(300)]
    systems = [ids.new(1) for _ in range(4)]
    records: list[TraceRecord] = []
    at_s = 0.0
    while len(records) < requests:
        rag = int(at_s // phase_s) % 2 == 0
        at_s += rng.expovariate(rag_rate_per_s if rag else chat_rate_per_s)
        if rag:
            chain, fresh, output = docs[_zipf(rng, len(docs))], rng.randint(64, 448), (16, 64)
        else:
            chain, fresh, output = systems[_zipf(rng, 4)], rng.randint(32, 256), (128, 512)
        length = len(chain) * block_tokens + fresh
        records.append(TraceRecord(at_s * 1000, length, rng.randint(*output),
                                   (*chain, *ids.new(1))))  # fmt: skip
    return records


def built_in(name: str, requests: int, seed: int, block_tokens: int) -> list[TraceRecord]:
    if name == "conversations":
        return conversations(requests, seed=seed, block_tokens=block_tokens)
    if name == "documents":
        return documents(requests, seed=seed, block_tokens=block_tokens)
    if name == "shifting":
        return shifting(requests, seed=seed, block_tokens=block_tokens)
    raise InvalidRequestError(f"unknown workload {name!r}; built in: {', '.join(BUILT_IN)}")


def _extend(
    chain: list[int], tail: int, tokens: int, block_tokens: int, ids: _Ids
) -> tuple[list[int], int]:
    """The chain after `tokens` more: a partial last block is replaced (its content changed)."""
    if tail:
        chain = chain[:-1]
    total = tail + tokens
    full, rest = divmod(total, block_tokens)
    return chain + ids.new(full + (1 if rest else 0)), rest


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index in [0, n) drawn with probability ~ 1/(rank^s)."""
    cumulative = _ZIPF_CACHE.get((n, s))
    if cumulative is None:
        cumulative = _ZIPF_CACHE[(n, s)] = list(
            itertools.accumulate(1 / (k + 1) ** s for k in range(n))
        )
    return rng.choices(range(n), cum_weights=cumulative)[0]


_ZIPF_CACHE: dict[tuple[int, float], list[float]] = {}
