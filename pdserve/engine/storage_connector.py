"""StorageConnector: the engine's side of the shared KV storage tier.

It writes published blocks back (the KV cache manager's write sink), reads ahead the blocks a
request's device prefix hit lacks, holds the verified bytes per request until the request is
given its blocks, and then loads them into those blocks.

Threads: `write_back`, `prefetch`, `apply_fetched`, `num_usable`, `load`, `forget` and
`is_pending` run on the engine thread (the owner). `read_ahead` blocks on storage I/O and runs on
a handler thread, for a request the engine does not schedule yet; its result is handed over
through a lock. The tier's worker answers prefetches through a queue and `wake` (which must not
block), never touching the connector's state itself.
"""

import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash
from pdserve.kvcache.manager import CacheRequest
from pdserve.model.staging import KVStager
from pdserve.storage.tier import StorageTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class StagedBlocks:
    """Verified bytes of blocks [first_block, first_block + len(blocks)) of one request (the
    very object `owner`: a later request that reuses the id never takes them)."""

    owner: CacheRequest
    first_block: int
    blocks: tuple[bytes, ...]

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.blocks)


class StorageConnector:
    def __init__(
        self,
        tier: StorageTier,
        stager: KVStager,
        block_size: int,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.tier = tier
        self._stager = stager
        self._block_size = block_size
        self._wake = wake
        self._staged: dict[str, StagedBlocks] = {}
        self._pending: dict[str, CacheRequest] = {}  # prefetches in flight, by request id
        self._fetched: queue.SimpleQueue[StagedBlocks] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards `_staged` against `read_ahead`'s handler thread
        self.loaded_tokens = 0  # every load, re-admissions after preemption included

    @property
    def write_on_evict(self) -> bool:
        return self.tier.config.device_write_policy == "on_eviction"

    @property
    def write_through(self) -> bool:
        return self.tier.config.device_write_policy == "write_through"

    @property
    def write_on_preempt(self) -> bool:
        return self.tier.config.write_back_on_preempt

    # -- write-back ---------------------------------------------------------------------------

    def write_back(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Copy published blocks to host memory (they may be overwritten next step: on a GPU
        the next forward waits for the copy) and queue them for the storage writer, which
        waits for the copy before it reads them. The engine thread never waits; with no
        staging memory free the blocks are not written (counted, as when storage is behind)."""
        fresh = [(b, h) for b, h in blocks if not self.tier.is_known_stored(h)]
        if not fresh:
            return
        copy = self._stager.copy_out([b for b, _ in fresh])
        if copy is None:
            self.tier.counters.add(writes_dropped=len(fresh))
            return
        items = [(h, v) for (_, h), v in zip(fresh, copy.views, strict=True)]
        self.tier.write(items, copy.ready, copy.release)

    # -- reads ----------------------------------------------------------------------------------

    def _chain_end(self, request: CacheRequest) -> int:
        """Blocks a hit may cover: never the last token (it must be computed)."""
        return (request.num_tokens - 1) // self._block_size

    def read_ahead(self, request: CacheRequest, device_blocks: int) -> None:
        """Stage the stored blocks that follow a device hit of `device_blocks` blocks. Blocking
        I/O, on the caller's (handler) thread; the request must not be scheduled yet."""
        end = self._chain_end(request)
        if device_blocks >= end:
            return
        blocks = self.tier.read_chain(request.block_hashes[device_blocks:end])
        with self._lock:
            self._staged[request.request_id] = StagedBlocks(request, device_blocks, tuple(blocks))

    def _staged_for(self, request: CacheRequest) -> StagedBlocks | None:
        with self._lock:
            staged = self._staged.get(request.request_id)
        return staged if staged is not None and staged.owner is request else None

    def needs_prefetch(self, request: CacheRequest, device_blocks: int) -> bool:
        """Whether admission should wait for a read: nothing staged from at most
        `device_blocks` (never asked, or the device hit shrank since), storage could add
        blocks, and the tier is up."""
        if request.request_id in self._pending or device_blocks >= self._chain_end(request):
            return False
        staged = self._staged_for(request)
        if staged is not None and staged.first_block <= device_blocks:
            return False
        return self.tier.available

    def prefetch(self, request: CacheRequest, device_blocks: int) -> None:
        """Read ahead on the tier's worker; the request waits (`is_pending`) until
        `apply_fetched` hands the answer over."""
        self._pending[request.request_id] = request

        def done(blocks: list[bytes]) -> None:  # on the storage worker thread
            self._fetched.put(StagedBlocks(request, device_blocks, tuple(blocks)))
            self._wake()

        self.tier.prefetch(request.block_hashes[device_blocks : self._chain_end(request)], done)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def apply_fetched(self, wait: bool = False) -> None:
        """Stage finished prefetches (admission can then proceed). With `wait`, wait up to a
        second for one (a loop-less `generate` with nothing else to do)."""
        block = wait and bool(self._pending)
        while True:
            try:
                staged = self._fetched.get(block=block, timeout=1.0)
            except queue.Empty:
                return
            block = False
            request_id = staged.owner.request_id
            if self._pending.get(request_id) is staged.owner:  # else forgotten meanwhile
                del self._pending[request_id]
                with self._lock:
                    self._staged[request_id] = staged

    def num_usable(self, request: CacheRequest, device_blocks: int) -> int:
        """Staged blocks that extend a device hit of `device_blocks` blocks without a gap."""
        staged = self._staged_for(request)
        if staged is None:
            return 0
        end = min(staged.end_block, self._chain_end(request))
        if not staged.first_block <= device_blocks < end:
            return 0
        return end - device_blocks

    def load(self, request: CacheRequest, block_table: Sequence[int], device_blocks: int) -> int:
        """Write the usable staged blocks into `block_table` after the device hit and drop every
        staged byte of the request, usable or not. Returns how many blocks were loaded (the
        caller publishes them: their bytes were verified when read)."""
        count = self.num_usable(request, device_blocks)
        staged = self._staged_for(request)
        if staged is None:
            return 0
        self.forget(request.request_id)
        if count == 0:
            return 0
        start = device_blocks - staged.first_block
        blocks = staged.blocks[start : start + count]
        self._stager.load(block_table[device_blocks : device_blocks + len(blocks)], blocks)
        self.loaded_tokens += count * self._block_size
        return count

    def forget(self, request_id: str) -> None:
        """Drop what is staged or pending for a request (finished, or preempted: its blocks
        may be in storage by the time it is admitted again)."""
        self._pending.pop(request_id, None)
        with self._lock:
            self._staged.pop(request_id, None)

    def check_integrity(self, live: Collection[str]) -> None:
        """Raise IntegrityError when bytes are staged or a read is pending for a request that
        is not in `live` (a leak). Engine thread, when idle."""
        with self._lock:
            stale = (set(self._staged) | set(self._pending)) - set(live)
        if stale:
            raise IntegrityError(f"storage reads held for requests no longer live: {sorted(stale)}")
