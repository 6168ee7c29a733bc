"""MooncakeKVTransport: KV blocks written straight into a decode instance's reserved blocks by the
Mooncake transfer engine (RDMA on GPU clusters, TCP here), then committed over gRPC.

Each instance runs one `MooncakeEngine` (P2P handshake: no metadata server) and registers its KV
cache with it at start. A decode instance's Reserve reply carries its engine's session
(`host:port`) and the address of its KV cache; the sender computes each block's remote address
(base + block id x block bytes). Blocks consecutive on both sides are written as one transfer
(at most `MAX_RUN_BYTES`); at most `transfer.max_batch_entries` transfers are in flight per engine
(the engine's TCP queue is bounded), and the reservation's lease is checked before each group.

Completion is polled from Python with short naps (`POLL_INTERVAL_S`, the GIL released): the
library's own synchronous calls spin on a core until the transfer ends, and on a small host that
core is the one its I/O thread needs.
"""

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from pdserve.config import TransferConfig
from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import KVTarget, KVTransferError, KVTransport, TransferResult
from pdserve.transfer.direct import check_bounds, commit, copy_runs

logger = logging.getLogger(__name__)

MAX_RUN_BYTES = 8 * 2**20  # a longer run is split, so that its parts spread over the lanes
POLL_INTERVAL_S = 0.0002
_SUBMIT_FAILED = (-1, 2**64 - 1)  # `transfer_submit_write` returns -1 as an unsigned batch id
_WAITING, _FAILED, _TIMED_OUT = 0, -1, -2  # `transfer_check_status` (1: done, batch freed)


def _library_defaults(config: TransferConfig | None = None) -> None:
    """Settings the library reads from the environment (an operator's own values win): errors
    only in its log (it still prints a benign "Local segment descriptor not found" per engine),
    a frozen peer fails a write after 10 s, not 30, and TCP moves data in 1 MiB reads and
    writes rather than 64 KiB ones."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "10")
    if config is not None:
        os.environ.setdefault("MC_TCP_SLICE_SIZE", str(config.mooncake_tcp_chunk_bytes))


def mooncake_available() -> bool:
    """Whether the Mooncake transfer engine can be imported (package and libibverbs present)."""
    if importlib.util.find_spec("mooncake") is None:
        return False
    _library_defaults()  # read when the library loads
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as e:
        logger.warning("Mooncake is installed but cannot load (%s): is libibverbs1 there?", e)
        return False
    return True


class MooncakeEngine:
    """This process's Mooncake transfer engine, in P2P handshake mode."""

    def __init__(self, config: TransferConfig, hostname: str) -> None:
        _library_defaults(config)
        from mooncake.engine import TransferEngine

        self.engine: Any = TransferEngine()
        rc = self.engine.initialize(
            hostname, "P2PHANDSHAKE", config.mooncake_protocol, config.mooncake_devices or ""
        )
        if rc != 0:
            raise KVTransferError(
                f"Mooncake transfer engine failed to start on {hostname} "
                f"({config.mooncake_protocol}): code {rc}"
            )
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, address: int, size: int) -> None:
        """Register memory that peers write into (or that this engine sends from)."""
        rc = self.engine.register_memory(address, size)
        if rc != 0:
            raise KVTransferError(f"Mooncake could not register {size} bytes: code {rc}")
        self._registered.append(address)

    def close(self) -> None:
        for address in self._registered:
            self.engine.unregister_memory(address)
        self._registered.clear()


def plan_writes(
    target: KVTarget, blocks: Sequence[memoryview], max_bytes: int = MAX_RUN_BYTES
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each transfer: runs of blocks that are
    consecutive on both sides, cut every `max_bytes` (at least one block each)."""
    size, base = target.block_bytes, target.endpoints.mooncake_base
    per_transfer = max(1, max_bytes // size)
    return [
        (source + i * size, base + (block_id + i) * size, min(per_transfer, count - i) * size)
        for block_id, count, source in copy_runs(target.block_ids, blocks)
        for i in range(0, count, per_transfer)
    ]


class MooncakeKVTransport(KVTransport):
    name = "mooncake"

    def __init__(
        self, config: TransferConfig, channels: ChannelPool, engine: MooncakeEngine
    ) -> None:
        self._config = config
        self._channels = channels
        self._engine = engine
        self._lock = threading.Lock()  # one group of transfers in flight per engine

    def can_reach(self, target: KVTarget) -> bool:
        return bool(target.endpoints.mooncake_session)

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        start = time.perf_counter()
        check_bounds(target, blocks)
        writes = plan_writes(target, blocks)
        session, step = target.endpoints.mooncake_session, self._config.max_batch_entries
        for first in range(0, len(writes), step):
            target.check_deadline()
            with self._lock:
                failure = self._write(session, writes[first : first + step], target.deadline)
            if failure:
                raise KVTransferError(
                    f"Mooncake write of request {target.request_id} to {session} failed: {failure}"
                )
        commit(self._channels, target, len(blocks))
        size = target.block_bytes
        return TransferResult(len(blocks), len(blocks) * size, time.perf_counter() - start)

    def _write(self, session: str, writes: Sequence[tuple[int, int, int]], deadline: float) -> str:
        """Start every write, then wait until none is in flight (a write that lands after the
        reservation is released would corrupt another request's blocks), or until the lease
        ends (`deadline`; else the library's own limit: its transfer timeout plus 1 s per GiB).
        What went wrong, or ""."""
        engine = self._engine.engine
        failure = ""
        pending = []
        for source, destination, length in writes:
            batch = engine.transfer_submit_write(session, source, destination, length)
            if batch in _SUBMIT_FAILED:
                failure = "the transfer engine refused a write (is the peer gone?)"
                break
            pending.append(batch)
        limit = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
        give_up = min(deadline, time.monotonic() + limit + sum(w[2] for w in writes) / 2**30)
        for index, batch in enumerate(pending):  # in submission order, the order they finish in
            while (status := engine.transfer_check_status(batch)) == _WAITING:
                if time.monotonic() >= give_up:
                    logger.error(
                        "Mooncake writes to %s still in flight at their deadline: %d abandoned",
                        session,
                        len(pending) - index,
                    )
                    return failure or "writes did not finish before the reservation's lease ended"
                time.sleep(POLL_INTERVAL_S)
            if status == _FAILED:
                failure = failure or "a write failed"
            elif status == _TIMED_OUT:  # reported once; the library keeps the batch
                failure = failure or "a write timed out"
        return failure
