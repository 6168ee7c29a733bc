"""StorageConnector: the engine's side of the shared KV storage tier.

It writes published blocks back (the KV cache manager's write sink) and reads ahead the blocks a
request's device prefix hit lacks into the engine's `StagedReads`, from which admission loads
them into the request's blocks.

Threads: `write_back`, `prefetch`, `apply_fetched`, `forget` and `is_pending` run on the engine
thread (the owner). `read_ahead` blocks on storage I/O and runs on a handler thread, for a
request the engine does not schedule yet. The tier's worker answers prefetches through a queue
and `wake` (which must not block), never touching the connector's state itself.
"""

import logging
import queue
from collections.abc import Callable, Collection, Sequence

from pdserve.engine.staged_reads import StagedBlocks, StagedReads
from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash
from pdserve.kvcache.manager import CacheRequest
from pdserve.model.staging import KVStager
from pdserve.storage.tier import StorageTier

logger = logging.getLogger(__name__)


class StorageConnector:
    def __init__(
        self,
        tier: StorageTier,
        stager: KVStager,
        staged: StagedReads,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.tier = tier
        self._stager = stager
        self.staged = staged  # where reads go; admission loads them
        self._wake = wake
        self._pending: dict[str, CacheRequest] = {}  # prefetches in flight, by request id
        self._fetched: queue.SimpleQueue[StagedBlocks] = queue.SimpleQueue()

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

    def read_ahead(
        self, request: CacheRequest, device_blocks: int, pulled: Sequence[bytes] = ()
    ) -> None:
        """Stage the stored blocks that follow a device hit of `device_blocks` blocks and the
        `pulled` blocks after it (read from a peer instance), after those. Blocking I/O, on
        the caller's (handler) thread; the request must not be scheduled yet."""
        start, end = device_blocks + len(pulled), self.staged.chain_end(request)
        stored = self.tier.read_chain(request.block_hashes[start:end]) if start < end else []
        blocks = (*pulled, *stored)
        if blocks:
            self.staged.put(StagedBlocks(request, device_blocks, blocks, len(pulled)))

    def needs_prefetch(self, request: CacheRequest, device_blocks: int) -> bool:
        """Whether admission should wait for a read: nothing staged from at most
        `device_blocks` (never asked, or the device hit shrank since), storage could add
        blocks, and the tier is up."""
        end = self.staged.chain_end(request)
        if request.request_id in self._pending or device_blocks >= end:
            return False
        staged = self.staged.of(request)
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

        end = self.staged.chain_end(request)
        self.tier.prefetch(request.block_hashes[device_blocks:end], done)

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
                self.staged.put(staged)

    def forget(self, request_id: str) -> None:
        """Drop a request's pending read (finished, or preempted: its blocks may be in storage
        by the time it is admitted again)."""
        self._pending.pop(request_id, None)

    def check_integrity(self, live: Collection[str]) -> None:
        """Raise IntegrityError when a read is pending for a request that is not in `live` (a
        leak). Engine thread, when idle."""
        stale = set(self._pending) - set(live)
        if stale:
            raise IntegrityError(f"storage reads pending for requests gone: {sorted(stale)}")
