"""MooncakeKVTransport: KV blocks written straight into a decode instance's reserved blocks by the
Mooncake transfer engine (RDMA on GPU clusters, TCP here), then committed over gRPC.

Each instance runs a `MooncakeEngine` (P2P handshake: no metadata server) and registers its KV
cache with it at start. A decode instance's Reserve reply carries its engine's session
(`host:port`) and the address of its KV cache; the sender computes each block's remote address
(base + block id x block bytes). Blocks consecutive on both sides are written as one transfer
(at most `MAX_RUN_BYTES`); at most `transfer.max_batch_entries` transfers are in flight per sender
(the engine's TCP queue is bounded), and the reservation's lease is checked before each group.

Over TCP one transfer engine moves all its bytes on one I/O thread, in socket calls of at most
64 KiB (its asio library's limit): that thread is a sender's ceiling (about 2.5 GB/s on a
2.4 GHz EPYC core, where a blocking `sendall` reaches about 3). A prefill instance therefore
runs `transfer.mooncake_engines` engines (auto: one per four cores, at most four; one over RDMA,
whose NIC does the work) and deals its transfers round-robin over them; a decode instance
receives with one.

Completion is polled from Python with short naps (`POLL_INTERVAL_S`, the GIL released): the
library's own synchronous calls spin on a core until the transfer ends, and on a small host that
core is the one its I/O thread needs.
"""

import importlib.metadata
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.config import TransferConfig
from pdserve.errors import ConfigError, KVTransferError
from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import KVSource, KVTarget, KVTransport, TransferResult
from pdserve.transfer.direct import address_of, check_bounds, commit, copy_runs, send_by_rank

logger = logging.getLogger(__name__)

MAX_RUN_BYTES = 8 * 2**20  # a longer run is split, so that its parts spread over lanes and engines
MAX_AUTO_ENGINES = 4
CORES_PER_AUTO_ENGINE = 4
POLL_INTERVAL_S = 0.0002
_SUBMIT_FAILED = (-1, 2**64 - 1)  # `transfer_submit_write` returns -1 as an unsigned batch id
_WAITING, _FAILED, _TIMED_OUT = 0, -1, -2  # `transfer_check_status` (1: done, batch freed)


