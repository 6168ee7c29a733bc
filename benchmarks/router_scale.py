"""Router at scale: thousands of open streams through the real HTTP router.

    python benchmarks/router_scale.py [--quick] [--stages 100:20,1000:20,4000:2] [--replicas 1,2]

Only the router is measured: behind it stand a fake prefill and a fake decode instance, real
`grpc.aio` servers (checking the cluster secret, as real instances do) that answer Prefill at
once and advance every running request by one token per step at a fixed rate, sending each
step's tokens as one message on the router's output subscription (each token's text is its send
time in ns). A fake of the *other* side of the router's interface: what the router does with
each request (schema, hashing, routing, leases, Prefill and the output subscription over gRPC,
transcript, SSE formatting) is all real.

Processes (2-core box): the router alone in a child process (`serve_router`, the real app), or
`router.replicas` of them on one port (SO_REUSEPORT), the fakes in another, the client here:
raw asyncio HTTP/1.1 connections (cheaper than an HTTP client library: the client must not be
what limits). Each stage `streams:rate` ramps `streams` streaming
`/v1/completions` (ramp 1 s, then held for `--hold-s`), each generating `rate` tokens/s, and
reports: streams held at once (peak), errors, added latency per token (fake send → client
receive, so it includes the fake's gRPC hop: an upper bound of router receive → client receive)
p50/p99, tokens/s through the router, router CPU per 1k tokens (its process's CPU time over the
stage), RSS per open stream (router RSS at the peak minus before the stage, over streams); with
several router processes their CPU and RSS are summed. Each stage runs once per `--replicas`
count (default 1,2), the order alternating from stage to stage. A non-streaming series
(`--plain`, concurrent requests of `--plain-tokens` tokens, one router process) reports
requests/s and latency.

`--sglang-router PYTHON` (a Python with `pip install sglang-router`) runs the same streaming
stages through sglang-router in front of an OpenAI-HTTP stand-in that streams at the same rate,
and reports pdserve's figures as ratios to its.

Writes `benchmarks/results/router_scale.json` and ends with one line (`_common.finish`):
`RESULT router_scale held_N=… errors_N=… p99_ms_N=… tokens_per_s_N=… plain_rps_N=…
plain_errors_N=…` (one router process), `replicas_R_vs_1_tokens_per_s_N=… errors_R_N=…` and
`cpu_ms_per_1k_R_N=…` for the router counts R (plus `vs_sglang_tokens_per_s_N=…
vs_sglang_p99_N=… vs_sglang_cpu_N=…` with the peer), one set per stage N.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from _common import finish, parse_args, print_table

from pdserve.config import EngineConfig, RouterConfig
from pdserve.rpc.auth import AUTHORIZATION, new_secret
from pdserve.rpc.channels import SERVER_OPTIONS
from pdserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

MODEL = "tiny"
FAKE_TOKEN = 65
PROMPT = "a 32-character prompt, in ASCII."  # text: sglang-router refuses token-id prompts
HOST = "127.0.0.1"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stages", default=None, help="streams:tokens_per_s,... (default 100:20,1000:20,4000:2)"
    )
    parser.add_argument("--hold-s", type=float, default=None, help="seconds each stage holds")
    parser.add_argument(
        "--replicas", default="1,2", help="router process counts to run each stage with"
    )
    parser.add_argument(
        "--plain", default=None, help="concurrent non-streaming requests (default 100,1000)"
    )
    parser.add_argument("--plain-tokens", type=int, default=4)
    parser.add_argument("--plain-rate", type=float, default=200.0, help="tokens/s per request")
    parser.add_argument(
        "--sglang-router",
        metavar="PYTHON",
        help="a Python with sglang-router installed: run the streaming stages through it too",
    )


def _raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the fakes: instant prefill, fixed-rate decode ----------------------------------------------


class _Fakes:
    """Both fake instances in one process. Prefill starts each request on the fake decode
    engine, which (like a real one) advances every running request by one token per step, at
    the stage's rate, and sends each step's outputs as one message on the router's output
    subscription."""

    def __init__(self, secret: str) -> None:
        self.expected = (AUTHORIZATION, f"Bearer {secret}")
        # subscriber -> (request id, attempt) -> [tokens left, tokens in all]
        self.running: dict[str, dict[tuple[str, str], list[int]]] = {}
        self.interval_s = 0.05  # set by the benchmark before each stage

    def check(self, context: Any) -> bool:
        return self.expected in tuple(context.invocation_metadata() or ())

    def start(self, generate: common_pb2.GenerateRequest) -> None:
        count = max(1, generate.sampling.max_tokens)
        requests = self.running.setdefault(generate.subscriber, {})
        requests[(generate.request_id, generate.attempt)] = [count, count]

    def step(self, subscriber: str) -> common_pb2.StepOutputs:
        """One token for each running request of `subscriber` (its text: the send time)."""
        requests = self.running.setdefault(subscriber, {})
        text = f"{time.time_ns()};"
        step = common_pb2.StepOutputs()
        for key, progress in list(requests.items()):
            output = step.outputs.add(request_id=key[0], attempt=key[1])
            output.chunk.token_ids.append(FAKE_TOKEN)
            output.chunk.text = text
            progress[0] -= 1
            if not progress[0]:
                output.final.finish_reason = common_pb2.FINISH_REASON_LENGTH
                output.final.num_output_tokens = progress[1]
                del requests[key]
        return step


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, fakes: _Fakes) -> None:
        self.fakes = fakes

    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResult:
        if not self.fakes.check(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no secret")
        self.fakes.start(request.request)
        return prefill_pb2.PrefillResult(
            first_token_id=FAKE_TOKEN, num_prompt_tokens=len(request.request.prompt_token_ids)
        )


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Answers the handoff's calls at once (only the fake prefill would make them)."""

    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveReply:
        return decode_pb2.ReserveReply()

    async def CommitKV(self, request: Any, context: Any) -> decode_pb2.CommitKVReply:
        return decode_pb2.CommitKVReply()

    async def PushKV(self, request_iterator: Any, context: Any) -> decode_pb2.PushKVReply:
        async for _ in request_iterator:
            pass
        return decode_pb2.PushKVReply()

    async def StartDecode(self, request: Any, context: Any) -> decode_pb2.StartDecodeReply:
        return decode_pb2.StartDecodeReply()


