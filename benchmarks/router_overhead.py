"""Router overhead: µs per routing decision, and requests/s the HTTP router proxies.

    python benchmarks/router_overhead.py [--quick]

`decision_us` is one `cache_aware` routing decision for a 4k-token prompt (256 blocks of 16
tokens) among 16 prefill instances whose KV-event index holds ~100k distinct blocks:
`KVEventIndex.overlaps` + `LoadTracker.snapshot` + `CacheAwarePolicy.choose`. The prompt is fully
cached on one instance and partly on others, so the chain walk visits all 256 blocks (the worst
case). Hashing the prompt (`BlockHasher.hash_tokens`) is **excluded** from `decision_us` and
reported on its own row (`hash_us`): the router hashes once per request whatever the policy.
Target: decision_us <= 200. A bare loop of dict lookups over the same 256 hashes is timed as the
machine's baseline.

`proxy_rps`: requests/s the OpenAI HTTP router (`serve_router`, the real app, `cache_aware` policy)
proxies to instant fake instances. The fakes are minimal gRPC servers built on the generated
servicer bases and `create_server`: 2 PrefillService (Prefill answers a PrefillResult at once) and 1
DecodeService, each with an InstanceService (GetStats reports free blocks; SubscribeKVEvents sends
an empty snapshot and holds the stream open until cancelled; Abort; the decode fake's
SubscribeOutputs sends each request's one token and its end, queued by the fake Prefill). A client
of `--workers` (16) concurrent httpx workers posts non-streaming `/v1/completions` with a
`--proxy-prompt-tokens` (64) token-id prompt, max_tokens 2, for `--proxy-seconds` (5; quick 2) after
a 1 s warm-up; only 200 responses are counted. Every request costs the router: JSON parsing and
validation, hashing the prompt, a routing decision, the Prefill RPC and its output on the
subscription, two leases, and the JSON response.

Process layout (2-core box): the router runs alone in this process; the fakes and the client run
in a child process (`multiprocessing` spawn), so the router does not share its GIL with them.
The baseline, measured in the same run by the same client, is a bare FastAPI app on uvicorn
(same server settings, in this process) whose `/v1/completions` validates the body with the
router's `CompletionRequest` and returns a fixed completion: the HTTP stack and schema alone.
`proxy_ratio` = proxy_rps / bare_http_rps (median of per-round ratios; the sides alternate,
`--proxy-rounds` rounds: 3, quick 2). The JSON also has each process's CPU time per request
(`router_cpu_us_per_request`: what one proxied request costs the router; "peer cores": CPU of
the child process, client plus fakes, in cores, to show which side limits) and latency
percentiles.

Tracing's cost: a third side, `traced`, is the same router with tracing on at a sample ratio of
1 (`pdserve.observability.tracing`, OpenTelemetry's SDK and OTLP/gRPC exporter), its spans sent
to an OTLP collector in the child process that counts and drops them; it is switched on before
the side's span and off (its last spans flushed) after, and alternates with the others.
`tracing_cpu_ratio` = router CPU per request traced / untraced (the router with tracing off
makes no span and sends no trace metadata: the untraced side is the default's cost).

Prints tables, writes benchmarks/results/router_overhead.json, ends with one RESULT line:
`RESULT router_overhead decision_us=… auth_us=… proxy_rps=… proxy_ratio=… router_cpu_us=…
router_cpu_us_traced=… tracing_cpu_ratio=…` (the proxy figures nan with `--skip-proxy`).
"""

