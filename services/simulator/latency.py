"""The latency simulator: a trace replayed through simulated instances in simulated time.

Each simulated instance is pdserve's own scheduler (`Scheduler`: continuous batching under
`max_num_seqs` and `max_num_batched_tokens`, chunked prefill, preemption when blocks run out)
over its own KV cache manager and eviction policy, with `PromptAdmission` giving prompts their
blocks; only the forward pass is missing. A step's duration is what the instance's step time
model (`StepTimeModel`, the fit a live instance exports in `GetStats`) predicts for the step's
shape, times a ratio drawn from the measured ÷ predicted ratios the instance exports with its
fit (steps on a busy machine stray from the fit; the spread makes the tail). Requests are
routed by the router's own `Routing` (the prefill policy over the exact KV-event index, which
the simulated caches feed; the decode policy over the capacities polled every
`router.stats_interval_s`; conditional disaggregation over the polled step time models).

What another thread asks of an engine (admission, a reservation, a handoff, a release) waits for
the step running there to end, as the engine loop takes its mailbox between steps. A
disaggregated request follows the prefill instance's protocol: prefill admits the prompt,
decode reserves blocks for it unless the growth headroom of its running requests would not
survive (refusals retried after `decode.retry_after_ms`, at most `prefill.reserve_max_backoff_s`,
`prefill.reserve_max_attempts` times, then the router retries another pair after
`router.retry_backoff_s`, doubling), prefill computes it as a prefill-only request, the blocks
decode lacks move in `bytes ÷ bandwidth` seconds, and decode starts generating with prefill's
first token. A local or mixed request runs whole on one instance.

Each step also takes the engine loop's own time between steps (`step_gap_s`, measured), and
each message between two processes (the client's request and its tokens through the router
included) a time the router measured on its Prefill calls (drawn from their quantiles, or a
constant `rpc_s`). Not simulated: reservation leases expiring, the storage tier, failures.
"""

import itertools
import math
import random
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.config import DecodeConfig, PrefillConfig, RouterConfig
from pdserve.engine.admission import PromptAdmission
from pdserve.engine.perf_model import FEATURES, StepTimeModel, step_shape
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.stop import stop_status
from pdserve.engine.validation import validate_request
from pdserve.errors import ConfigError, IntegrityError, NoCapacityError, PdserveError
from pdserve.kvcache.events import KVEvent, LoadReport
from pdserve.kvcache.eviction import make_eviction_policy
from pdserve.kvcache.hashing import BlockHash, BlockHasher
from pdserve.kvcache.manager import KVCacheManager
from pdserve.metrics import RouterMetrics
from pdserve.v1 import common_pb2
from services.router.disaggregation import GB
from services.router.kv_index import KVEventIndex
from services.router.load import Lease
from services.router.membership import Membership, Role
from services.router.routing import Route, Routing
from services.simulator.events import EventQueue
from services.simulator.trace import TraceRecord

MIN_STEP_S = 1e-6  # a step takes at least this long (a fit can predict 0 for tiny steps)
OUTPUT_TOKEN = 1  # the token every simulated step samples (ignore_eos: never a stop)


