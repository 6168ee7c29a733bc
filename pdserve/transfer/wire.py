"""Zero-copy parsing of `KVChunk` messages on the receiving side.

protobuf's parser copies the `data` field, and every read of it copies again; a 4 MiB chunk then
costs more to receive than to send. `parse_kv_chunk` reads the five fields straight from the
received buffer and returns `data` as a memoryview slice of it. Anything unexpected (unknown
fields, other wire types) falls back to the protobuf parser, so the format stays `KVChunk`.
"""

from dataclasses import dataclass

from pdserve.v1 import decode_pb2


@dataclass(frozen=True, slots=True)
class KVChunkView:
    request_id: str
    first_block: int
    num_blocks: int
    data: memoryview
    last: bool = False


def parse_kv_chunk(raw: bytes) -> KVChunkView:
    try:
        return _parse(memoryview(raw))
    except (IndexError, ValueError, UnicodeDecodeError):
        message = decode_pb2.KVChunk.FromString(raw)
        return KVChunkView(
            message.request_id,
            message.first_block,
            message.num_blocks,
            memoryview(message.data),
            message.last,
        )


def _parse(view: memoryview) -> KVChunkView:
    request_id, first_block, num_blocks, data, last = "", 0, 0, memoryview(b""), False
    position = 0
    while position < len(view):
        tag, position = _varint(view, position)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0 and field in (2, 3, 5):
            value, position = _varint(view, position)
            if field == 2:
                first_block = value
            elif field == 3:
                num_blocks = value
            else:
                last = bool(value)
        elif wire_type == 2 and field in (1, 4):
            length, position = _varint(view, position)
            if position + length > len(view):
                raise ValueError("truncated field")
            payload = view[position : position + length]
            position += length
            if field == 1:
                request_id = bytes(payload).decode()
            else:
                data = payload
        else:
            raise ValueError(f"unexpected field {field} (wire type {wire_type})")
    return KVChunkView(request_id, first_block, num_blocks, data, last)


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