import argparse
import asyncio
import multiprocessing
import os
import queue
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
import httpx
import uvicorn
from _common import finish, median, median_seconds, parse_args, print_table, repeats
from fastapi import FastAPI
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.config import EngineConfig, RouterConfig
from pdserve.kvcache.events import BlockRemoved, BlockStored
from pdserve.kvcache.hashing import BlockHash, BlockHasher
from pdserve.observability import tracing
from pdserve.rpc.auth import BearerTokenInterceptor, new_secret
from pdserve.rpc.server import create_server
from pdserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.router.kv_index import KVEventIndex
from services.router.load import Lease, LoadTracker
from services.router.openai_schema import CompletionRequest
from services.router.policies import (
    Decision,
    PolicyConfig,
    RouteReason,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from services.router.server import serve_router

NAME = "router_overhead"
BLOCK_SIZE = 16
SYSTEM_TOKENS = 1024  # shared by every conversation, held by every instance
FILLER_CHAIN_BLOCKS = 192  # length of the other conversations filling the index
DECISION_TARGET_US = 200.0
MODEL_NAME = "tiny"
FAKE_PREFILL = 2
FAKE_DECODE = 1
FAKE_TOKEN = 66  # "B" in the tiny model's byte-level vocabulary
WARMUP_S = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=16, help="prefill instances")
    parser.add_argument("--indexed-blocks", type=int, default=100_000, help="distinct blocks")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-proxy", action="store_true", help="no proxy_rps measurement")
    parser.add_argument("--workers", type=int, default=16, help="concurrent HTTP client workers")
    parser.add_argument(
        "--proxy-seconds", type=float, help="measured seconds per side (5; quick 2)"
    )
    parser.add_argument("--proxy-rounds", type=int, help="rounds of (bare, proxy) (3; quick 2)")
    parser.add_argument("--proxy-prompt-tokens", type=int, default=64, help="prompt token ids")


@dataclass(frozen=True, slots=True)
class Setup:
    index: KVEventIndex
    tracker: LoadTracker
    leases: list[Lease]
    instances: tuple[str, ...]
    tokens: list[int]
    hashes: list[BlockHash]
    hasher: BlockHasher


