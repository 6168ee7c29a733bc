"""KV transfer: each transport against its baseline, and a TTFT breakdown of one PD request.

    python benchmarks/kv_transfer.py [--quick] [--sizes BYTES:BLOCKS,...]
        [--transport grpc,shm,mooncake] [--skip-ttft] [--prompt-len N]

Transfer, for each block size of `--sizes` (default 1,000 of the tiny model's 64 KiB blocks, then
256 Llama-3-8B-shaped blocks of 2 MiB: 16 tokens x 32 layers x 8 KV heads x 128 dims x K and V x
bf16): the blocks are moved over loopback into reservations of a real decode instance
(`serve_decode`, tiny model, fp32, block size = block bytes / 4 KiB tokens) running in a separate
process, as a decode instance does, its KV cache in shared memory and registered with Mooncake.
A reservation holds the KV of one prompt, made with the Reserve RPC: a prompt under 4,096 tokens
in blocks of 16 tokens, whatever a block's bytes (at most 255 blocks; the 64 KiB case gets 4
reservations of 250 blocks, the 2 MiB case 2 of 128: a 2,048-token Llama-3-8B prompt each). A
2 MiB block holds 512 tiny-model tokens, so the receiver loads the tiny model with its context
raised to fit such a prompt (a copy of its config; the weights are linked). Reservations are
sent one after the other (the timed span), aborted and made afresh every round; the first round
of each transport checks every byte in the receiving process.

Each transport runs next to its baseline, measured between the same processes in the same run:
  grpc     `GrpcKVTransport.send`     vs bare grpcio: a generic stream-unary handler counting
           prebuilt `bytes` messages of exactly the transport's sizes (`--chunk-bytes`)
  shm      `ShmKVTransport.send`      vs memcpy of the same blocks within the sending process
  mooncake `MooncakeKVTransport.send` vs raw loopback TCP (length + blocks per reservation into a
           ring buffer with `recv_into`, acknowledged); the sender runs `--mooncake-engines`
           transfer engines (default: as a prefill instance, `transfer.mooncake_engines` auto)
Direct transports include their CommitKV call. Each transport alternates round by round with its
own baseline (which goes first flips). `ratio_<transport>` = median over rounds of transport GB/s
/ baseline GB/s (GB = 10^9 bytes) for the 2 MiB block; `ratio_<transport>_64k` for 64 KiB.
Targets: grpc >= 0.8, mooncake >= 0.8, shm >= 0.5.
Each timed span also records the CPU time of both processes (`<side>_cpu_ms_per_gib`: sender +
receiver, per GiB moved) and the loopback packets (`<side>_packets_per_mib`, from
/proc/net/dev: the host's, so other traffic adds to it); `cpu_ratio_<transport>` = median over
rounds of the transport's CPU per byte / its baseline's. When both processes share few cores and
keep them busy, GB/s follows CPU per byte: ratio ~ 1 / cpu_ratio.

TTFT: one `--prompt-len`-token prompt (2,048; distinct every round: no prefix-cache hits) through
in-process `serve_prefill` + `serve_decode` instances (tiny model, block size 16) behind an
in-process router (`serve_router`; `Router.generate` run on the router's event loop, the path of
every HTTP request without the OpenAI formatting), max 2 tokens: reserve, queue, prefill compute,
KV transfer and handoff come from `PrefillResult.timings` (the final event's `prefill`); the
router's loop measures TTFT (call to first token) and the first decode step (first token to
second; the step starts at the handoff, so it may partly overlap the first token's delivery).
`--threads` (default 1) sets torch threads: on the shared 2-core box two OpenMP threads slow a
forward pass ~10x whenever another process holds a core.
"""

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import random
import resource
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import numpy as np
import torch
from _common import finish, median, parse_args, print_table, repeats

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig, TransferConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.instance.convert import endpoints_from_proto, generate_request
from pdserve.model.config import ModelConfig
from pdserve.model.kv_layout import kv_layout
from pdserve.model.parallel import SINGLE
from pdserve.model.staging import KVStager
from pdserve.model.tiny import default_model_dir
from pdserve.rpc.auth import new_secret
from pdserve.rpc.channels import CHANNEL_OPTIONS, ChannelPool
from pdserve.transfer.base import KVTarget, KVTransport
from pdserve.transfer.direct import ShmKVTransport, address_of
from pdserve.transfer.grpc import DEFAULT_CHUNK_BYTES, GrpcKVTransport
from pdserve.transfer.mooncake import MooncakeEngine, MooncakeKVTransport, sender_engines
from pdserve.v1 import common_pb2, common_pb2_grpc, decode_pb2, decode_pb2_grpc
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router
from services.router.server import RunningRouter, serve_router