@dataclass(frozen=True, slots=True)
class InstanceProfile:
    """What one simulated instance is: its KV cache, its scheduler's limits, its speed."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    coefficients: Mapping[str, float]  # the step time model (`perf_model.FEATURES`)
    kv_block_bytes: int
    max_model_len: int
    eviction_policy: str = "lrfu"
    lrfu_half_life_s: float = 60.0
    lrfu_score_capacity: int = 8
    step_gap_s: float = 0.0  # the engine loop's own time between two busy steps (measured)
    # measured ÷ predicted step times (`StepTimeModel.ratio_quantiles`): each step's time is
    # the fit's times one drawn at random; empty: the fit's exactly
    step_ratios: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        missing = [name for name in FEATURES if name not in self.coefficients]
        if missing:
            raise ConfigError(f"step time model lacks coefficients: {', '.join(missing)}")
        if min(self.num_blocks, self.block_size, self.max_num_seqs,
               self.max_num_batched_tokens, self.max_model_len) < 1:  # fmt: skip
            raise ConfigError("an instance profile needs positive sizes and limits")
        if any(not ratio > 0 for ratio in self.step_ratios):
            raise ConfigError("step time ratios must be positive")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The simulated cluster: instances per role, their profiles and the settings they run."""

    profiles: Mapping[str, InstanceProfile]  # by role
    prefill: int = 1
    decode: int = 1
    mixed: int = 0
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill_config: PrefillConfig = field(default_factory=PrefillConfig)
    decode_config: DecodeConfig = field(default_factory=DecodeConfig)
    transfer_gbps: float = 1.0  # KV bytes between instances, GB/s
    # one message between two processes (client, router, instances), one way: a
    # disaggregated request's first token takes seven (the request to the router, on to
    # prefill, Reserve and its reply, StartDecode, the token to the router and on to the
    # client), a local or mixed one's four
    rpc_s: float = 0.0
    # measured message times (`ListInstances.message_quantiles`) each message draws its own
    # from; empty: every message takes `rpc_s`
    rpc_draws_s: tuple[float, ...] = ()
    vocab_size: int = 32_000  # prompt tokens are drawn below it

    def __post_init__(self) -> None:
        if self.mixed and (self.prefill or self.decode):
            raise ConfigError("a cluster runs mixed instances or prefill + decode, not both")
        if not self.mixed and not (self.prefill and self.decode):
            raise ConfigError("a disaggregated cluster needs at least one prefill and one decode")
        for role in self.roles():
            if role not in self.profiles:
                raise ConfigError(f"no instance profile for role {role}")
        if self.transfer_gbps <= 0:
            raise ConfigError(f"transfer bandwidth must be positive, got {self.transfer_gbps}")
        if self.rpc_s < 0 or any(not s >= 0 for s in self.rpc_draws_s):
            raise ConfigError("message times must be >= 0")

    def roles(self) -> tuple[str, ...]:
        return ("mixed",) if self.mixed else ("prefill", "decode")

    def count(self, role: str) -> int:
        return int(getattr(self, role))


@dataclass(slots=True, eq=False)
class RequestResult:
    """One trace request's life in the simulation (times in seconds of simulated time)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens its computing instance held at admission
    path: str = ""  # remote (prefill, then decode) | local (decode alone) | mixed
    attempts: int = 0
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0  # output tokens delivered
    failed: str = ""  # why it failed (empty: it did not)
    # when a disaggregated request passed each point of its way (the last attempt's):
    # at_prefill, reserved (prefill has decode's reservation), computed (prefill's first
    # token), handed_off (decode took it)
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time between its output tokens (None with fewer than two)."""
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


@dataclass(slots=True)
class Sample:
    """The cluster at one poll: per instance (role, running, waiting, KV blocks in use)."""

    at: float
    instances: dict[str, tuple[str, int, int, int]]


@dataclass(slots=True)
class LatencyResult:
    spec: ClusterSpec
    requests: list[RequestResult]
    itl: "array[float]"  # every gap between consecutive output tokens of a request, in seconds
    samples: list[Sample]
    started: float  # the first arrival
    ended: float  # the last request's end
    preemptions: int
    instance_names: dict[str, str]  # name -> role, of the instances at the end
    instance_seconds: float  # each instance's time from its start (or the first arrival) on


