"""Direct-write transports: the sender writes into the decode instance's reserved blocks itself,
then commits them (`DecodeService.CommitKV`), which is what makes them count as received.

`ShmKVTransport`: the decode instance's KV cache lives in a shared-memory segment; on the same
host a transfer is a copy into it. `MooncakeKVTransport` (pdserve.transfer.mooncake) writes over
the Mooncake transfer engine (RDMA on clusters, TCP here).
"""

import contextlib
import ctypes
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from pdserve.errors import KVTransferError, PdserveError
from pdserve.model.shm_segments import segment_path
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import Deadlines, DecodeClient
from pdserve.transfer.base import KVSource, KVTarget, KVTransport, TransferResult, host_id


def commit(channels: ChannelPool, target: KVTarget, num_blocks: int, timeout_s: float) -> None:
    """Tell the decode instance that blocks [first_block, + num_blocks) are written; a commit
    unanswered for `timeout_s` (transfer.stall_timeout_s) is a stalled transfer. Raises
    KVTransferError (whatever decode answered: the transfer did not complete)."""
    try:
        DecodeClient(target.address, channels, Deadlines(control_s=timeout_s)).commit_kv(
            target.request_id, target.first_block, num_blocks
        )
    except PdserveError as e:
        raise KVTransferError(
            f"decode {target.address} did not commit the KV of request {target.request_id}: {e}"
        ) from e


def check_bounds(target: KVTarget, num_blocks: int, block_bytes: Sequence[int]) -> None:
    """The blocks to send (`num_blocks`, each of its `block_bytes`) fit the reservation."""
    if len(target.block_ids) != num_blocks:
        raise KVTransferError(
            f"request {target.request_id}: {num_blocks} blocks to send, "
            f"{len(target.block_ids)} reserved"
        )
    size = target.block_bytes
    if any(b != size for b in block_bytes):
        raise KVTransferError(f"request {target.request_id}: blocks are not {size} bytes")
    limit = target.endpoints.kv_bytes
    if any((block_id + 1) * size > limit for block_id in target.block_ids):
        raise KVTransferError(f"request {target.request_id}: a block lies outside decode's cache")


def address_of(view: memoryview) -> int:
    """The address of a block's bytes (a view: no copy)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def copy_runs(
    block_ids: Sequence[int], addresses: Sequence[int], size: int
) -> Iterator[tuple[int, int, int]]:
    """(first block id, count, source address) of runs that are consecutive on both sides:
    the destination ids follow each other and so do the source blocks (at `addresses`, `size`
    bytes each) in memory, so that each run is one copy."""
    start = 0
    for i in range(1, len(addresses) + 1):
        if (
            i == len(addresses)
            or block_ids[i] != block_ids[i - 1] + 1
            or addresses[i] != addresses[i - 1] + size
        ):
            yield block_ids[start], i - start, addresses[start]
            start = i


def send_by_rank(
    channels: ChannelPool,
    target: KVTarget,
    source: KVSource,
    block_ids: Sequence[int],
    write: Callable[[KVTarget, KVSource], None],
    commit_timeout_s: float,
) -> TransferResult:
    """A tensor-parallel decode instance (`target.endpoints.ranks`): `write` each rank's slice
    of the blocks (`source.slices`, the sender's ranks) into that rank's cache, then commit
    once, so decode counts the blocks received only when every rank's slice is there."""
    start = time.perf_counter()
    targets, slices = target.rank_targets(), source.slices
    if len(targets) != len(slices):
        raise KVTransferError(
            f"request {target.request_id}: the sender has {len(slices)} tensor-parallel ranks, "
            f"decode {target.address} has {len(targets)} (tensor_parallel_size must match)"
        )
    for rank_target, rank_source in zip(targets, slices, strict=True):
        write(rank_target, rank_source)
    commit(channels, target, len(block_ids), commit_timeout_s)
    size = target.block_bytes
    return TransferResult(len(block_ids), len(block_ids) * size, time.perf_counter() - start)


class _Segment:
    """A decode instance's KV cache segment mapped here, and how many writes are under way."""

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as f:
            self.mapping = mmap.mmap(f.fileno(), 0)
        self.address = int(np.frombuffer(self.mapping, dtype=np.uint8).ctypes.data)
        self.path = path
        self.writers = 0


class ShmKVTransport(KVTransport):
    """Thread-safe (the KVTransport contract): request threads send concurrently.

    A decode segment stays mapped while its name is in /dev/shm. Its owner removes the name
    when it stops, and so does the next instance to start on the host if the owner was
    killed (`pdserve.model.shm_segments`). Each new mapping first unmaps the segments whose
    name has gone and that no write is using. Otherwise every decode restart would leave a
    mapping here, and the mapping would keep the dead cache's memory.
    """

    name = "shm"

    def __init__(self, channels: ChannelPool, stall_timeout_s: float = 10.0) -> None:
        self._channels = channels
        self._stall_timeout_s = stall_timeout_s
        self._segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    def can_reach(self, target: KVTarget) -> bool:
        ranks = target.endpoints.ranks or (target.endpoints,)
        return all(bool(e.shm_name) and e.host_id == host_id() for e in ranks)

    @contextlib.contextmanager
    def _mapped(self, name: str) -> Iterator[int]:
        """The address where decode's KV cache segment `name` is mapped in this process, kept
        mapped until the block ends."""
        with self._lock:
            segment = self._segments.get(name)
            if segment is None:
                self._unmap_gone()
                # mapped directly (not multiprocessing's SharedMemory, whose resource tracker
                # would unlink the owner's segment when this process exits)
                try:
                    segment = _Segment(segment_path(name))
                except OSError as e:
                    raise KVTransferError(f"cannot attach decode's KV segment {name}: {e}") from e
                self._segments[name] = segment
            segment.writers += 1
        try:
            yield segment.address
        finally:
            with self._lock:
                segment.writers -= 1

    def _unmap_gone(self) -> None:
        """Under the lock: unmap the segments whose name has gone and that no write uses."""
        for name, segment in list(self._segments.items()):
            if segment.writers == 0 and not segment.path.exists():
                with contextlib.suppress(BufferError):  # a view still alive: mapped till exit
                    segment.mapping.close()
                del self._segments[name]

    def send_blocks(
        self, target: KVTarget, source: KVSource, block_ids: Sequence[int]
    ) -> TransferResult:
        if not target.endpoints.ranks:
            return super().send_blocks(target, source, block_ids)

        def write(rank_target: KVTarget, rank_source: KVSource) -> None:
            with rank_source.staged(block_ids) as views:
                self._write(rank_target, views)

        return send_by_rank(self._channels, target, source, block_ids, write, self._stall_timeout_s)

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        start = time.perf_counter()
        self._write(target, blocks)
        commit(self._channels, target, len(blocks), self._stall_timeout_s)
        size = target.block_bytes
        return TransferResult(len(blocks), len(blocks) * size, time.perf_counter() - start)

    def _write(self, target: KVTarget, blocks: Sequence[memoryview]) -> None:
        check_bounds(target, len(blocks), [len(b) for b in blocks])
        target.check_deadline()
        size = target.block_bytes
        sources = [address_of(b) for b in blocks]
        with self._mapped(target.endpoints.shm_name) as cache:
            for block_id, count, source in copy_runs(target.block_ids, sources, size):
                ctypes.memmove(cache + block_id * size, source, count * size)  # GIL released

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                # BufferError: a tensor view is still alive; the mapping goes at exit
                with contextlib.suppress(BufferError):
                    segment.mapping.close()
            self._segments.clear()
