"""Store keys, store ids and the directory store's containment: what a value read from Redis may
name (pdserve.storage.keys), and the store refusing the rest. No Redis, no sockets."""

from pathlib import Path

import pytest

from pdserve.errors import BlockStoreError
from pdserve.kvcache.hashing import BlockHash
from pdserve.storage import DirectoryStore
from pdserve.storage.keys import (
    check_key,
    check_store_id,
    is_store_key,
    key_binding,
    new_key,
    peer_address,
)

HASH_A = BlockHash(bytes(range(32)))
HASH_B = BlockHash(bytes(range(1, 33)))


def test_a_new_key_is_a_fresh_store_key_bound_to_its_tag_and_block() -> None:
    first, second = new_key("tag", HASH_A), new_key("tag", HASH_A)
    assert first != second and is_store_key(first) and is_store_key(second)
    check_key(first, "tag", HASH_A)
    assert first.startswith(key_binding("tag", HASH_A))


@pytest.mark.parametrize(
    ("tag", "block_hash"), [("tag", HASH_B), ("other", HASH_A), ("tag/", HASH_A)]
)
def test_a_key_of_another_block_or_layout_is_refused(tag: str, block_hash: BlockHash) -> None:
    with pytest.raises(BlockStoreError, match="another block or layout"):
        check_key(new_key(tag, block_hash), "tag", HASH_A)


@pytest.mark.parametrize(
    "key",
    [
        "../../../victim",
        "/etc/passwd",
        "",
        "a" * 32 + "-" + "b" * 11,  # one nonce digit short
        "A" * 32 + "-" + "b" * 12,  # upper case
        "a" * 32 + "-" + "b" * 12 + "/..",
        "a" * 32 + "-" + "b" * 12 + "\n",
        "..-" + "b" * 12,
    ],
)
def test_a_value_not_shaped_as_a_key_is_refused(key: str) -> None:
    assert not is_store_key(key)
    with pytest.raises(BlockStoreError, match="not a store key"):
        check_key(key, "tag", HASH_A)


@pytest.mark.parametrize(
    ("store_id", "target"),
    [
        ("mem:127.0.0.1:50051", "dns:///127.0.0.1:50051"),
        ("mem:node-3.cluster.local:1", "dns:///node-3.cluster.local:1"),
        ("mem:[::1]:65535", "dns:///[::1]:65535"),
        # a host named like a gRPC scheme: `unix:1234` alone would dial a unix socket
        ("mem:unix:1234", "dns:///unix:1234"),
    ],
)
def test_a_memory_store_id_names_a_peer_dialled_through_dns(store_id: str, target: str) -> None:
    assert peer_address(store_id) == target
    check_store_id(store_id)


@pytest.mark.parametrize(
    "store_id",
    [
        "mem:unix:/tmp/pdserve.sock",
        "mem:10.0.0.1",
        "mem:10.0.0.1:0",
        "mem:10.0.0.1:65536",
        "mem:10.0.0.1:050051",
        "mem:host name:80",
        "mem:-host:80",
        "mem:user@host:80",
        "mem:[::1:80",
        "mem:",
        "dns:///10.0.0.1:80",
    ],
)
def test_a_malformed_memory_store_id_is_refused(store_id: str) -> None:
    with pytest.raises(BlockStoreError, match="store id"):
        check_store_id(store_id)


def test_a_directory_store_id_is_accepted_and_an_unknown_kind_refused() -> None:
    check_store_id("dir:host:/var/cache/pdserve/kv-store")
    with pytest.raises(BlockStoreError, match="not a store id"):
        check_store_id("s3:bucket")


@pytest.fixture
def store(tmp_path: Path) -> DirectoryStore:
    return DirectoryStore(tmp_path / "kv" / "store", fsync=False)


def test_the_directory_store_refuses_keys_that_are_not_store_keys(
    store: DirectoryStore, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    for key in ("../victim", str(victim)):
        with pytest.raises(BlockStoreError, match="not a store key"):
            store.get(key)
        with pytest.raises(BlockStoreError, match="not a store key"):
            store.put(key, memoryview(b"overwrite"))
        with pytest.raises(BlockStoreError, match="not a store key"):
            store.delete([new_key("tag", HASH_A), key])  # nothing deleted, not even the first
    assert victim.read_bytes() == b"keep"


def test_the_directory_store_refuses_a_key_whose_shard_folder_leads_outside(
    store: DirectoryStore, tmp_path: Path
) -> None:
    key = new_key("tag", HASH_A)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / key).write_bytes(b"keep")
    (store.root / key[:2]).rmdir()  # made when the store opened: replaced by a link
    (store.root / key[:2]).symlink_to(outside, target_is_directory=True)
    with pytest.raises(BlockStoreError, match="outside"):
        store.get(key)
    with pytest.raises(BlockStoreError, match="outside"):
        store.delete([key])
    assert (outside / key).read_bytes() == b"keep"


def test_the_directory_store_round_trips_a_store_key(store: DirectoryStore) -> None:
    key = new_key("tag", HASH_A)
    store.put(key, memoryview(b"block"))
    assert store.get(key) == b"block" and store.keys() == {key}
    store.delete([key])
    assert store.keys() == set()


def test_the_directory_store_never_follows_a_link_at_a_block_file(
    store: DirectoryStore, tmp_path: Path
) -> None:
    key = new_key("tag", HASH_A)
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    (store.root / key[:2] / key).symlink_to(victim)
    with pytest.raises(BlockStoreError, match="cannot read"):
        store.get(key)
    store.put(key, memoryview(b"block"))  # replaces the link itself, not its target
    assert store.get(key) == b"block" and victim.read_bytes() == b"secret"


def test_a_removed_shard_folder_is_made_again_on_the_next_write(store: DirectoryStore) -> None:
    key = new_key("tag", HASH_A)
    (store.root / key[:2]).rmdir()
    with pytest.raises(BlockStoreError, match="cannot read"):
        store.get(key)
    store.put(key, memoryview(b"block"))
    assert store.get(key) == b"block"
    assert store.keys() == {key}
