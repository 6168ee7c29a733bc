"""GrpcKVTransport: blocks streamed to the peer's `DecodeService.PushKV`.

Consecutive blocks are packed into messages of at most `chunk_bytes` (at least one block each);
the generator feeding the stream is pulled by gRPC as HTTP/2 flow control allows, so at most a
couple of chunks are buffered however large the transfer.
"""

import time
from collections.abc import Iterator, Sequence

import grpc

from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import KVTransferError, KVTransport, TransferResult
from pdserve.v1 import decode_pb2, decode_pb2_grpc

DEFAULT_CHUNK_BYTES = 4 * 2**20


class GrpcKVTransport(KVTransport):
    name = "grpc"

    def __init__(
        self, channels: ChannelPool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 60.0
    ) -> None:
        self._channels = channels
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s

    def send(
        self, peer: str, request_id: str, first_block: int, blocks: Sequence[memoryview]
    ) -> TransferResult:
        stub = decode_pb2_grpc.DecodeServiceStub(self._channels.get(peer))
        start = time.perf_counter()
        try:
            reply = stub.PushKV(
                self._chunks(request_id, first_block, blocks), timeout=self._timeout_s
            )
        except grpc.RpcError as e:
            raise KVTransferError(
                f"KV transfer of request {request_id} to {peer} failed: "
                f"{e.code().name}: {e.details()}"
            ) from e
        expected = sum(len(b) for b in blocks)
        if reply.blocks_received != len(blocks) or reply.bytes_received != expected:
            raise KVTransferError(
                f"peer {peer} acknowledged {reply.blocks_received} blocks / {reply.bytes_received} "
                f"bytes of request {request_id}, sent {len(blocks)} / {expected}"
            )
        return TransferResult(len(blocks), expected, time.perf_counter() - start)

    def _chunks(
        self, request_id: str, first_block: int, blocks: Sequence[memoryview]
    ) -> Iterator[decode_pb2.KVChunk]:
        index = 0
        while index < len(blocks):
            batch = [blocks[index]]
            size = len(blocks[index])
            while (
                index + len(batch) < len(blocks)
                and size + len(blocks[index + len(batch)]) <= self._chunk_bytes
            ):
                size += len(blocks[index + len(batch)])
                batch.append(blocks[index + len(batch)])
            yield decode_pb2.KVChunk(
                request_id=request_id,
                first_block=first_block + index,
                num_blocks=len(batch),
                data=b"".join(batch),
            )
            index += len(batch)
