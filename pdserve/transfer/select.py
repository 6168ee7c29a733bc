"""Per-pair transport choice: `transfer.transport` names one, or `auto` picks the first that
reaches the decode instance: CUDA IPC (both KV caches on GPUs of this host, decode's visible
here), shared memory (decode's CPU cache on this host), Mooncake (both ends run it), else gRPC."""

import logging
import threading
from typing import TYPE_CHECKING

from pdserve.choices import TransportName
from pdserve.config import TransferConfig
from pdserve.errors import KVTransferError
from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import KVTarget, KVTransport
from pdserve.transfer.direct import ShmKVTransport
from pdserve.transfer.grpc import GrpcKVTransport

if TYPE_CHECKING:
    from pdserve.transfer.mooncake import MooncakeEngine

logger = logging.getLogger(__name__)

# `auto` tries these in order, then falls back to gRPC, which reaches every decode instance.
AUTO_ORDER = (TransportName.CUDA_IPC, TransportName.SHM, TransportName.MOONCAKE)
if {TransportName.AUTO, *AUTO_ORDER, TransportName.GRPC} != set(TransportName):
    raise TypeError("TransportSelector must handle every TransportName (AUTO_ORDER + grpc)")


class TransportSelector:
    """Thread-safe: request threads choose concurrently; a lock guards the per-pair choices."""

    def __init__(
        self,
        config: TransferConfig,
        channels: ChannelPool,
        chunk_bytes: int,
        mooncake: "MooncakeEngine | None" = None,
        cuda_ipc: KVTransport | None = None,
    ) -> None:
        """`cuda_ipc`: the sender's `CudaIpcKVTransport` (it knows where the sender's KV cache
        lives, which `can_reach` needs and a target cannot tell); None: not offered."""
        self.config = config
        self.transports: dict[str, KVTransport] = {
            TransportName.GRPC: GrpcKVTransport(
                channels, chunk_bytes, stall_timeout_s=config.stall_timeout_s
            ),
            TransportName.SHM: ShmKVTransport(channels, config.stall_timeout_s),
        }
        if cuda_ipc is not None:
            self.transports[TransportName.CUDA_IPC] = cuda_ipc
        if mooncake is not None:
            from pdserve.transfer.mooncake import MooncakeKVTransport

            self.transports[TransportName.MOONCAKE] = MooncakeKVTransport(
                config, channels, mooncake
            )
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def choose(self, target: KVTarget) -> KVTransport:
        """The transport for this target. Raises KVTransferError when a forced one cannot reach
        it."""
        mode = self.config.transport
        if mode == TransportName.AUTO:
            chosen = next(
                (
                    transport
                    for name in AUTO_ORDER
                    if (transport := self.transports.get(name)) is not None
                    and transport.can_reach(target)
                ),
                self.transports[TransportName.GRPC],
            )
        else:
            forced = self.transports.get(mode)
            if forced is None or not forced.can_reach(target):
                raise KVTransferError(
                    f"transfer.transport is {mode}, which cannot reach decode {target.address} "
                    "(not on this host, not offered, its GPU not visible, or not installed; the "
                    "log says why): use auto or grpc"
                )
            chosen = forced
        with self._lock:
            if (target.address, chosen.name) not in self._logged:
                self._logged.add((target.address, chosen.name))
                logger.info("KV transfers to %s use %s", target.address, chosen.name)
        return chosen

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
