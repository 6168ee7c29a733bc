"""StagedReads: KV bytes read for a request before it is admitted, loaded into its blocks then.

The bytes come from the storage tier (`StorageConnector`) or from a decode instance that holds
the prompt's prefix (`InstanceRuntime.pull_kv`); either way they extend the request's device
prefix hit, and admission (`PromptAdmission.admit`) loads and publishes the blocks that do so
without a gap. Staging happens on handler or storage threads; loading on the engine thread.
"""

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.errors import IntegrityError
from pdserve.kvcache.manager import CacheRequest
from pdserve.model.staging import KVStager


@dataclass(frozen=True, slots=True, eq=False)
class StagedBlocks:
    """Verified bytes of blocks [first_block, first_block + len(blocks)) of one request (the
    very object `owner`: a later request that reuses the id never takes them); the first
    `pulled` of them came from a peer instance, the rest from the storage tier."""

    owner: CacheRequest
    first_block: int
    blocks: tuple[bytes, ...]
    pulled: int = 0

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.blocks)


@dataclass(frozen=True, slots=True)
class Usable:
    """Staged blocks that extend a device hit: `blocks` in all, the first `pulled` of them
    from a peer instance."""

    blocks: int = 0
    pulled: int = 0


class StagedReads:
    """Thread-safe: `put` may run on any thread; `load` on the engine thread."""

    def __init__(self, stager: KVStager, block_size: int) -> None:
        self._stager = stager
        self._block_size = block_size
        self._staged: dict[str, StagedBlocks] = {}
        self._lock = threading.Lock()
        # loaded from the storage tier: every load, re-admissions after preemption included
        self.loaded_tokens = 0

    def chain_end(self, request: CacheRequest) -> int:
        """Blocks a hit may cover: never the last token (it must be computed)."""
        return (request.num_tokens - 1) // self._block_size

    def put(self, staged: StagedBlocks) -> None:
        """Stage bytes for `staged.owner`, replacing what it had staged."""
        with self._lock:
            self._staged[staged.owner.request_id] = staged

    def of(self, request: CacheRequest) -> StagedBlocks | None:
        with self._lock:
            staged = self._staged.get(request.request_id)
        return staged if staged is not None and staged.owner is request else None

    def usable(self, request: CacheRequest, device_blocks: int) -> Usable:
        """The staged blocks that extend a device hit of `device_blocks` blocks without a gap."""
        staged = self.of(request)
        if staged is None:
            return Usable()
        end = min(staged.end_block, self.chain_end(request))
        if not staged.first_block <= device_blocks < end:
            return Usable()
        pulled_end = staged.first_block + staged.pulled
        return Usable(end - device_blocks, max(0, min(pulled_end, end) - device_blocks))

    def load(self, request: CacheRequest, block_table: Sequence[int], device_blocks: int) -> int:
        """Write the usable staged blocks into `block_table` after the device hit and drop every
        staged byte of the request, usable or not. Returns how many blocks were loaded (the
        caller publishes them: their bytes were verified when read)."""
        usable = self.usable(request, device_blocks)
        count = usable.blocks
        staged = self.of(request)
        if staged is None:
            return 0
        self.forget(request.request_id)
        if count == 0:
            return 0
        start = device_blocks - staged.first_block
        blocks = staged.blocks[start : start + count]
        self._stager.load(block_table[device_blocks : device_blocks + len(blocks)], blocks)
        self.loaded_tokens += (count - usable.pulled) * self._block_size
        return count

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._staged)

    def check_integrity(self, live: Collection[str]) -> None:
        """Raise IntegrityError when bytes are staged for a request not in `live` (a leak)."""
        stale = self.held() - set(live)
        if stale:
            raise IntegrityError(f"KV reads held for requests no longer live: {sorted(stale)}")
