"""KV transfer: the gRPC transport against bare grpcio, and a TTFT breakdown of one PD request.

    python benchmarks/kv_transfer.py [--quick] [--blocks N] [--block-bytes B] [--prompt-len N]

Transfer: `--blocks` KV blocks (1,000) are moved over loopback by `GrpcKVTransport.send` into
reservations of a real decode instance (`serve_decode`, built-in tiny model, fp32, block size 16
tokens: 64 KiB per block, the engine's real block) running in a separate process, as a decode
instance does. The tiny model's context window is 4,096 tokens, so one prompt covers at most 255
blocks: the 1,000 blocks go to 4 reservations of 250 blocks (4,000-token prompts, reserved with
the Reserve RPC), sent one after the other; the timed span is the 4 `send` calls. Reservations are
aborted and made afresh every round; the first round checks that every byte landed in the right
block (digests compared in the receiving process).

The baseline is bare grpcio between the same two processes: a generic stream-unary handler
(identity serializers: raw bytes) in the receiving process counting a client stream of prebuilt
`bytes` messages of exactly the transport's sizes (blocks packed into messages of at most
`--chunk-bytes`, default `DEFAULT_CHUNK_BYTES`; one stream per reservation), server and channel
with the same options (`CHANNEL_OPTIONS`, 32 worker threads). A third side, for reference, adds to
that the two copies any grpcio transport of block views must make: the sender joins each message
from the block views, the receiver copies it into a buffer ("floor"). Sides run in turn, the order
rotating each round.
`ratio_grpc` = median over rounds of transport GB/s ÷ baseline GB/s (GB = 10^9 bytes), target
>= 0.8; `ratio_floor` = the same for the floor. `--block-bytes B` runs the comparison with blocks
of B bytes (a multiple of the tiny model's 4 KiB of fp32 KV per token; 2097152 = a Llama-3-8B
bf16 block of 16 tokens): the decode instance then runs with a block size of B / 4 KiB tokens, so
its real blocks are B bytes (2 MiB: 512 tokens, 7 blocks per reservation).

TTFT: one `--prompt-len`-token prompt (2,048; distinct every round: no prefix-cache hits) through
in-process `serve_prefill` + `serve_decode` instances (tiny model, block size 16) with
`PDClient.generate` (max 2 tokens): reserve, queue, prefill compute, KV transfer and handoff come
from `PrefillResult.timings`; the client measures TTFT (call to first token) and the first decode
step (first token to second; the step starts at the handoff, so it may partly overlap the
StreamTokens call). `--threads` (default 1) sets torch threads: on the shared 2-core box two
OpenMP threads slow a forward pass ~10x whenever another process holds a core.
"""

import argparse
import contextlib
import hashlib
import multiprocessing
import random
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import grpc
import torch
from _common import finish, median, parse_args, print_table, repeats

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.model.config import ModelConfig
from pdserve.model.tiny import default_model_dir
from pdserve.rpc.channels import CHANNEL_OPTIONS, ChannelPool
from pdserve.rpc.convert import generate_request
from pdserve.transfer.grpc import DEFAULT_CHUNK_BYTES, GrpcKVTransport
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, PDClient, TokenDelta

NAME = "kv_transfer"
RATIO_TARGET = 0.8
DEFAULT_BLOCK_SIZE = 16  # tokens per block (the engine default)
SERVER_WORKERS = 32  # as pdserve.rpc.server.create_server
SINK_SERVICE = "pdserve.bench.ByteSink"
RECEIVE_BUFFER_BYTES = 256 * 2**20  # the floor's receive buffer (a ring): bigger than caches
GB = 1e9


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=1000, help="KV blocks per transfer round")
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=None,
        help="bytes per block (a multiple of the tiny model's fp32 KV bytes per token); default "
        f"the block of {DEFAULT_BLOCK_SIZE} tokens (64 KiB)",
    )
    parser.add_argument(
        "--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="transport message size"
    )
    parser.add_argument("--prompt-len", type=int, default=2048, help="TTFT prompt tokens")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of both instances (default 1)"
    )
    parser.add_argument("--skip-ttft", action="store_true", help="only the transfer comparison")


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
        """Bytes of each message of one reservation's stream (as `GrpcKVTransport._chunks`)."""
        full, rest = divmod(blocks, self.blocks_per_message)
        sizes = [self.blocks_per_message * self.block_bytes] * full
        return sizes + ([rest * self.block_bytes] if rest else [])


