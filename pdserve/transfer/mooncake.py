"""MooncakeKVTransport: KV blocks written straight into a decode instance's reserved blocks by the
Mooncake transfer engine (RDMA on GPU clusters, TCP here), then committed over gRPC.

Each instance runs one `MooncakeEngine` (P2P handshake: no metadata server) and registers its KV
cache with it at start. A decode instance's Reserve reply carries its engine's session
(`host:port`) and the address of its KV cache; the sender computes each block's remote address
(base + block id x block bytes) and writes in batches of at most `transfer.max_batch_entries`
blocks (the engine's TCP queue is bounded), checking the reservation's lease before each batch.
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
from pdserve.transfer.direct import address_of, check_bounds, commit

logger = logging.getLogger(__name__)


def mooncake_available() -> bool:
    """Whether the Mooncake transfer engine can be imported (package and libibverbs present)."""
    if importlib.util.find_spec("mooncake") is None:
        return False
    # read when the library loads: errors only (it still prints a benign "Local segment
    # descriptor not found" per engine), and a frozen peer fails a write after 10 s, not 30
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "10")
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as e:
        logger.warning("Mooncake is installed but cannot load (%s): is libibverbs1 there?", e)
        return False
    return True


class MooncakeEngine:
    """This process's Mooncake transfer engine, in P2P handshake mode."""

    def __init__(self, config: TransferConfig, hostname: str) -> None:
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


class MooncakeKVTransport(KVTransport):
    name = "mooncake"

    def __init__(
        self, config: TransferConfig, channels: ChannelPool, engine: MooncakeEngine
    ) -> None:
        self._config = config
        self._channels = channels
        self._engine = engine
        self._lock = threading.Lock()  # one batch in flight per engine

    def can_reach(self, target: KVTarget) -> bool:
        return bool(target.endpoints.mooncake_session)

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        start = time.perf_counter()
        check_bounds(target, blocks)
        size, base = target.block_bytes, target.endpoints.mooncake_base
        sources = [address_of(b) for b in blocks]
        destinations = [base + block_id * size for block_id in target.block_ids]
        step = self._config.max_batch_entries
        for first in range(0, len(blocks), step):
            target.check_deadline()
            last = min(first + step, len(blocks))
            with self._lock:
                rc = self._engine.engine.batch_transfer_sync_write(
                    target.endpoints.mooncake_session,
                    sources[first:last],
                    destinations[first:last],
                    [size] * (last - first),
                )
            if rc != 0:
                raise KVTransferError(
                    f"Mooncake write of request {target.request_id} to "
                    f"{target.endpoints.mooncake_session} failed: code {rc}"
                )
        commit(self._channels, target, len(blocks))
        return TransferResult(len(blocks), len(blocks) * size, time.perf_counter() - start)
