"""Direct-write transports (shared memory, Mooncake over TCP) into the reservations of a real
decode instance (its KV cache in shared memory and registered with its Mooncake engine): the
bytes land in the reserved blocks whether decode's block ids follow each other or not, and
Mooncake writes runs of blocks consecutive on both sides as single transfers."""

import multiprocessing
import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from credentials import SECRET, channels

from pdserve.config import DecodeConfig, EngineConfig, TransferConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import KVTransferError
from pdserve.instance.convert import endpoints_from_proto, generate_request
from pdserve.model.shm_segments import segment_path
from pdserve.rpc.server import AioServer
from pdserve.transfer.base import KVTarget, KVTransport
from pdserve.transfer.direct import ShmKVTransport, address_of
from pdserve.transfer.mooncake import MooncakeEngine, MooncakeKVTransport, plan_writes
from pdserve.v1 import common_pb2, common_pb2_grpc, decode_pb2, decode_pb2_grpc
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

BLOCK_SIZE = 16
NUM_BLOCKS = 64
SUBSCRIBER = "router-1"


def serve(model_dir: str, secret: str) -> tuple[DecodeInstance, AioServer, int]:
    engine = EngineConfig(model=model_dir, num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=False)
    return serve_decode(
        engine,
        DecodeConfig(),
        transfer=TransferConfig(transport="mooncake"),  # its engine too, on loopback
        secret=secret,
    )


@pytest.fixture
def decode(tiny_model_dir: Path) -> Iterator[tuple[DecodeInstance, str]]:
    instance, server, port = serve(str(tiny_model_dir), SECRET)
    try:
        yield instance, f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait()
        instance.stop()


class Sender:
    """The sending side: source blocks in one registered buffer, and a transport."""

    def __init__(self, name: str, address: str, block_bytes: int, engines: int = 1) -> None:
        self.address = address
        self.channels = channels()
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(address))
        # the output subscription a router holds there: reservations name it
        instance = common_pb2_grpc.InstanceServiceStub(self.channels.get(address))
        self.outputs = instance.SubscribeOutputs(
            common_pb2.OutputsRequest(subscriber=SUBSCRIBER), timeout=120
        )
        assert not next(self.outputs).outputs  # open
        self.source = bytearray(random.Random(7).randbytes(NUM_BLOCKS * block_bytes))
        view = memoryview(self.source)
        self.blocks = [view[i * block_bytes : (i + 1) * block_bytes] for i in range(NUM_BLOCKS)]
        self.engine: MooncakeEngine | None = None
        self.transport: KVTransport
        if name == "shm":
            self.transport = ShmKVTransport(self.channels)
        else:
            config = TransferConfig()
            self.engine = MooncakeEngine(config, "127.0.0.1", engines)
            self.engine.register(address_of(view), len(self.source))
            self.transport = MooncakeKVTransport(config, self.channels, self.engine)
        self.serial = 0

    def reserve(self, request_id: str, num_blocks: int) -> KVTarget:
        self.serial += 1
        prompt = [32 + (self.serial * 31 + 7 * i) % 90 for i in range(num_blocks * BLOCK_SIZE)]
        params = SamplingParams(max_tokens=1)
        request = generate_request(request_id, prompt, params, subscriber=SUBSCRIBER)
        reply = self.stub.Reserve(decode_pb2.ReserveRequest(request=request))
        assert reply.num_blocks == num_blocks
        return KVTarget(
            self.address,
            request_id,
            0,
            tuple(reply.block_ids),
            reply.block_bytes,
            endpoints_from_proto(reply.endpoints),
        )

    def abort(self, request_id: str) -> None:
        common_pb2_grpc.InstanceServiceStub(self.channels.get(self.address)).Abort(
            common_pb2.AbortRequest(request_id=request_id)
        )

    def close(self) -> None:
        self.outputs.cancel()
        self.transport.close()
        if self.engine is not None:
            self.engine.close()
        self.channels.close()


def received(instance: DecodeInstance, request_id: str) -> list[bytes]:
    def block_table(engine: LLMEngine) -> list[int]:
        return list(engine.kv_cache.block_table(request_id))

    runtime = instance.runtime
    with runtime.stager.staged(runtime.loop.call(block_table)) as views:
        return [bytes(view) for view in views]


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_blocks_land_in_reservations_whatever_decode_block_ids_they_get(
    transport: str, decode: tuple[DecodeInstance, str]
) -> None:
    instance, address = decode
    sender = Sender(transport, address, instance.runtime.stager.block_bytes)
    try:
        # a fresh pool hands out consecutive ids: one transfer
        ascending = sender.reserve("ascending", 4)
        assert len(plan_writes(ascending, [address_of(b) for b in sender.blocks[:4]])) == 1
        check_send(instance, sender, ascending, sender.blocks[:4])
        # holes: the blocks of two aborted reservations and the one block left at the end
        sender.reserve("middle", 4)
        sender.reserve("last", 4)
        sender.reserve("fill", NUM_BLOCKS - 12 - 3)  # decode keeps a block per reservation
        sender.abort("ascending")
        sender.abort("last")
        mixed = sender.reserve("mixed", 8)
        assert 1 < len(plan_writes(mixed, [address_of(b) for b in sender.blocks[20:28]])) < 8
        check_send(instance, sender, mixed, sender.blocks[20:28])
    finally:
        for request_id in ("ascending", "middle", "last", "fill", "mixed"):
            sender.abort(request_id)
        sender.close()
    assert instance.stats().num_reservations == 0
    instance.check_integrity()