def plan_transfer(
    num_blocks: int, block_bytes: int | None, chunk_bytes: int, context: int, token_bytes: int
) -> TransferPlan:
    """Block size in tokens for `block_bytes`, and the fewest reservations (prompts shorter than
    the context window) that cover `num_blocks`, split as evenly as possible."""
    block_bytes = block_bytes or DEFAULT_BLOCK_SIZE * token_bytes
    if block_bytes <= 0 or block_bytes % token_bytes:
        raise SystemExit(f"--block-bytes must be a positive multiple of {token_bytes}")
    if num_blocks < 1:
        raise SystemExit("--blocks must be at least 1")
    block_size = block_bytes // token_bytes
    per_prompt = max(1, (context - 1) // block_size)  # a prompt leaves room for one output token
    num_requests = -(-num_blocks // per_prompt)
    base, extra = divmod(num_blocks, num_requests)
    split = [base + (1 if i < extra else 0) for i in range(num_requests)]
    per_message = max(1, chunk_bytes // block_bytes)
    return TransferPlan(block_bytes, block_size, split, per_message, chunk_bytes, context)


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


def block_digests(blocks: Sequence[memoryview | bytes]) -> list[bytes]:
    return [hashlib.blake2b(block, digest_size=16).digest() for block in blocks]


class ByteSink:
    """Bare grpcio: a generic stream-unary service of raw `bytes` messages (identity
    serializers). `Count` counts a stream's bytes (the cost of grpcio alone); `Store` also copies
    each message into a buffer (a ring)."""

    def __init__(self, buffer_bytes: int) -> None:
        self.sink = bytearray(buffer_bytes)
        self._sink_offset = 0
        handler = grpc.method_handlers_generic_handler(
            SINK_SERVICE,
            {
                "Count": grpc.stream_unary_rpc_method_handler(self._count),
                "Store": grpc.stream_unary_rpc_method_handler(self._store),
            },
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

    def _store(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        received = 0
        sink = memoryview(self.sink)
        for message in request_iterator:
            if self._sink_offset + len(message) > len(sink):
                self._sink_offset = 0
            sink[self._sink_offset : self._sink_offset + len(message)] = message
            self._sink_offset += len(message)
            received += len(message)
        return received.to_bytes(8, "little")

    def close(self) -> None:
        self.server.stop(0).wait()


def receiver_main(
    conn: Connection, engine_config: EngineConfig, sink_bytes: int, threads: int
) -> None:
    """The receiving process: a decode instance and a byte sink, each behind its gRPC server.
    Sends back (decode port, sink port), then answers verification requests (request ids and
    expected block digests -> an error string or "") until it receives None."""
    torch.set_num_threads(threads)
    instance, server, port = serve_decode(engine_config, DecodeConfig())
    sink = ByteSink(sink_bytes)
    try:
        conn.send((port, sink.port))
        while (command := conn.recv()) is not None:
            request_ids, expected = command
            conn.send(verify_blocks(instance, request_ids, expected))
    finally:
        sink.close()
        server.stop(0).wait()
        instance.stop()


def verify_blocks(
    instance: DecodeInstance, request_ids: Sequence[str], expected: list[bytes]
) -> str:
    """ "" when the reservations' blocks in the KV cache hold the expected bytes, block for block;
    else what differs."""
    core = instance.core
    received: list[bytes] = []
    for request_id in request_ids:

        def block_table(engine: LLMEngine, request_id: str = request_id) -> list[int]:
            return list(engine.kv_cache.block_table(request_id))

        received += block_digests(core.block_io.read(core.loop.call(block_table)))
    if len(received) != len(expected):
        return f"{len(received)} blocks reserved, {len(expected)} sent"
    for index, (got, sent) in enumerate(zip(received, expected, strict=True)):
        if got != sent:
            return f"block {index} arrived corrupted"
    return ""


class Receiver:
    """The receiving process (`receiver_main`), started with `spawn`: the sender and the receivers
    run in different processes, as prefill and decode instances do."""

    def __init__(self, engine_config: EngineConfig, sink_bytes: int, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=receiver_main, args=(child, engine_config, sink_bytes, threads), daemon=True
        )
        self._process.start()
        child.close()
        if not self._conn.poll(120):
            self.close()
            raise RuntimeError("the receiver process did not start within 120 s")
        self.decode_port, self.sink_port = self._conn.recv()

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


class TransportSide:
    """`GrpcKVTransport.send` of the plan's blocks into fresh reservations (the Reserve RPC) of
    the receiver's decode instance."""

    def __init__(self, plan: TransferPlan, receiver: Receiver) -> None:
        self.plan = plan
        self.receiver = receiver
        self.address = f"127.0.0.1:{receiver.decode_port}"
        self.channels = ChannelPool()
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(self.address))
        self.transport = GrpcKVTransport(self.channels, plan.chunk_bytes)
        self.prompts = Prompts()
        view = memoryview(random_bytes(plan.total_bytes))
        size = plan.block_bytes
        self.blocks = [view[i * size : (i + 1) * size] for i in range(plan.num_blocks)]
        self.rounds = 0

    def _reserve(self, request_ids: list[str]) -> None:
        """Reserve the round's requests, appending their ids to `request_ids` as granted."""
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for i, blocks in enumerate(self.plan.blocks_per_request):
            request_id = f"kv-{self.rounds}-{i}"
            length = min(blocks * self.plan.block_size, self.plan.context - 1)
            prompt = self.prompts.take(length)
            grant = self.stub.Reserve(
                decode_pb2.ReserveRequest(request=generate_request(request_id, prompt, params))
            )
            if not grant.granted:
                raise RuntimeError(f"reservation {request_id} refused: {grant.reason}")
            request_ids.append(request_id)
            if grant.num_blocks != blocks or grant.num_cached_tokens != 0:
                raise RuntimeError(f"reservation {request_id}: {grant}, expected {blocks} blocks")
            if grant.block_bytes != self.plan.block_bytes:
                raise RuntimeError(f"decode blocks are {grant.block_bytes} bytes")
        self.rounds += 1

    def _bytes_received(self) -> int:
        return int(self.stub.GetStats(common_pb2.StatsRequest()).kv_bytes_received)

    def run(self, verify: bool = False) -> float:
        """Seconds for the `send` calls of one round (reservation and release untimed)."""
        request_ids: list[str] = []
        before = self._bytes_received()
        try:
            self._reserve(request_ids)
            start = time.perf_counter()
            first = 0
            for request_id, blocks in zip(request_ids, self.plan.blocks_per_request, strict=True):
                self.transport.send(
                    self.address, request_id, 0, self.blocks[first : first + blocks]
                )
                first += blocks
            seconds = time.perf_counter() - start
            if (received := self._bytes_received() - before) != self.plan.total_bytes:
                raise RuntimeError(f"decode counted {received} bytes")
            if verify:
                self.receiver.verify(request_ids, block_digests(self.blocks))
        finally:
            for request_id in request_ids:
                self.stub.Abort(common_pb2.AbortRequest(request_id=request_id))
        return seconds

    def close(self) -> None:
        self.transport.close()
        self.channels.close()


class BareGrpc:
    """Bare grpcio into the receiver's byte sink.

    `run_baseline`: the plan's bytes as prebuilt messages of the transport's sizes; the sink
    counts them (the cost of grpcio alone). `run_floor`: the same streams, but each message is
    joined from the block views as it is sent and the sink copies it into a buffer: the two
    copies any grpcio transport of block views into memory makes (a reference, not the target).
    """

    def __init__(self, plan: TransferPlan, blocks: Sequence[memoryview], port: int) -> None:
        self.plan = plan
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        self.count: grpc.StreamUnaryMultiCallable[bytes, bytes] = self.channel.stream_unary(
            f"/{SINK_SERVICE}/Count"
        )
        self.store: grpc.StreamUnaryMultiCallable[bytes, bytes] = self.channel.stream_unary(
            f"/{SINK_SERVICE}/Store"
        )
        # per stream (reservation), per message: its block views
        self.streams: list[list[Sequence[memoryview]]] = []
        first = 0
        for count in plan.blocks_per_request:
            messages = []
            for size in plan.message_sizes(count):
                num = size // plan.block_bytes
                messages.append(blocks[first : first + num])
                first += num
            self.streams.append(messages)
        self.prebuilt = [[b"".join(m) for m in stream] for stream in self.streams]

    def run_baseline(self) -> float:
        start = time.perf_counter()
        for messages in self.prebuilt:
            self._check(self.count(iter(messages)), sum(len(m) for m in messages))
        return time.perf_counter() - start

    def run_floor(self) -> float:
        start = time.perf_counter()
        for stream in self.streams:
            self._check(
                self.store(b"".join(m) for m in stream),
                self.plan.block_bytes * sum(map(len, stream)),
            )
        return time.perf_counter() - start

    @staticmethod
    def _check(reply: bytes, expected: int) -> None:
        if int.from_bytes(reply, "little") != expected:
            raise RuntimeError(f"bare grpcio server counted {reply!r} bytes, sent {expected}")

    def close(self) -> None:
        self.channel.close()


SIDES = ("transport", "baseline", "floor")


@dataclass(frozen=True, slots=True)
class TransferFigures:
    num_blocks: int
    block_bytes: int
    block_size_tokens: int
    total_bytes: int
    reservations: list[int]  # blocks per reservation (one `send` / stream each)
    blocks_per_message: int
    chunk_bytes: int
    grpc_gbps: float  # medians over rounds
    baseline_gbps: float
    floor_gbps: float
    ratio_grpc: float  # median of per-round transport / baseline
    ratio_floor: float  # median of per-round floor / baseline
    samples_gbps: dict[str, list[float]]  # per side, per round
    ratios: list[float]


def bench_transfer(args: argparse.Namespace, repeat: int) -> TransferFigures:
    model_config = ModelConfig.from_dir(default_model_dir())
    token_bytes = model_config.kv_bytes_per_token(torch.float32)
    context = int(model_config.max_position_embeddings)
    plan = plan_transfer(args.blocks, args.block_bytes, args.chunk_bytes, context, token_bytes)
    num_requests = len(plan.blocks_per_request)
    engine_config = EngineConfig(
        dtype="float32",
        block_size=plan.block_size,
        # a margin over the blocks sent: each reservation may grow by one block (its output)
        num_kv_blocks=plan.num_blocks + max(plan.num_blocks // 10, 2 * num_requests) + 16,
        enable_prefix_caching=False,
        torch_threads=args.threads,
    )
    largest = plan.blocks_per_message * plan.block_bytes
    sink_bytes = min(plan.total_bytes, max(RECEIVE_BUFFER_BYTES, largest))
    receiver = Receiver(engine_config, sink_bytes, args.threads)
    transport: TransportSide | None = None
    bare: BareGrpc | None = None
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        transport = TransportSide(plan, receiver)
        bare = BareGrpc(plan, transport.blocks, receiver.sink_port)
        runs = {"transport": transport.run, "baseline": bare.run_baseline, "floor": bare.run_floor}
        transport.run(verify=True)  # warm-up, and a check that the bytes land intact
        bare.run_baseline()
        bare.run_floor()
        for i in range(repeat):  # the order rotates round by round: each side sees the same load
            for side in SIDES[i % 3 :] + SIDES[: i % 3]:
                samples[side].append(plan.total_bytes / runs[side]() / GB)
    finally:
        if transport is not None:
            transport.close()
        if bare is not None:
            bare.close()
        receiver.close()
    ratios = [t / b for t, b in zip(samples["transport"], samples["baseline"], strict=True)]
    floors = [f / b for f, b in zip(samples["floor"], samples["baseline"], strict=True)]
    return TransferFigures(
        num_blocks=plan.num_blocks,
        block_bytes=plan.block_bytes,
        block_size_tokens=plan.block_size,
        total_bytes=plan.total_bytes,
        reservations=plan.blocks_per_request,
        blocks_per_message=plan.blocks_per_message,
        chunk_bytes=plan.chunk_bytes,
        grpc_gbps=median(samples["transport"]),
        baseline_gbps=median(samples["baseline"]),
        floor_gbps=median(samples["floor"]),
        ratio_grpc=median(ratios),
        ratio_floor=median(floors),
        samples_gbps=samples,
        ratios=ratios,
    )


# -- TTFT ----------------------------------------------------------------------------------------

STAGES = ("reserve", "queue", "compute", "transfer", "handoff")


def one_request(client: PDClient, prefill: str, decode: str, prompt: list[int]) -> dict[str, float]:
    """Milliseconds of each stage of one request; the prefill's from its reported timings."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    token_times: list[float] = []
    finished: Finished | None = None
    start = time.perf_counter()
    for event in client.generate(prefill, decode, prompt, params):
        if isinstance(event, TokenDelta):
            token_times.extend(time.perf_counter() for _ in event.token_ids)
        else:
            finished = event
    if finished is None or len(token_times) != 2:
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
    decode, decode_server, decode_port = serve_decode(engine_config, DecodeConfig())
    try:
        prefill, prefill_server, prefill_port = serve_prefill(engine_config, PrefillConfig())
    except BaseException:
        decode_server.stop(0).wait()
        decode.stop()
        raise
    client = PDClient()
    prompts = Prompts()
    prefill_address, decode_address = f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}"

    def run() -> dict[str, float]:
        return one_request(client, prefill_address, decode_address, prompts.take(args.prompt_len))

    try:
        run()  # warm-up (channels, first forward passes)
        rounds = [run() for _ in range(repeat)]
    finally:
        client.close()
        prefill_server.stop(0).wait()
        decode_server.stop(0).wait()
        prefill.stop()
        decode.stop()
    medians = {key: median([r[key] for r in rounds]) for key in rounds[0]}
    return TTFTFigures(args.prompt_len, medians, rounds)


# -- main ----------------------------------------------------------------------------------------


def report_transfer(transfer: TransferFigures, repeat: int) -> str:
    verdict = "PASS" if transfer.ratio_grpc >= RATIO_TARGET else "FAIL"
    print_table(
        f"KV transfer over loopback: {transfer.num_blocks} blocks of {transfer.block_bytes} bytes "
        f"({transfer.total_bytes / 2**20:.1f} MiB in {len(transfer.reservations)} reservations, "
        f"{transfer.blocks_per_message} blocks per message), median of {repeat}",
        ["path", "GB/s", "note"],
        [
            ["GrpcKVTransport.send", transfer.grpc_gbps, "into a decode instance's KV cache"],
            ["bare grpcio (baseline)", transfer.baseline_gbps, "same message sizes, prebuilt"],
            ["bare grpcio + 2 copies", transfer.floor_gbps, "join blocks, copy into a buffer"],
            ["ratio_grpc", transfer.ratio_grpc, f"target >= {RATIO_TARGET}: {verdict}"],
            ["ratio_floor", transfer.ratio_floor, "copies floor / baseline (reference)"],
        ],
    )
    return verdict


def report_ttft(ttft: TTFTFigures, threads: int, repeat: int) -> None:
    figures = ttft.medians
    rows: list[list[str | int | float]] = [
        [name, figures[f"{name}_ms"], "PrefillResult.timings"] for name in STAGES
    ]
    rows += [
        ["other", figures["other_ms"], "TTFT - stages: RPCs, StreamTokens, client"],
        ["TTFT", figures["ttft_ms"], "client: generate() to first token"],
        ["first decode step", figures["first_decode_step_ms"], "client: token 1 to token 2"],
    ]
    kv_mib = figures["kv_bytes"] / 2**20
    print_table(
        f"TTFT of a {ttft.prompt_len}-token prompt ({kv_mib:.1f} MiB of KV), prefill + decode "
        f"in-process, tiny model, {threads} thread(s), median of {repeat}",
        ["stage", "ms", "source"],
        rows,
    )


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=3, full=9)
    torch.set_num_threads(args.threads)

    transfer = bench_transfer(args, repeat)
    verdict = report_transfer(transfer, repeat)
    metrics: dict[str, float] = {
        "ratio_grpc": transfer.ratio_grpc,
        "grpc_gbps": transfer.grpc_gbps,
        "baseline_gbps": transfer.baseline_gbps,
        "ratio_floor": transfer.ratio_floor,
    }
    results: dict[str, object] = {
        "transfer": asdict(transfer),
        "ratio_target": RATIO_TARGET,
        "verdict": verdict,
        "repeat": repeat,
    }
    if not args.skip_ttft:
        ttft = bench_ttft(args, repeat)
        report_ttft(ttft, args.threads, repeat)
        results["ttft"] = asdict(ttft)
        metrics["ttft_ms"] = ttft.medians["ttft_ms"]
        for name in (*STAGES, "other"):
            metrics[f"ttft_{name}_ms"] = ttft.medians[f"{name}_ms"]
        metrics["first_decode_step_ms"] = ttft.medians["first_decode_step_ms"]

    print(f"\nratio_grpc {transfer.ratio_grpc:.3f}: target >= {RATIO_TARGET} -> {verdict}")
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()