def _library_defaults() -> None:
    """Settings the library reads from the environment (an operator's own values win): errors
    only in its log (it still prints a benign "Local segment descriptor not found" per engine),
    and a frozen peer fails a write after 10 s, not 30."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "10")


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


NON_CUDA_PACKAGE = "mooncake-transfer-engine-non-cuda"
CUDA_PACKAGE = "mooncake-transfer-engine"


def check_memory_kind(device_type: str, installed: Callable[[str], bool] | None = None) -> None:
    """Refuse to register a GPU KV cache with the non-CUDA build of Mooncake (it would take a
    device pointer for host memory). Raises ConfigError naming the package to install."""
    if device_type != "cuda":
        return
    if (installed or _installed)(NON_CUDA_PACKAGE):
        raise ConfigError(
            f"the KV cache is on CUDA but the Mooncake package installed is {NON_CUDA_PACKAGE}, "
            f"which cannot send from GPU memory: install {CUDA_PACKAGE} (its CUDA build) "
            "instead, or set transfer.mooncake: false (KV then goes over gRPC)"
        )


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def sender_engines(config: TransferConfig) -> int:
    """How many transfer engines a sending instance runs: `transfer.mooncake_engines`, or when
    0 (auto) one per `CORES_PER_AUTO_ENGINE` cores this process may use, at most
    `MAX_AUTO_ENGINES`, and one over RDMA."""
    if config.mooncake_engines:
        return config.mooncake_engines
    if config.mooncake_protocol == "rdma":
        return 1
    cores = len(os.sched_getaffinity(0))
    return max(1, min(MAX_AUTO_ENGINES, cores // CORES_PER_AUTO_ENGINE))


class MooncakeEngine:
    """This process's Mooncake transfer engines, in P2P handshake mode: `count` of them, each
    with its own I/O thread. Peers write into the first (its `session`); a sender spreads its
    writes over all (`engines`)."""

    def __init__(self, config: TransferConfig, hostname: str, count: int = 1) -> None:
        _library_defaults()
        self.engines: list[Any] = []
        self._registered: list[int] = []
        try:
            for _ in range(max(1, count)):
                self.engines.append(self._start(config, hostname))
        except BaseException:
            self.close()
            raise
        self.session = f"{hostname}:{self.engines[0].get_rpc_port()}"

    @staticmethod
    def _start(config: TransferConfig, hostname: str) -> Any:
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        rc = engine.initialize(
            hostname, "P2PHANDSHAKE", config.mooncake_protocol, config.mooncake_devices or ""
        )
        if rc != 0:
            raise KVTransferError(
                f"Mooncake transfer engine failed to start on {hostname} "
                f"({config.mooncake_protocol}): code {rc}"
            )
        return engine

    def register(self, address: int, size: int) -> None:
        """Register memory that peers write into (or that these engines send from)."""
        for engine in self.engines:
            rc = engine.register_memory(address, size)
            if rc != 0:
                raise KVTransferError(f"Mooncake could not register {size} bytes: code {rc}")
        self._registered.append(address)

    def close(self) -> None:
        for address in self._registered:
            for engine in self.engines:
                engine.unregister_memory(address)
        self._registered.clear()


def deal(count: int, engines: int, first: int) -> list[int]:
    """The engine of each of `count` transfers: round-robin from engine `first`."""
    return [(first + i) % engines for i in range(count)]


def plan_writes(
    target: KVTarget, sources: Sequence[int], max_bytes: int = MAX_RUN_BYTES
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each transfer of the blocks at
    `sources`: runs of blocks that are consecutive on both sides, cut every `max_bytes` (at
    least one block each)."""
    size, base = target.block_bytes, target.endpoints.mooncake_base
    per_transfer = max(1, max_bytes // size)
    return [
        (source + i * size, base + (block_id + i) * size, min(per_transfer, count - i) * size)
        for block_id, count, source in copy_runs(target.block_ids, sources, size)
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
        self._lock = threading.Lock()  # one group of transfers in flight per sender
        self._next_engine = 0  # where the next send starts dealing (small sends take turns)
        self.writes_per_engine = [0] * len(engine.engines)  # transfers submitted, per engine

    def can_reach(self, target: KVTarget) -> bool:
        ranks = target.endpoints.ranks or (target.endpoints,)
        return all(bool(e.mooncake_session) for e in ranks)

    def send_blocks(
        self, target: KVTarget, source: KVSource, block_ids: Sequence[int]
    ) -> TransferResult:
        """Straight from the sender's registered KV cache (host or device memory: no staging
        copy), block b at `base_address + b x block_bytes`; to a tensor-parallel decode
        instance, each rank's slice from that rank's cache into decode's same rank's."""
        if not target.endpoints.ranks:
            check_bounds(target, len(block_ids), [source.block_bytes] * len(block_ids))
            size = source.block_bytes
            return self._send(target, [source.base_address + b * size for b in block_ids])

        def write(rank_target: KVTarget, rank_source: KVSource) -> None:
            size = rank_source.block_bytes
            check_bounds(rank_target, len(block_ids), [size] * len(block_ids))
            addresses = [rank_source.base_address + b * size for b in block_ids]
            self._write_all(rank_target, addresses)

        return send_by_rank(
            self._channels, target, source, block_ids, write, self._config.stall_timeout_s
        )

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        """From host memory registered with the engine (`MooncakeEngine.register`)."""
        check_bounds(target, len(blocks), [len(b) for b in blocks])
        return self._send(target, [address_of(b) for b in blocks])

    def _send(self, target: KVTarget, sources: Sequence[int]) -> TransferResult:
        start = time.perf_counter()
        self._write_all(target, sources)
        commit(self._channels, target, len(sources), self._config.stall_timeout_s)
        size = target.block_bytes
        return TransferResult(len(sources), len(sources) * size, time.perf_counter() - start)

    def _write_all(self, target: KVTarget, sources: Sequence[int]) -> None:
        """Write the blocks at `sources` into the target's; raises KVTransferError."""
        writes = plan_writes(target, sources)
        session, step = target.endpoints.mooncake_session, self._config.max_batch_entries
        for first in range(0, len(writes), step):
            target.check_deadline()
            with self._lock:
                failure = self._write(session, writes[first : first + step], target.deadline)
            if failure:
                raise KVTransferError(
                    f"Mooncake write of request {target.request_id} to {session} failed: {failure}"
                )

    def _write(self, session: str, writes: Sequence[tuple[int, int, int]], deadline: float) -> str:
        """Start every write (dealt over the engines), then wait until none is in flight (a
        write that lands after the reservation is released would corrupt another request's
        blocks), or until the lease ends (`deadline`; else the library's own limit: its
        transfer timeout plus 1 s per GiB). What went wrong, or ""."""
        engines = self._engine.engines
        dealt = deal(len(writes), len(engines), self._next_engine)
        self._next_engine = (self._next_engine + len(writes)) % len(engines)
        failure = ""
        pending = []
        for (source, destination, length), index in zip(writes, dealt, strict=True):
            engine = engines[index]
            batch = engine.transfer_submit_write(session, source, destination, length)
            if batch in _SUBMIT_FAILED:
                failure = "the transfer engine refused a write (is the peer gone?)"
                break
            pending.append((engine, batch))
            self.writes_per_engine[index] += 1
        limit = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
        give_up = min(deadline, time.monotonic() + limit + sum(w[2] for w in writes) / 2**30)
        for index, (engine, batch) in enumerate(pending):  # in submission order
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
