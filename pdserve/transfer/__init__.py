"""KV transfer between instances: one interface, several transports."""

from pdserve.transfer.base import (
    KVEndpoints,
    KVReceiver,
    KVTarget,
    KVTransferError,
    KVTransport,
    TransferResult,
)

__all__ = [
    "KVEndpoints",
    "KVReceiver",
    "KVTarget",
    "KVTransferError",
    "KVTransport",
    "TransferResult",
]
