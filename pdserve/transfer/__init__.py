"""KV transfer between instances: one interface, several transports."""

from pdserve.errors import KVTransferError
from pdserve.transfer.base import KVEndpoints, KVReceiver, KVTarget, KVTransport, TransferResult

__all__ = [
    "KVEndpoints",
    "KVReceiver",
    "KVTarget",
    "KVTransferError",
    "KVTransport",
    "TransferResult",
]
