"""KV transfer between instances: one interface, several transports."""

from pdserve.transfer.base import KVReceiver, KVTransferError, KVTransport, TransferResult

__all__ = ["KVReceiver", "KVTransferError", "KVTransport", "TransferResult"]
