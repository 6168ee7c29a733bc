"""KVTransport: moves a request's KV blocks into a reservation on a peer instance.

The sender passes one memoryview per block, in block-table order starting at `target.first_block`
(an index into the request's block table on the receiver). Streaming transports (gRPC) hand the
bytes to the receiver's server; direct-write transports (shared memory, Mooncake) write straight
into the reserved blocks (`target.block_ids`) and then commit them over gRPC. KV bytes never travel
through Ray's object store. A transport is shared by the sender's request threads and must be
thread-safe.
"""

import dataclasses
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pdserve.errors import KVTransferError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class TransferResult:
    num_blocks: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class KVEndpoints:
    """How a decode instance's KV cache can be written directly (from its Reserve reply)."""

    host_id: str = ""
    shm_name: str = ""
    mooncake_session: str = ""
    mooncake_base: int = 0
    kv_bytes: int = 0
    cuda_ipc_handle: bytes = b""  # its GPU KV cache, opened by a peer on the same host
    gpu_uuid: str = ""  # the GPU holding that cache
    # a tensor-parallel decode instance: each rank's slice cache, rank 0 first (the fields
    # above then offer no direct write)
    ranks: tuple["KVEndpoints", ...] = ()


@dataclass(frozen=True, slots=True)
class KVTarget:
    """A reservation on a decode instance: where a request's blocks go."""

    address: str  # the decode instance's gRPC address
    request_id: str
    first_block: int  # index in the request's block table of the first block sent
    block_ids: tuple[int, ...] = ()  # decode's ids of the blocks sent (direct writes)
    block_bytes: int = 0
    endpoints: KVEndpoints = field(default_factory=KVEndpoints)
    deadline: float = float("inf")  # time.monotonic() after which the lease may be gone

    def rank_targets(self) -> list["KVTarget"]:
        """One target per rank of a tensor-parallel decode instance: the same blocks, that
        rank's cache and slice size (`block_bytes / ranks`)."""
        ranks = self.endpoints.ranks
        size = self.block_bytes // len(ranks) if ranks else self.block_bytes
        return [dataclasses.replace(self, endpoints=e, block_bytes=size) for e in ranks]

    def check_deadline(self) -> None:
        """Direct writes must end before the lease does: after it, the blocks may be reused."""
        if time.monotonic() >= self.deadline:
            raise KVTransferError(
                f"the reservation of request {self.request_id} on {self.address} is about to "
                "expire: not writing into it"
            )


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """A decode instance holding the first `num_blocks` blocks of a prompt (the router's
    index says so): a prefill instance reads them there rather than compute them."""

    address: str  # its gRPC address
    num_blocks: int


class KVReceiver(Protocol):
    """The receiving side (a decode instance)."""

    def receive_blocks(self, request_id: str, first_block: int, data: memoryview) -> int:
        """Write whole blocks `first_block, first_block + 1, ...` of the request's reservation
        from `data`; returns the number of blocks written. Raises KVTransferError."""
        ...


class KVSource(Protocol):
    """The sender's KV cache (`pdserve.model.staging.KVStager`): where its blocks live, and
    host views of them."""

    block_bytes: int
    base_address: int  # of block 0; block b is at base_address + b x block_bytes
    device: "torch.device"

    def staged(self, block_ids: Sequence[int]) -> AbstractContextManager[list[memoryview]]:
        """Host views of the blocks, valid inside the `with`."""
        ...

    @property
    def slices(self) -> "Sequence[KVSource]":
        """Each tensor-parallel rank's part of the cache, rank 0 first (itself: one rank)."""
        ...


class KVTransport(ABC):
    name: str

    def can_reach(self, target: KVTarget) -> bool:
        """Whether this transport can write into `target` (gRPC always can)."""
        return True

    def send_blocks(
        self, target: KVTarget, source: KVSource, block_ids: Sequence[int]
    ) -> TransferResult:
        """Write blocks `block_ids` of the sender's cache into `target`: by default from host
        views of them (on a GPU, staged in pinned memory). Raises KVTransferError."""
        with source.staged(block_ids) as views:
            return self.send(target, views)

    @abstractmethod
    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        """Write `blocks` into the target reservation; returns once the receiver has every byte
        (acknowledged or committed). Raises KVTransferError."""

    def close(self) -> None:  # noqa: B027  (optional hook: most transports hold nothing)
        """Release connections; the transport is unusable afterwards."""


@cache
def host_id() -> str:
    """This host's identity: hostname plus boot id (two containers may share a hostname)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    suffix = boot.read_text().strip() if boot.exists() else ""
    return f"{socket.gethostname()}/{suffix}"