class FakeInstance(common_pb2_grpc.InstanceServiceServicer):
    def __init__(self, role: str, fakes: _Fakes) -> None:
        self.role = role
        self.fakes = fakes

    async def Abort(self, request: Any, context: Any) -> common_pb2.AbortReply:
        for requests in self.fakes.running.values():
            if requests.pop((request.request_id, request.attempt), None) is not None:
                return common_pb2.AbortReply(found=True)
        return common_pb2.AbortReply(found=False)

    async def GetStats(self, request: Any, context: Any) -> common_pb2.InstanceStats:
        return common_pb2.InstanceStats(
            role=self.role, block_size=16, num_blocks=1 << 20, num_free_blocks=1 << 20
        )

    async def SubscribeKVEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield common_pb2.KVEvent(snapshot=common_pb2.BlocksStored())
        await asyncio.Event().wait()  # held open until the router cancels it

    async def SubscribeOutputs(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """Decode's engine steps, at the stage's rate: one message per step."""
        if not self.fakes.check(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no secret")
        yield common_pb2.StepOutputs()
        due = time.monotonic()
        while True:
            due += self.fakes.interval_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            step = self.fakes.step(request.subscriber)
            if step.outputs:
                yield step


async def _serve_fakes(conn: Connection, secret: str) -> None:
    fakes = _Fakes(secret)
    servers, ports = [], []
    for role in ("prefill", "decode"):
        server = grpc.aio.server(
            options=[*SERVER_OPTIONS, ("grpc.max_concurrent_streams", 100_000)]
        )
        if role == "prefill":
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(FakePrefill(fakes), server)
        else:
            decode_pb2_grpc.add_DecodeServiceServicer_to_server(FakeDecode(), server)
        common_pb2_grpc.add_InstanceServiceServicer_to_server(FakeInstance(role, fakes), server)
        ports.append(server.add_insecure_port(f"{HOST}:0"))
        await server.start()
        servers.append(server)
    conn.send(ports)
    loop = asyncio.get_running_loop()
    while (rate := await loop.run_in_executor(None, conn.recv)) is not None:  # None: stop
        fakes.interval_s = 1.0 / rate
        conn.send(rate)
    for server in servers:
        await server.stop(0)


def fakes_process(conn: Connection, secret: str) -> None:
    _raise_fd_limit()
    asyncio.run(_serve_fakes(conn, secret))


def router_process(
    conn: Connection, secret: str, prefill: str, decode: str, port: int, replicas: int
) -> None:
    _raise_fd_limit()
    from services.router.server import serve_router

    config = RouterConfig(
        port=port, model_name=MODEL, max_concurrent_requests=100_000, replicas=replicas
    )
    running = serve_router(config, EngineConfig(), [prefill], [decode], secret=secret)
    conn.send((running.port, os.getpid()))
    conn.recv()
    running.stop()


# -- the peer's stand-in: an OpenAI HTTP worker streaming at the same rate --------------------


async def _worker_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: list[float]
) -> None:
    """HTTP/1.1 keep-alive: GETs (health, model info) answer `{}`; a POST streams its
    `max_tokens` SSE chunks (text: send time in ns) at the stage's rate, chunked."""
    try:
        while line := await reader.readline():
            if line.startswith(b"PRI "):  # an HTTP/2 probe: this worker speaks HTTP/1.1
                return
            method = line.split(b" ", 1)[0]
            length = 0
            while (header := await reader.readline()) not in (b"\r\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            if method != b"POST":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                continue
            await _stream_sse(writer, int(json.loads(body).get("max_tokens", 1)), interval[0])
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        writer.close()


async def _stream_sse(writer: asyncio.StreamWriter, count: int, interval: float) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    start = time.monotonic()
    for i in range(count):
        delay = start + i * interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        data = (b'data: {"object":"text_completion","model":"tiny","choices":[{"index":0,'
                b'"text":"%d;","finish_reason":null}]}\n\n' % time.time_ns())  # fmt: skip
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    await writer.drain()


async def _serve_worker(conn: Connection) -> None:
    interval = [0.05]
    server = await asyncio.start_server(
        lambda r, w: _worker_connection(r, w, interval), HOST, 0, backlog=8192
    )
    conn.send(server.sockets[0].getsockname()[1])
    loop = asyncio.get_running_loop()
    while (rate := await loop.run_in_executor(None, conn.recv)) is not None:
        interval[0] = 1.0 / rate
        conn.send(rate)
    server.close()


def worker_process(conn: Connection) -> None:
    _raise_fd_limit()
    asyncio.run(_serve_worker(conn))


def bench_sglang(args: argparse.Namespace, hold_s: float) -> list[dict[str, Any]]:
    """The streaming stages through sglang-router (its Rust binary, round robin, one worker)."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    worker = context.Process(target=worker_process, args=(child,), daemon=True)
    worker.start()
    worker_port = conn.recv()
    port, metrics_port = _free_port(), _free_port()
    router = subprocess.Popen(
        [args.sglang_router, "-m", "sglang_router.launch_router", "--host", HOST,
         "--port", str(port), "--worker-urls", f"http://{HOST}:{worker_port}",
         "--policy", "round_robin", "--log-level", "warn",
         "--prometheus-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_raise_fd_limit,
    )  # fmt: skip
    try:
        _wait_http(port, router)
        rows = []
        for n, rate in _stages(args):
            conn.send(rate)
            conn.recv()
            rows.append(asyncio.run(run_stream_stage(port, [router.pid], n, rate, hold_s)))
        return rows
    finally:
        router.terminate()
        router.wait(20)
        conn.send(None)
        worker.join(10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _wait_http(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Until the router at `port` routes a request (its worker found healthy)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stream": True}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sglang-router exited with status {process.returncode}")
        stats = StageStats()
        asyncio.run(stream_one(port, _request(body), stats))
        if not stats.errors:
            return
        time.sleep(0.5)
    raise RuntimeError("sglang-router did not route a request in time")


# -- the client: raw HTTP/1.1 on asyncio --------------------------------------------------------


@dataclass
class StageStats:
    latencies_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    open_now: int = 0
    open_peak: int = 0
    completed: int = 0
    request_s: list[float] = field(default_factory=list)


def _request(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _open(
    port: int, request: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """Send `request`; returns the connection once a 200's headers are read, and its
    Content-Length (0 for a chunked body)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(request)
    status = await reader.readline()
    if b" 200 " not in status:
        writer.close()
        raise RuntimeError(status.decode(errors="replace").strip())
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return reader, writer, length


async def stream_one(port: int, request: bytes, stats: StageStats) -> None:
    """One streaming request: every chunk's tokens timed against their send time."""
    try:
        reader, writer, _ = await _open(port, request)
    except (OSError, RuntimeError) as e:
        stats.errors.append(str(e))
        return
    stats.open_now += 1
    stats.open_peak = max(stats.open_peak, stats.open_now)
    done = False
    try:
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            now = time.time_ns()
            done = done or b"[DONE]" in data
            for piece in data.split(b'"text":"')[1:]:
                sent = piece.split(b";", 1)[0]
                if sent.isdigit():
                    stats.latencies_ms.append((now - int(sent)) / 1e6)
                    stats.tokens += 1
        if not done:
            stats.errors.append("stream ended without [DONE]")
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        stats.errors.append(f"stream broke: {e!r}")
    finally:
        stats.open_now -= 1
        writer.close()
    stats.completed += 1


async def plain_one(port: int, request: bytes, stats: StageStats) -> None:
    start = time.perf_counter()
    try:
        reader, writer, length = await _open(port, request)
        body = await reader.readexactly(length)
    except (OSError, RuntimeError, asyncio.IncompleteReadError) as e:
        stats.errors.append(str(e))
        return
    writer.close()
    if b'"finish_reason":"length"' not in body:
        stats.errors.append("incomplete answer")
        return
    stats.request_s.append(time.perf_counter() - start)
    stats.completed += 1


# -- stages ---------------------------------------------------------------------------------------


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _rss_mib(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_stream_stage(
    port: int, pid: list[int], streams: int, rate: float, hold_s: float
) -> dict[str, Any]:
    tokens = max(2, int(rate * (hold_s + 1.0)))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "stream": True,
            "temperature": 0}  # fmt: skip
    request = _request(body)
    stats = StageStats()
    rss_before, cpu_before = _rss_mib(pid), _cpu_s(pid)
    start = time.perf_counter()
    tasks = []
    batch = max(1, streams // 20)  # the ramp: 20 batches over 1 s
    for first in range(0, streams, batch):
        count = min(batch, streams - first)
        tasks += [asyncio.ensure_future(stream_one(port, request, stats)) for _ in range(count)]
        await asyncio.sleep(1.0 / 20)
    await asyncio.sleep(max(0.0, hold_s / 2))
    rss_peak = _rss_mib(pid)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    cpu = _cpu_s(pid) - cpu_before
    return {
        "streams": streams, "replicas": len(pid), "rate_per_stream": rate,
        "streams_held": stats.open_peak,
        "errors": len(stats.errors), "error_examples": stats.errors[:3],
        "token_latency_p50_ms": _percentile(stats.latencies_ms, 0.5),
        "token_latency_p99_ms": _percentile(stats.latencies_ms, 0.99),
        "tokens": stats.tokens, "tokens_per_s": stats.tokens / elapsed,
        "router_cpu_ms_per_1k_tokens": 1e6 * cpu / max(1, stats.tokens),
        "router_cpu_cores": cpu / elapsed,
        "rss_kib_per_stream": 1024 * (rss_peak - rss_before) / max(1, stats.open_peak),
    }  # fmt: skip


async def run_plain_stage(
    port: int, pid: list[int], concurrent: int, tokens: int, rate: float
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    request = _request(body)
    stats = StageStats()
    cpu_before = _cpu_s(pid)
    start = time.perf_counter()
    await asyncio.gather(*(plain_one(port, request, stats) for _ in range(concurrent)))
    elapsed = time.perf_counter() - start
    return {
        "concurrent": concurrent, "completed": stats.completed, "errors": len(stats.errors),
        "error_examples": stats.errors[:3], "requests_per_s": stats.completed / elapsed,
        "latency_p50_s": _percentile(stats.request_s, 0.5),
        "latency_p99_s": _percentile(stats.request_s, 0.99),
        "router_cpu_ms_per_request": 1e3 * (_cpu_s(pid) - cpu_before) / max(1, stats.completed),
    }  # fmt: skip


def _stages(args: argparse.Namespace) -> list[tuple[int, float]]:
    text = args.stages or ("100:20,400:20" if args.quick else "100:20,1000:20,4000:2")
    return [(int(n), float(r)) for n, r in (s.split(":") for s in text.split(","))]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    _raise_fd_limit()
    hold_s = args.hold_s or (3.0 if args.quick else 8.0)
    plain = [int(n) for n in (args.plain or ("100" if args.quick else "100,1000")).split(",")]
    context = multiprocessing.get_context("spawn")
    secret = new_secret()
    fakes_conn, fakes_child = context.Pipe()
    fakes = context.Process(target=fakes_process, args=(fakes_child, secret), daemon=True)
    fakes.start()
    prefill_port, decode_port = fakes_conn.recv()
    addresses = (f"{HOST}:{prefill_port}", f"{HOST}:{decode_port}")
    counts = [int(c) for c in args.replicas.split(",")]
    try:

        def at_rate(rate: float) -> None:  # the fake decode's tokens/s per stream
            fakes_conn.send(rate)
            fakes_conn.recv()

        streaming = []
        for stage, (n, rate) in enumerate(_stages(args)):
            at_rate(rate)
            for count in counts if stage % 2 == 0 else counts[::-1]:  # A/B, B/A, ...
                with _Routers(context, secret, addresses, count) as (port, pids):
                    streaming.append(asyncio.run(run_stream_stage(port, pids, n, rate, hold_s)))
        at_rate(args.plain_rate)
        with _Routers(context, secret, addresses, 1) as (port, pids):
            plain_rows = [
                asyncio.run(run_plain_stage(port, pids, n, args.plain_tokens, args.plain_rate))
                for n in plain
            ]
    finally:
        fakes_conn.send(None)
        fakes.join(20)
        if fakes.is_alive():
            fakes.terminate()
    results: dict[str, Any] = {"streaming": streaming, "plain": plain_rows, "hold_s": hold_s}
    if args.sglang_router:
        results["sglang_router"] = bench_sglang(args, hold_s)
    return results


class _Routers:
    """`count` router processes on one port (the first binds a free one, the others join it
    with SO_REUSEPORT); yields (port, their pids)."""

    def __init__(self, context: Any, secret: str, addresses: tuple[str, str], count: int) -> None:
        self._context, self._secret, self._addresses = context, secret, addresses
        self._count = count
        self._running: list[tuple[Connection, Any]] = []

    def __enter__(self) -> tuple[int, list[int]]:
        port, pids = 0, []
        for _ in range(self._count):
            conn, child = self._context.Pipe()
            args = (child, self._secret, *self._addresses, port, self._count)
            process = self._context.Process(target=router_process, args=args, daemon=True)
            process.start()
            self._running.append((conn, process))
            port, pid = conn.recv()
            pids.append(pid)
        return port, pids

    def __exit__(self, *_: object) -> None:
        for conn, process in self._running:
            conn.send(None)
            process.join(20)
            if process.is_alive():
                process.terminate()


def report(results: dict[str, Any]) -> dict[str, float]:
    rows = [
        [r["streams"], r["replicas"], r["rate_per_stream"], r["streams_held"], r["errors"],
         r["token_latency_p50_ms"], r["token_latency_p99_ms"], r["tokens_per_s"],
         r["router_cpu_ms_per_1k_tokens"], r["rss_kib_per_stream"]]
        for r in results["streaming"]
    ]  # fmt: skip
    print_table(
        "streaming through the router (fake instances)",
        ["streams", "routers", "tok/s each", "held", "errors", "lat p50 ms", "lat p99 ms",
         "tok/s", "router CPU ms/1k tok", "RSS KiB/stream"],
        rows,
    )  # fmt: skip
    print_table(
        "non-streaming",
        ["concurrent", "completed", "errors", "req/s", "p50 s", "p99 s", "router CPU ms/req"],
        [[r["concurrent"], r["completed"], r["errors"], r["requests_per_s"], r["latency_p50_s"],
          r["latency_p99_s"], r["router_cpu_ms_per_request"]] for r in results["plain"]],
    )  # fmt: skip
    metrics: dict[str, float] = {}
    single = {r["streams"]: r for r in results["streaming"] if r["replicas"] == 1}
    for r in results["streaming"]:
        n, count = r["streams"], r["replicas"]
        metrics[f"cpu_ms_per_1k_{count}_{n}"] = r["router_cpu_ms_per_1k_tokens"]
        if count == 1:
            metrics[f"held_{n}"] = r["streams_held"]
            metrics[f"errors_{n}"] = r["errors"]
            metrics[f"p99_ms_{n}"] = r["token_latency_p99_ms"]
            metrics[f"tokens_per_s_{n}"] = r["tokens_per_s"]
        elif n in single:
            ratio = r["tokens_per_s"] / max(single[n]["tokens_per_s"], 1e-9)
            metrics[f"replicas_{count}_vs_1_tokens_per_s_{n}"] = ratio
            metrics[f"errors_{count}_{n}"] = r["errors"]
    for r in results["plain"]:
        metrics[f"plain_rps_{r['concurrent']}"] = r["requests_per_s"]
        metrics[f"plain_errors_{r['concurrent']}"] = r["errors"]
    peer = results.get("sglang_router")
    if peer:
        _report_peer(results["streaming"], peer, metrics)
    return metrics


def _report_peer(
    ours: list[dict[str, Any]], peer: list[dict[str, Any]], metrics: dict[str, float]
) -> None:
    """sglang-router's stages, and pdserve's as ratios to them (> 1: pdserve better)."""
    print_table(
        "the same stages through sglang-router (OpenAI-HTTP stand-in worker)",
        ["streams", "held", "errors", "lat p50 ms", "lat p99 ms", "tok/s",
         "router CPU ms/1k tok", "RSS KiB/stream"],
        [[r["streams"], r["streams_held"], r["errors"], r["token_latency_p50_ms"],
          r["token_latency_p99_ms"], r["tokens_per_s"], r["router_cpu_ms_per_1k_tokens"],
          r["rss_kib_per_stream"]] for r in peer],
    )  # fmt: skip
    for a, b in zip([r for r in ours if r["replicas"] == 1], peer, strict=True):
        n = a["streams"]
        metrics[f"vs_sglang_tokens_per_s_{n}"] = a["tokens_per_s"] / max(b["tokens_per_s"], 1e-9)
        metrics[f"vs_sglang_p99_{n}"] = b["token_latency_p99_ms"] / a["token_latency_p99_ms"]
        metrics[f"vs_sglang_cpu_{n}"] = (
            b["router_cpu_ms_per_1k_tokens"] / a["router_cpu_ms_per_1k_tokens"]
        )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], configure)
    results = bench(args)
    finish("router_scale", args, results, report(results))


if __name__ == "__main__":
    main()