def test_a_sender_deals_its_writes_over_its_engines(decode: tuple[DecodeInstance, str]) -> None:
    """Two sending engines (two I/O threads): every run of blocks goes through one of them, in
    turn from send to send, and each lands in decode's reserved blocks."""
    instance, address = decode
    sender = Sender("mooncake", address, instance.runtime.stager.block_bytes, engines=2)
    assert isinstance(sender.transport, MooncakeKVTransport)
    try:
        one = sender.reserve("one", 4)
        assert len(plan_writes(one, [address_of(b) for b in sender.blocks[:4]])) == 1
        check_send(instance, sender, one, sender.blocks[:4])
        assert sender.transport.writes_per_engine == [1, 0]
        # every other block of the source: 8 runs of one block, four through each engine
        spread = sender.reserve("spread", 8)
        check_send(instance, sender, spread, sender.blocks[8:24:2])
        assert sender.transport.writes_per_engine == [5, 4]
    finally:
        for request_id in ("one", "spread"):
            sender.abort(request_id)
        sender.close()
    assert instance.stats().num_reservations == 0
    instance.check_integrity()


def check_send(
    instance: DecodeInstance, sender: Sender, target: KVTarget, blocks: list[memoryview]
) -> None:
    result = sender.transport.send(target, blocks)
    assert result.num_blocks == len(blocks)
    assert received(instance, target.request_id) == [bytes(b) for b in blocks]


def test_a_write_into_an_aborted_reservation_is_a_typed_error(
    decode: tuple[DecodeInstance, str],
) -> None:
    """The Mooncake write lands, but the commit finds no reservation: the sender gets a
    KVTransferError, and decode holds nothing."""
    instance, address = decode
    sender = Sender("mooncake", address, instance.runtime.stager.block_bytes)
    try:
        target = sender.reserve("gone", 4)
        sender.abort("gone")
        with pytest.raises(KVTransferError, match="gone"):
            sender.transport.send(target, sender.blocks[:4])
    finally:
        sender.close()
    assert instance.stats().num_reservations == 0
    instance.check_integrity()


def test_the_shared_kv_cache_has_its_pages_from_the_start(
    decode: tuple[DecodeInstance, str],
) -> None:
    """Allocated when the instance starts, not on first touch: a /dev/shm that fills up later
    cannot kill the instance with SIGBUS in the middle of a transfer."""
    instance, _ = decode
    runner = instance.runtime.engine.runner
    assert runner.segment is not None
    nbytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    stat = os.stat(segment_path(runner.segment.name))
    assert stat.st_blocks * 512 >= nbytes


def serve_until_killed(model_dir: str, secret: str, started: "Queue[tuple[int, str, int]]") -> None:
    """A decode instance in a process of its own: (port, KV segment, block bytes) to `started`."""
    instance, _, port = serve(model_dir, secret)
    runner = instance.runtime.engine.runner
    assert runner.segment is not None
    started.put((port, runner.segment.name, instance.runtime.stager.block_bytes))
    threading.Event().wait()


def test_a_killed_decodes_kv_cache_is_freed_once_another_starts(tiny_model_dir: Path) -> None:
    """A decode instance SIGKILLed after a prefill wrote into its KV cache: the next instance
    to start on the host removes the cache's segment, and the prefill drops its mapping of it
    as it maps the new instance's (else the dead cache's memory would stay taken)."""
    context = multiprocessing.get_context("spawn")
    started: Queue[tuple[int, str, int]] = context.Queue()
    child = context.Process(target=serve_until_killed, args=(str(tiny_model_dir), SECRET, started))
    child.start()
    port, dead_segment, block_bytes = started.get(timeout=120)
    sender = Sender("shm", f"127.0.0.1:{port}", block_bytes)
    try:
        sender.transport.send(sender.reserve("before", 2), sender.blocks[:2])
        assert dead_segment in Path("/proc/self/maps").read_text()
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert segment_path(dead_segment).exists()  # nobody could remove it
        instance, server, new_port = serve(str(tiny_model_dir), SECRET)
        try:
            assert not segment_path(dead_segment).exists()
            after = Sender("shm", f"127.0.0.1:{new_port}", block_bytes)
            try:
                sender.transport.send(after.reserve("after", 2), sender.blocks[:2])
                # before the subscription closes: decode then drops the request's blocks
                assert received(instance, "after") == [bytes(b) for b in sender.blocks[:2]]
            finally:
                after.close()
            assert dead_segment not in Path("/proc/self/maps").read_text()
        finally:
            server.stop(0).wait()
            instance.stop()
    finally:
        sender.close()
        if child.is_alive():
            child.kill()
            child.join()
