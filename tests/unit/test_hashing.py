"""Chained block hashing: deterministic across processes, chained, full blocks only."""

import json
import os
import random
import subprocess
import sys

from pdserve.kvcache.hashing import BlockHash, BlockHasher, PromptHashes, hash_block, root_hash

BLOCK_SIZE = 4
TOKEN_LISTS: list[list[int]] = [
    [],
    [1, 2, 3],
    [1, 2, 3, 4],
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    list(range(100, 140)),
    [0, 2**32 - 1, 7, 7, 7, 7, 65535, 1],
]

_CHILD_SCRIPT = """
import json, sys
from pdserve.kvcache.hashing import BlockHasher
token_lists = json.loads(sys.argv[1])
hasher = BlockHasher.for_model(int(sys.argv[2]), sys.argv[3])
print(json.dumps([[h.hex() for h in hasher.hash_tokens(t)] for t in token_lists]))
"""


def _hex_chains(hasher: BlockHasher, token_lists: list[list[int]]) -> list[list[str]]:
    return [[h.hex() for h in hasher.hash_tokens(tokens)] for tokens in token_lists]


def _hashes_in_subprocess(token_lists: list[list[int]], hash_seed: int) -> list[list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    args = [json.dumps(token_lists), str(BLOCK_SIZE), "model-a"]
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD_SCRIPT, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: list[list[str]] = json.loads(completed.stdout)
    return result


def test_hash_tokens_equal_across_processes_with_different_hash_seeds() -> None:
    in_process = _hex_chains(BlockHasher.for_model(BLOCK_SIZE, "model-a"), TOKEN_LISTS)
    current = os.environ.get("PYTHONHASHSEED")
    seeds = [s for s in random.Random().sample(range(1, 2**32 - 1), 3) if str(s) != current][:2]
    for seed in seeds:
        assert _hashes_in_subprocess(TOKEN_LISTS, seed) == in_process, f"PYTHONHASHSEED={seed}"


def test_hash_tokens_deterministic_when_called_twice() -> None:
    first = BlockHasher.for_model(BLOCK_SIZE, "m").hash_tokens(list(range(40)))
    second = BlockHasher.for_model(BLOCK_SIZE, "m").hash_tokens(list(range(40)))
    assert first == second
    assert all(isinstance(h, bytes) and len(h) == 32 for h in first)


def test_hash_tokens_changes_every_later_hash_when_block0_token_changes() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    tokens = list(range(5 * BLOCK_SIZE))
    changed = list(tokens)
    changed[1] = 999
    original_hashes = hasher.hash_tokens(tokens)
    changed_hashes = hasher.hash_tokens(changed)
    assert len(original_hashes) == len(changed_hashes) == 5
    assert all(a != b for a, b in zip(original_hashes, changed_hashes, strict=True))


def test_hash_tokens_keeps_earlier_hashes_when_later_block_changes() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    tokens = list(range(4 * BLOCK_SIZE))
    changed = list(tokens)
    changed[2 * BLOCK_SIZE] = 999
    original_hashes = hasher.hash_tokens(tokens)
    changed_hashes = hasher.hash_tokens(changed)
    assert original_hashes[:2] == changed_hashes[:2]
    assert all(a != b for a, b in zip(original_hashes[2:], changed_hashes[2:], strict=True))


def test_hash_tokens_differ_when_model_tag_differs() -> None:
    tokens = list(range(3 * BLOCK_SIZE))
    hashes_a = BlockHasher.for_model(BLOCK_SIZE, "model-a").hash_tokens(tokens)
    hashes_b = BlockHasher.for_model(BLOCK_SIZE, "model-b").hash_tokens(tokens)
    assert set(hashes_a).isdisjoint(hashes_b)


def test_hash_tokens_differ_when_root_differs() -> None:
    tokens = list(range(2 * BLOCK_SIZE))
    plain = BlockHasher(BLOCK_SIZE, root_hash()).hash_tokens(tokens)
    keyed = BlockHasher(BLOCK_SIZE, root_hash(("x",))).hash_tokens(tokens)
    split_keys = BlockHasher(BLOCK_SIZE, root_hash(("a", "bc"))).hash_tokens(tokens)
    joined_keys = BlockHasher(BLOCK_SIZE, root_hash(("ab", "c"))).hash_tokens(tokens)
    assert plain != keyed
    assert split_keys != joined_keys


def test_hash_tokens_equal_to_manual_chain_of_hash_block() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    tokens = list(range(3 * BLOCK_SIZE))
    parent = hasher.root
    expected: list[BlockHash] = []
    for start in range(0, len(tokens), BLOCK_SIZE):
        parent = hash_block(parent, tokens[start : start + BLOCK_SIZE])
        expected.append(parent)
    assert hasher.hash_tokens(tokens) == expected


def test_hash_tokens_hashes_only_full_blocks_when_last_block_partial() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    assert hasher.hash_tokens([]) == []
    assert hasher.hash_tokens([1] * (BLOCK_SIZE - 1)) == []
    for extra in range(BLOCK_SIZE):
        tokens = list(range(3 * BLOCK_SIZE + extra))
        hashes = hasher.hash_tokens(tokens)
        assert len(hashes) == 3
        assert hashes == hasher.hash_tokens(tokens[: 3 * BLOCK_SIZE])


def test_extend_incremental_equals_hash_tokens_of_whole() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    rng = random.Random(1234)
    for _ in range(50):
        tokens = [rng.randrange(0, 50) for _ in range(rng.randrange(0, 40))]
        hashes: list[BlockHash] = []
        end = 0
        while end < len(tokens):
            end = min(len(tokens), end + rng.randrange(1, 7))
            hasher.extend(hashes, tokens[:end])
            assert hashes == hasher.hash_tokens(tokens[:end])
        assert hashes == hasher.hash_tokens(tokens)


def test_extend_appends_nothing_when_no_new_full_block() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    tokens = list(range(2 * BLOCK_SIZE + 1))
    hashes = hasher.hash_tokens(tokens)
    before = list(hashes)
    hasher.extend(hashes, tokens + [7] * (BLOCK_SIZE - 2))
    assert hashes == before


def test_hash_tokens_leaves_input_unmodified() -> None:
    hasher = BlockHasher.for_model(BLOCK_SIZE, "m")
    tokens = list(range(3 * BLOCK_SIZE + 2))
    snapshot = list(tokens)
    hasher.hash_tokens(tokens)
    hashes = hasher.hash_tokens(tokens[:BLOCK_SIZE])
    hasher.extend(hashes, tokens)
    assert tokens == snapshot
    assert hashes == hasher.hash_tokens(snapshot)


def _chain(hasher: BlockHasher, tokens: list[int]) -> PromptHashes:
    return PromptHashes(hasher.root, hasher.block_size, tuple(hasher.hash_tokens(tokens)))


def test_a_sent_chain_of_the_same_hasher_is_adopted() -> None:
    hasher = BlockHasher.for_model(16, "m")
    tokens = list(range(100, 260))
    assert hasher.adopt(_chain(hasher, tokens), tokens) == hasher.hash_tokens(tokens)


def test_a_chain_of_another_model_block_size_or_prompt_is_not_adopted() -> None:
    hasher = BlockHasher.for_model(16, "m")
    tokens = list(range(100, 260))
    assert hasher.adopt(None, tokens) == []
    assert hasher.adopt(_chain(BlockHasher.for_model(16, "other"), tokens), tokens) == []
    assert hasher.adopt(_chain(BlockHasher.for_model(32, "m"), tokens), tokens) == []
    assert hasher.adopt(_chain(hasher, tokens[:-16]), tokens) == []  # one block short
    assert hasher.adopt(_chain(hasher, [7, *tokens[1:]]), tokens) == []  # other tokens


def test_a_forged_link_is_caught_at_the_ends_always_and_in_the_middle_by_the_sample() -> None:
    hasher = BlockHasher.for_model(16, "m")
    tokens = list(range(100, 164))  # 4 blocks
    good = _chain(hasher, tokens)
    for index in range(4):
        forged = list(good.hashes)
        forged[index] = BlockHash(bytes(32))
        sent = PromptHashes(good.root, good.block_size, tuple(forged))
        adopted = [hasher.adopt(sent, tokens) for _ in range(60)]
        # a link is checked with its parent: the first and the last link (hence the one before
        # it) always; link 1 when the random check falls on link 1 or 2 (1 in 2 here)
        if index in (0, 2, 3):
            assert all(a == [] for a in adopted)
        else:
            assert [] in adopted and forged in adopted
