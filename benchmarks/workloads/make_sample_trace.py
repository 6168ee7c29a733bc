"""Write a small synthetic trace in the Mooncake format for `serve_load.py --trace`.

    python benchmarks/workloads/make_sample_trace.py [--shape chat|documents] [--seed 0] [--out F]

One JSON object per line, sorted by time:
    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}
Each hash id stands for one 512-token block of the prompt; equal ids mean equal blocks. The last
id of a record covers its partial last block: when a later turn of the same session fills that
block, the full block gets a new id (its content differs), as in the published Mooncake traces.

Shape: `--sessions` chat sessions start uniformly over the first half of `--duration-s` (120 s);
each picks one of `--prefixes` shared system prefixes (1-3 blocks: ids 0..), then runs 2-6 turns
separated by exponential think times (mean `--think-s`, 10 s). A turn's prompt is the previous
prompt + the previous answer + a new user message (64-640 tokens); answers are 16-128 tokens.
Prompt + answer stay below 4,000 tokens so that every record also fits the built-in tiny model's
4,096-token context at the format's own 512-token blocks. On the 2-core CPU box that is slow
(prompts of up to 3,900 tokens); replay with `--block-tokens 64` (every length scaled by 64/512)
and a `--time-scale` below 1 to compress the think times, e.g.

    python benchmarks/serve_load.py --trace benchmarks/workloads/sample_trace.jsonl \\
        --block-tokens 64 --time-scale 0.25

Shape `documents` (questions over shared documents: retrieval-augmented generation, few-shot
templates, agents' tool specifications): `--documents` (32) documents of 3-6 blocks (ids 0..);
`--requests` (320) requests arrive as a Poisson process over `--duration-s`, each asks about one
document drawn uniformly: its prompt is the document + a question of 64-448 tokens (one fresh
id), answers 16-64 tokens. Every document is wanted again and again, by requests far apart.

The committed `sample_trace.jsonl` and `documents_trace.jsonl` are this script's output with the
defaults of each shape.
"""

import argparse
import json
import random
from pathlib import Path
from typing import Any

BLOCK = 512
MAX_TOTAL = 4000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=("chat", "documents"), default="chat")
    parser.add_argument("--sessions", type=int, default=32, help="chat")
    parser.add_argument("--documents", type=int, default=32, help="documents")
    parser.add_argument("--requests", type=int, default=320, help="documents")
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--think-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: <shape's name>_trace.jsonl here")
    args = parser.parse_args()
    if args.out is None:
        name = "sample" if args.shape == "chat" else args.shape
        args.out = Path(__file__).resolve().parent / f"{name}_trace.jsonl"
    records = chat_records(args) if args.shape == "chat" else document_records(args)
    records.sort(key=lambda r: r["timestamp"])
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} records to {args.out}")


def document_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    documents = []
    next_id = 0
    for _ in range(args.documents):
        blocks = rng.randint(3, 6)
        documents.append(list(range(next_id, next_id + blocks)))
        next_id += blocks
    records = []
    now = 0.0
    for _ in range(args.requests):
        now += rng.expovariate(args.requests / args.duration_s)
        document = rng.choice(documents)
        records.append(
            {
                "timestamp": round(now * 1000),
                "input_length": len(document) * BLOCK + rng.randint(64, 448),
                "output_length": rng.randint(16, 64),
                "hash_ids": [*document, next_id],  # the question: a partial block of its own
            }
        )
        next_id += 1
    return records


def chat_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)

    next_id = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    prefixes = []
    for _ in range(args.prefixes):
        blocks = rng.randint(1, 3)
        prefixes.append([new_id() for _ in range(blocks)])

    records = []
    for _ in range(args.sessions):
        prefix = rng.choice(prefixes)
        full_ids = list(prefix)  # ids of the session's full blocks so far
        length = len(prefix) * BLOCK  # tokens of the session so far (prefix = full blocks)
        now = rng.uniform(0, args.duration_s / 2)
        for _turn in range(rng.randint(2, 6)):
            length += rng.randint(64, 640)  # the new user message
            output = rng.randint(16, 128)
            if length + output >= MAX_TOTAL:
                break
            while len(full_ids) < length // BLOCK:  # blocks that became full get their ids
                full_ids.append(new_id())
            partial = [new_id()] if length % BLOCK else []
            records.append(
                {
                    "timestamp": round(now * 1000),
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": full_ids + partial,
                }
            )
            length += output  # the answer joins the conversation
            now += rng.expovariate(1 / args.think_s)

    return records


if __name__ == "__main__":
    main()
