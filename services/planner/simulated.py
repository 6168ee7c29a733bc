"""The SLA planner in the latency simulator: a trace replayed through a cluster that pdserve's
own `Planner` reshapes as the trace goes, every `planner.interval_s` of simulated time — the
same forecast from the requests seen so far, the same model (each candidate split replaying a
synthetic trace of the forecast through the simulator), the same hysteresis and the same moves
(`steps`: role changes first, then instances added or retired) as `PlannerLoop` makes in
`pdserve up`.

Moves take simulated time. A role change drains the instance (no new requests; those on it
finish there), then takes `Moves.role_change_s` (the switch itself) before the instance is
routed in its new role, with an empty prefix cache (the live one keeps its cache: the
simulation is the pessimist). An added instance counts in instance-seconds from its start and
is routed `Moves.start_s` later (process, weights, first steps). A retired one drains, then
stops. While any instance is starting, draining or switching, the planner waits, as the live
one waits for a change to finish and a new instance to serve.

`sizing="mean"` is the planner most autoscalers run: it judges candidate splits on requests
of the recent mean lengths (`IntervalModel`).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.config import ClusterConfig
from pdserve.errors import ConfigError
from services.planner.evaluate import IntervalModel, SimulatedCluster
from services.planner.planner import Decision, Forecast, Planner, Prediction, Split, plan, steps
from services.router.history import Sample
from services.simulator.latency import InstanceProfile, LatencyResult, RequestResult, Simulation
from services.simulator.profiles import cluster_spec
from services.simulator.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class Moves:
    """How long the planner's moves take in simulated time."""

    # `benchmarks/role_change.py`, tiny model on 2 CPU cores: 0.19 s to decode, 0.50 s back
    role_change_s: float = 0.5
    # from the call to the first step: a process, its weights, its warm-up (a new node and
    # its image pull on an autoscaled cluster take minutes more)
    start_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role_change_s < 0 or self.start_s < 0:
            raise ConfigError("a move's duration must be >= 0")


class PlannedSimulation:
    """One replay of a trace through a cluster that starts as `counts` and is planned. Use
    `run`; `decisions` holds every interval's decision afterwards."""

    def __init__(
        self,
        config: ClusterConfig,
        profiles: Mapping[str, InstanceProfile],
        counts: Mapping[str, int],
        *,
        transfer_gbps: float | None = None,
        vocab_size: int = 32_000,
        block_tokens: int = 512,
        moves: Moves = Moves(),
        sizing: str = "distribution",
        rpc_s: float = 0.0,
        rpc_draws_s: tuple[float, ...] = (),
        seed: int = 0,
    ) -> None:
        spec = cluster_spec(config, profiles, counts, transfer_gbps, vocab_size, rpc_s,
                            rpc_draws_s)  # fmt: skip
        if spec.mixed:
            raise ConfigError("the planner plans prefill and decode instances, not mixed ones")
        self.sim = Simulation(spec, block_tokens, seed)
        self.moves = moves
        cluster = SimulatedCluster(config, profiles, transfer_gbps, vocab_size, rpc_s,
                                   rpc_draws_s)  # fmt: skip
        self._model = IntervalModel(cluster, config.planner.interval_s, sizing)
        self.planner = Planner(config.planner, self._evaluate, self.sim.clock)
        self.decisions: list[Decision] = []
        self.sim.every(config.planner.interval_s, self._tick)

    def run(
        self, records: list[TraceRecord], progress: Callable[[], object] = lambda: None
    ) -> LatencyResult:
        return self.sim.run(records, progress)

    def _tick(self) -> None:
        sim, config = self.sim, self.planner.config
        now = sim.now
        since = now - max(config.history_s, 2 * config.interval_s)
        arrivals = [r.arrival for r in sim.results if r.arrival >= since]
        # every request served, in the order they ended (as the router's history): the
        # forecast takes those of its history, or the last ones
        samples = sorted((_sample(r) for r in sim.results if _served(r)), key=lambda s: s.finished)
        decision, _ = plan(self.planner, self._split(), (arrivals, samples), now,
                           sorted(sim.changing), self._prepare)  # fmt: skip
        self.decisions.append(decision)
        if decision.action == "change":
            self._apply(decision)

    def _split(self) -> Split:
        roles = [instance.role for instance in self.sim.instances.values()]
        return Split(roles.count("prefill"), roles.count("decode"))

    def _prepare(self) -> None:
        """A new interval: new traces."""
        self._model = IntervalModel(self._model.cluster, self._model.interval_s,
                                    self._model.sizing)  # fmt: skip

    def _evaluate(self, split: Split, load: Forecast) -> Prediction:
        return self._model.predict(split, load)

    def _apply(self, decision: Decision) -> None:
        other = {"prefill": "decode", "decode": "prefill"}
        for kind, role in steps(decision.current, decision.target):
            if kind == "role":
                self.sim.change_role(self._idlest(other[role]), role, self.moves.role_change_s)
            elif kind == "add":
                self.sim.start_instance(role, self.moves.start_s)
            else:
                self.sim.stop_instance(self._idlest(role))

    def _idlest(self, role: str) -> str:
        """The serving `role` instance running the fewest requests (the quickest to drain)."""
        sim = self.sim
        serving = [(len(i.scheduler.running), name) for name, i in sim.instances.items()
                   if i.role == role and name not in sim.changing]  # fmt: skip
        return min(serving)[1]


def _served(result: RequestResult) -> bool:
    return not result.failed and result.tokens >= result.output_tokens > 0


def _sample(result: RequestResult) -> Sample:
    return Sample(result.arrival, result.prompt_tokens, result.cached_tokens, result.tokens,
                  result.ttft, result.tpot, result.last_token or result.arrival)  # fmt: skip
