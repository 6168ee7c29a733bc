"""The generated code in pdserve/v1/ must match proto/ (run `make proto` after editing a .proto)."""

import os
import subprocess
import sys
from pathlib import Path

from pdserve.transfer.grpc import encode_kv_chunk
from pdserve.transfer.wire import parse_kv_chunk
from pdserve.v1 import decode_pb2

ROOT = Path(__file__).parents[2]


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-Iproto",
            f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *protos,
        ],
        cwd=ROOT, check=True, env=env, capture_output=True,
    )  # fmt: skip
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*")}
    committed = {
        p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "pdserve" / "v1").glob("*_pb2*.py*")
    }
    assert len(generated) == len(protos) * 4
    stale = sorted(str(path) for path in generated if committed.get(path) != generated[path])
    extra = sorted(str(path) for path in set(committed) - set(generated))
    assert not stale and not extra, f"run `make proto`: stale {stale}, unexpected {extra}"


def test_hand_encoded_kv_chunk_parses_as_the_proto_message() -> None:
    blocks = [memoryview(bytes(range(i, i + 64))) for i in range(3)]
    wire = encode_kv_chunk("req-1", 7, blocks)
    parsed = decode_pb2.KVChunk.FromString(wire)
    assert (parsed.request_id, parsed.first_block, parsed.num_blocks) == ("req-1", 7, 3)
    assert parsed.data == b"".join(blocks)
    big = [memoryview(bytes(300))]  # a length that needs a two-byte varint
    assert decode_pb2.KVChunk.FromString(encode_kv_chunk("r", 0, big)).data == bytes(300)


def test_zero_copy_parser_reads_what_protobuf_writes() -> None:
    message = decode_pb2.KVChunk(request_id="ré", first_block=300, num_blocks=2, data=b"x" * 70000)
    view = parse_kv_chunk(message.SerializeToString())
    assert (view.request_id, view.first_block, view.num_blocks) == ("ré", 300, 2)
    assert bytes(view.data) == b"x" * 70000
    hand = parse_kv_chunk(encode_kv_chunk("a", 1, [memoryview(b"12"), memoryview(b"34")], True))
    assert (hand.request_id, hand.first_block, hand.num_blocks, bytes(hand.data), hand.last) == (
        "a", 1, 2, b"1234", True,
    )  # fmt: skip
    assert not parse_kv_chunk(encode_kv_chunk("a", 1, [memoryview(b"12")])).last
    assert parse_kv_chunk(b"").num_blocks == 0