SECRET = new_secret()  # this run's cluster secret (given to the receiving process)

NAME = "kv_transfer"
RATIO_TARGET = 0.8
DEFAULT_BLOCK_SIZE = 16  # tokens per block (the engine default)
SERVER_WORKERS = 32  # as pdserve.rpc.server.create_server
SINK_SERVICE = "pdserve.bench.ByteSink"
RECEIVE_BUFFER_BYTES = 256 * 2**20  # the TCP sink's receive buffer (a ring): bigger than caches
GB = 1e9
DEFAULT_SIZES = "65536:1000,2097152:256"
QUICK_SIZES = "65536:200,2097152:64"
PROMPT_TOKENS = 4096  # a reservation holds one prompt shorter than this, in blocks of
PROMPT_BLOCK_TOKENS = DEFAULT_BLOCK_SIZE  # 16 tokens (the tiny model's and Llama-3-8B's)
TARGETS = {"grpc": 0.8, "mooncake": 0.8, "shm": 0.5}
BIG_BLOCK = 2 * 2**20  # the Llama-3-8B-shaped block: its ratios are the headline keys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        default=None,
        help="block bytes:blocks per round, comma-separated (block bytes a multiple of the tiny "
        f"model's 4 KiB of fp32 KV per token); default {DEFAULT_SIZES} ({QUICK_SIZES} quick)",
    )
    parser.add_argument(
        "--transport",
        default="grpc,shm,mooncake",
        help="transports to measure, each next to its baseline (grpc: bare grpcio; shm: memcpy; "
        "mooncake: raw loopback TCP)",
    )
    parser.add_argument(
        "--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="gRPC message size"
    )
    parser.add_argument("--prompt-len", type=int, default=2048, help="TTFT prompt tokens")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of both instances (default 1)"
    )
    parser.add_argument(
        "--mooncake-engines",
        type=int,
        default=0,
        help="sending Mooncake engines (0: auto, as transfer.mooncake_engines)",
    )
    parser.add_argument("--skip-ttft", action="store_true", help="only the transfer comparison")


def parse_sizes(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]
        return [(size, blocks) for size, blocks in pairs]
    except ValueError as e:
        raise SystemExit(f"--sizes: expected BYTES:BLOCKS,...: {e}") from e


# -- transfer ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """How `num_blocks` blocks of `block_bytes` are split into reservations and messages."""

    block_bytes: int
    block_size: int  # tokens per block
    blocks_per_request: list[int]
    blocks_per_message: int
    chunk_bytes: int
    context: int  # the model's context window (tokens)

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_per_request)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def message_sizes(self, blocks: int) -> list[int]:
        """Bytes of each message of one reservation's stream (as `kv_chunks`)."""
        full, rest = divmod(blocks, self.blocks_per_message)
        sizes = [self.blocks_per_message * self.block_bytes] * full
        return sizes + ([rest * self.block_bytes] if rest else [])


