"""KVStager: every movement of whole KV blocks between the KV cache and host memory.

Senders (gRPC, shared memory), the storage tier's write-back and loads, and a decode instance's
received blocks all go through it. A block is one contiguous range of the cache
(`pdserve.model.kv_layout`), so a block is a row of bytes, whatever its element type.

On CPU (no `streams`) the KV cache is host memory: reads are views of it, writes copy into it,
nothing waits. On CUDA (`CudaStreams`) it owns a copy stream, so that device<->host copies
overlap the forward passes of the compute stream, and a set of pinned host rows
(`engine.kv_staging_bytes`), so that copies are asynchronous DMA. Its ordering rules:

- the engine thread calls `forward_done` after launching each forward; a read waits (on the copy
  stream) for the newest such event, so it sees what every earlier forward wrote;
- a copy-out (storage write-back of published blocks, which may be evicted and reused next step)
  records an event, and `before_forward` makes the compute stream wait for the newest one
  before the next forward may overwrite those blocks;
- a copy-in (a storage load) records an event too, which the next forward (which reads the
  loaded blocks) waits for; its pinned rows are given back once it completed;
- the holder of a copy-out waits for its event before reading the bytes (`StagedCopy.ready`):
  storage publishes a block only after its bytes are in host memory.

Tests drive the same code with fake streams on CPU tensors that run copies only when an event is
waited for, so that a missing wait shows up as stale bytes.
"""

import contextlib
import itertools
import logging
import mmap
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from pdserve.model.shm_segments import segment_path

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 * 2**20  # pinned host memory per instance on CUDA


class Event(Protocol):
    def query(self) -> bool:
        """Whether everything before the event has run."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until it has."""
        ...


class Streams(Protocol):
    """The device side: a compute stream (the engine's forwards) and a copy stream."""

    def record_compute(self) -> Event: ...

    def compute_wait(self, event: Event) -> None:
        """Later work on the compute stream waits for `event` (no host wait)."""
        ...

    def on_copy(self, work: Callable[[], None]) -> None:
        """Issue `work` (tensor copies) on the copy stream."""
        ...

    def copy_wait(self, event: Event) -> None: ...

    def record_copy(self) -> Event: ...