class TokenSource:
    """Prompt tokens for trace records: each hash id stands for `block_tokens` tokens drawn
    from a generator seeded by the id (equal ids, equal tokens), below `vocab_size`; a prompt
    longer than its ids cover gets the rest from a generator seeded by its length."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}

    def prompt(self, record: TraceRecord) -> list[int]:
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            tokens += self._block(hash_id)
            if len(tokens) >= record.input_length:
                break
        missing = record.input_length - len(tokens)
        if missing > 0:  # fewer ids than the length covers: the rest drawn for this length
            rng = np.random.default_rng([self.seed, 1 << 62, record.input_length])
            tokens += rng.integers(1, self.vocab_size, missing).tolist()
        return tokens[: record.input_length]

    def _block(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, hash_id & (2**63 - 1), hash_id < 0])
            block = rng.integers(1, self.vocab_size, self.block_tokens).tolist()
            if len(self._blocks) > 200_000:
                self._blocks.clear()
            self._blocks[hash_id] = block
        return block


class SimInstance:
    """One instance: pdserve's scheduler, KV cache and admission, stepped in simulated time."""

    def __init__(self, name: str, role: str, profile: InstanceProfile, sim: "Simulation") -> None:
        self.name, self.role, self.profile, self.sim = name, role, profile, sim
        follows = role != "decode" or sim.routing.disaggregation.follows_decode
        eviction = make_eviction_policy(
            profile.eviction_policy,
            profile.num_blocks,
            half_life_s=profile.lrfu_half_life_s,
            score_capacity=profile.lrfu_score_capacity,
            clock=sim.clock,
        )
        self.kv = KVCacheManager(
            profile.num_blocks,
            profile.block_size,
            event_sink=self._publish if follows else None,
            eviction=eviction,
        )
        self.admission = PromptAdmission(self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(profile.max_num_seqs, profile.max_num_batched_tokens),
            self.kv,
            self.admission,
        )
        self.scheduler.clock = sim.clock
        self.model = StepTimeModel.fixed(profile.coefficients)
        self._draws = random.Random(f"{sim.seed}:{name}")  # step time ratios
        self.busy = False
        self._calls: list[Callable[[], object]] = []  # waiting for the step to end
        self._between_steps = False
        self.reserved: dict[str, Request] = {}  # decode: reservations awaiting their KV
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0

    def _publish(self, event: KVEvent) -> None:
        self.sim.index.apply(self.name, event)

    # -- what the cluster asks of it -------------------------------------------------------------

    def growth_headroom(self) -> int:
        scheduler = self.scheduler
        decoding = [*scheduler.running, *scheduler.prefilled, *self.reserved.values()]
        horizon = self.sim.spec.decode_config.reserve_horizon_tokens
        return self.admission.growth_headroom_blocks(decoding, horizon, self.profile.max_model_len)

    def call(self, action: Callable[[], object]) -> None:
        """Run `action` on the engine thread: at once when no step runs, else when the running
        step ends (the engine loop takes its mailbox between steps)."""
        if self.busy:
            self._calls.append(action)
        else:
            action()

    def submit(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.kick()

    def load_report(self) -> LoadReport:
        """What its KV-event stream's load report would say."""
        scheduler = self.scheduler
        return LoadReport(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.prefilled),
            num_reservations=len(self.reserved),
            queued_prefill_tokens=scheduler.queued_prompt_tokens(),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
        )

    def stats(self) -> common_pb2.InstanceStats:
        """What its GetStats would answer (the fields the router reads)."""
        kv, scheduler = self.kv, self.scheduler
        stats = common_pb2.InstanceStats(
            role=self.role,
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.prefilled),
            max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
            kv_block_bytes=self.profile.kv_block_bytes,
        )
        stats.step_time.samples = self.model.samples
        stats.step_time.coefficients.update(self.model.named_coefficients())
        if self.transfer_seconds > 0:
            stats.kv_bytes_sent_by_transport["simulated"] = self.transferred_bytes
            stats.kv_transfer_seconds_by_transport["simulated"] = self.transfer_seconds
        return stats

    # -- steps -----------------------------------------------------------------------------------

    def kick(self) -> None:
        """Start a step if none runs and one can advance a request."""
        if self.busy or self._between_steps or not self.scheduler.has_schedulable_requests():
            return
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            if scheduled.preempted:  # it freed blocks: the engine loop schedules again at once
                self.kick()
            return  # nothing fits now: a request that ends or frees blocks kicks again
        shape = step_shape(
            (c.request.num_computed_tokens, c.num_new_tokens) for c in scheduled.chunks
        )
        self.busy = True
        seconds = max(self.model.predict(shape), MIN_STEP_S)
        if self.profile.step_ratios:
            seconds *= self._draws.choice(self.profile.step_ratios)
        seconds += self.profile.step_gap_s
        self.sim.at(self.sim.now + seconds, lambda: self._stepped(scheduled))

    def _stepped(self, scheduled: SchedulerOutput) -> None:
        """The step ended: its tokens are computed (requests ending now start no step: the
        next one is scheduled after every chunk is accounted for)."""
        for chunk in scheduled.chunks:
            if not self.scheduler.computed(chunk):
                continue
            request = chunk.request
            request.append_output_token(OUTPUT_TOKEN)
            if request.prefill_only:
                self.scheduler.hold_for_transfer(request)
                self.sim.kv_ready(self, request)
            else:
                self.sim.token(self, request)
        self.busy = False
        self._between_steps = True
        calls, self._calls = self._calls, []
        for action in calls:
            action()
        self._between_steps = False
        self.kick()

    def free(self, request_id: str) -> None:
        """Drop a request's preallocated blocks (its reservation elsewhere was refused): a
        request waiting for blocks may now fit."""
        self.kv.free(request_id)
        self.kick()

    def end(self, request: Request, status: RequestStatus) -> None:
        """Finish a request here (its blocks freed; a prefill's after its transfer)."""
        self.scheduler.finish(request, status)
        self.kick()

    def check_stop(self, request: Request) -> RequestStatus | None:
        return stop_status(
            request.output_token_ids,
            request.num_prompt_tokens,
            request.sampling_params,
            eos_token_ids=(),
            max_model_len=self.profile.max_model_len,
        )


