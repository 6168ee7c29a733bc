"""Block stores: where the bytes of stored KV blocks live. The index (Redis) says which store and
key hold a block; a store only puts, gets and deletes bytes by key.

`DirectoryStore`: one file per block under a directory (local disk, or a filesystem shared by the
instances: then every instance reads every block). A block is written to a temporary file, flushed
to disk (fsync, unless disabled) and renamed, so a key names complete bytes or nothing.
`HostMemoryStore`: blocks in this process's memory, served to peers over gRPC
(`StorageService.ReadBlocks`); `RemoteMemoryStore` reads another instance's pool.

Keys come from the index, so from Redis: a directory store refuses any key that is not shaped as
`keys.new_key` makes them or whose path would leave its root (`pdserve.storage.keys`).
"""

import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from pdserve.errors import BlockStoreError
from pdserve.kvcache.hashing import BlockHash
from pdserve.storage.keys import is_store_key, new_key


class BlockStore(ABC):
    """Bytes by key. Implementations are thread-safe."""

    store_id: str  # how the index names this store; unique in the cluster
    writable: bool = True  # False for a view of another instance's store

    @staticmethod
    def new_key(block_hex: str, tag: str = "") -> str:
        """A fresh key for a block's bytes under `tag` (`keys.new_key`; for tools that hold a
        hash as hex)."""
        return new_key(tag, BlockHash(bytes.fromhex(block_hex)))

    @abstractmethod
    def put(self, key: str, data: memoryview) -> None:
        """Store `data` durably under `key`. Raises BlockStoreError."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes under `key`. Raises BlockStoreError when they are missing (or `key` is
        not a store key)."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the bytes under `keys`; missing keys are ignored. Raises BlockStoreError,
        deleting nothing, when one is not a store key."""

    @abstractmethod
    def keys(self) -> set[str]:
        """Every key the store holds (tests and integrity checks)."""


class DirectoryStore(BlockStore):
    """Thread-safe: every put writes its own temporary file and renames it into place.

    A key's file is `root/key[:2]/key`; only store keys are accepted, and a key's shard folder
    and file are opened without following links (O_NOFOLLOW, the file relative to the folder's
    descriptor), so no path leads outside the root, however the folders are changed meanwhile.
    The 256 shard folders are made when the store opens (a folder made on a block's first write
    cost that write its journal commit). KV bytes derive from users' prompts: folders are made
    0700 and files 0600 (instances sharing a store over a shared filesystem run as one user).
    A get is a few system calls: no path object, no resolution per block."""

    def __init__(self, root: str | Path, store_id: str | None = None, fsync: bool = True) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._resolved_root = self.root.resolve()
        self.store_id = store_id or f"dir:{self._resolved_root}"
        self.fsync = fsync
        self._prefix = f"{self._resolved_root}/"
        for n in range(256):  # a read-only or foreign root keeps what it has
            with contextlib.suppress(OSError):
                os.mkdir(f"{self._prefix}{n:02x}", 0o700)

    def _folder(self, key: str, create: bool = False) -> int:
        """A descriptor of `key`'s shard folder, opened without following a link (`create`:
        make it when missing). Raises BlockStoreError for a key that is not a store key or a
        folder that is a link."""
        if not is_store_key(key):
            raise BlockStoreError(f"{key!r} is not a store key: refused by {self.root}")
        folder = f"{self._prefix}{key[:2]}"
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        try:
            return os.open(folder, flags)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as e:  # ELOOP, ENOTDIR: a link, or not a folder
            raise BlockStoreError(
                f"shard folder {folder} is not a plain folder (a link may lead outside "
                f"{self.root}): refused ({e.strerror})"
            ) from e
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        return os.open(folder, flags)

    def put(self, key: str, data: memoryview) -> None:
        temporary = f".{key}.tmp"
        try:
            folder = self._folder(key, create=True)
            try:
                self._write(folder, temporary, data)
                os.replace(temporary, key, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise
            finally:
                os.close(folder)
        except OSError as e:
            raise BlockStoreError(f"cannot write block {key} under {self.root}: {e}") from e

    def _write(self, folder: int, name: str, data: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(name, flags, 0o600, dir_fd=folder)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        try:
            folder = self._folder(key)
            try:
                fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
            finally:
                os.close(folder)
            try:
                size = os.fstat(fd).st_size
                data = os.read(fd, size)
                while len(data) < size:  # a short read: rare, on some filesystems
                    more = os.read(fd, size - len(data))
                    if not more:
                        break
                    data += more
            finally:
                os.close(fd)
        except OSError as e:
            raise BlockStoreError(f"cannot read block {key} under {self.root}: {e}") from e
        return data

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            if not is_store_key(key):
                raise BlockStoreError(f"{key!r} is not a store key: refused by {self.root}")
        for key in keys:
            try:
                folder = self._folder(key)
            except FileNotFoundError:
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(key, dir_fd=folder)
            finally:
                os.close(folder)

    def keys(self) -> set[str]:
        return {p.name for p in self.root.glob("*/*") if not p.name.startswith(".")}


class HostMemoryStore(BlockStore):
    """Blocks in this process's memory, up to `capacity_bytes` (the index's capacity accounting
    keeps it there; a put beyond it fails rather than grow without bound). Its id names the
    instance's gRPC address (`mem:host:port`), where peers read it: `bind` sets it once the
    server is listening.

    Thread-safe: a lock guards the pool (the tier's worker writes, peers' reads arrive on
    handler threads).
    """

    def __init__(self, store_id: str | None, capacity_bytes: int) -> None:
        self.store_id = store_id or "mem:unbound"
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def bind(self, address: str) -> None:
        self.store_id = f"mem:{address}"

    def put(self, key: str, data: memoryview) -> None:
        with self._lock:
            if self._bytes + len(data) > self.capacity_bytes:
                raise BlockStoreError(
                    f"host memory store {self.store_id} is full ({self._bytes} bytes)"
                )
            self._blocks[key] = bytes(data)
            self._bytes += len(data)

    def get(self, key: str) -> bytes:
        with self._lock:
            data = self._blocks.get(key)
        if data is None:
            raise BlockStoreError(f"host memory store {self.store_id} has no block {key}")
        return data

    def delete(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                data = self._blocks.pop(key, None)
                if data is not None:
                    self._bytes -= len(data)

    def keys(self) -> set[str]:
        with self._lock:
            return set(self._blocks)
