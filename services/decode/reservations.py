"""Reservations: blocks a decode instance set aside for a prompt whose KV is on its way.

A reservation is a lease. It ends when the first token arrives (the request starts decoding), when
the sender aborts or its KV stream breaks, or when it expires; then its blocks are freed. A lease
does not expire while a KV stream is writing into it (the stream's end settles it instead), and
every block written renews it: a long transfer keeps its reservation while bytes flow.
Thread-safe: handler threads write KV while the engine thread starts, expires and frees.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.errors import IntegrityError, KVTransferError


@dataclass(slots=True)
class Reservation:
    request: Request
    block_ids: tuple[int, ...]  # the request's block table; covers the prompt
    num_cached_blocks: int  # decode's own prefix hit: never written by transfers
    expires_at: float
    lease_s: float
    received: set[int] = field(default_factory=set)
    active_streams: int = 0
    cancelled: bool = False  # released while a stream was writing: freed when it ends

    @property
    def complete(self) -> bool:
        return len(self.received) == len(self.block_ids) - self.num_cached_blocks


class ReservationTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._reservations)

    def requests(self) -> list[Request]:
        with self._lock:
            return [r.request for r in self._reservations.values()]

    def num_blocks(self) -> int:
        """Blocks held by reservations, excluding shared prefix-hit blocks."""
        with self._lock:
            return sum(len(r.block_ids) - r.num_cached_blocks for r in self._reservations.values())

    def add(
        self, request: Request, block_ids: tuple[int, ...], num_cached_blocks: int, lease_s: float
    ) -> None:
        with self._lock:
            self._reservations[request.request_id] = Reservation(
                request, block_ids, num_cached_blocks, self._clock() + lease_s, lease_s
            )

    def begin_write(self, request_id: str, first_block: int, num_blocks: int) -> tuple[int, ...]:
        """Validate a write of blocks [first_block, first_block + num_blocks) and hold the lease
        until `end_write`. Returns the block ids to write. Raises KVTransferError."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            if reservation is None:
                raise KVTransferError(
                    f"no reservation for request {request_id} (expired or aborted?)"
                )
            last = first_block + num_blocks
            if (
                num_blocks <= 0
                or first_block < reservation.num_cached_blocks
                or last > len(reservation.block_ids)
            ):
                raise KVTransferError(
                    f"request {request_id}: blocks [{first_block}, {last}) outside the writable "
                    f"range [{reservation.num_cached_blocks}, {len(reservation.block_ids)})"
                )
            reservation.active_streams += 1
            return reservation.block_ids[first_block:last]

    def end_write(
        self, request_id: str, first_block: int, num_blocks: int, ok: bool
    ) -> Reservation | None:
        """Settle a write. Returns the reservation when it must now be released (the write
        failed, or it was cancelled while writing); the caller frees its blocks."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            if reservation is None:
                return None
            reservation.active_streams -= 1
            if ok:
                reservation.received.update(range(first_block, first_block + num_blocks))
                reservation.expires_at = max(
                    reservation.expires_at, self._clock() + reservation.lease_s
                )
            if (not ok or reservation.cancelled) and reservation.active_streams == 0:
                return self._reservations.pop(request_id)
            return None

    def pop(self, request_id: str) -> Reservation | None:
        """Remove a reservation to start or release it. While a stream writes into it, it is
        only marked cancelled (the stream's `end_write` hands it back) and None is returned."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            if reservation is None:
                return None
            if reservation.active_streams > 0:
                reservation.cancelled = True
                return None
            return self._reservations.pop(request_id)

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._reservations

    def pop_if(self, request: Request) -> Reservation | None:
        """Remove the reservation of this very request (not of another with its id), unless a
        stream writes into it (then it is only marked cancelled, as in `pop`)."""
        with self._lock:
            reservation = self._reservations.get(request.request_id)
            if reservation is None or reservation.request is not request:
                return None
        return self.pop(request.request_id)

    def pop_expired(self) -> list[Reservation]:
        """Remove and return the reservations whose lease ran out and that no stream writes."""
        now = self._clock()
        with self._lock:
            expired = [
                r
                for r in self._reservations.values()
                if r.expires_at <= now and r.active_streams == 0
            ]
            for reservation in expired:
                del self._reservations[reservation.request.request_id]
            return expired

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every reservation's bookkeeping is consistent."""
        with self._lock:
            for request_id, r in self._reservations.items():
                writable = range(r.num_cached_blocks, len(r.block_ids))
                if r.active_streams < 0 or not r.received <= set(writable):
                    raise IntegrityError(
                        f"reservation of {request_id}: {r.active_streams} streams, received "
                        f"blocks outside [{writable.start}, {writable.stop})"
                    )
