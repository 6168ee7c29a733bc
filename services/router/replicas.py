"""Router replicas: `router.replicas` router processes serving one port.

`pdserve up` runs replica 0, the *primary*, in its own process: the admin API, the supervisor
and the planner act on its `Router`. It starts `router.replicas - 1` more in processes of their
own (`multiprocessing`'s spawn: the cluster secret travels over the spawn pipe, never on a
command line), each a whole `Router` — its own KV-event and output subscriptions, its own
leases, its own admission queue — listening on the same port with `SO_REUSEPORT`, so that the
kernel spreads new connections over the live listeners. A replica that dies takes its
connections with it (their streams end; the instances abort its requests when its output
subscriptions close); the next connections go to the others.

The primary's view of the cluster (`View`: the members of each role, the drained ones, the
prefill policy) is the one the admin API changes; `RouterReplicas` sends it to every replica
whenever it changes (checked every `SYNC_S`) and to a replica as it starts. The same thread
restarts a dead replica after `restart_backoff_s` (doubling after each failed start), at most
`max_restarts` times within `restart_window_s` (`cluster.*`, as for instances: a crash loop is
given up; a replica lost now and then is always restarted, as soon as the first time). Each
replica serves its own metrics on a port of its own (`metrics_address`), which Prometheus
discovery lists with the replica's name.
"""

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from prometheus_client.registry import Collector

from pdserve.config import EngineConfig, ObservabilityConfig, RouterConfig
from pdserve.errors import ClusterError
from pdserve.metrics import serve_metrics
from pdserve.rpc.tls import TlsFiles
from services.restarts import RestartBudget
from services.router.membership import Role
from services.router.router import Router

logger = logging.getLogger(__name__)

SYNC_S = 0.2
START_TIMEOUT_S = 120.0
_DRAIN = "drain"


@dataclass(frozen=True, slots=True)
class View:
    """What a replica takes from the primary: who to route to, and how."""

    prefill: tuple[str, ...]  # prefill, or mixed, instances
    decode: tuple[str, ...]
    mixed: bool
    drained: frozenset[str]
    policy: str

    @classmethod
    def of(cls, router: Router) -> "View":
        membership = router.membership
        prefill, decode = membership.members(Role.PREFILL), membership.members(Role.DECODE)
        drained = frozenset(a for a in (*prefill, *decode) if membership.is_drained(a))
        return cls(prefill, decode, membership.mixed, drained, router.attempts.policy_name)

    def apply(self, router: Router) -> None:
        """Make `router`'s members, drained marks and policy this view's."""
        membership = router.membership
        have = {(role, a) for role in Role for a in membership.members(role)}
        want = {(Role.PREFILL, a) for a in self.prefill} | {(Role.DECODE, a) for a in self.decode}
        for _, address in sorted(have - want):
            router.remove_instance(address)
        for role, address in sorted(want - have):
            router.add_instance(str(role), address)
        for _, address in want:
            membership.set_drained(address, address in self.drained)
        if router.attempts.policy_name != self.policy:
            router.set_policy(self.policy)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What a replica process needs to serve."""

    index: int
    router: RouterConfig  # its port: the primary's bound one
    engine: EngineConfig
    observability: ObservabilityConfig
    secret: str
    tls: TlsFiles | None
    view: View
    metrics_host: str
    drain_timeout_s: float


@dataclass(slots=True)
class ReplicaInfo:
    """One replica as `pdserve admin list` shows it."""

    name: str
    pid: int = 0
    alive: bool = False
    restarts: int = 0
    metrics_address: str = ""


class RouterMetricsCollector(Collector):
    """A router's registry with its load gauges refreshed at every scrape."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Any]:
        self.router.export_load()
        yield from self.router.metrics.registry.collect()


class _Replica:
    def __init__(self, index: int, budget: RestartBudget) -> None:
        self.info = ReplicaInfo(f"router-{index}")
        self.index = index
        self.process: Any = None  # multiprocessing's SpawnProcess
        self.conn: Connection | None = None
        self.restart_at: float | None = None  # dead: when to start it again
        self.backoff_s = 0.0
        self.budget = budget


