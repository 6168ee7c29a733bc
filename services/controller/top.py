"""`pdserve top`: a terminal view of a running cluster, refreshed every `--interval` seconds.

Each refresh takes a `Snapshot` (the admin API's ListInstances reply and the router's
Prometheus metrics); `render` turns the latest snapshot, and the one before it for rates and
recent latencies, into a Rich renderable: the instances by role, then the router. `--once`
takes two snapshots `--interval` apart, prints one view and exits; otherwise the view refreshes
until Ctrl-C.

Exit status: 0; 3 when there is no running cluster or it does not answer (try again later);
2 for the caller's mistakes (a wrong token), as `pdserve admin`.
"""

import argparse
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pdserve.config import load_cluster_config
from pdserve.errors import ClusterError
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from services.controller import admin_cli

EXIT_UNAVAILABLE = 3  # admin_cli.exit_code's "try again later"
DEADLINE_S = 10.0  # of each ListInstances call and each scrape of the router's /metrics
ROLES = ("prefill", "mixed", "decode")  # the order of the instance table's sections
PIPED_MAX_WIDTH = 1000  # columns of --once's view when piped (it is printed no wider than needed)
NONE = "-"  # a value that cannot be known yet (no earlier snapshot, no observations)


def add_parser(commands: Any) -> None:
    top = commands.add_parser("top", help="a live view of a running cluster (instances, router)")
    admin_cli.add_connection_arguments(top)
    top.add_argument("--router-url", help="the router's http://host:port (default: cluster.json)")
    top.add_argument("--once", action="store_true", help="print one view and exit")
    top.add_argument(
        "--interval",
        type=_seconds,
        default=1.0,
        help="seconds between refreshes, and between the two snapshots of --once (default 1)",
    )


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


