"""Supervisor: takes dead instances out of routing at once and recreates them, within a budget.

`pdserve up`'s watch loop calls `check` every health interval. An instance whose actor stops
answering is removed from the router (its in-flight streams migrate by themselves: the router
sees them break), then recreated with the same name and role after `cluster.restart_backoff_s`
(doubling after each failed try), at most `cluster.max_restarts` times within
`cluster.restart_window_s` (a crash loop is given up; a rare loss is always healed); the router,
admin and scrape targets follow its new endpoints. When the budget is spent the supervisor says
so and the cluster serves with what is left.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import ClusterError
from services.controller.cluster import Cluster
from services.restarts import RestartBudget
from services.router.router import Router

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Down:
    address: str
    drained: bool  # the operator had drained it: it comes back drained
    retry_at: float
    backoff_s: float
    given_up: bool = False


class Supervisor:
    """Main thread only (`check`); scaling from admin handlers is kept out by `cluster.lock`."""

    def __init__(
        self,
        cluster: Cluster,
        router: Router,
        on_change: Callable[[], None],
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.router = router
        self._on_change = on_change  # the instance set changed: state file and scrape targets
        self._report = report  # one line for the operator (stderr)
        self._clock = clock
        self._down: dict[str, _Down] = {}
        self._budgets: dict[str, RestartBudget] = {}

    def check(self) -> None:
        """Notice newly dead instances, then retry the restarts that are due."""
        config = self.cluster.config
        for name in self.cluster.dead_instances():
            if name in self._down:
                continue
            info = self.cluster.info(name)
            if info is None:  # removed by scaling meanwhile
                continue
            membership = self.router.membership
            # drained by the operator: it comes back drained (not when it was shutting down)
            drained = membership.is_drained(info.address) and not membership.is_leaving(
                info.address
            )
            self.router.remove_instance(info.address)
            backoff = config.restart_backoff_s
            self._down[name] = _Down(info.address, drained, self._clock() + backoff, backoff)
            self._report(f"instance {name} is dead: out of routing, restarting in {backoff:g} s")
        self.router.metrics.dead_instances.set(len(self._down))
        for name, down in list(self._down.items()):
            if not down.given_up and self._clock() >= down.retry_at:
                self._restart(name, down)

    def next_check_s(self, interval_s: float) -> float:
        """Seconds until `check` is due: the health interval, or sooner for a pending restart."""
        pending = [d.retry_at for d in self._down.values() if not d.given_up]
        return max(0.0, min([interval_s, *(at - self._clock() for at in pending)]))

    def _restart(self, name: str, down: _Down) -> None:
        info = self.cluster.info(name)
        if info is None:  # removed by scaling meanwhile
            del self._down[name]
            self.router.metrics.dead_instances.set(len(self._down))
            return
        config = self.cluster.config
        budget = self._budgets.setdefault(
            name, RestartBudget(config.max_restarts, config.restart_window_s, self._clock)
        )
        if not budget.spend():
            down.given_up = True
            self._report(
                f"instance {name} is dead and its restart budget is spent "
                f"({budget.spent_text()}); serving without it"
            )
            return
        try:
            restarted = self.cluster.restart_instance(name)
        except ClusterError as e:
            down.backoff_s = max(2 * down.backoff_s, 0.5)
            down.retry_at = self._clock() + down.backoff_s
            self._report(f"instance {name} did not restart ({e}); next try in {down.backoff_s:g} s")
            return
        del self._down[name]
        self.router.metrics.dead_instances.set(len(self._down))
        self.router.metrics.instance_restarts.labels(name, restarted.role).inc()
        if down.drained:
            self.router.membership.set_drained(restarted.address, True)
        self.router.add_instance(restarted.role, restarted.address)
        self._on_change()
        self._report(
            f"instance {name} restarted at {restarted.address} (restart {restarted.restarts})"
        )
