"""KVTransport: moves a request's KV blocks into a reservation on a peer instance.

The sender passes one memoryview per block, in block-table order starting at `first_block` (an
index into the request's block table on the receiver). KV bytes never travel through Ray's object
store. A transport is shared by the sender's request threads and must be thread-safe.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import PdserveError


class KVTransferError(PdserveError):
    """A transfer failed (peer gone, reservation unknown or expired, size mismatch)."""


@dataclass(frozen=True, slots=True)
class TransferResult:
    num_blocks: int
    num_bytes: int
    seconds: float


class KVReceiver(Protocol):
    """The receiving side (a decode instance)."""

    def receive_blocks(self, request_id: str, first_block: int, data: memoryview) -> int:
        """Write whole blocks `first_block, first_block + 1, ...` of the request's reservation
        from `data`; returns the number of blocks written. Raises KVTransferError."""
        ...


class KVTransport(ABC):
    name: str

    @abstractmethod
    def send(
        self, peer: str, request_id: str, first_block: int, blocks: Sequence[memoryview]
    ) -> TransferResult:
        """Write `blocks` into the reservation of `request_id` on `peer`; blocks until the
        receiver acknowledged every byte. Raises KVTransferError."""

    def close(self) -> None:  # noqa: B027  (optional hook: most transports hold nothing)
        """Release connections; the transport is unusable afterwards."""