def plan_transfer(
    num_blocks: int, block_bytes: int | None, chunk_bytes: int, context: int, token_bytes: int
) -> TransferPlan:
    """Block size in tiny-model tokens for `block_bytes`, and the fewest reservations (each the
    prompt of one request: under `PROMPT_TOKENS` tokens in blocks of `PROMPT_BLOCK_TOKENS`) that
    cover `num_blocks`, split as evenly as possible. The plan's context is the model's, raised
    when a reservation's prompt needs more tiny-model tokens."""
    block_bytes = block_bytes or DEFAULT_BLOCK_SIZE * token_bytes
    if block_bytes <= 0 or block_bytes % token_bytes:
        raise SystemExit(f"--block-bytes must be a positive multiple of {token_bytes}")
    if num_blocks < 1:
        raise SystemExit("--blocks must be at least 1")
    block_size = block_bytes // token_bytes
    per_prompt = (PROMPT_TOKENS - 1) // PROMPT_BLOCK_TOKENS
    num_requests = -(-num_blocks // per_prompt)
    base, extra = divmod(num_blocks, num_requests)
    split = [base + (1 if i < extra else 0) for i in range(num_requests)]
    per_message = max(1, chunk_bytes // block_bytes)
    context = max(context, max(split) * block_size + block_size)  # room for one output token
    return TransferPlan(block_bytes, block_size, split, per_message, chunk_bytes, context)


def long_context_model(directory: Path, context: int) -> Path:
    """The tiny model with its context window raised to `context` tokens: its config.json
    rewritten under `directory`, its other files linked."""
    source = default_model_dir()
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = context
    (directory / "config.json").write_text(json.dumps(config))
    for path in source.iterdir():
        if path.name != "config.json":
            (directory / path.name).symlink_to(path)
    return directory


class Prompts:
    """Distinct token sequences (every call gives fresh ones): no prefix-cache hits anywhere."""

    def __init__(self) -> None:
        self._serial = 0

    def take(self, length: int) -> list[int]:
        self._serial += 1
        seed = self._serial * 1_000_003
        return [32 + (seed + 7 * i * i + 13 * i) % 95 for i in range(length)]


def random_bytes(size: int, seed: int = 0) -> bytearray:
    """`size` pseudo-random bytes (KV-like: nothing compresses or repeats)."""
    data = bytearray(size)
    rng = random.Random(seed)
    step = 16 * 2**20
    for offset in range(0, size, step):
        data[offset : offset + step] = rng.randbytes(min(step, size - offset))
    return data


def touched_buffer(size: int) -> bytearray:
    """Zeroes whose pages are mapped already: no baseline pays first-touch page faults (the
    decode instance allocates its shared KV cache's pages when it starts)."""
    buffer = bytearray(size)
    np.frombuffer(buffer, dtype=np.uint8).fill(0)
    return buffer


def block_digests(blocks: Sequence[memoryview | bytes]) -> list[bytes]:
    return [hashlib.blake2b(block, digest_size=16).digest() for block in blocks]


class ByteSink:
    """Bare grpcio: a generic stream-unary service of raw `bytes` messages (identity
    serializers) that counts a stream's bytes: the cost of grpcio alone."""

    def __init__(self) -> None:
        handler = grpc.method_handlers_generic_handler(
            SINK_SERVICE, {"Count": grpc.stream_unary_rpc_method_handler(self._count)}
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=SERVER_WORKERS),
            handlers=[handler],
            options=CHANNEL_OPTIONS,
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @staticmethod
    def _count(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        received = 0
        for message in request_iterator:
            received += len(message)
        return received.to_bytes(8, "little")

    def close(self) -> None:
        self.server.stop(0).wait()


class TcpSink:
    """Raw loopback TCP: each stream is an 8-byte length then that many bytes, received into a
    ring buffer (`recv_into`: one copy, like any receiver), then a 1-byte acknowledgement."""

    def __init__(self, buffer_bytes: int) -> None:
        self._buffer = memoryview(touched_buffer(buffer_bytes))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self._listener.accept()
            with connection:
                while header := _recv_exactly(connection, memoryview(bytearray(8))):
                    remaining, offset = int.from_bytes(header, "little"), 0
                    while remaining:
                        if offset == len(self._buffer):
                            offset = 0
                        room = self._buffer[offset : offset + remaining]
                        got = connection.recv_into(room)
                        if not got:
                            return
                        offset, remaining = offset + got, remaining - got
                    connection.sendall(b"k")

    def close(self) -> None:
        self._listener.close()


def _recv_exactly(connection: socket.socket, view: memoryview) -> bytes:
    got = 0
    while got < len(view):
        n = connection.recv_into(view[got:])
        if not n:
            return b""
        got += n
    return bytes(view)


def receiver_main(conn: Connection, engine_config: EngineConfig, threads: int, secret: str) -> None:
    """The receiving process: a decode instance (its KV cache in shared memory and registered
    with Mooncake), a grpcio byte sink and a TCP sink. Sends back their ports, then answers
    verification requests (request ids, expected block digests -> an error or "") until None."""
    torch.set_num_threads(threads)
    instance, server, port = serve_decode(
        engine_config,
        DecodeConfig(reservation_timeout_s=600),
        transfer=TransferConfig(transport="mooncake"),  # its Mooncake engine too, on loopback
        secret=secret,
    )
    sink, tcp = ByteSink(), TcpSink(RECEIVE_BUFFER_BYTES)
    try:
        conn.send((port, sink.port, tcp.port))
        while (command := conn.recv()) is not None:
            if command == "cpu":
                conn.send(process_cpu_seconds())
                continue
            request_ids, expected = command
            conn.send(verify_blocks(instance, request_ids, expected))
    finally:
        tcp.close()
        sink.close()
        server.stop(0).wait()
        instance.stop()


def process_cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def loopback_packets() -> int:
    """Packets received by the loopback interface since boot (/proc/net/dev)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[1])
    return 0


@dataclass(frozen=True, slots=True)
class Reading:
    """One timed span: wall seconds, CPU seconds of both processes, loopback packets."""

    seconds: float
    cpu_seconds: float
    packets: int


class Span:
    """Measures one timed span; the CPU readings (one of them a pipe round trip to the
    receiver) are taken outside the wall-clock interval."""

    def __init__(self, receiver: "Receiver") -> None:
        self._receiver = receiver
        self._cpu = receiver.cpu_seconds() + process_cpu_seconds()
        self._packets = loopback_packets()
        self._start = time.perf_counter()

    def stop(self) -> Reading:
        seconds = time.perf_counter() - self._start
        packets = loopback_packets() - self._packets
        cpu = self._receiver.cpu_seconds() + process_cpu_seconds() - self._cpu
        return Reading(seconds, cpu, packets)


def verify_blocks(
    instance: DecodeInstance, request_ids: Sequence[str], expected: list[bytes]
) -> str:
    """An empty string when the reservations' blocks in the KV cache hold the expected bytes,
    block for block; else what differs."""
    runtime = instance.runtime
    received: list[bytes] = []
    for request_id in request_ids:

        def block_table(engine: LLMEngine, request_id: str = request_id) -> list[int]:
            return list(engine.kv_cache.block_table(request_id))

        with runtime.stager.staged(runtime.loop.call(block_table)) as views:
            received += block_digests(views)
    if len(received) != len(expected):
        return f"{len(received)} blocks reserved, {len(expected)} sent"
    for index, (got, sent) in enumerate(zip(received, expected, strict=True)):
        if got != sent:
            return f"block {index} arrived corrupted"
    return ""


class Receiver:
    """The receiving process (`receiver_main`), started with `spawn`: the sender and the receivers
    run in different processes, as prefill and decode instances do."""

    def __init__(self, engine_config: EngineConfig, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=receiver_main, args=(child, engine_config, threads, SECRET), daemon=True
        )
        self._process.start()
        child.close()
        if not self._conn.poll(120):
            self.close()
            raise RuntimeError("the receiver process did not start within 120 s")
        self.decode_port, self.sink_port, self.tcp_port = self._conn.recv()

    def cpu_seconds(self) -> float:
        """The receiving process's CPU time so far."""
        self._conn.send("cpu")
        return float(self._conn.recv())

    def verify(self, request_ids: Sequence[str], expected: list[bytes]) -> None:
        self._conn.send((list(request_ids), expected))
        error = self._conn.recv()
        if error:
            raise RuntimeError(f"KV transfer verification failed: {error}")

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # a dead receiver has closed its end
                self._conn.send(None)
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


class Senders:
    """Every side of one block size, in the sending process: the transports into fresh
    reservations (the Reserve RPC) of the receiver's decode instance, and the baselines."""

    def __init__(
        self,
        plan: TransferPlan,
        receiver: Receiver,
        names: Sequence[str],
        transfer: TransferConfig,
    ) -> None:
        self.plan = plan
        self.receiver = receiver
        self.transfer = transfer
        self.address = f"127.0.0.1:{receiver.decode_port}"
        self.channels = ChannelPool(SECRET)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(self.address))
        # the output subscription a router holds on decode: its reservations name it
        instance = common_pb2_grpc.InstanceServiceStub(self.channels.get(self.address))
        self.outputs = instance.SubscribeOutputs(common_pb2.OutputsRequest(subscriber=SUBSCRIBER))
        next(self.outputs)  # its first, empty message: open
        self.prompts = Prompts()
        self.source = random_bytes(plan.total_bytes)
        view = memoryview(self.source)
        size = plan.block_bytes
        self.blocks = [view[i * size : (i + 1) * size] for i in range(plan.num_blocks)]
        # the sender's KV cache, as a prefill instance sends from it (`send_blocks`)
        rows = torch.frombuffer(self.source, dtype=torch.uint8).view(plan.num_blocks, size)
        self.cache = KVStager(rows)
        self.rounds = 0
        self.names = set(names)
        self.transports: dict[str, KVTransport] = {}
        self.mooncake: MooncakeEngine | None = None
        # baselines
        self.grpcio_channel = grpc.insecure_channel(
            f"127.0.0.1:{receiver.sink_port}", options=CHANNEL_OPTIONS
        )
        self.count: grpc.StreamUnaryMultiCallable[bytes, bytes] = self.grpcio_channel.stream_unary(
            f"/{SINK_SERVICE}/Count"
        )
        self.prebuilt: list[list[bytes]] = []  # per reservation, its gRPC messages
        first = 0
        for count in plan.blocks_per_request:
            messages = []
            for message_size in plan.message_sizes(count):
                num = message_size // size
                messages.append(b"".join(self.blocks[first : first + num]))
                first += num
            self.prebuilt.append(messages)
        self.tcp = socket.create_connection(("127.0.0.1", receiver.tcp_port))
        self.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.destination = memoryview(touched_buffer(plan.total_bytes))

    def run(self, side: str, verify: bool = False) -> Reading:
        """Moving the plan's bytes by `side` (reservation and release untimed)."""
        if side in self.names:
            return self._run_transport(self._transport(side), verify)
        span = Span(self.receiver)
        if side == "grpcio":
            for messages in self.prebuilt:
                reply = self.count(iter(messages))
                if int.from_bytes(reply, "little") != sum(len(m) for m in messages):
                    raise RuntimeError("the grpcio sink counted the wrong number of bytes")
        elif side == "tcp":
            first = 0
            for count in self.plan.blocks_per_request:
                self.tcp.sendall((count * self.plan.block_bytes).to_bytes(8, "little"))
                for block in self.blocks[first : first + count]:
                    self.tcp.sendall(block)
                if self.tcp.recv(1) != b"k":
                    raise RuntimeError("the TCP sink did not acknowledge")
                first += count
        else:  # memcpy: the same blocks copied into memory of this process
            size = self.plan.block_bytes
            for index, block in enumerate(self.blocks):
                self.destination[index * size : (index + 1) * size] = block
        return span.stop()

    def _transport(self, name: str) -> KVTransport:
        """Built on first use: a transport's machinery (Mooncake's engine and its registered
        memory) does not run in this process while the others are measured."""
        transport = self.transports.get(name)
        if transport is None:
            if name == "grpc":
                transport = GrpcKVTransport(self.channels, self.plan.chunk_bytes)
            elif name == "shm":
                transport = ShmKVTransport(self.channels)
            else:
                config = self.transfer
                self.mooncake = MooncakeEngine(config, "127.0.0.1", sender_engines(config))
                self.mooncake.register(address_of(memoryview(self.source)), len(self.source))
                transport = MooncakeKVTransport(config, self.channels, self.mooncake)
            self.transports[name] = transport
        return transport

    def _reserve(self) -> list[KVTarget]:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        targets = []
        for i, blocks in enumerate(self.plan.blocks_per_request):
            request_id = f"kv-{self.rounds}-{i}"
            length = blocks * self.plan.block_size
            prompt = self.prompts.take(length)
            request = generate_request(request_id, prompt, params, subscriber=SUBSCRIBER)
            reply = self.stub.Reserve(decode_pb2.ReserveRequest(request=request))
            if reply.num_blocks != blocks or reply.num_cached_tokens:
                raise RuntimeError(f"reservation {request_id}: {reply}, expected {blocks} blocks")
            endpoints = endpoints_from_proto(reply.endpoints)
            targets.append(
                KVTarget(
                    self.address,
                    request_id,
                    0,
                    tuple(reply.block_ids),
                    reply.block_bytes,
                    endpoints,
                )
            )
        self.rounds += 1
        return targets

    def _run_transport(self, transport: KVTransport, verify: bool) -> Reading:
        targets: list[KVTarget] = []
        try:
            targets = self._reserve()
            span = Span(self.receiver)
            first = 0
            for target, count in zip(targets, self.plan.blocks_per_request, strict=True):
                transport.send_blocks(target, self.cache, range(first, first + count))
                first += count
            reading = span.stop()
            if verify:
                self.receiver.verify([t.request_id for t in targets], block_digests(self.blocks))
        finally:
            for target in targets:
                common_pb2_grpc.InstanceServiceStub(self.channels.get(self.address)).Abort(
                    common_pb2.AbortRequest(request_id=target.request_id)
                )
        return reading

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
        if self.mooncake is not None:
            self.mooncake.close()
        self.tcp.close()
        self.grpcio_channel.close()
        self.outputs.cancel()
        self.channels.close()


BASELINES = {"grpc": "grpcio", "mooncake": "tcp", "shm": "memcpy"}
SUBSCRIBER = "kv-transfer-bench"


@dataclass(frozen=True, slots=True)
class TransferFigures:
    num_blocks: int
    block_bytes: int
    block_size_tokens: int
    total_bytes: int
    reservations: list[int]  # blocks per reservation (one `send` / stream each)
    blocks_per_message: int  # gRPC
    gbps: dict[str, float]  # per side: median over rounds
    ratios: dict[str, float]  # per transport: median of per-round transport / its baseline
    cpu_ms_per_gib: dict[str, float]  # per side: median over rounds, sender + receiver
    cpu_ratios: dict[str, float]  # per transport: median of per-round CPU per byte / baseline's
    packets_per_mib: dict[str, float]  # per side: median over rounds, loopback
    samples_gbps: dict[str, list[float]]  # per side, per round
    samples_cpu_ms_per_gib: dict[str, list[float]]


def receiver_engine(plan: TransferPlan, threads: int, model: Path | None) -> EngineConfig:
    num_requests = len(plan.blocks_per_request)
    return EngineConfig(
        model=None if model is None else str(model),
        dtype="float32",
        block_size=plan.block_size,
        # a margin over the blocks sent: each reservation may grow by one block (its output)
        num_kv_blocks=plan.num_blocks + max(plan.num_blocks // 10, 2 * num_requests) + 16,
        enable_prefix_caching=False,
        torch_threads=threads,
    )


def measure_transfer(
    args: argparse.Namespace, repeat: int, plan: TransferPlan, engine_config: EngineConfig
) -> dict[str, list[Reading]]:
    """A reading per side and round: each transport, then its baseline (or the other way
    round)."""
    transports = [t for t in args.transport.split(",") if t]
    sides = [side for t in transports for side in (t, BASELINES[t])]
    receiver = Receiver(engine_config, args.threads)
    senders: Senders | None = None
    samples: dict[str, list[Reading]] = {side: [] for side in sides}
    try:
        transfer = TransferConfig(mooncake_engines=args.mooncake_engines)
        senders = Senders(plan, receiver, transports, transfer)
        for transport in transports:  # each transport alternates with its own baseline only
            senders.run(transport, verify=True)  # warm-up, and a check that the bytes land intact
            pair = (transport, BASELINES[transport])
            for i in range(repeat):  # (which goes first flips round by round)
                for side in pair if i % 2 == 0 else pair[::-1]:
                    samples[side].append(senders.run(side))
    finally:
        if senders is not None:
            senders.close()
        receiver.close()
    return samples


def bench_transfer(
    args: argparse.Namespace, repeat: int, num_blocks: int, block_bytes: int
) -> TransferFigures:
    model_config = ModelConfig.from_dir(default_model_dir())
    token_bytes = kv_layout(model_config, SINGLE, torch.float32).bytes_per_token()
    context = int(model_config.max_position_embeddings)
    plan = plan_transfer(num_blocks, block_bytes, args.chunk_bytes, context, token_bytes)
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-transfer-") as directory:
        model = None
        if plan.context > context:
            model = long_context_model(Path(directory), plan.context)
        readings = measure_transfer(args, repeat, plan, receiver_engine(plan, args.threads, model))
    gib = plan.total_bytes / 2**30
    samples = {
        side: [plan.total_bytes / r.seconds / GB for r in rs] for side, rs in readings.items()
    }
    cpu = {side: [1e3 * r.cpu_seconds / gib for r in rs] for side, rs in readings.items()}
    transports = [side for side in samples if side in BASELINES]

    def per_round(values: dict[str, list[float]], t: str) -> float:
        return median([a / b for a, b in zip(values[t], values[BASELINES[t]], strict=True)])

    mib = plan.total_bytes / 2**20
    return TransferFigures(
        num_blocks=plan.num_blocks,
        block_bytes=plan.block_bytes,
        block_size_tokens=plan.block_size,
        total_bytes=plan.total_bytes,
        reservations=plan.blocks_per_request,
        blocks_per_message=plan.blocks_per_message,
        gbps={side: median(values) for side, values in samples.items()},
        ratios={t: per_round(samples, t) for t in transports},
        cpu_ms_per_gib={side: median(values) for side, values in cpu.items()},
        cpu_ratios={t: per_round(cpu, t) for t in transports},
        packets_per_mib={
            side: median([r.packets / mib for r in rs]) for side, rs in readings.items()
        },
        samples_gbps=samples,
        samples_cpu_ms_per_gib=cpu,
    )


# -- TTFT ----------------------------------------------------------------------------------------

STAGES = ("reserve", "queue", "compute", "transfer", "handoff")


async def timed_events(
    router: Router, prompt: list[int], params: SamplingParams
) -> tuple[float, list[float], Finished | None]:
    """(start, each token's arrival, the final event) of one request, timed on the router's
    event loop."""
    token_times: list[float] = []
    finished: Finished | None = None
    start = time.perf_counter()
    events = router.generate(uuid.uuid4().hex, prompt, params)
    try:
        async for event in events:
            if isinstance(event, TokenDelta):
                token_times.extend(time.perf_counter() for _ in event.token_ids)
            else:
                finished = event
    finally:
        await events.aclose()
    return start, token_times, finished


def one_request(running: RunningRouter, prompt: list[int]) -> dict[str, float]:
    """Milliseconds of each stage of one request; the prefill's from its reported timings."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = asyncio.run_coroutine_threadsafe(
        timed_events(running.router, prompt, params), running.loop
    )
    start, token_times, finished = request.result(600)
    if finished is None or finished.prefill is None or len(token_times) != 2:
        raise RuntimeError(f"request ended with {len(token_times)} tokens, expected 2")
    timings = finished.prefill.timings
    stages = {
        "reserve": timings.reserve_s,
        "queue": timings.queue_s,
        "compute": timings.compute_s,
        "transfer": timings.transfer_s,
        "handoff": timings.handoff_s,
    }
    result = {f"{name}_ms": 1e3 * seconds for name, seconds in stages.items()}
    result["ttft_ms"] = 1e3 * (token_times[0] - start)
    result["other_ms"] = result["ttft_ms"] - sum(1e3 * s for s in stages.values())
    result["first_decode_step_ms"] = 1e3 * (token_times[1] - token_times[0])
    result["kv_bytes"] = float(finished.prefill.kv_bytes_sent)
    return result


@dataclass(frozen=True, slots=True)
class TTFTFigures:
    prompt_len: int
    medians: dict[str, float]  # ms per stage (keys of `one_request`)
    rounds: list[dict[str, float]]


def bench_ttft(args: argparse.Namespace, repeat: int) -> TTFTFigures:
    engine_config = EngineConfig(torch_threads=args.threads)
    decode, decode_server, decode_port = serve_decode(engine_config, DecodeConfig(), secret=SECRET)
    try:
        prefill, prefill_server, prefill_port = serve_prefill(
            engine_config, PrefillConfig(), secret=SECRET
        )
    except BaseException:
        decode_server.stop(0).wait()
        decode.stop()
        raise
    running: RunningRouter | None = None
    prompts = Prompts()
    prefill_address, decode_address = f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}"
    try:
        running = serve_router(
            RouterConfig(port=0, model_name="tiny"),
            engine_config,
            [prefill_address],
            [decode_address],
            secret=SECRET,
        )
        one_request(running, prompts.take(args.prompt_len))  # warm-up: channels, first passes
        rounds = [one_request(running, prompts.take(args.prompt_len)) for _ in range(repeat)]
    finally:
        if running is not None:
            running.stop()
        prefill_server.stop(0).wait()
        decode_server.stop(0).wait()
        prefill.stop()
        decode.stop()
    medians = {key: median([r[key] for r in rounds]) for key in rounds[0]}
    return TTFTFigures(args.prompt_len, medians, rounds)


# -- main ----------------------------------------------------------------------------------------


def report_transfer(figures: TransferFigures, repeat: int) -> dict[str, str]:
    """Print one block size's table; returns the verdict per transport."""
    verdicts = {t: "PASS" if ratio >= TARGETS[t] else "FAIL" for t, ratio in figures.ratios.items()}
    rows: list[list[str | int | float]] = []
    for transport, ratio in figures.ratios.items():
        baseline = BASELINES[transport]
        for side, label in ((transport, transport), (baseline, f"  {baseline} (baseline)")):
            rows.append(
                [
                    label,
                    figures.gbps[side],
                    figures.cpu_ms_per_gib[side],
                    figures.packets_per_mib[side],
                    "",
                ]
            )
        rows.append(
            [
                f"  ratio_{transport}",
                ratio,
                figures.cpu_ratios[transport],
                "",
                f"target >= {TARGETS[transport]}: {verdicts[transport]}",
            ]
        )
    print_table(
        f"KV transfer: {figures.num_blocks} blocks of {figures.block_bytes} bytes "
        f"({figures.total_bytes / 2**20:.1f} MiB in {len(figures.reservations)} reservations), "
        f"median of {repeat}",
        ["side", "GB/s", "CPU ms/GiB", "packets/MiB", "note"],
        rows,
    )
    return verdicts


def report_ttft(ttft: TTFTFigures, threads: int, repeat: int) -> None:
    figures = ttft.medians
    rows: list[list[str | int | float]] = [
        [name, figures[f"{name}_ms"], "PrefillResult.timings"] for name in STAGES
    ]
    rows += [
        ["other", figures["other_ms"], "TTFT - stages: router, RPCs, output delivery"],
        ["TTFT", figures["ttft_ms"], "router: generate() to first token"],
        ["first decode step", figures["first_decode_step_ms"], "router: token 1 to token 2"],
    ]
    kv_mib = figures["kv_bytes"] / 2**20
    print_table(
        f"TTFT of a {ttft.prompt_len}-token prompt ({kv_mib:.1f} MiB of KV), router + prefill + "
        f"decode in-process, tiny model, {threads} thread(s), median of {repeat}",
        ["stage", "ms", "source"],
        rows,
    )


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=3, full=15)
    torch.set_num_threads(args.threads)

    sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    metrics: dict[str, float] = {}
    engines = sender_engines(TransferConfig(mooncake_engines=args.mooncake_engines))
    results: dict[str, object] = {
        "targets": TARGETS,
        "repeat": repeat,
        "mooncake_engines": engines,
        "transfer": [],
    }
    verdict_lines = []
    for block_bytes, num_blocks in sizes:
        figures = bench_transfer(args, repeat, num_blocks, block_bytes)
        verdicts = report_transfer(figures, repeat)
        results["transfer"].append({**asdict(figures), "verdicts": verdicts})  # type: ignore[attr-defined]
        suffix = "" if block_bytes == BIG_BLOCK else f"_{block_bytes // 1024}k"
        for transport, ratio in figures.ratios.items():
            metrics[f"ratio_{transport}{suffix}"] = ratio
            metrics[f"{transport}_gbps{suffix}"] = figures.gbps[transport]
            metrics[f"{BASELINES[transport]}_gbps{suffix}"] = figures.gbps[BASELINES[transport]]
            metrics[f"cpu_ratio_{transport}{suffix}"] = figures.cpu_ratios[transport]
            for side in (transport, BASELINES[transport]):
                metrics[f"{side}_cpu_ms_per_gib{suffix}"] = figures.cpu_ms_per_gib[side]
                metrics[f"{side}_packets_per_mib{suffix}"] = figures.packets_per_mib[side]
            verdict_lines.append(
                f"ratio_{transport}{suffix} {ratio:.3f}: target >= {TARGETS[transport]} -> "
                f"{verdicts[transport]}"
            )
    if not args.skip_ttft:
        ttft = bench_ttft(args, repeat)
        report_ttft(ttft, args.threads, repeat)
        results["ttft"] = asdict(ttft)
        metrics["ttft_ms"] = ttft.medians["ttft_ms"]
        for name in (*STAGES, "other"):
            metrics[f"ttft_{name}_ms"] = ttft.medians[f"{name}_ms"]
        metrics["first_decode_step_ms"] = ttft.medians["first_decode_step_ms"]

    print("\n" + "\n".join(verdict_lines))
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()
