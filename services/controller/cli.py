"""The `pdserve` command line.

`pdserve generate` runs a single in-process engine (no Ray, no network) and streams the output;
with `--cluster` it is a client of the running cluster's router (its OpenAI API) instead.
`pdserve up` places prefill and decode instances on Ray and stays in the foreground until Ctrl-C
or `pdserve down`.
Errors caused by the user's input are one line on stderr and exit status 2; nothing else prints a
traceback unless `--debug` is given.
"""

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.config import ClusterConfig, load_cluster_config, load_engine_config
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.engine import check_model
from pdserve.errors import ClusterError, PdserveError
from pdserve.model.tokenizer import Tokenizer
from pdserve.storage.redis_server import redacted
from services.controller import admin_cli, top
from services.simulator import cli as simulator_cli

if TYPE_CHECKING:
    from services.controller.cluster import Cluster, InstanceInfo
    from services.controller.supervisor import Supervisor
    from services.planner.loop import PlannerLoop
    from services.router.replicas import ReplicaInfo, RouterReplicas
    from services.router.router import Router
    from services.router.server import RunningRouter

EXIT_USAGE = 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="LLM serving with PD disaggregation"
    )
    parser.add_argument("--debug", action="store_true", help="log verbosely and show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate from a prompt with an in-process engine")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", help="Hugging Face model directory (default: built-in tiny model)")
    gen.add_argument("--config", help="YAML config file (its `engine:` section is used)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    gen.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    gen.add_argument("--device", default=None, help="cpu | cuda")
    gen.add_argument(
        "--cluster",
        action="store_true",
        help="send the request to the router of the cluster started by `pdserve up` instead",
    )
    gen.add_argument("--state-dir", help="where `pdserve up` wrote cluster.json (with --cluster)")
    up = commands.add_parser("up", help="start prefill and decode instances on Ray (foreground)")
    up.add_argument("--config", help="YAML config file (sections engine, prefill, decode, cluster)")
    up.add_argument("--address", help="Ray cluster to join (e.g. auto); default: start local Ray")
    up.add_argument("--state-dir", help="where to write cluster.json (default: user state dir)")
    up.add_argument(
        "--redis-url",
        help="Redis of the storage tier (redis://, rediss://); default: start an embedded one",
    )
    up.add_argument("--health-interval", type=float, default=5.0, help="seconds between checks")
    admin_cli.add_parser(commands)
    top.add_parser(commands)
    simulator_cli.add_parser(commands)
    down = commands.add_parser("down", help="stop the cluster started by `pdserve up`")
    down.add_argument("--config", help="the config file given to `up` (for state_dir)")
    down.add_argument("--state-dir", help="where `up` wrote cluster.json")
    return parser


def _generate(args: argparse.Namespace) -> int:
    config = load_engine_config(
        args.config, overrides={"model": args.model, "dtype": args.dtype, "device": args.device}
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    if args.cluster:
        finish_reason = _generate_on_cluster(args, params)
    else:
        engine = LLMEngine.from_config(config)
        finish_reason = None
        for output in engine.stream(_prompt_ids(engine.tokenizer, args), params):
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
            finish_reason = output.finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def _prompt_ids(tokenizer: Tokenizer, args: argparse.Namespace) -> list[int]:
    if args.chat:
        return tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    return tokenizer.encode(args.prompt)


def _generate_on_cluster(args: argparse.Namespace, params: SamplingParams) -> str | None:
    """Send the prompt to the running cluster's router, through its OpenAI API like any other
    client, and stream the text; returns the finish reason."""
    from services.controller.cluster import read_state

    cluster = load_cluster_config(args.config, overrides={"state_dir": args.state_dir})
    url = read_state(cluster)["router_url"]
    [card] = _http_json(f"{url}/v1/models")["data"]
    body: dict[str, object] = {
        "model": card["id"],
        "stream": True,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(params.stop),
    }
    if args.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": args.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", args.prompt
    finish_reason = None
    for chunk in _http_events(url + path, body):
        for choice in chunk["choices"]:
            text = choice["delta"].get("content") if args.chat else choice.get("text")
            sys.stdout.write(text or "")
            sys.stdout.flush()
            finish_reason = choice.get("finish_reason") or finish_reason
    return finish_reason


def _http_json(url: str, body: dict[str, object] | None = None) -> Any:
    with _http(url, body) as reply:
        return json.load(reply)


def _http_events(url: str, body: dict[str, object]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream, until `[DONE]`."""
    with _http(url, body) as reply:
        for line in reply:
            data = line.decode().strip().removeprefix("data: ")
            if data == "[DONE]":
                return
            if data:
                yield json.loads(data)


def _http(url: str, body: dict[str, object] | None) -> Any:
    """An open HTTP reply (POST when `body` is given); an error answer raises ClusterError with
    the router's message."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:
        message = json.loads(e.read() or b"{}").get("error", {}).get("message", e.reason)
        raise ClusterError(f"the router at {url} answered {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise ClusterError(f"the router at {url} cannot be reached ({e.reason}); is it up?") from e


def _up(args: argparse.Namespace) -> int:
    # The whole config is validated (ConfigError: one line, exit 2) before Ray is even imported,
    # let alone started, and before the embedded Redis.
    config = load_cluster_config(
        args.config, overrides={"ray_address": args.address, "state_dir": args.state_dir}
    )
    if args.redis_url:  # replace() re-runs StorageConfig's checks on the URL
        config = replace(config, storage=replace(config.storage, redis_url=args.redis_url))
    check_model(config.engine)  # the model's config.json against the engine's: one line, exit 2
    config = _observe(config, args.debug)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: stacks to stderr
    ray_token = _prepare_ray_auth(config)  # before Ray is imported: it reads its auth mode then
    from services.controller.cluster import Cluster, StartStopped, cluster_secret
    from services.controller.state import state_path

    path = state_path(config)
    print("starting pdserve: placing instances on Ray ...", flush=True)
    secret = cluster_secret(path.parent, create=True)
    cluster = Cluster(config, secret)
    running = _Running()
    try:
        _serve_cluster(args, config, cluster, secret, running)
    except StartStopped:
        print("pdserve up: stopped while starting", file=sys.stderr, flush=True)
    finally:
        _shut_down(config, cluster, running, ray_token)
    return 0


def _observe(config: ClusterConfig, debug: bool) -> ClusterConfig:
    """Start `up`'s own logs (the router's request lines among them) and traces (the
    router's spans); returns `config` with the collector the standard OTEL_* variables name,
    when the config names none, so that the instances (which Ray may start on other nodes,
    without this environment) send their spans there too."""
    from pdserve.observability import logs, tracing

    settings = config.observability
    logs.configure_logging(settings.log_format, logging.DEBUG if debug else logging.INFO)
    endpoint = tracing.trace_endpoint(settings.otlp_endpoint)
    if endpoint != settings.otlp_endpoint:  # replace() checks the variable's value
        settings = replace(settings, otlp_endpoint=endpoint)
        config = replace(config, observability=settings)
    if tracing.configure(endpoint, settings.trace_sample_ratio, "pdserve-router"):
        print(f"tracing on: sampling {settings.trace_sample_ratio:g} of requests", flush=True)
    return config


@dataclass(slots=True)
class _Running:
    """What `pdserve up` has started so far, for its shutdown."""

    router: "RunningRouter | None" = None
    admin: grpc.Server | None = None
    planner: "PlannerLoop | None" = None
    replicas: "RouterReplicas | None" = None  # router.replicas > 1: the other processes
    primary_metrics: Any = None  # then: up's own router's metrics server
    primary_metrics_address: str = ""

    def router_processes(self) -> "list[ReplicaInfo]":
        """Every router process, up's own first; empty without replicas."""
        from services.router.replicas import ReplicaInfo

        if self.replicas is None:
            return []
        own = ReplicaInfo("router-0", os.getpid(), True, 0, self.primary_metrics_address)
        return [own, *self.replicas.infos()]


def _prepare_ray_auth(config: ClusterConfig) -> Path | None:
    """Token authentication for a local Ray (its token file), or a warning when joining one
    without a token (None)."""
    from services.controller import ray_auth
    from services.controller.state import state_path

    joining = config.ray_address or os.environ.get("RAY_ADDRESS")  # ray.init follows both
    if not joining:
        return ray_auth.prepare_local_ray(state_path(config).parent)
    if ray_auth.joins_without_token():
        ray_auth.warn_unauthenticated(joining)
    return None


def _serve_cluster(
    args: argparse.Namespace,
    config: ClusterConfig,
    cluster: "Cluster",
    secret: str,
    running: "_Running",
) -> None:
    """Place the instances, start the router and admin API (kept in `running`), publish
    the state, then watch until a signal arrives."""
    from pdserve.metrics import PlannerMetrics
    from services.controller.admin import admin_token, serve_admin
    from services.controller.state import state_path, tls_files
    from services.controller.supervisor import Supervisor
    from services.controller.topology import Topology
    from services.planner.loop import PlannerLoop
    from services.router.replicas import RouterReplicas
    from services.router.server import serve_router

    stop = cluster.stopping  # a signal: the start gives up waiting for Ray, the watch ends
    wake = threading.Event()  # check the instances now (a signal, or the router lost one)
    path = state_path(config)
    targets_path = path.with_name("prometheus_targets.json")
    _stop_on_signals(stop, wake)
    cluster.connect()
    _stop_on_signals(stop, wake)  # again: ray.init installs its own handlers
    instances = cluster.up()
    router = serve_router(
        config.router,
        config.engine,
        [i.address for i in instances if i.role == "prefill"],
        [i.address for i in instances if i.role == "decode"],
        [i.address for i in instances if i.role == "mixed"],
        secret=secret,
        tls=tls_files(config),
        scrape_targets=lambda address: scrape_targets(
            config, cluster.instances, address, running.router_processes()
        ),
        on_unreachable=wake.set,
        observability=config.observability,
    )
    running.router = router
    token = admin_token(config.admin, path.parent)
    admin_address = ""

    def changed() -> None:  # the instance set changed: scrape targets and cluster.json follow
        publish()
        cluster.write_state(path, router_url=router.url, admin_address=admin_address)

    if config.router.replicas > 1:
        running.primary_metrics, running.primary_metrics_address = _serve_primary_metrics(
            router.router, config.router.host
        )
        running.replicas = RouterReplicas(
            router.router, router.port, config.engine, config.observability, secret,
            tls_files(config), config.max_restarts, config.restart_window_s,
            config.restart_backoff_s, config.drain_timeout_s, on_change=lambda: changed(),
        )  # fmt: skip
        running.replicas.start()
    publish = TargetPublisher(cluster, router, targets_path, running.router_processes)
    publish()
    topology = Topology(cluster, router.router, changed)
    topology.routers = running.router_processes
    if config.planner.enabled:
        metrics = PlannerMetrics(router.router.metrics.registry)  # on the router's /metrics
        running.planner = PlannerLoop(topology, metrics)
    admin_server, admin_port = serve_admin(config.admin, token, topology, running.planner)
    running.admin = admin_server
    admin_address = f"{config.admin.host}:{admin_port}"
    cluster.write_state(path, router_url=router.url, admin_address=admin_address)
    _print_endpoints(cluster, router, targets_path, admin_address, path)
    supervisor = Supervisor(cluster, router.router, changed, _report)
    if running.planner is not None:
        running.planner.start()
    _watch(cluster, supervisor, stop, wake, args.health_interval)


def _serve_primary_metrics(router: "Router", host: str) -> tuple[Any, str]:
    """`up`'s own router's metrics on a port of its own (with replicas, the API port answers
    for whichever replica takes the connection)."""
    from pdserve.metrics import serve_metrics
    from services.router.replicas import RouterMetricsCollector

    server, port = serve_metrics(RouterMetricsCollector(router), host=host)
    return server, f"{host}:{port}"


def _stop_on_signals(stop: threading.Event, wake: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop`: a start gives up, the watch loop ends (then `up` drains
    and shuts down)."""

    def stop_watching(*_: object) -> None:
        stop.set()
        wake.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_watching)


def _shut_down(
    config: ClusterConfig, cluster: "Cluster", running: "_Running", ray_token: Path | None
) -> None:
    """Drain the router, stop the admin API and router, stop the cluster, remove the state
    files this `up` made (the cluster secret stays: it signs the storage index)."""
    from pdserve.observability import tracing
    from services.controller.state import state_path

    router, admin_server = running.router, running.admin
    if running.planner is not None:
        running.planner.stop()  # no change starts while the cluster goes down
    replicas = running.replicas
    stopping = threading.Thread(  # they drain beside the primary
        target=replicas.stop if replicas is not None else lambda _: None,
        args=(config.drain_timeout_s,),
    )
    stopping.start()
    if router is not None and not router.router.drain(config.drain_timeout_s):
        left = len(router.router.active_requests())
        print(f"drain timed out: {left} requests cut short", file=sys.stderr, flush=True)
    stopping.join()
    if admin_server is not None:
        admin_server.stop(grace=2).wait()
    if running.primary_metrics is not None:
        running.primary_metrics.shutdown()
    if router is not None:
        router.stop()
    cluster.down()
    path = state_path(config)
    path.unlink(missing_ok=True)
    path.with_name("prometheus_targets.json").unlink(missing_ok=True)
    if not (config.admin.token or os.environ.get("PDSERVE_ADMIN_TOKEN")):
        path.with_name("admin_token").unlink(missing_ok=True)  # generated by this `up`
    if ray_token is not None:
        ray_token.unlink(missing_ok=True)
    tracing.shutdown()  # the router's last spans
    print("pdserve is down", flush=True)


class TargetPublisher:
    """Writes the file_sd scrape targets at start, and again whenever scaling changes the
    instances (the router's HTTP SD computes them on each request).

    Called from the admin server's handler threads after scaling; rewrites files atomically
    (temp + rename).
    """

    def __init__(
        self,
        cluster: "Cluster",
        router: "RunningRouter",
        path: Path,
        routers: "Callable[[], list[ReplicaInfo]]" = list,
    ) -> None:
        self._cluster, self._router, self._path = cluster, router, path
        self._routers = routers

    def __call__(self) -> None:
        address = self._router.url.removeprefix("http://")
        groups = scrape_targets(
            self._cluster.config, self._cluster.instances, address, self._routers()
        )
        write_file_sd(self._path, groups)


def _print_endpoints(
    cluster: "Cluster", router: "RunningRouter", targets: Path, admin: str, state: Path
) -> None:
    for info in cluster.instances:
        print(
            f"{info.name:<12} {info.role:<8} grpc://{info.address} "
            f"metrics=http://{info.metrics_address}/metrics",
            flush=True,
        )
    print(f"{'router':<12} {'openai':<8} {router.url}/v1", flush=True)
    print(
        f"{'prometheus':<12} {'targets':<8} {targets} (HTTP SD: {router.url}/prometheus/targets)",
        flush=True,
    )
    print(f"{'admin':<12} {'grpc':<8} {admin} (`pdserve admin list`)", flush=True)
    storage = cluster.config.storage
    if storage.enabled:
        where = "embedded" if cluster.embedded_redis is not None else "external"
        print(f"{'storage':<12} {where:<8} {redacted(storage.redis_url)}", flush=True)
    print(f"pdserve is up ({state}); Ctrl-C or `pdserve down` stops it", flush=True)
    print(
        f"try: curl {router.url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{router.router.model.model_id}", "prompt": "Once upon a time", '
        f'"max_tokens": 32}}\'',
        flush=True,
    )


def scrape_targets(
    config: ClusterConfig,
    instances: Sequence["InstanceInfo"],
    router_address: str,
    routers: Sequence["ReplicaInfo"] = (),
) -> list[dict[str, object]]:
    """Prometheus service-discovery groups (file_sd and HTTP SD share the format): the router and
    every instance's `/metrics`, labelled with role and instance name. With router replicas
    (`routers`, `up`'s own first) each router's own metrics port, named after it: the API port
    answers for whichever replica takes the connection."""
    namespace = config.namespace
    groups: list[dict[str, object]] = [
        {
            "targets": [r.metrics_address],
            "labels": {"pdserve_namespace": namespace, "role": "router", "name": r.name},
        }
        for r in routers
        if r.metrics_address
    ] or [
        {
            "targets": [router_address],
            "labels": {"pdserve_namespace": namespace, "role": "router", "name": "router"},
        }
    ]
    for info in instances:
        labels = {"pdserve_namespace": config.namespace, "role": info.role, "name": info.name}
        groups.append({"targets": [info.metrics_address], "labels": labels})
    return groups


def write_file_sd(path: Path, groups: list[dict[str, object]]) -> None:
    """Write Prometheus file_sd JSON atomically (Prometheus re-reads the file on change)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=2))
    tmp.replace(path)


def _watch(
    cluster: "Cluster",
    supervisor: "Supervisor",
    stop: threading.Event,
    wake: threading.Event,
    interval_s: float,
) -> None:
    """Every `interval_s`, and at once when woken: take dead instances out of routing and
    restart them, restart the embedded Redis if it died."""
    while not stop.is_set():
        wake.wait(supervisor.next_check_s(interval_s))
        wake.clear()
        if stop.is_set():
            return
        supervisor.check()
        try:
            if cluster.supervise_storage():
                _report("embedded Redis died: restarted (its index starts empty)")
        except PdserveError as e:
            _report(f"embedded Redis died and did not restart: {e}")


def _report(line: str) -> None:
    """Something the operator must know about the running cluster: a warning on stderr."""
    logging.getLogger("pdserve").warning("%s", line)


def _down(args: argparse.Namespace) -> int:
    from services.controller.cluster import read_state
    from services.controller.state import state_path

    config = load_cluster_config(args.config, overrides={"state_dir": args.state_dir})
    path = state_path(config)
    state = read_state(config)
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        print(f"`pdserve up` (pid {pid}) is gone; removed stale {path}")
        return 0
    deadline = time.monotonic() + 120
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    print("pdserve is down" if not path.exists() else f"pid {pid} did not stop within 120 s")
    return 0 if not path.exists() else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": _generate,
    "up": _up,
    "down": _down,
    "admin": lambda args: admin_cli.run(args),
    "top": lambda args: top.run(args),
    "simulate": lambda args: simulator_cli.run(args),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except PdserveError as e:
        if args.debug:
            raise
        print(f"pdserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
