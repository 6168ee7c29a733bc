"""GrpcKVTransport: blocks streamed to the peer's `DecodeService.PushKV`.

Consecutive blocks are packed into messages of at most `chunk_bytes` (at least one block each);
the generator feeding the stream is pulled by gRPC as HTTP/2 flow control allows, so at most a
couple of chunks are buffered however large the transfer. A transfer has no overall deadline:
it is cut only when it stalls, when gRPC has taken no chunk (or, after the last, no reply came)
for `stall_timeout_s` — a receiver that stopped reading, a network that stopped moving.
"""

import time
from collections.abc import Iterator, Sequence
from typing import Any

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
        self,
        channels: ChannelPool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout_s: float = 10.0,
    ) -> None:
        self._channels = channels
        self._chunk_bytes = chunk_bytes
        self._stall_timeout_s = stall_timeout_s

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        peer, request_id, first_block = target.address, target.request_id, target.first_block
        channel = self._channels.get(peer)
        push: grpc.StreamUnaryMultiCallable[bytes, decode_pb2.PushKVReply] = channel.stream_unary(
            PUSH_KV_METHOD,
            request_serializer=None,  # `kv_chunks` encodes the messages without extra copies
            response_deserializer=decode_pb2.PushKVReply.FromString,
        )
        start = time.perf_counter()
        chunks = _Progress(kv_chunks(request_id, first_block, blocks, self._chunk_bytes))
        call = push.future(chunks)
        try:
            reply = self._reply(call, chunks)
        except grpc.RpcError as e:
            raise KVTransferError(
                f"KV transfer of request {request_id} to {peer} failed: "
                f"{e.code().name}: {e.details()}"
            ) from e
        except TimeoutError:
            call.cancel()
            raise KVTransferError(
                f"KV transfer of request {request_id} to {peer} stalled: no bytes moved for "
                f"{self._stall_timeout_s:g} s (transfer.stall_timeout_s)"
            ) from None
        expected = sum(len(b) for b in blocks)
        if reply.blocks_received != len(blocks) or reply.bytes_received != expected:
            raise KVTransferError(
                f"peer {peer} acknowledged {reply.blocks_received} blocks / {reply.bytes_received} "
                f"bytes of request {request_id}, sent {len(blocks)} / {expected}"
            )
        return TransferResult(len(blocks), expected, time.perf_counter() - start)

    def _reply(self, call: "grpc.Future[Any]", chunks: "_Progress") -> decode_pb2.PushKVReply:
        """The call's reply; raises its RpcError, or TimeoutError once it stalled."""
        while True:
            left = chunks.moved_at + self._stall_timeout_s - time.monotonic()
            try:
                reply: decode_pb2.PushKVReply = call.result(timeout=max(left, 0.0))
                return reply
            except grpc.FutureTimeoutError:
                if time.monotonic() - chunks.moved_at >= self._stall_timeout_s:
                    raise TimeoutError from None


class _Progress:
    """The chunks of one transfer, noting when gRPC last took one (flow control lets it take
    the next only as the receiver reads)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self.moved_at = time.monotonic()

    def __iter__(self) -> "_Progress":
        return self

    def __next__(self) -> bytes:
        chunk = next(self._chunks)
        self.moved_at = time.monotonic()
        return chunk


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
