"""PlannerLoop: the SLA planner inside `pdserve up`.

Every `planner.interval_s` a daemon thread reads the cluster — the instances and their step
time fits (`Topology.describe_all`), the router's recent requests (`Router.history`) — forecasts
the next interval, lets the `Planner` decide with the latency simulator as its model, and
carries a change out through the `Topology`: role changes first (seconds, no new resources),
then instances added (their resources asked of Ray's autoscaler first), then retired. Each
decision is logged with its reason and exported (`PlannerMetrics`); `pdserve admin planner`
shows the last ones.
"""

import logging
import threading
import time
from collections.abc import Callable
from statistics import fmean

from google.protobuf.json_format import MessageToDict

from pdserve.errors import PdserveError
from pdserve.metrics import PlannerMetrics
from pdserve.v1 import admin_pb2
from services.controller.topology import Refused, Topology
from services.planner.evaluate import IntervalModel, SimulatedCluster
from services.planner.planner import (
    LENGTHS_AT_LEAST,
    Decision,
    Forecast,
    Planner,
    Prediction,
    Split,
    plan,
    steps,
)
from services.simulator.profiles import from_listing, measured_link_gbps

logger = logging.getLogger(__name__)


class PlannerLoop:
    """`tick` runs on the loop's thread (or a test's); `status` on any."""

    def __init__(
        self,
        topology: Topology,
        metrics: PlannerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topology = topology
        self.config = topology.cluster.config
        self.metrics = metrics
        self._clock = clock
        self.planner = Planner(self.config.planner, self._evaluate, clock)
        self._model: IntervalModel | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def _run(self) -> None:
        while not self._stopped.wait(self.config.planner.interval_s):
            try:
                self.tick()
            except Exception:  # a bug: logged, the next interval tries again
                logger.exception("planner: the interval's decision failed")

    def tick(self) -> Decision:
        """Read the cluster, decide, act. Returns the decision."""
        router, planner_config = self.topology.router, self.config.planner
        instances = self.topology.describe_all()
        current = Split(
            sum(1 for i in instances if i.role == "prefill"),
            sum(1 for i in instances if i.role == "decode"),
        )
        not_ready = [i.name for i in instances if not i.alive or i.stats.num_steps == 0]
        now = time.perf_counter()
        since = now - max(planner_config.history_s, 2 * planner_config.interval_s)
        history = (router.history.arrivals_since(since),
                   router.history.served_since(since, at_least=LENGTHS_AT_LEAST))  # fmt: skip
        vocab_size = router.model.vocab_size
        decision, load = plan(self.planner, current, history, now, not_ready,
                              lambda: self._prepare(instances, vocab_size))  # fmt: skip
        self._report(decision, load)
        if decision.action == "change":
            self._apply(decision)
        return decision

    def _prepare(self, instances: list[admin_pb2.InstanceInfo], vocab_size: int) -> None:
        """The simulated cluster of this interval (profiles from the instances' fits, the
        measured link and message time) and a new model of it (each load's trace drawn when
        first asked for)."""
        listing = [MessageToDict(i, preserving_proto_field_name=True) for i in instances]
        profiles, _ = from_listing(listing, self.config)
        link = measured_link_gbps(listing)
        history = self.topology.router.history
        cluster = SimulatedCluster(self.config, profiles, link, vocab_size,
                                   history.message_s() or 0.0,
                                   tuple(history.message_quantiles()))  # fmt: skip
        self._model = IntervalModel(cluster, self.config.planner.interval_s)

    def _evaluate(self, split: Split, load: Forecast) -> Prediction:
        if self._model is None:
            raise RuntimeError("planner: no simulated cluster prepared")
        return self._model.predict(split, load)

    def _report(self, decision: Decision, load: Forecast | None) -> None:
        self.metrics.observe(decision)
        level = logging.WARNING if decision.action == "change" else logging.INFO
        figures = ""
        if load is not None:
            figures += f"; forecast {load.rate_per_s:.2f} requests/s"
        if (predicted := decision.predicted) is not None:
            figures += (f"; predicted p90 TTFT {predicted.ttft_p90_s:.3f} s, "
                        f"ITL {predicted.itl_p90_s:.4f} s")  # fmt: skip
        if (seen := decision.observed) is not None:
            figures += f"; observed {seen.ttft_p90_s:.3f} s, {seen.itl_p90_s:.4f} s"
        logger.log(level, "planner: %s %s -> %s: %s%s", decision.action, decision.current,
                   decision.target, decision.reason, figures)  # fmt: skip

    def _apply(self, decision: Decision) -> None:
        """Role changes first, then instances added, then retired; a refused or failed step
        ends the change (logged and counted) and the next interval plans again."""
        topology, other = self.topology, {"prefill": "decode", "decode": "prefill"}
        try:
            for kind, role in steps(decision.current, decision.target):
                if kind == "role":
                    topology.change_role(self._idlest(other[role]), role)
                else:
                    topology.scale(role, self._count(role) + (1 if kind == "add" else -1))
        except (Refused, PdserveError) as e:
            self.metrics.decisions.labels("failed").inc()
            logger.warning("planner: the change to %s stopped: %s", decision.target, e)

    def _count(self, role: str) -> int:
        return sum(1 for i in self.topology.cluster.instances if i.role == role)

    def _idlest(self, role: str) -> str:
        """The `role` instance running the fewest requests (the quickest to drain)."""
        described = [i for i in self.topology.describe_all() if i.role == role]
        return min(described, key=lambda i: (i.stats.num_running, i.name)).name

    def status(self) -> admin_pb2.PlannerStatus:
        """The last decisions, newest last, for `pdserve admin planner`."""
        offset = time.time() - self._clock()
        config = self.planner.config
        reply = admin_pb2.PlannerStatus(
            enabled=True,
            targets=admin_pb2.PlannerTargets(
                ttft_p90_s=config.ttft_p90_s, itl_p90_s=config.itl_p90_s
            ),
        )
        for d in self.planner.recent():
            message = reply.decisions.add(
                at_unix_s=d.at + offset,
                action=d.action,
                current=str(d.current),
                target=str(d.target),
                reason=d.reason,
                unreachable=d.unreachable,
            )
            if d.predicted is not None:
                message.predicted_ttft_p90_s = d.predicted.ttft_p90_s
                message.predicted_itl_p90_s = d.predicted.itl_p90_s
            if d.observed is not None:
                message.observed_ttft_p90_s = d.observed.ttft_p90_s
                message.observed_itl_p90_s = d.observed.itl_p90_s
            if d.load is not None and (samples := d.load.samples):
                message.forecast_rate_per_s = d.load.rate_per_s
                message.forecast_requests = len(samples)
                message.forecast_prompt_tokens = fmean(s.prompt_tokens for s in samples)
                message.forecast_cached_tokens = fmean(s.cached_tokens for s in samples)
                message.forecast_output_tokens = fmean(s.output_tokens for s in samples)
            for split, p in sorted(d.predictions.items()):
                message.candidates.add(split=str(split), ttft_p90_s=p.ttft_p90_s,
                                       itl_p90_s=p.itl_p90_s, goodput=p.goodput)  # fmt: skip
        return reply