# -- what a refresh collects -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram: cumulative observation counts by ascending bucket bound (the
    last bound is +Inf: its count is the total)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def __add__(self, other: "Histogram") -> "Histogram":
        """Both processes' observations (the same buckets: every router exports them)."""
        if not self.counts or self.bounds != other.bounds:
            return other if not self.counts else self
        counts = zip(self.counts, other.counts, strict=True)
        return Histogram(self.bounds, tuple(a + b for a, b in counts))

    def since(self, earlier: "Histogram") -> "Histogram":
        """The observations made after `earlier` was scraped; all of them when the counts
        went down (the router restarted in between)."""
        if self.count < earlier.count or self.bounds != earlier.bounds:
            return self
        counts = tuple(c - e for c, e in zip(self.counts, earlier.counts, strict=True))
        return Histogram(self.bounds, counts)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q <= 1) as Prometheus' histogram_quantile estimates it: linear
        within the bucket that holds it, the highest finite bound when that bucket is +Inf;
        None without observations."""
        if self.count == 0:
            return None
        rank = q * self.count
        i = next(i for i, cumulative in enumerate(self.counts) if cumulative >= rank)
        lower, below = (self.bounds[i - 1], self.counts[i - 1]) if i else (0.0, 0.0)
        if math.isinf(self.bounds[i]):
            return lower
        return lower + (self.bounds[i] - lower) * (rank - below) / (self.counts[i] - below)


@dataclass(frozen=True, slots=True)
class RouterSample:
    """The router's metrics that top shows, from one scrape of its /metrics."""

    requests: float  # pdserve_router_requests_total, every endpoint and status
    running: float  # generations running now
    migrations: float  # every reason
    retries: float
    rejected: float  # 429s and 401s at the router's edge, every reason
    queued: float  # requests in the admission queue now
    ttft: Histogram
    inter_token: Histogram

    @classmethod
    def parse_all(cls, texts: Sequence[str]) -> "RouterSample":
        """Every router process's metrics (`router.replicas`), added up."""
        samples = [cls.parse(text) for text in texts]
        first, *rest = samples
        for other in rest:
            first = RouterSample(
                first.requests + other.requests, first.running + other.running,
                first.migrations + other.migrations, first.retries + other.retries,
                first.rejected + other.rejected, first.queued + other.queued,
                first.ttft + other.ttft, first.inter_token + other.inter_token,
            )  # fmt: skip
        return first

    @classmethod
    def parse(cls, text: str) -> "RouterSample":
        """From Prometheus text; a labelled counter not exported yet (never incremented)
        counts 0."""
        samples: dict[str, list[Sample]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append(sample)

        def total(name: str) -> float:
            return sum(s.value for s in samples[name])

        return cls(
            requests=total("pdserve_router_requests_total"),
            running=total("pdserve_router_running_generations"),
            migrations=total("pdserve_router_migrations_total"),
            retries=total("pdserve_router_retries_total"),
            rejected=total("pdserve_router_rejections_total"),
            queued=total("pdserve_router_queue_length"),
            ttft=_histogram(samples["pdserve_router_time_to_first_token_seconds_bucket"]),
            inter_token=_histogram(samples["pdserve_router_inter_token_latency_seconds_bucket"]),
        )


def _histogram(buckets: list[Sample]) -> Histogram:
    ordered = sorted((float(s.labels["le"]), s.value) for s in buckets)
    return Histogram(tuple(b for b, _ in ordered), tuple(c for _, c in ordered))


@dataclass(frozen=True, slots=True)
class Load:
    """What an instance that answered reported (its InstanceStats), as top shows it."""

    num_running: int
    num_waiting: int
    used_blocks: int
    num_blocks: int
    hit_tokens: int  # prompt tokens found in the device prefix cache or the storage tier
    prefix_cache_queries: int  # prompt tokens of admitted requests
    num_computed_tokens: int
    num_reservations: int

    @classmethod
    def from_proto(cls, stats: common_pb2.InstanceStats) -> "Load":
        return cls(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            used_blocks=stats.num_blocks - stats.num_free_blocks,
            num_blocks=stats.num_blocks,
            hit_tokens=stats.device_hit_tokens
            + stats.peer_hit_tokens
            + stats.storage.storage_hit_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            num_computed_tokens=stats.num_computed_tokens,
            num_reservations=stats.num_reservations,
        )

    @property
    def kv_use(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float | None:
        """Of the prompt tokens admitted since the instance started, the fraction found in a
        cache tier; None before the first."""
        return self.hit_tokens / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass(frozen=True, slots=True)
class InstanceSample:
    """One instance as the admin API listed it."""

    name: str
    role: str
    alive: bool
    drained: bool
    restarts: int
    load: Load | None  # None: the instance did not answer

    @classmethod
    def from_proto(cls, info: admin_pb2.InstanceInfo) -> "InstanceSample":
        load = Load.from_proto(info.stats) if info.HasField("stats") else None
        return cls(info.name, info.role, info.alive, info.drained, info.restarts, load)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One refresh: every instance and the router, at `taken_at` (monotonic seconds)."""

    taken_at: float
    instances: tuple[InstanceSample, ...]
    router: RouterSample

    @classmethod
    def build(
        cls,
        reply: admin_pb2.ListInstancesReply,
        metrics_text: str | Sequence[str],
        taken_at: float,
    ) -> "Snapshot":
        """`metrics_text`: the router's /metrics, or each router process's."""
        instances = tuple(InstanceSample.from_proto(i) for i in reply.instances)
        texts = [metrics_text] if isinstance(metrics_text, str) else metrics_text
        return cls(taken_at, instances, RouterSample.parse_all(texts))


class ClusterReader:
    """Takes snapshots of one running cluster: ListInstances on its admin API, GET /metrics on
    its router (on each router process's own metrics port with `router.replicas` > 1: the API
    port answers for one of them), each with a deadline of DEADLINE_S. Owns the channel and the
    HTTP client until `close`."""

    def __init__(self, channel: grpc.Channel, metadata: admin_cli.Metadata, router_url: str):
        self._channel, self._metadata = channel, metadata
        self._admin = admin_pb2_grpc.AdminServiceStub(channel)
        self._metrics_url = f"{router_url.rstrip('/')}/metrics"
        self._http = httpx.Client(timeout=DEADLINE_S)

    def snapshot(self) -> Snapshot:
        """Raises grpc.RpcError when the admin API fails, ClusterError when the router's
        metrics cannot be read."""
        reply = self._admin.ListInstances(
            admin_pb2.ListInstancesRequest(), metadata=self._metadata, timeout=DEADLINE_S
        )
        urls = [
            f"http://{r.metrics_address}/metrics"
            for r in reply.routers
            if r.alive and r.metrics_address
        ] or [self._metrics_url]
        return Snapshot.build(reply, [self._scrape(url) for url in urls], time.monotonic())

    def _scrape(self, url: str) -> str:
        try:
            response = self._http.get(url)
            response.raise_for_status()
        except httpx.HTTPError as e:
            raise ClusterError(
                f"the router's metrics at {url} cannot be read ({e}); is the cluster up?"
            ) from e
        return response.text

    def close(self) -> None:
        self._http.close()
        self._channel.close()


# -- what changed between two refreshes --------------------------------------------------------


def rate(now: float, before: float, seconds: float) -> float:
    """A counter's increase per second; one that went down was reset (its process restarted)
    and has counted from zero since."""
    return (now - before if now >= before else now) / seconds


def tokens_per_s(current: Snapshot, previous: Snapshot | None) -> dict[str, float]:
    """Tokens run through forward passes per second, by name of the instances that answered
    in both snapshots."""
    if previous is None:
        return {}
    seconds = current.taken_at - previous.taken_at
    before = {i.name: i.load.num_computed_tokens for i in previous.instances if i.load is not None}
    return {
        i.name: rate(i.load.num_computed_tokens, before[i.name], seconds)
        for i in current.instances
        if i.load is not None and i.name in before
    }


def requests_per_s(current: Snapshot, previous: Snapshot | None) -> float | None:
    """Requests the router answered per second between the snapshots (every endpoint and
    status); None without an earlier snapshot."""
    if previous is None:
        return None
    seconds = current.taken_at - previous.taken_at
    return rate(current.router.requests, previous.router.requests, seconds)


@dataclass(frozen=True, slots=True)
class Latency:
    """p50 and p99 of a router histogram over the last refresh when requests were observed in
    it, else since the router started."""

    p50: float | None
    p99: float | None
    window: str

    @classmethod
    def of(cls, now: Histogram, before: Histogram | None, seconds: float) -> "Latency":
        """`before`: the histogram `seconds` earlier (None: no earlier snapshot)."""
        recent = now.since(before) if before is not None else None
        if recent is None or recent.count == 0:
            return cls(now.quantile(0.5), now.quantile(0.99), "since start")
        return cls(recent.quantile(0.5), recent.quantile(0.99), f"last {seconds:.1f} s")


# -- rendering -----------------------------------------------------------------------------


def render(current: Snapshot, previous: Snapshot | None = None) -> RenderableType:
    """The view of `current`: the instances by role, then the router. Rates and recent
    latencies are the change since `previous` (without one, rates show "-")."""
    return Group(_instances_table(current, previous), _router_table(current, previous))


INSTANCE_COLUMNS = (
    "name", "role", "state", "restarts", "running", "waiting", "KV blocks", "hit rate",
    "tokens/s", "reservations",
)  # fmt: skip


def _instances_table(current: Snapshot, previous: Snapshot | None) -> Table:
    table = Table(
        title="instances", title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True
    )
    for header in INSTANCE_COLUMNS:
        if header in ("name", "role", "state"):  # kept whole in a narrow terminal
            table.add_column(header, no_wrap=True)
        else:  # numbers fold onto a second line there, not cut short
            table.add_column(header, justify="right", overflow="fold")
    speeds = tokens_per_s(current, previous)
    role = None
    for instance in sorted(current.instances, key=_by_role):
        if role is not None and instance.role != role:
            table.add_section()
        role = instance.role
        table.add_row(*_instance_cells(instance, speeds.get(instance.name)))
    return table


def _by_role(instance: InstanceSample) -> tuple[int, str]:
    order = ROLES.index(instance.role) if instance.role in ROLES else len(ROLES)
    return order, instance.name


def _instance_cells(instance: InstanceSample, speed: float | None) -> list[RenderableType]:
    head: list[RenderableType] = [
        instance.name, instance.role, _state(instance), str(instance.restarts)
    ]  # fmt: skip
    load = instance.load
    if load is None:
        return head + [NONE] * (len(INSTANCE_COLUMNS) - len(head))
    return [
        *head,
        str(load.num_running),
        str(load.num_waiting),
        f"{load.used_blocks}/{load.num_blocks} ({load.kv_use:.0%})",
        NONE if load.hit_rate is None else f"{load.hit_rate:.1%}",
        NONE if speed is None else f"{speed:.1f}",
        str(load.num_reservations) if instance.role == "decode" else "",
    ]


def _state(instance: InstanceSample) -> Text:
    if not instance.alive:
        return Text("dead", style="bold red")
    if instance.drained:
        return Text("drained", style="yellow")
    return Text("alive", style="green")


def _router_table(current: Snapshot, previous: Snapshot | None) -> Table:
    table = Table(title="router", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("over")
    now = current.router
    before = previous.router if previous is not None else None
    seconds = current.taken_at - previous.taken_at if previous is not None else 0.0
    requests = requests_per_s(current, previous)
    table.add_row("requests/s", NONE if requests is None else f"{requests:.2f}", "")
    table.add_row("running generations", f"{now.running:.0f}", "")
    for name, histogram, earlier in (
        ("TTFT p50 / p99", now.ttft, before.ttft if before else None),
        ("ITL p50 / p99", now.inter_token, before.inter_token if before else None),
    ):
        latency = Latency.of(histogram, earlier, seconds)
        table.add_row(name, f"{_ms(latency.p50)} / {_ms(latency.p99)}", latency.window)
    table.add_row("migrations", f"{now.migrations:.0f}", "since start")
    table.add_row("retries", f"{now.retries:.0f}", "since start")
    table.add_row("queued", f"{now.queued:.0f}", "now")
    table.add_row("rejected", f"{now.rejected:.0f}", "since start")
    return table


def _ms(seconds: float | None) -> str:
    return NONE if seconds is None else f"{seconds * 1000:.1f} ms"


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        reader = _reader(args)
    except ClusterError as e:
        return _unavailable(str(e))
    try:
        if args.once:
            _print_once(reader, args.interval)
        else:
            _watch(reader, args.interval)
    except grpc.RpcError as e:
        message = f"ListInstances on the admin API failed: {e.code().name}: {e.details()}"
        print(f"pdserve top: {message}", file=sys.stderr)
        return admin_cli.exit_code(e.code())
    except ClusterError as e:
        return _unavailable(str(e))
    except KeyboardInterrupt:
        return 0  # the live view's way out
    finally:
        reader.close()
    return 0


def _reader(args: argparse.Namespace) -> ClusterReader:
    """Raises ClusterError when the addresses are needed and no cluster.json exists."""
    from services.controller.cluster import read_state

    config = load_cluster_config(args.config, overrides={"state_dir": args.state_dir})
    router_url = args.router_url or read_state(config)["router_url"]
    channel, metadata = admin_cli.connect(args, config)
    return ClusterReader(channel, metadata, router_url)


def _unavailable(reason: str) -> int:
    print(f"pdserve top: {reason}", file=sys.stderr)
    return EXIT_UNAVAILABLE


def _print_once(reader: ClusterReader, interval_s: float) -> None:
    """Two snapshots `interval_s` apart (so rates are shown), one view. Piped, it is printed
    without colour at its natural width (the terminal's width does not apply)."""
    previous = reader.snapshot()
    time.sleep(interval_s)
    view = render(reader.snapshot(), previous)
    console = Console()
    if not console.is_terminal:
        unbounded = console.options.update_width(PIPED_MAX_WIDTH)
        console.width = Measurement.get(console, unbounded, view).maximum
    console.print(view)


def _watch(reader: ClusterReader, interval_s: float) -> None:
    """Refresh the view every `interval_s` until Ctrl-C (KeyboardInterrupt)."""
    previous = reader.snapshot()
    with Live(render(previous), auto_refresh=False) as live:
        while True:
            time.sleep(interval_s)
            current = reader.snapshot()
            live.update(render(current, previous), refresh=True)
            previous = current
