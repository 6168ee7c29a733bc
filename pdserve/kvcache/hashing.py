"""Chained, seed-free block hashing shared by every process, node and the router.

A block's hash is ``sha256(parent_hash || token ids as little-endian uint32)``; the chain starts at
a root hash derived from extra keys (the model tag, ...), so equal hashes mean equal token prefixes
of the same model, on any machine, in any process. Python's ``hash()`` is never used: it is salted
per process. Only full blocks have hashes.
"""

import hashlib
import logging
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte SHA-256 digest identifying a full block and its whole prefix."""

_HASH_VERSION = b"pdserve-block-hash-v1"


def root_hash(extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash that parents the first block; `extra_keys` (e.g. the model tag) separate namespaces."""
    digest = hashlib.sha256(_HASH_VERSION)
    for key in extra_keys:
        encoded = key.encode()
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return BlockHash(digest.digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block of `token_ids` whose prefix hashes to `parent`."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return BlockHash(hashlib.sha256(parent + payload).digest())


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes the hash chain of a token sequence for one block size and namespace."""

    block_size: int
    root: BlockHash

    @classmethod
    def for_model(cls, block_size: int, model_tag: str) -> "BlockHasher":
        return cls(block_size=block_size, root=root_hash((model_tag,)))

    def hash_tokens(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`; a trailing partial block has none."""
        hashes: list[BlockHash] = []
        self.extend(hashes, token_ids)
        return hashes

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Append to `hashes` (the chain of a prefix of `token_ids`) the newly full blocks.

        Mutates `hashes` only; `token_ids` is read, never changed.
        """
        parent = hashes[-1] if hashes else self.root
        size = self.block_size
        start = len(hashes) * size
        num_new = (len(token_ids) - start) // size
        if num_new <= 0:
            return
        payload = struct.pack(f"<{num_new * size}I", *token_ids[start : start + num_new * size])
        stride = 4 * size
        for offset in range(0, len(payload), stride):
            parent = BlockHash(hashlib.sha256(parent + payload[offset : offset + stride]).digest())
            hashes.append(parent)

    def adopt(self, given: "PromptHashes | None", token_ids: Sequence[int]) -> list[BlockHash]:
        """The chain of `token_ids`' full blocks that another process computed (the router, a
        prefill instance), when it used this hasher and passes a sampled check: the first link
        (anchored at the root), the last and one random link, each one SHA-256 of its block and
        parent — three hashes however long the prompt; [] otherwise, for the caller to compute.
        Only authenticated peers send chains; the sample catches a sender's bug (a chain of
        other tokens, another model) at the ends for sure and in the middle with probability
        1/n per request, which is the bargain this makes for not hashing every prompt twice."""
        if given is None or (given.root, given.block_size) != (self.root, self.block_size):
            return []
        size = self.block_size
        chain = list(given.hashes)
        if not chain or len(chain) != len(token_ids) // size:
            return []
        links = {0, len(chain) - 1, random.randrange(len(chain))}
        for i in links:
            parent = chain[i - 1] if i else self.root
            if hash_block(parent, token_ids[i * size : (i + 1) * size]) != chain[i]:
                logger.warning("a request's block hash %d does not match its tokens: recomputed", i)
                return []
        return chain


@dataclass(frozen=True, slots=True)
class PromptHashes:
    """A prompt's block hash chain as sent with a request, with what computed it."""

    root: BlockHash
    block_size: int
    hashes: tuple[BlockHash, ...]
