"""Collectives of a tensor-parallel group whose ranks share one host's memory (CPU ranks).

gloo over loopback TCP costs about 1 ms per collective on a small VM (its threads wake through
the kernel); a decode step of a Llama runs 2 per layer. Here each rank writes its tensor into
its slot of one shared-memory segment and raises its arrival counter; every rank spins (then
yields) until every counter reached the operation's sequence number, then reads: tens of
microseconds. Each operation uses one of two slot sets by the parity of its sequence number,
and every operation waits for every rank's arrival: a rank that writes operation n + 2 into a
set has seen everyone arrive at n + 1, which each did only after reading operation n — so no
slot is overwritten while it is read, without a second barrier.

Sums add the ranks' slots in rank order on every rank, so every rank holds the same bits.
x86-64 only (its stores become visible in program order: a slot's bytes before the counter);
elsewhere, and for tensors larger than a slot, the group uses gloo. A peer that stops arriving
fails the wait after the group's timeout; one that died is noticed sooner (every 0.1 s the
waiter looks its process up).
"""

import contextlib
import mmap
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pdserve.model.shm_segments import SHM_DIR, claim, new_name, release, running

SLOT_BYTES = 4 * 2**20  # per rank and parity: larger tensors go through gloo
_LINE = 8  # int64s per cache line: each counter on a line of its own
_HEADER = 4096
_SPINS = 2000  # busy checks before yielding the core between checks
_LIVENESS_S = 0.1


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class PeerGone(RuntimeError):
    """A rank stopped arriving (dead, or past the timeout)."""


class ShmCollectives:
    """One rank's view of the segment. Owned by the rank's engine thread (or worker loop)."""

    def __init__(self, path: Path, rank: int, size: int, owner: bool) -> None:
        self.path, self.rank, self.size, self.owner = path, rank, size, owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=_HEADER // 8)
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER)
        self._slots = data.view(2, size, SLOT_BYTES)
        self._seq = 0
        self._pids: list[int] = []
        self._claim: int | None = None  # rank 0, until every rank mapped it

    @classmethod
    def create(cls, size: int) -> "ShmCollectives":
        """Rank 0: a new segment (its name goes to the others through the group's store)."""
        path = SHM_DIR / new_name("tp")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        held = claim(path.name)
        try:
            if held is None:
                raise OSError(f"shared-memory segment {path} was removed as it was created")
            os.posix_fallocate(fd, 0, _HEADER + 2 * size * SLOT_BYTES)
            collectives = cls(path, 0, size, owner=True)
        except OSError:
            path.unlink(missing_ok=True)
            release(held)
            raise
        finally:
            os.close(fd)
        collectives._claim = held
        return collectives

    def register(self, pids: Sequence[int]) -> None:
        """Every rank's process id, by rank (for the liveness checks)."""
        self._pids = list(pids)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor, timeout_s: float) -> None:
        """Sum `x` (contiguous) over the ranks, in place."""
        parity = self._publish(x)
        self._wait(timeout_s)
        parts = [self._view(parity, r, x) for r in range(self.size)]
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)

    def gather_columns(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor | None:
        parity = self._publish(x)
        self._wait(timeout_s)
        if self.rank != 0:
            return None
        return torch.cat([self._view(parity, r, x) for r in range(self.size)], dim=-1)

    def broadcast(self, x: torch.Tensor, timeout_s: float) -> None:
        """Rank 0's `x` into every rank's `x`."""
        parity = self._publish(x if self.rank == 0 else None)
        self._wait(timeout_s)
        if self.rank != 0:
            x.copy_(self._view(parity, 0, x))

    def _publish(self, x: torch.Tensor | None) -> int:
        self._seq += 1
        parity = self._seq % 2
        if x is not None:
            nbytes = x.numel() * x.element_size()
            self._slots[parity, self.rank, :nbytes].copy_(x.reshape(-1).view(torch.uint8))
        self._counters[self.rank * _LINE] = self._seq  # after the bytes (x86-64 store order)
        return parity

    def _view(self, parity: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        return self._slots[parity, rank, :nbytes].view(like.dtype).view(like.shape)

    def _wait(self, timeout_s: float) -> None:
        counters, seq, spins = self._counters, self._seq, 0
        start = time.monotonic()
        check = start + _LIVENESS_S
        while any(counters[r * _LINE] < seq for r in range(self.size)):
            spins += 1
            if spins < _SPINS:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now >= check:
                self._check_peers(now - start, timeout_s)
                check = now + _LIVENESS_S

    def _check_peers(self, waited_s: float, timeout_s: float) -> None:
        late = [r for r in range(self.size) if self._counters[r * _LINE] < self._seq]
        gone = [r for r in late if r < len(self._pids) and not running(self._pids[r])]
        if gone:
            raise PeerGone(f"rank {gone[0]}'s process is gone")
        if waited_s >= timeout_s:
            raise PeerGone(f"rank {late[0]} did not arrive within {timeout_s:g} s")

    def forget_name(self) -> None:
        """Rank 0, once every rank mapped the segment: remove its name (the memory stays until
        the last mapping goes, so a crashed process leaves nothing behind)."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.owner = False
            release(self._claim)
            self._claim = None

    def close(self) -> None:
        """Unmap (and remove the name if it is still there). Idempotent."""
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        self.forget_name()