@dataclass(slots=True, eq=False)
class _Flight:
    """A request in flight: its result, its prompt and where it runs now."""

    result: RequestResult
    tokens: list[int]
    hashes: list[BlockHash]
    params: SamplingParams
    excluded: set[str] = field(default_factory=set)
    route: Route | None = None
    leases: tuple[Lease, ...] = ()
    decode: "SimInstance | None" = None  # where its KV goes, once decode reserved for it
    decode_cached: int = 0  # tokens decode held when it reserved (not sent)

    def bound_to(self, name: str) -> bool:
        """It runs or will run on `name` (prefill is done with it once its first token
        exists)."""
        route = self.route
        if route is None:
            return False
        if route.decode is None or route.decode == name:
            return name in (route.prefill, route.decode)
        return route.prefill == name and self.result.first_token is None


class _Repeat:
    """An action that reschedules itself every `interval_s` (`Simulation.every`)."""

    def __init__(self, sim: "Simulation", interval_s: float, action: Callable[[], object]) -> None:
        self.sim, self.interval_s, self.action = sim, interval_s, action

    def __call__(self) -> None:
        self.action()
        self.sim.at(self.sim.now + self.interval_s, self)


class Simulation:
    """One replay of a trace through one cluster. Use `run`."""

    def __init__(self, spec: ClusterSpec, block_tokens: int, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self._messages = random.Random(f"{seed}:messages")  # message times drawn
        self.events = EventQueue()
        roles = spec.roles()
        block_size = spec.profiles[roles[0]].block_size
        if any(spec.profiles[r].block_size != block_size for r in roles):
            raise ConfigError("every role must use the same block_size")
        self.hasher = BlockHasher.for_model(block_size, "simulated")
        self.tokens = TokenSource(block_tokens, spec.vocab_size, seed)
        self.index = KVEventIndex()
        self.membership = Membership(mixed=bool(spec.mixed))
        self._stats: dict[str, common_pb2.InstanceStats] = {}
        self.routing = Routing(
            spec.router,
            block_size,
            self.membership,
            self.index,
            self._load_report,
            RouterMetrics(),
            self._stats.get,
        )
        self.instances: dict[str, SimInstance] = {}
        self._since: dict[str, float] = {}  # when each instance started
        self._retired_seconds = 0.0  # of the instances stopped
        self._draining: dict[str, Callable[[], object]] = {}  # what to do once drained
        self.changing: set[str] = set()  # starting, draining or changing role
        self._numbers: dict[str, itertools.count[int]] = {}  # the next name of each role
        for role in roles:
            for _ in range(spec.count(role)):
                self._start(role)
        self._results: list[RequestResult] = []
        self._flights: dict[str, _Flight] = {}  # by request id
        self._itl = array("d")
        self._samples: list[Sample] = []
        self._live = 0  # requests not yet ended
        self._repeating: list[_Repeat] = []
        self._preemptions = 0  # of instances retired
        self.every(spec.router.stats_interval_s, self._poll)

    @property
    def now(self) -> float:
        return self.events.now

    def clock(self) -> float:
        return self.events.now

    def at(self, time_s: float, action: Callable[[], object]) -> None:
        self.events.at(time_s, action)

    @property
    def results(self) -> list[RequestResult]:
        """Every request that arrived so far, in arrival order."""
        return self._results

    def every(self, interval_s: float, action: Callable[[], object]) -> None:
        """Run `action` every `interval_s` of simulated time, from the first arrival until the
        last request ended (the router's stats poll; a planner's interval). Call before `run`."""
        self._repeating.append(_Repeat(self, interval_s, action))

    def run(
        self, records: Sequence[TraceRecord], progress: Callable[[], object] = lambda: None
    ) -> LatencyResult:
        if not records:
            raise ConfigError("the trace has no records")
        start = records[0].timestamp_ms / 1000
        self.events.now = start
        self._since = dict.fromkeys(self._since, start)
        for repeat in self._repeating:
            self.at(start, repeat)
        for n, record in enumerate(records):
            self.events.advance(record.timestamp_ms / 1000)
            self._arrive(n, record)
            progress()
        self.events.advance(math.inf, lambda: not self._live and self._only_repeating())
        ended = max((r.last_token or r.arrival for r in self._results), default=start)
        preemptions = self._preemptions + sum(
            i.scheduler.stats.num_preemptions for i in self.instances.values()
        )
        for instance in self.instances.values():
            instance.kv.check_integrity()
        self.routing.load.check_integrity()
        names = {name: instance.role for name, instance in self.instances.items()}
        seconds = self._retired_seconds + sum(max(0.0, ended - t) for t in self._since.values())
        return LatencyResult(self.spec, self._results, self._itl, self._samples, start, ended,
                             preemptions, names, seconds)  # fmt: skip

    def _only_repeating(self) -> bool:
        return all(isinstance(action, _Repeat) for action in self.events.actions())

    def _poll(self) -> None:
        """The router's stats poll: every instance's stats, decode capacities, a sample; and
        draining instances that have nothing left are let go."""
        sample = Sample(self.now, {})
        for name, instance in list(self.instances.items()):
            if name in self._draining and self._idle(name):
                self._draining.pop(name)()
                continue
            stats = instance.stats()
            self._stats[name] = stats
            used = stats.num_blocks - stats.num_free_blocks
            sample.instances[name] = (instance.role, stats.num_running, stats.num_waiting, used)
        self._samples.append(sample)

    # -- the cluster changing (a planner's moves) ------------------------------------------------

    def start_instance(self, role: str, ready_in_s: float) -> str:
        """Start an instance of `role`: it counts (instance-seconds) from now and is routed to
        `ready_in_s` later (its process, weights and first steps). Returns its name."""
        name = self._start(role, routed=False)
        self.changing.add(name)
        self.at(self.now + ready_in_s, lambda: self._route(name))
        return name

    def stop_instance(self, name: str) -> None:
        """Drain `name` (no new requests), then stop it once nothing runs or waits there."""
        self._drain(name, lambda: self._stop(name))

    def change_role(self, name: str, role: str, switch_s: float) -> None:
        """Drain `name`, then make it a `role` instance `switch_s` later (the switch itself).
        The simulated instance starts its new role with an empty prefix cache."""

        def switch() -> None:
            self._retire(name)
            self._start(role, name, routed=False)
            self.at(self.now + switch_s, lambda: self._route(name))

        self._drain(name, switch)

    def _start(self, role: str, name: str | None = None, routed: bool = True) -> str:
        name = name or f"{role}-{next(self._numbers.setdefault(role, itertools.count()))}"
        self.instances[name] = SimInstance(name, role, self.spec.profiles[role], self)
        self._since.setdefault(name, self.now)
        if routed:
            self._route(name)
        return name

    def _route(self, name: str) -> None:
        role = self.instances[name].role
        self.membership.add(Role.DECODE if role == "decode" else Role.PREFILL, name)
        self.changing.discard(name)

    def _drain(self, name: str, then: Callable[[], object]) -> None:
        if name not in self.instances or name in self.changing:
            raise ConfigError(f"instance {name} is not serving")
        self.membership.set_drained(name, True)
        self.changing.add(name)
        self._draining[name] = then

    def _idle(self, name: str) -> bool:
        """Nothing runs, waits, is reserved or is on its way to `name`."""
        instance = self.instances[name]
        if instance.busy or instance.reserved or instance.scheduler.has_unfinished_requests():
            return False
        return not any(flight.bound_to(name) for flight in self._flights.values())

    def _retire(self, name: str) -> None:
        """Take `name` out of the router's view and its instance away."""
        instance = self.instances.pop(name)
        instance.kv.check_integrity()
        self._preemptions += instance.scheduler.stats.num_preemptions
        self.membership.remove(name)
        self.index.drop_instance(name)
        self._stats.pop(name, None)

    def _stop(self, name: str) -> None:
        self._retire(name)
        self._retired_seconds += self.now - self._since.pop(name)
        self.changing.discard(name)

    def _load_report(self, name: str) -> LoadReport | None:
        """What the instance's last load report says: its state now (a live instance reports
        each step's change within milliseconds)."""
        instance = self.instances.get(name)
        return instance.load_report() if instance is not None else None

    def _acknowledge(self, flight: _Flight, instance: SimInstance) -> None:
        """The instance counts the attempt in its load from now (its next report says so)."""
        self.routing.load.acknowledge(instance.name, flight.leases[0].seq)

    # -- a request's life ------------------------------------------------------------------------

    def _arrive(self, index: int, record: TraceRecord) -> None:
        tokens = self.tokens.prompt(record)
        result = RequestResult(index, self.now, len(tokens), record.output_length)
        self._results.append(result)
        self._live += 1
        if record.output_length < 1:
            self._fail(_Flight(result, tokens, [], SamplingParams()), "no output tokens asked")
            return
        params = SamplingParams(max_tokens=record.output_length, ignore_eos=True)
        window = min(p.max_model_len for p in self.spec.profiles.values())
        try:  # the router's edge check: prompt and output must fit the context window
            validate_request(tokens, params, vocab_size=self.spec.vocab_size, max_model_len=window)
        except PdserveError as e:
            self._fail(_Flight(result, tokens, [], params), f"refused: {e}")
            return
        flight = _Flight(result, tokens, self.hasher.hash_tokens(tokens), params)
        self._flights[f"r{index}"] = flight
        self._hop(lambda: self._attempt(flight))  # the request reaches the router

    def _request(self, flight: _Flight, prefill_only: bool = False) -> Request:
        """The request as one instance builds it (its own object, the router's chain)."""
        return Request(
            request_id=f"r{flight.result.index}",
            prompt_token_ids=tuple(flight.tokens),
            sampling_params=flight.params,
            hasher=self.hasher,
            prefill_only=prefill_only,
            block_hashes=list(flight.hashes),
        )

    def _attempt(self, flight: _Flight) -> None:
        result = flight.result
        result.attempts += 1
        request_id = f"r{result.index}"
        try:
            route = self.routing.choose(
                request_id, len(flight.tokens), flight.hashes, flight.excluded
            )
        except NoCapacityError as e:
            self._fail(flight, str(e))
            return
        flight.route = route
        flight.leases = self.routing.leases(route, len(flight.tokens))
        instance = self.instances[route.prefill]
        if route.decode is None:
            self._hop(lambda: self._run_whole(flight, instance, route.on_decode))
        else:
            decode = self.instances[route.decode]
            self._hop(lambda: self._prefill(flight, instance, decode))

    def _hop(self, action: Callable[[], object], after_s: float = 0.0) -> None:
        """`action` once a message sent `after_s` from now reached the other process."""
        self.at(self.now + after_s + self._message_s(), action)

    def _message_s(self) -> float:
        draws = self.spec.rpc_draws_s
        return self._messages.choice(draws) if draws else self.spec.rpc_s

    def _run_whole(self, flight: _Flight, instance: SimInstance, on_decode: bool) -> None:
        """Mixed, or local prefill on a decode instance (refused when its blocks would eat
        the running requests' growth headroom, as the decode instance refuses)."""
        instance.call(lambda: self._queue_whole(flight, instance, on_decode))

    def _queue_whole(self, flight: _Flight, instance: SimInstance, on_decode: bool) -> None:
        request = self._request(flight)
        if on_decode and not instance.admission.fits(request, instance.growth_headroom()):
            self._retry(flight, instance.name)
            return
        flight.result.path = "local" if on_decode else "mixed"
        instance.submit(request)
        self._acknowledge(flight, instance)

    def _prefill(self, flight: _Flight, prefill: SimInstance, decode: SimInstance) -> None:
        flight.result.path = "remote"
        flight.result.marks["at_prefill"] = self.now
        request = self._request(flight, prefill_only=True)

        def preallocate() -> None:
            prefill.admission.admit(request)  # None: the scheduler admits it when blocks free
            self._acknowledge(flight, prefill)
            self._hop(lambda: decode.call(
                lambda: self._reserve(flight, prefill, decode, request, 1)))  # fmt: skip

        prefill.call(preallocate)

    def _reserve(
        self, flight: _Flight, prefill: SimInstance, decode: SimInstance, request: Request,
        tries: int,
    ) -> None:  # fmt: skip
        """Decode reserves blocks for the prompt, or refuses; prefill asks again after the
        refusal's retry-after, at most `reserve_max_attempts` times."""
        mine = self._request(flight)
        admission = decode.admission.admit(mine, growth_headroom_blocks=decode.growth_headroom())
        if admission is None:
            config = self.spec.prefill_config
            if tries >= config.reserve_max_attempts:
                prefill.call(lambda: prefill.free(request.request_id))
                self._retry(flight, decode.name)
                return
            wait = min(self.spec.decode_config.retry_after_ms / 1000, config.reserve_max_backoff_s)
            self.at(self.now + wait, lambda: decode.call(
                lambda: self._reserve(flight, prefill, decode, request, tries + 1)))  # fmt: skip
            return
        decode.reserved[mine.request_id] = mine
        self._acknowledge(flight, decode)
        flight.decode, flight.decode_cached = decode, admission.num_computed_tokens
        self._hop(lambda: prefill.call(lambda: self._submit_reserved(flight, prefill, request)))

    def _submit_reserved(self, flight: _Flight, prefill: SimInstance, request: Request) -> None:
        flight.result.marks["reserved"] = self.now
        prefill.submit(request)

    def _retry(self, flight: _Flight, refused_by: str) -> None:
        """The attempt failed before its first token (a decode instance refused): the router
        releases its leases and tries another pair after its backoff, or gives up."""
        for lease in flight.leases:
            lease.release()
        flight.excluded.add(refused_by)
        config = self.spec.router
        attempts = flight.result.attempts
        if attempts >= config.max_attempts:
            self._fail(flight, f"refused on {attempts} attempts")
            return
        self.at(self.now + config.retry_backoff_s * 2 ** (attempts - 1),
                lambda: self._attempt(flight))  # fmt: skip

    def kv_ready(self, prefill: SimInstance, request: Request) -> None:
        """Prefill computed the prompt: the blocks decode lacks move, then decode starts."""
        flight = self._flights[request.request_id]
        flight.result.marks["computed"] = self.now
        decode = flight.decode
        if decode is None:
            raise IntegrityError(
                f"request {request.request_id} was prefilled without a reservation"
            )
        block_size = prefill.profile.block_size
        blocks = -(-request.num_prompt_tokens // block_size) - flight.decode_cached // block_size
        num_bytes = max(0, blocks) * decode.profile.kv_block_bytes
        seconds = num_bytes / (self.spec.transfer_gbps * GB)
        prefill.transferred_bytes += num_bytes
        prefill.transfer_seconds += seconds
        first = request.output_token_ids[-1]
        self._hop(lambda: decode.call(
            lambda: self._hand_off(flight, prefill, request, decode, first)), seconds)  # fmt: skip

    def _hand_off(
        self, flight: _Flight, prefill: SimInstance, sent: Request, decode: SimInstance,
        first_token: int,
    ) -> None:  # fmt: skip
        prefill.call(lambda: prefill.end(sent, RequestStatus.FINISHED_STOPPED))
        request = decode.reserved.pop(sent.request_id)
        decode.scheduler.admit_prefilled(request)
        request.append_output_token(first_token)
        flight.result.cached_tokens = sent.num_cached_tokens
        flight.result.marks["handed_off"] = self.now
        flight.leases[0].release()  # prefill is done once the first token exists
        self.token(decode, request)
        decode.kick()

    def token(self, instance: SimInstance, request: Request) -> None:
        """An output token was made: it reaches the client two messages later (through
        the router). A stream keeps its order: a token whose messages were quicker than its
        predecessor's arrives with it, in one chunk (no gap between them is counted)."""
        flight = self._flights[request.request_id]
        result = flight.result
        reached = self.now + self._message_s() + self._message_s()
        if result.last_token is not None:
            if reached > result.last_token:
                self._itl.append(reached - result.last_token)
            reached = max(reached, result.last_token)
        elif flight.decode is None:  # its first token, from the instance that computed it
            result.cached_tokens = request.num_cached_tokens
            flight.leases[0].finish_prefill()
        if result.first_token is None:
            result.first_token = reached
        result.last_token = reached
        result.tokens += 1
        status = instance.check_stop(request)
        if status is not None:
            instance.end(request, status)
            for lease in flight.leases:
                lease.release()
            self._done(flight)

    def _fail(self, flight: _Flight, why: str) -> None:
        flight.result.failed = why
        self._done(flight)

    def _done(self, flight: _Flight) -> None:
        self._flights.pop(f"r{flight.result.index}", None)
        self._live -= 1
