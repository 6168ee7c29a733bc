"""Store keys and peer addresses: made here from trusted inputs, and checked here wherever a value
read from Redis would name one. Anyone who can write to Redis can write any value, so a key or a
store id taken from the index is never joined onto a path or dialled before it passes these checks.

A store key is `{binding}-{nonce}`: `binding` is 32 hex digits of SHA-256 over the index's layout
tag and the block hash, `nonce` 12 random hex digits (a key is never reused, so a late delete
hits only old bytes). The binding ties a key to one (tag, hash): an index entry for hash A, or
for A under another tag, cannot name the bytes of hash B, or of A written under another layout.
A key has no `/`, `.` or `..` in it, so it stays one file name under its store's shard folder.

A host memory store's id is `mem:host:port`, `host` a DNS name, an IPv4 address or a bracketed
IPv6 address, `port` 1-65535; peers are dialled as `dns:///host:port`, so no value from Redis
picks a gRPC name resolver (`unix:`, `ipv4:`, ...) for us.
"""

import hashlib
import re
import struct
import uuid

from pdserve.errors import BlockStoreError
from pdserve.kvcache.hashing import BlockHash

MEMORY_PREFIX = "mem:"
DIRECTORY_PREFIX = "dir:"
BINDING_HEX_DIGITS = 32
NONCE_HEX_DIGITS = 12
HASH_BYTES = 32  # a BlockHash is a SHA-256 digest

_KEY_VERSION = b"pdserve-store-key-v1"
_KEY = re.compile(rf"[0-9a-f]{{{BINDING_HEX_DIGITS}}}-[0-9a-f]{{{NONCE_HEX_DIGITS}}}")
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*|\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r"[1-9][0-9]{0,4}")


def key_binding(tag: str, block_hash: BlockHash) -> str:
    """The hex digits every key of `block_hash` under `tag` starts with."""
    encoded = tag.encode()
    digest = hashlib.sha256(_KEY_VERSION + struct.pack("<I", len(encoded)) + encoded)
    digest.update(block_hash)
    return digest.hexdigest()[:BINDING_HEX_DIGITS]


def new_key(tag: str, block_hash: BlockHash) -> str:
    """A fresh key for the bytes of `block_hash` written under `tag`."""
    return f"{key_binding(tag, block_hash)}-{uuid.uuid4().hex[:NONCE_HEX_DIGITS]}"


def is_store_key(key: str) -> bool:
    """Whether `key` has the shape of a store key (of some block, under some tag)."""
    return _KEY.fullmatch(key) is not None


def check_key(key: str, tag: str, block_hash: BlockHash) -> None:
    """Raise BlockStoreError unless `key` is a key of `block_hash`'s bytes written under `tag`.
    Pure."""
    if not is_store_key(key):
        raise BlockStoreError(f"{key!r} is not a store key")
    if not key.startswith(key_binding(tag, block_hash)):
        raise BlockStoreError(
            f"key {key} belongs to another block or layout than {block_hash.hex()} under {tag}"
        )


def peer_address(store_id: str) -> str:
    """The gRPC target of the host memory store `store_id` (`mem:host:port`). Pure. Raises
    BlockStoreError when `store_id` is not a well-formed memory store id."""
    host, sep, port = store_id.removeprefix(MEMORY_PREFIX).rpartition(":")
    well_formed = (
        store_id.startswith(MEMORY_PREFIX)
        and sep == ":"
        and _HOST.fullmatch(host) is not None
        and _PORT.fullmatch(port) is not None
        and int(port) <= 65535
    )
    if not well_formed:
        raise BlockStoreError(f"{store_id!r} is not a memory store id (mem:host:port)")
    return f"dns:///{host}:{port}"


def check_store_id(store_id: str) -> None:
    """Raise BlockStoreError unless `store_id` names a directory store (`dir:...`: only ever
    compared with this instance's own) or a well-formed host memory store. Pure."""
    if store_id.startswith(MEMORY_PREFIX):
        peer_address(store_id)
    elif not store_id.startswith(DIRECTORY_PREFIX):
        raise BlockStoreError(f"{store_id!r} is not a store id (dir:... or mem:host:port)")


__all__ = [
    "DIRECTORY_PREFIX",
    "MEMORY_PREFIX",
    "check_key",
    "check_store_id",
    "is_store_key",
    "key_binding",
    "new_key",
    "peer_address",
]
