"""GrpcKVTransport: blocks streamed to the peer's `DecodeService.PushKV`.

Consecutive blocks are packed into messages of at most `chunk_bytes` (at least one block each);
the generator feeding the stream is pulled by gRPC as HTTP/2 flow control allows, so at most a
couple of chunks are buffered however large the transfer.
"""

import time
from collections.abc import Iterator, Sequence

import grpc

from pdserve.errors import KVTransferError
from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import KVTarget, KVTransport, TransferResult
from pdserve.v1 import decode_pb2

DEFAULT_CHUNK_BYTES = 2**20
PUSH_KV_METHOD = "/pdserve.v1.DecodeService/PushKV"
_DATA_TAG = bytes([(4 << 3) | 2])  # KVChunk.data: field 4, length-delimited


class GrpcKVTransport(KVTransport):
    """Thread-safe (the KVTransport contract): request threads send concurrently over shared
    channels.
    """

    name = "grpc"

    def __init__(
        self, channels: ChannelPool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 60.0
    ) -> None:
        self._channels = channels
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        peer, request_id, first_block = target.address, target.request_id, target.first_block
        channel = self._channels.get(peer)
        push: grpc.StreamUnaryMultiCallable[bytes, decode_pb2.PushKVReply] = channel.stream_unary(
            PUSH_KV_METHOD,
            request_serializer=None,  # `kv_chunks` encodes the messages without extra copies
            response_deserializer=decode_pb2.PushKVReply.FromString,
        )
        start = time.perf_counter()
        try:
            chunks = kv_chunks(request_id, first_block, blocks, self._chunk_bytes)
            reply = push(chunks, timeout=self._timeout_s)
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


def kv_chunks(
    request_id: str, first_block: int, blocks: Sequence[memoryview], chunk_bytes: int
) -> Iterator[bytes]:
    """Serialized `KVChunk` messages of consecutive blocks, at most `chunk_bytes` each (at
    least one block), the last one marked `last`."""
    index = 0
    while index < len(blocks):
        end, size = index + 1, len(blocks[index])
        while end < len(blocks) and size + len(blocks[end]) <= chunk_bytes:
            size += len(blocks[end])
            end += 1
        last = end == len(blocks)
        yield encode_kv_chunk(request_id, first_block + index, blocks[index:end], last)
        index = end


def encode_kv_chunk(
    request_id: str, first_block: int, blocks: Sequence[memoryview], last: bool = False
) -> bytes:
    """The wire form of `KVChunk(request_id, first_block, num_blocks, data=b"".join(blocks),
    last)`, built with one copy of the block bytes (protobuf would make three)."""
    header = decode_pb2.KVChunk(
        request_id=request_id, first_block=first_block, num_blocks=len(blocks), last=last
    ).SerializeToString()
    size = sum(len(b) for b in blocks)
    return b"".join([header, _DATA_TAG, _varint(size), *blocks])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