def build(args: argparse.Namespace) -> Setup:
    """An index of ~`indexed_blocks` blocks over `instances`; two in-flight requests each."""
    rng = random.Random(args.seed)
    hasher = BlockHasher.for_model(BLOCK_SIZE, "bench-model")
    instances = tuple(f"10.0.{i // 256}.{i % 256}:50051" for i in range(args.instances))
    tokens = [rng.randrange(32_000) for _ in range(args.tokens)]
    tokens[:SYSTEM_TOKENS] = [7 + i % 100 for i in range(SYSTEM_TOKENS)]
    hashes = hasher.hash_tokens(tokens)
    system = hashes[: SYSTEM_TOKENS // BLOCK_SIZE]

    index = KVEventIndex()
    for i, instance_id in enumerate(instances):
        # instance 0 holds the whole prompt, 1 three quarters, 2 half, the others the system part
        held = max(len(system), len(hashes) * (4 - min(i, 4)) // 4)
        index.apply(instance_id, BlockStored(tuple(hashes[:held])))
    while len(index) < args.indexed_blocks:
        filler = tuple(BlockHash(os.urandom(32)) for _ in range(FILLER_CHAIN_BLOCKS))
        for instance_id in rng.sample(instances, rng.randint(1, 3)):
            index.apply(instance_id, BlockStored((*system, *filler)))

    tracker = LoadTracker()
    leases = [tracker.acquire(instance_id, 256) for instance_id in instances for _ in range(2)]
    return Setup(index, tracker, leases, instances, tokens, hashes, hasher)


def decide(setup: Setup, policy: RoutingPolicy, hashes: Sequence[BlockHash]) -> Decision:
    """One routing decision as the router makes it, prompt hashes already computed."""
    request = RouteRequest("bench", len(setup.tokens), BLOCK_SIZE)
    overlaps = setup.index.overlaps(hashes, setup.instances)
    return policy.choose(setup.instances, request, setup.tracker.snapshot(), overlaps)


def bench_decisions(setup: Setup, repeat: int, number: int) -> dict[str, float]:
    """µs per decision for three prompts, per component for the worst case, and a baseline."""
    policy = make_policy("cache_aware", PolicyConfig())
    hit = decide(setup, policy, setup.hashes)
    assert (hit.instance_id, hit.reason) == (setup.instances[0], RouteReason.CACHE_HIT), hit
    miss_hashes = setup.hasher.hash_tokens([t + 1 for t in setup.tokens])
    system_only = [*setup.hashes[: SYSTEM_TOKENS // BLOCK_SIZE], *miss_hashes[64:]]

    def timed(fn: Callable[[], object]) -> float:
        return median_seconds(fn, repeat=repeat, number=number) * 1e6

    request = RouteRequest("bench", len(setup.tokens), BLOCK_SIZE)
    overlaps = setup.index.overlaps(setup.hashes, setup.instances)
    loads = setup.tracker.snapshot()
    holders = {h: 1 for h in setup.hashes}
    return {
        "decision_us": timed(lambda: decide(setup, policy, setup.hashes)),
        "decision_system_prefix_us": timed(lambda: decide(setup, policy, system_only)),
        "decision_miss_us": timed(lambda: decide(setup, policy, miss_hashes)),
        "overlaps_us": timed(lambda: setup.index.overlaps(setup.hashes, setup.instances)),
        "snapshot_us": timed(setup.tracker.snapshot),
        "choose_us": timed(lambda: policy.choose(setup.instances, request, loads, overlaps)),
        "lease_us": timed(lambda: setup.tracker.acquire(setup.instances[0], 100).release()),
        "baseline_dict_loop_us": timed(lambda: [holders.get(h, 0) & 1 for h in setup.hashes]),
        "hash_us": median_seconds(lambda: setup.hasher.hash_tokens(setup.tokens), repeat=repeat)
        * 1e6,
        **bench_auth(timed),
    }


class _Details:
    """What grpc hands a server interceptor for one call."""

    method = "/pdserve.v1.PrefillService/Prefill"

    def __init__(self, token: str) -> None:
        self.invocation_metadata = (("user-agent", "grpc-python"), ("authorization", token))


def bench_auth(timed: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """The cluster-secret check per RPC: BearerTokenInterceptor.intercept_service on a call that
    carries the right secret, and the bare continuation it wraps (grpc's handler lookup)."""
    secret = new_secret()
    interceptor = BearerTokenInterceptor(secret)
    details = _Details(f"Bearer {secret}")
    handler = object()

    def continuation(_: object) -> object:
        return handler

    assert interceptor.intercept_service(continuation, details) is handler  # type: ignore[arg-type]
    return {
        "auth_us": timed(lambda: interceptor.intercept_service(continuation, details)),  # type: ignore[arg-type]
        "auth_baseline_us": timed(lambda: continuation(details)),
    }


def bench_events(setup: Setup, repeat: int, number: int) -> float:
    """µs to apply one 16-block BlockStored plus its BlockRemoved to the full index."""
    blocks = tuple(BlockHash(os.urandom(32)) for _ in range(16))
    instance_id = setup.instances[-1]

    def store_and_remove() -> None:
        setup.index.apply(instance_id, BlockStored(blocks))
        setup.index.apply(instance_id, BlockRemoved(blocks))

    return median_seconds(store_and_remove, repeat=repeat, number=number) * 1e6


# -- proxy_rps: the HTTP router in front of instant fake instances ---------------------------------


class _Outputs:
    """What the fake prefill hands the fake decode (same process): each request's one output,
    queued for its router's output subscription."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[common_pb2.RequestOutputs]] = {}

    def of(self, subscriber: str) -> "queue.SimpleQueue[common_pb2.RequestOutputs]":
        with self._lock:
            return self._queues.setdefault(subscriber, queue.SimpleQueue())


OUTPUTS = _Outputs()


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Answers at once with the result (first token FAKE_TOKEN); the request's output (that
    token, and the end) goes to its router's subscription on the fake decode."""

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillResult:
        generate = request.request
        output = common_pb2.RequestOutputs(
            request_id=generate.request_id,
            attempt=generate.attempt,
            chunk=common_pb2.TokenChunk(token_ids=[FAKE_TOKEN], text="B"),
            final=common_pb2.TokenFinal(
                finish_reason=common_pb2.FINISH_REASON_LENGTH, num_output_tokens=1
            ),
        )
        OUTPUTS.of(generate.subscriber).put(output)
        return prefill_pb2.PrefillResult(
            first_token_id=FAKE_TOKEN, num_prompt_tokens=len(generate.prompt_token_ids)
        )


class FakeInstance(common_pb2_grpc.InstanceServiceServicer):
    """InstanceService of a fake: empty KV-event snapshot then nothing until cancelled; stats
    report free blocks; Abort finds nothing; the output subscription sends what is queued."""

    def __init__(self, role: str) -> None:
        self.role = role

    def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortReply:
        return common_pb2.AbortReply(found=False)

    def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> common_pb2.InstanceStats:
        return common_pb2.InstanceStats(
            role=self.role, block_size=BLOCK_SIZE, num_blocks=4096, num_free_blocks=4096
        )

    def SubscribeKVEvents(
        self, request: common_pb2.KVEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.KVEvent]:
        yield common_pb2.KVEvent(snapshot=common_pb2.BlocksStored())
        ended = threading.Event()
        context.add_callback(ended.set)
        while not ended.wait(0.5) and context.is_active():
            pass

    def SubscribeOutputs(
        self, request: common_pb2.OutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.StepOutputs]:
        yield common_pb2.StepOutputs()
        outputs = OUTPUTS.of(request.subscriber)
        while context.is_active():
            try:
                first = outputs.get(timeout=0.5)
            except queue.Empty:
                continue
            step = common_pb2.StepOutputs(outputs=[first])
            while not outputs.empty():  # everything ready goes in one message, as a step's
                step.outputs.append(outputs.get())
            yield step


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """The handoff's calls are never made (the fake prefill makes none)."""


def start_fake(
    role: str, register: Callable[[grpc.Server], None], name: str, secret: str
) -> tuple[grpc.Server, int]:
    """A fake instance checking the cluster secret on every call, as a real one does."""

    def register_all(server: grpc.Server) -> None:
        register(server)
        common_pb2_grpc.add_InstanceServiceServicer_to_server(FakeInstance(role), server)

    interceptors = [BearerTokenInterceptor(secret)]
    return create_server(
        register_all, [name, "pdserve.v1.InstanceService"], interceptors=interceptors
    )


def start_fakes(secret: str) -> tuple[list[grpc.Server], list[int], list[int]]:
    """FAKE_PREFILL prefill and FAKE_DECODE decode fake servers: (servers, ports, ports)."""
    servers: list[grpc.Server] = []
    prefill_ports, decode_ports = [], []
    for _ in range(FAKE_PREFILL):
        server, port = start_fake(
            "prefill",
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(FakePrefill(), s),
            "pdserve.v1.PrefillService",
            secret,
        )
        servers.append(server)
        prefill_ports.append(port)
    for _ in range(FAKE_DECODE):
        server, port = start_fake(
            "decode",
            lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(FakeDecode(), s),
            "pdserve.v1.DecodeService",
            secret,
        )
        servers.append(server)
        decode_ports.append(port)
    return servers, prefill_ports, decode_ports


async def drive_http(
    url: str, body: dict[str, Any], workers: int, warmup_s: float, seconds: float
) -> dict[str, Any]:
    """`workers` concurrent POST loops for warmup_s + seconds; counts 200s that complete in the
    measured window, and this process's CPU time over it."""
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    ok = errors = 0
    latencies: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        begin = time.perf_counter()
        window_start, window_end = begin + warmup_s, begin + warmup_s + seconds

        async def worker() -> None:
            nonlocal ok, errors
            while (sent := time.perf_counter()) < window_end:
                response = await client.post(url, json=body)
                done = time.perf_counter()
                if not window_start <= done <= window_end:
                    continue
                if response.status_code == 200 and response.json()["choices"][0]["text"] == "B":
                    ok += 1
                    latencies.append(done - sent)
                else:
                    errors += 1

        async def cpu_window() -> float:
            await asyncio.sleep(warmup_s)
            cpu = time.process_time()
            await asyncio.sleep(seconds)
            return time.process_time() - cpu

        *_, cpu_s = await asyncio.gather(*(worker() for _ in range(workers)), cpu_window())
    latencies.sort()
    return {
        "requests": ok,
        "errors": errors,
        "seconds": seconds,
        "rps": ok / seconds,
        "client_cpu_s": cpu_s,
        "latency_p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else float("nan"),
        "latency_p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))]
        if latencies
        else float("nan"),
    }


class CountingCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts the spans it is sent and keeps none."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.spans += sum(
            len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
        )
        return trace_service_pb2.ExportTraceServiceResponse()


def start_collector() -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(CountingCollector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def peer_process(conn: Connection, secret: str) -> None:
    """The child process: the fake instances and a trace collector, then the HTTP client on
    request."""
    servers, prefill_ports, decode_ports = start_fakes(secret)
    collector, collector_port = start_collector()
    servers.append(collector)
    try:
        conn.send((prefill_ports, decode_ports, collector_port))
        while (job := conn.recv()) is not None:
            conn.send(asyncio.run(drive_http(**job)))
    finally:
        for server in servers:
            server.stop(0).wait()


@dataclass
class HttpServer:
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_bare() -> HttpServer:
    """The baseline: the router's request schema on FastAPI + uvicorn, a fixed completion."""
    app = FastAPI(docs_url=None, redoc_url=None)
    reply = {
        "id": "cmpl-bare",
        "object": "text_completion",
        "created": 0,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "text": "B", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return reply

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    return HttpServer(server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}")


def bench_proxy(args: argparse.Namespace) -> dict[str, Any]:
    """Alternating rounds of (bare HTTP, router proxy) driven from the child process."""
    seconds = args.proxy_seconds or (2.0 if args.quick else 5.0)
    rounds = args.proxy_rounds or (2 if args.quick else 3)
    rng = random.Random(args.seed)
    body = {
        "model": MODEL_NAME,
        "prompt": [rng.randrange(32, 127) for _ in range(args.proxy_prompt_tokens)],
        "max_tokens": 2,
        "temperature": 0,
    }
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    secret = new_secret()
    peer = context.Process(target=peer_process, args=(child, secret), daemon=True)
    peer.start()
    router = bare = None
    try:
        prefill_ports, decode_ports, collector_port = parent.recv()
        router = serve_router(
            RouterConfig(port=0, model_name=MODEL_NAME, prefill_policy="cache_aware"),
            EngineConfig(),
            [f"127.0.0.1:{p}" for p in prefill_ports],
            [f"127.0.0.1:{p}" for p in decode_ports],
            secret=secret,
        )
        bare = serve_bare()
        sides = {"bare": bare.url, "proxy": router.url, "traced": router.url}
        samples: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        endpoint = f"http://127.0.0.1:{collector_port}"
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                if side == "traced":
                    tracing.configure(endpoint, 1.0, "pdserve-router-benchmark")
                try:
                    samples[side].append(drive(parent, sides[side], body, args.workers, seconds))
                finally:
                    tracing.shutdown()  # a no-op when it was off
        loads = router.router.attempts.load.snapshot()  # instances with a live lease
        leases = sum(load.in_flight_requests for load in loads.values())
    finally:  # the router first: its channels close before the fake servers go away
        if router is not None:
            router.stop()
        if bare is not None:
            bare.stop()
        parent.send(None)
        peer.join(15)
        if peer.is_alive():
            peer.terminate()
    return proxy_figures(samples, leases, args, seconds, rounds)


def drive(
    parent: Connection, url: str, body: dict[str, Any], workers: int, seconds: float
) -> dict[str, Any]:
    """One timed span of load on `url` from the peer process, with this process's CPU time
    over it (the servers run here)."""
    job = {
        "url": url + "/v1/completions",
        "body": body,
        "workers": workers,
        "warmup_s": WARMUP_S,
        "seconds": seconds,
    }
    parent.send(job)
    time.sleep(WARMUP_S)
    cpu = time.process_time()
    time.sleep(seconds)
    server_cpu = time.process_time() - cpu
    sample: dict[str, Any] = parent.recv()
    sample["server_cpu_s"] = server_cpu
    sample["server_cpu_us_per_request"] = (
        1e6 * server_cpu / sample["requests"] if sample["requests"] else float("nan")
    )
    return sample


def proxy_figures(
    samples: dict[str, list[dict[str, Any]]],
    leases: int,
    args: argparse.Namespace,
    seconds: float,
    rounds: int,
) -> dict[str, Any]:
    ratios = [p["rps"] / b["rps"] for p, b in zip(samples["proxy"], samples["bare"], strict=True)]

    def med(side: str, key: str) -> float:
        return median([s[key] for s in samples[side]])

    return {
        "proxy_rps": med("proxy", "rps"),
        "bare_http_rps": med("bare", "rps"),
        "proxy_ratio": statistics.median(ratios),
        "router_cpu_us_per_request": med("proxy", "server_cpu_us_per_request"),
        "router_cpu_us_per_request_traced": med("traced", "server_cpu_us_per_request"),
        "tracing_cpu_ratio": statistics.median(
            t["server_cpu_us_per_request"] / p["server_cpu_us_per_request"]
            for t, p in zip(samples["traced"], samples["proxy"], strict=True)
        ),
        "traced_rps": med("traced", "rps"),
        "traced_latency_p50_ms": med("traced", "latency_p50_ms"),
        "traced_errors": sum(s["errors"] for s in samples["traced"]),
        "bare_cpu_us_per_request": med("bare", "server_cpu_us_per_request"),
        "proxy_latency_p50_ms": med("proxy", "latency_p50_ms"),
        "proxy_latency_p99_ms": med("proxy", "latency_p99_ms"),
        "bare_latency_p50_ms": med("bare", "latency_p50_ms"),
        "proxy_errors": sum(s["errors"] for s in samples["proxy"]),
        "proxy_peer_cores": med("proxy", "client_cpu_s") / seconds,
        "bare_peer_cores": med("bare", "client_cpu_s") / seconds,
        "live_leases_after": leases,
        "workers": args.workers,
        "seconds_per_side": seconds,
        "rounds": rounds,
        "prompt_tokens": args.proxy_prompt_tokens,
        "samples": samples,
    }


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=5, full=11)
    number = 200 if args.quick else 1000
    setup = build(args)
    figures = bench_decisions(setup, repeat, number)
    event_us = bench_events(setup, repeat, number)
    setup.index.check_integrity()
    for lease in setup.leases:
        lease.release()
    setup.tracker.check_integrity()

    decision_us = figures["decision_us"]
    verdict = "PASS" if decision_us <= DECISION_TARGET_US else "FAIL"
    num_blocks = len(setup.hashes)
    report_decisions(args, setup, figures, event_us, verdict, repeat)
    results: dict[str, Any] = {
        **figures,
        "apply_event_pair_us": event_us,
        "decision_vs_baseline": decision_us / figures["baseline_dict_loop_us"],
        "decision_target_us": DECISION_TARGET_US,
        "decision_pass": verdict == "PASS",
        "hashing_in_decision": False,
        "indexed_blocks": len(setup.index),
        "prompt_blocks": num_blocks,
        "repeat": repeat,
        "calls_per_sample": number,
    }
    metrics = {
        "decision_us": decision_us,
        "auth_us": figures["auth_us"],
        "proxy_rps": float("nan"),
        "proxy_ratio": float("nan"),
    }
    if not args.skip_proxy:
        proxy = bench_proxy(args)
        results["proxy"] = proxy
        metrics["proxy_rps"] = proxy["proxy_rps"]
        metrics["proxy_ratio"] = proxy["proxy_ratio"]
        metrics["router_cpu_us"] = proxy["router_cpu_us_per_request"]
        metrics["router_cpu_us_traced"] = proxy["router_cpu_us_per_request_traced"]
        metrics["tracing_cpu_ratio"] = proxy["tracing_cpu_ratio"]
        report_proxy(proxy)
    finish(NAME, args, results, metrics)


def report_decisions(
    args: argparse.Namespace,
    setup: Any,
    figures: dict[str, float],
    event_us: float,
    verdict: str,
    repeat: int,
) -> None:
    decision_us, num_blocks = figures["decision_us"], len(setup.hashes)
    print_table(
        f"cache_aware routing, {args.instances} instances, {len(setup.index):,} indexed blocks, "
        f"{args.tokens}-token prompt ({num_blocks} blocks), median of {repeat}",
        ["operation", "µs", "note"],
        [
            [
                "decision, full hit",
                decision_us,
                f"{num_blocks}-block walk; target <= 200: {verdict}",
            ],
            ["decision, system prefix", figures["decision_system_prefix_us"], "64-block walk"],
            ["decision, miss", figures["decision_miss_us"], "walk stops at block 0"],
            ["  overlaps", figures["overlaps_us"], "KVEventIndex.overlaps, full hit"],
            ["  loads snapshot", figures["snapshot_us"], "LoadTracker.snapshot"],
            ["  policy choose", figures["choose_us"], "CacheAwarePolicy.choose"],
            ["lease acquire+release", figures["lease_us"], "per request, not in decision"],
            ["hash prompt", figures["hash_us"], "BlockHasher.hash_tokens, not in decision"],
            ["cluster-secret check", figures["auth_us"], "per instance RPC (interceptor)"],
            ["  bare continuation", figures["auth_baseline_us"], "what it wraps"],
            ["dict-loop baseline", figures["baseline_dict_loop_us"], f"{num_blocks} lookups"],
            ["apply KV events", event_us, "16-block store + remove"],
        ],
    )
    print(f"\ndecision (hashing excluded): {decision_us:.1f} µs -> {verdict}")


def report_proxy(proxy: dict[str, Any]) -> None:
    print_table(
        f"HTTP router proxying to instant fake instances ({FAKE_PREFILL} prefill, "
        f"{FAKE_DECODE} decode), {proxy['workers']} client workers, "
        f"{proxy['seconds_per_side']:g} s x {proxy['rounds']} rounds, median",
        ["side", "requests/s", "p50 ms", "p99 ms", "server CPU µs/req", "peer cores", "note"],
        [
            [
                "router proxy",
                proxy["proxy_rps"],
                proxy["proxy_latency_p50_ms"],
                proxy["proxy_latency_p99_ms"],
                proxy["router_cpu_us_per_request"],
                proxy["proxy_peer_cores"],
                f"{proxy['proxy_errors']} errors",
            ],
            [
                "router proxy, traced",
                proxy["traced_rps"],
                proxy["traced_latency_p50_ms"],
                float("nan"),
                proxy["router_cpu_us_per_request_traced"],
                float("nan"),
                f"tracing on, ratio 1; {proxy['traced_errors']} errors",
            ],
            [
                "bare HTTP",
                proxy["bare_http_rps"],
                proxy["bare_latency_p50_ms"],
                float("nan"),
                proxy["bare_cpu_us_per_request"],
                proxy["bare_peer_cores"],
                "same schema, fixed reply",
            ],
        ],
    )
    print(f"\nproxy_rps {proxy['proxy_rps']:.0f}, {proxy['proxy_ratio']:.2f} x bare HTTP")
    print(
        f"router CPU per request with tracing on at ratio 1: {proxy['tracing_cpu_ratio']:.2f} x off"
    )


if __name__ == "__main__":
    main()