class RouterReplicas:
    """The replica processes beside the primary `router` (which serves `config.port`)."""

    def __init__(
        self,
        router: Router,
        port: int,
        engine: EngineConfig,
        observability: ObservabilityConfig,
        secret: str,
        tls: TlsFiles | None,
        max_restarts: int,
        restart_window_s: float | None,
        restart_backoff_s: float,
        drain_timeout_s: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_change()`: a replica started, died or came back (scrape targets follow)."""
        self._router = router
        self._spec = ReplicaSpec(
            0, replace(router.config, port=port), engine, observability, secret, tls,
            View.of(router), router.config.host, drain_timeout_s,
        )  # fmt: skip
        self._backoff_s = restart_backoff_s
        self._on_change = on_change
        self._context = multiprocessing.get_context("spawn")
        self._replicas = [
            _Replica(i, RestartBudget(max_restarts, restart_window_s))
            for i in range(1, router.config.replicas)
        ]
        self._view = self._spec.view
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="router-replicas", daemon=True)

    def start(self) -> None:
        """Start every replica and wait until each serves; raises ClusterError if one does
        not."""
        for replica in self._replicas:
            self._start(replica)
        for replica in self._replicas:
            self._wait_ready(replica)
        self._thread.start()

    def infos(self) -> list[ReplicaInfo]:
        return [replace(replica.info) for replica in self._replicas]

    def stop(self, drain_timeout_s: float) -> None:
        """Let each replica drain (its running requests finish, up to `drain_timeout_s`),
        then end it."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for replica in self._replicas:
            if replica.conn is not None and replica.process.is_alive():
                with contextlib.suppress(OSError):  # it died meanwhile
                    replica.conn.send(_DRAIN)
        deadline = time.monotonic() + drain_timeout_s + 5
        for replica in self._replicas:
            if replica.process is not None:
                replica.process.join(max(0.0, deadline - time.monotonic()))
                if replica.process.is_alive():
                    replica.process.kill()
                    replica.process.join(5)

    # -- internals ------------------------------------------------------------------------------

    def _start(self, replica: _Replica) -> None:
        parent, child = self._context.Pipe()
        spec = replace(self._spec, index=replica.index, view=self._view)
        process = self._context.Process(
            target=run_replica, args=(spec, child), name=replica.info.name, daemon=True
        )
        process.start()
        child.close()
        replica.process, replica.conn = process, parent
        replica.info.pid, replica.info.alive = process.pid or 0, False

    def _wait_ready(self, replica: _Replica) -> None:
        conn = replica.conn
        if conn is None:
            raise ClusterError(f"router replica {replica.info.name} was never started")
        if not conn.poll(START_TIMEOUT_S):
            raise ClusterError(f"router replica {replica.info.name} did not start in time")
        try:
            _, metrics_address = conn.recv()
        except EOFError:
            raise ClusterError(
                f"router replica {replica.info.name} exited while starting (see its log)"
            ) from None
        replica.info.metrics_address = metrics_address
        replica.info.alive = True
        logger.info("router replica %s serving (pid %d, metrics on %s)", replica.info.name,
                    replica.info.pid, metrics_address)  # fmt: skip

    def _watch(self) -> None:
        """Every SYNC_S: the primary's view to the replicas when it changed; dead replicas
        noticed and, after their backoff, started again."""
        while not self._stopped.wait(SYNC_S):
            view = View.of(self._router)
            changed = view != self._view
            self._view = view
            for replica in self._replicas:
                self._tend(replica, view if changed else None)

    def _tend(self, replica: _Replica, view: View | None) -> None:
        info = replica.info
        if info.alive and not replica.process.is_alive():
            self._died(replica)
        elif info.alive and view is not None and replica.conn is not None:
            try:
                replica.conn.send(view)
            except OSError:
                self._died(replica)
        if replica.restart_at is not None and time.monotonic() >= replica.restart_at:
            self._restart(replica)

    def _died(self, replica: _Replica) -> None:
        replica.info.alive = False
        replica.backoff_s = self._backoff_s
        replica.restart_at = time.monotonic() + replica.backoff_s
        logger.warning("router replica %s died (exit %s); restarting it in %.1f s",
                       replica.info.name, replica.process.exitcode, replica.backoff_s)  # fmt: skip
        self._on_change()

    def _restart(self, replica: _Replica) -> None:
        replica.restart_at = None
        if not replica.budget.spend():
            logger.error("router replica %s is dead and its restart budget is spent (%s): the "
                         "other replicas serve on", replica.info.name,
                         replica.budget.spent_text())  # fmt: skip
            return
        replica.info.restarts += 1
        try:
            self._start(replica)
            self._wait_ready(replica)
        except ClusterError as e:
            if replica.process.is_alive():  # started, but never said it serves
                replica.process.kill()
                replica.process.join(5)
            replica.backoff_s = max(2 * replica.backoff_s, 0.5)
            replica.restart_at = time.monotonic() + replica.backoff_s
            logger.error("%s; next try in %.1f s", e, replica.backoff_s)
            return
        self._on_change()


def run_replica(spec: ReplicaSpec, conn: Connection) -> None:
    """A replica process: serve `spec` until the primary says drain, or goes away."""
    from pdserve.observability import logs
    from services.router.server import serve_router

    logs.configure_logging(spec.observability.log_format, logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `up`'s Ctrl-C: the primary drains us
    view = spec.view
    running = serve_router(
        spec.router, spec.engine, [] if view.mixed else list(view.prefill), list(view.decode),
        list(view.prefill) if view.mixed else None, secret=spec.secret, tls=spec.tls,
        observability=spec.observability,
    )  # fmt: skip
    view.apply(running.router)  # drained marks and policy
    server, port = serve_metrics(RouterMetricsCollector(running.router), host=spec.metrics_host)
    conn.send(("ready", f"{spec.metrics_host}:{port}"))  # (kind, its metrics address)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the primary is gone: nothing routes this cluster's changes
                break
            if message == _DRAIN:
                running.router.drain(spec.drain_timeout_s)
                break
            message.apply(running.router)
    finally:
        server.shutdown()
        running.stop()
