"""FakeKVTransport: in-process delivery to registered receivers, for unit tests."""

import time
from collections.abc import Sequence

from pdserve.transfer.base import (
    KVReceiver,
    KVTarget,
    KVTransferError,
    KVTransport,
    TransferResult,
)


class FakeKVTransport(KVTransport):
    name = "fake"

    def __init__(self) -> None:
        self.receivers: dict[str, KVReceiver] = {}

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        receiver = self.receivers.get(target.address)
        if receiver is None:
            raise KVTransferError(f"no receiver registered for peer {target.address!r}")
        start = time.perf_counter()
        data = memoryview(b"".join(blocks))
        written = receiver.receive_blocks(target.request_id, target.first_block, data)
        return TransferResult(written, len(data), time.perf_counter() - start)