class CudaStreams:
    """A CUDA copy stream beside the device's current (compute) stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def record_compute(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_wait(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def on_copy(self, work: Callable[[], None]) -> None:
        with torch.cuda.stream(self.copy_stream):
            work()

    def copy_wait(self, event: Event) -> None:
        self.copy_stream.wait_event(event)  # type: ignore[arg-type]

    def record_copy(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.copy_stream)
        return event


class PinnedRows:
    """Rows of one (pinned) host tensor handed out as contiguous runs, first fit. Thread-safe."""

    def __init__(self, rows: int, row_bytes: int, pin: bool) -> None:
        self.buffer = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
        self.rows = rows
        self._free: list[tuple[int, int]] = [(0, rows)]  # (start, count), sorted, disjoint
        self._changed = threading.Condition()

    def take(self, count: int, wait: bool) -> int | None:
        """The first row of `count` free consecutive rows; None when there are none (and not
        `wait`) or when `count` exceeds every row."""
        with self._changed:
            while True:
                for index, (start, free) in enumerate(self._free):
                    if free >= count:
                        rest = (start + count, free - count)
                        self._free[index : index + 1] = [rest] if rest[1] else []
                        return start
                if not wait or count > self.rows:
                    return None
                self._changed.wait()

    def give(self, start: int, count: int) -> None:
        with self._changed:
            runs = sorted([*self._free, (start, count)])
            merged = [runs[0]]
            for first, size in runs[1:]:
                last_start, last_size = merged[-1]
                if last_start + last_size == first:
                    merged[-1] = (last_start, last_size + size)
                else:
                    merged.append((first, size))
            self._free = merged
            self._changed.notify_all()

    @property
    def num_free(self) -> int:
        with self._changed:
            return sum(count for _, count in self._free)


class StagedCopy:
    """Host copies of blocks (a copy-out): `views` hold their bytes once `ready()` returned;
    `release()` gives the memory back (idempotent). Held by the storage writer."""

    def __init__(
        self, views: list[memoryview], event: Event | None, release: Callable[[], None]
    ) -> None:
        self.views = views
        self._event = event
        self._release = release
        self._lock = threading.Lock()
        self._released = False

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()


class KVStager:
    """See the module docstring. `staged`/`write` run on any thread for blocks the caller owns
    (reserved or pinned for its request); `copy_out`, `load`, `forward_done` and
    `before_forward` run on the engine thread."""

    direct_writes = True  # peers may write into (and read from) `base_address` directly

    @property
    def slices(self) -> Sequence["KVStager"]:
        """Each tensor-parallel rank's part of the cache, rank 0 first: one rank, itself."""
        return [self]

    def __init__(
        self,
        kv_cache: torch.Tensor,
        streams: Streams | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        self.cache = kv_cache  # the tensor (a GPU one is shared with same-host peers whole)
        self._bytes = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        self.block_bytes = int(self._bytes.shape[1])
        self.total_bytes = int(self._bytes.numel())
        self.device = kv_cache.device
        self.base_address = int(kv_cache.data_ptr())
        self.streams = streams
        self._staging_rows = max(1, staging_bytes // self.block_bytes)
        self._rows: PinnedRows | None = None  # pinned on first use (a runner may never send)
        self._rows_lock = threading.Lock()
        self._forward: Event | None = None  # the newest forward's
        self._copy_out: Event | None = None  # the newest copy-out not yet waited for by compute
        self._copy_in: Event | None = None
        self._loads: list[tuple[Event, int, torch.Tensor]] = []  # copy-ins holding rows
        self._loads_lock = threading.Lock()  # copy-ins come from handler and engine threads

    # -- engine thread: ordering with the forwards ------------------------------------------------

    def forward_done(self) -> None:
        if self.streams is not None:
            self._forward = self.streams.record_compute()

    def before_forward(self) -> None:
        """The next forward waits for the copies it depends on (copy-outs of blocks it may
        overwrite, copy-ins of blocks it reads)."""
        if self.streams is None:
            return
        for event in (self._copy_out, self._copy_in):
            if event is not None:
                self.streams.compute_wait(event)
        self._copy_out = self._copy_in = None
        self._reap_loads()

    # -- reads ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def staged(self, block_ids: Sequence[int]) -> Iterator[list[memoryview]]:
        """Host views of whole blocks, valid inside the `with` (a send). CPU: views of the
        cache itself; CUDA: pinned copies, made on the copy stream after the newest forward
        (waits for free rows, or uses a one-off buffer for more blocks than the ring holds)."""
        if self.streams is None or not block_ids:
            yield [memoryview(self._bytes[b].numpy().data) for b in block_ids]
            return
        start, rows = self._rows_waiting(len(block_ids))
        try:
            event = self._gather(self.streams, block_ids, rows)
            event.synchronize()
            yield [memoryview(row.numpy().data) for row in rows]
        finally:
            self._give(start, len(block_ids))

    def copy_out(self, block_ids: Sequence[int]) -> StagedCopy | None:
        """Start copying blocks to host memory (storage write-back); never blocks. None when no
        staging memory is free (the caller drops the write, as storage does when behind)."""
        if self.streams is None:  # the blocks may be overwritten next step: copy them now
            copies = [memoryview(bytes(self._bytes[b].numpy().data)) for b in block_ids]
            return StagedCopy(copies, None, lambda: None)
        free = self._rows_free(len(block_ids))
        if free is None:
            return None
        start, rows = free
        event = self._gather(self.streams, block_ids, rows)
        self._copy_out = event
        views = [memoryview(row.numpy().data) for row in rows]
        return StagedCopy(views, event, lambda: self._give(start, len(block_ids)))

    def _gather(self, streams: Streams, block_ids: Sequence[int], rows: torch.Tensor) -> Event:
        forward = self._forward

        def copy() -> None:
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            rows.copy_(self._bytes.index_select(0, ids), non_blocking=True)

        if forward is not None:
            streams.copy_wait(forward)
        streams.on_copy(copy)
        return streams.record_copy()

    # -- writes -----------------------------------------------------------------------------------

    def write(self, block_ids: Sequence[int], data: memoryview) -> None:
        """Copy `data` (len(block_ids) whole blocks) into `block_ids` and wait until it is in
        the cache (a decode instance's received blocks, on a handler thread)."""
        if len(data) != len(block_ids) * self.block_bytes:
            raise ValueError(
                f"{len(data)} bytes is not {len(block_ids)} blocks of {self.block_bytes}"
            )
        if not block_ids:
            return
        event = self._put(block_ids, [_host_rows(data, len(block_ids))])
        if event is not None:
            event.synchronize()
            self._reap_loads()

    def load(self, block_ids: Sequence[int], blocks: Sequence[bytes]) -> None:
        """Copy one buffer per block into `block_ids` without waiting (a storage load, on the
        engine thread): the next forward waits for the copy instead."""
        if any(len(b) != self.block_bytes for b in blocks) or len(blocks) != len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks of {self.block_bytes} bytes expected")
        if block_ids:
            event = self._put(block_ids, [_host_rows(memoryview(b), 1) for b in blocks])
            if event is not None:
                self._copy_in = event

    def _put(self, block_ids: Sequence[int], parts: Sequence[torch.Tensor]) -> Event | None:
        """Copy host rows (`parts`, concatenated) into `block_ids`: directly on CPU, else
        through pinned rows and the copy stream (the returned event)."""
        if self.streams is None:
            if len(parts) == 1:
                self._scatter(block_ids, parts[0])
            else:
                for block_id, part in zip(block_ids, parts, strict=True):
                    self._bytes[block_id].copy_(part[0])
            return None
        start, rows = self._rows_waiting(len(block_ids))
        position = 0
        for part in parts:  # host memcpy into pinned memory: the DMA source
            rows[position : position + len(part)].copy_(part)
            position += len(part)
        self.streams.on_copy(lambda: self._scatter(block_ids, rows))
        event = self.streams.record_copy()
        with self._loads_lock:  # the rows (a one-off buffer too) live until the copy ran
            self._loads.append((event, start, rows))
        return event

    def _scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """One copy per run of consecutive block ids (a reservation's blocks mostly are one
        run); torch copies without the GIL, so gRPC threads keep receiving meanwhile."""
        for position, first, count in consecutive_runs(block_ids):
            self._bytes[first : first + count].copy_(
                rows[position : position + count], non_blocking=True
            )

    # -- staging rows ---------------------------------------------------------------------------

    @property
    def rows(self) -> PinnedRows:
        with self._rows_lock:
            if self._rows is None:
                pin = self.device.type == "cuda"
                self._rows = PinnedRows(self._staging_rows, self.block_bytes, pin)
            return self._rows

    def _rows_waiting(self, count: int) -> tuple[int, torch.Tensor]:
        """(first row, rows) of `count` staging rows, waiting for them; start -1 for a one-off
        buffer (more rows than the ring has)."""
        self._reap_loads()
        start = self.rows.take(count, wait=True) if count <= self.rows.rows else None
        if start is None:
            logger.debug("staging %d blocks through a one-off buffer", count)
            pin = self.device.type == "cuda"
            return -1, torch.empty((count, self.block_bytes), dtype=torch.uint8, pin_memory=pin)
        return start, self.rows.buffer[start : start + count]

    def _rows_free(self, count: int) -> tuple[int, torch.Tensor] | None:
        """`_rows_waiting` without waiting: None when the ring has no `count` free rows."""
        self._reap_loads()
        start = self.rows.take(count, wait=False)
        if start is None:
            return None
        return start, self.rows.buffer[start : start + count]

    def _give(self, start: int, count: int) -> None:
        if start >= 0:
            self.rows.give(start, count)

    def _reap_loads(self) -> None:
        """Give back the rows of copy-ins that completed."""
        keep: list[tuple[Event, int, torch.Tensor]] = []
        done: list[tuple[Event, int, torch.Tensor]] = []
        with self._loads_lock:
            for load in self._loads:
                (done if load[0].query() else keep).append(load)
            self._loads = keep
        for _, start, rows in done:
            self._give(start, len(rows))


def _host_rows(data: memoryview, count: int) -> torch.Tensor:
    """`data` as `count` rows of bytes (no copy; read-only buffers are only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).view(count, -1)


def consecutive_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position in `block_ids`, first block id, length) of each run of consecutive ids."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield start, block_ids[start], i - start
            start = i


class RankSlice(KVStager):
    """One rank's cache within a `SlicedKVStager`, as mapped in rank 0's process: host views on
    CPU (as `KVStager`); a GPU's blocks are copied to host memory and back synchronously."""

    @contextlib.contextmanager
    def staged(self, block_ids: Sequence[int]) -> Iterator[list[memoryview]]:
        if self.device.type == "cpu":
            yield [memoryview(self._bytes[b].numpy().data) for b in block_ids]
        else:
            yield [memoryview(row.numpy().data) for row in self.read(block_ids)]

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' bytes on the host (`[n, block_bytes]`)."""
        index = torch.tensor(block_ids, dtype=torch.long).to(self.device)
        return self._bytes.index_select(0, index).cpu()  # waits for the copy

    def put(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Host `rows` into the blocks; in the cache once this returns."""
        index = torch.tensor(block_ids, dtype=torch.long).to(self.device)
        self._bytes.index_copy_(0, index, rows.to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class SlicedKVStager(KVStager):
    """The KV blocks of a tensor-parallel instance, on rank 0: a block is every rank's slice of
    it (`kv_heads / size` heads each) in rank order, so the gRPC sender and receiver and the
    storage tier move whole blocks as before. Rank 0's own slice is its cache; the others' are
    mapped here (CPU: their shared-memory segments; CUDA: their caches over CUDA IPC). `slices`
    are the ranks' caches one by one, for direct writes rank by rank (shared memory, Mooncake:
    `KVTarget.rank_targets`); this cache itself is not one contiguous range, so `direct_writes`
    is False. Copies are synchronous: a step's collectives end after every rank wrote its KV
    (rank 0 reads the sampled tokens on the host, after the logits gather, which each rank runs
    after its last KV write), and rank 0 starts the next step only after its copies returned."""

    direct_writes = False

    def __init__(self, own: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        super().__init__(own)
        self._ranks = [RankSlice(t) for t in (own, *others)]
        widths = [r.block_bytes for r in self._ranks]
        self._bounds = list(zip(itertools.accumulate(widths, initial=0), widths, strict=False))
        self.block_bytes = sum(widths)
        self.total_bytes = self.block_bytes * int(own.shape[0])

    @property
    def slices(self) -> Sequence[KVStager]:
        return self._ranks

    def _joined(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.cat([r.read(block_ids) for r in self._ranks], dim=1)

    @contextlib.contextmanager
    def staged(self, block_ids: Sequence[int]) -> Iterator[list[memoryview]]:
        rows = self._joined(block_ids) if block_ids else torch.empty(0, self.block_bytes)
        yield [memoryview(row.numpy().data) for row in rows]

    def copy_out(self, block_ids: Sequence[int]) -> StagedCopy | None:
        rows = self._joined(block_ids)
        return StagedCopy([memoryview(row.numpy().data) for row in rows], None, lambda: None)

    def _put(self, block_ids: Sequence[int], parts: Sequence[torch.Tensor]) -> Event | None:
        rows = parts[0] if len(parts) == 1 else torch.cat(list(parts))
        for rank, (start, width) in zip(self._ranks, self._bounds, strict=True):
            rank.put(block_ids, rows[:, start : start + width])
        return None

    def forward_done(self) -> None:  # copies are synchronous: nothing to order
        return

    def before_forward(self) -> None:
        return


def map_segment(name: str, like: torch.Tensor) -> torch.Tensor:
    """Another process's KV cache segment `name` (shared memory), shaped and typed as `like`.
    Mapped directly: multiprocessing's SharedMemory would register it with this process's
    resource tracker, which unlinks the owner's segment when this process exits."""
    with open(segment_path(name), "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)[: like.numel() * like.element_size()]
    return raw.view(like.dtype).view(like.shape)
