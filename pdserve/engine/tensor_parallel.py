"""A tensor-parallel instance: rank 0 is the engine (scheduler, KV manager, prefix cache,
sampler); ranks 1..TP-1 are workers that load their part of the model, hold their part of every
KV block and run each step rank 0 sends them (`pdserve.model.parallel`).

Start-up, every rank alike: say it started in rank 0's TCPStore (its address is the
`Rendezvous`, which the launcher hands each worker: a local process, or a Ray actor the
controller placed), and once all did, join the process group through it and connect the control
connection (authenticated with the rendezvous' one-off key); load the model's part, wait until
every rank loaded (the two waits are `tp_start_timeout_s`, not a collective's timeout: a rank's
start and load may take minutes), size the KV cache and take the smallest block count of all
ranks.
Then a worker waits for steps until rank 0 says stop or is gone; a step that fails on a worker
ends the worker (its peers' collectives then fail with TensorParallelError, never hang).

KV movement: rank 0 maps every worker's KV cache (CPU: its shared-memory segment; CUDA: its
export over CUDA IPC, the ranks being on one node), so that every block movement of the instance
(sends, received blocks, storage reads and writes) goes through rank 0's `SlicedKVStager`: a
block is every rank's slice of it, in rank order.
"""

import dataclasses
import json
import logging
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import IO, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from pdserve.config import EngineConfig
from pdserve.errors import ConfigError, TensorParallelError
from pdserve.model.parallel import Shard, StepChannel, StepInputs, TPGroup, join_group, receive
from pdserve.model.runner import ModelRunner
from pdserve.model.staging import map_segment
from pdserve.transfer.base import KVEndpoints
from pdserve.transfer.cuda_ipc import export_kv_cache, open_peer_cache, visible_gpus

logger = logging.getLogger(__name__)

_RANK = struct.Struct("<q")
_WORKER_MAIN = "from pdserve.engine.tensor_parallel import main; main()"


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a worker finds rank 0: its TCPStore and its control listener, and the key that
    authenticates the control connection (one-off, never logged)."""

    host: str
    store_port: int
    control_port: int
    authkey: bytes
    size: int

    def __repr__(self) -> str:  # the key stays out of logs and Ray's task descriptions
        return f"Rendezvous({self.host}:{self.store_port}/{self.control_port}, size={self.size})"


class Workers(Protocol):
    """The launched workers (local processes, Ray actors)."""

    def alive(self) -> bool:
        """Whether every worker still runs."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for them to leave, then end them."""
        ...


WorkerLauncher = Callable[[EngineConfig, Rendezvous], Workers]
"""Starts ranks 1..size-1 with `serve_worker(config, rank, rendezvous)`."""


class LocalWorkers:
    """Workers as child processes of this one (tests, benchmarks, `pdserve generate`): each
    runs `tensor_parallel.main`, reading its settings from stdin (the key never appears on a
    command line); their output goes where this process's does."""

    def __init__(self, config: EngineConfig, rendezvous: Rendezvous) -> None:
        _check_gpus(config, rendezvous.size)
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, rendezvous.size):
            process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE)
            stdin = cast(IO[bytes], process.stdin)  # a pipe: stdin=PIPE
            stdin.write(worker_settings(_rank_device(config, rank), rank, rendezvous))
            stdin.close()
            self.processes.append(process)

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not stop: killing it", process.pid)
                process.kill()
                process.wait()


def _check_gpus(config: EngineConfig, size: int) -> None:
    """Local CUDA ranks take consecutive GPUs from rank 0's: refuse before launching when there
    are not enough (else a worker fails and rank 0 waits `tp_timeout_s` to find out)."""
    if not config.device.startswith("cuda"):
        return
    first = _first_gpu(config)
    if torch.cuda.device_count() < first + size:
        raise ConfigError(
            f"engine.tensor_parallel_size {size} from {config.device} needs GPUs {first}.."
            f"{first + size - 1}, but {torch.cuda.device_count()} are visible"
        )


def _rank_device(config: EngineConfig, rank: int) -> EngineConfig:
    """A local CUDA worker takes the GPU after rank 0's by its rank (`cuda:N` + rank)."""
    if not config.device.startswith("cuda"):
        return config
    return dataclasses.replace(config, device=f"cuda:{_first_gpu(config) + rank}")


def _first_gpu(config: EngineConfig) -> int:
    """Rank 0's GPU index (`cuda` is 0)."""
    return int(config.device.partition(":")[2] or 0)


def worker_settings(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> bytes:
    """What `serve_worker` needs, as one JSON document."""
    values = dataclasses.asdict(rendezvous) | {"authkey": rendezvous.authkey.hex()}
    document = {"engine": dataclasses.asdict(config), "rank": rank, "rendezvous": values}
    return json.dumps(document).encode()


def main() -> None:
    """A local worker: its settings from stdin (`worker_settings`)."""
    document = json.loads(sys.stdin.buffer.read())
    values = document["rendezvous"] | {"authkey": bytes.fromhex(document["rendezvous"]["authkey"])}
    serve_worker(EngineConfig(**document["engine"]), document["rank"], Rendezvous(**values))


def local_workers(config: EngineConfig, rendezvous: Rendezvous) -> Workers:
    return LocalWorkers(config, rendezvous)


_default: tuple[WorkerLauncher, str] = (local_workers, "127.0.0.1")  # `use_launcher`


def use_launcher(launch: WorkerLauncher, host: str) -> None:
    """Start this process's tensor-parallel workers with `launch`, rank 0 listening on `host`
    (a Ray instance actor, which holds one instance, installs its own before building it)."""
    global _default
    _default = (launch, host)


def default_launcher() -> tuple[WorkerLauncher, str]:
    return _default


class RankZero:
    """Rank 0's side once every rank joined: the model runner's `tp` (`StepSender`)."""

    def __init__(
        self,
        group: TPGroup,
        connections: list[Connection],
        workers: Workers,
        phases: "StartPhases",
    ) -> None:
        self.group = group
        self.connections = connections  # to ranks 1..size-1, in rank order
        self.workers = workers
        self.phases = phases
        self._channel = StepChannel(group, connections)

    def loaded(self) -> None:
        """Rank 0 loaded its part: wait until every worker did too."""
        self.phases.reach("loaded", self.workers.alive)

    def send(self, inputs: StepInputs) -> None:
        self._channel.send(inputs)

    def check(self) -> None:
        self.group.check()
        if not self.workers.alive():
            raise TensorParallelError("a tensor-parallel worker of this instance is gone")

    def agree_on_blocks(self, num_blocks: int) -> int:
        """The smallest KV block count of every rank (each sized its own device)."""
        return self.group.min(num_blocks)

    def worker_caches(self, like: torch.Tensor) -> list["WorkerCache"]:
        """Each worker's KV cache (shaped and typed as rank 0's `like`) mapped into this
        process, in rank order: its shared-memory segment (CPU) or its CUDA IPC export."""
        caches = []
        for rank, connection in enumerate(self.connections, start=1):
            report = json.loads(_receive_text(connection, self.group.timeout))
            caches.append(_map_cache(rank, report, like))
        return caches

    def stop(self) -> None:
        """Tell the workers to leave, wait for them, leave the group. Idempotent."""
        self._channel.stop()
        self.workers.stop(timeout_s=30.0)
        for connection in self.connections:
            connection.close()
        self.group.close()


def rank_shard(config: EngineConfig, rank: int) -> Shard:
    """Rank `rank`'s part of the model: its heads, and its experts whole (expert parallel) or
    sliced."""
    return Shard(rank, config.tensor_parallel_size, config.expert_parallel_size > 1)


def start_rank_zero(
    config: EngineConfig, launch: WorkerLauncher, host: str = "127.0.0.1"
) -> RankZero:
    """Open the rendezvous on `host`, launch the workers, wait (`tp_start_timeout_s`) until
    they all started, then (`tp_timeout_s`) until all joined. Raises TensorParallelError."""
    size, timeout = config.tensor_parallel_size, timedelta(seconds=config.tp_timeout_s)
    store = TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
    authkey = secrets.token_bytes(32)
    listener = Listener((host, 0), authkey=authkey)
    rendezvous = Rendezvous(host, store.port, listener.address[1], authkey, size)
    workers = launch(config, rendezvous)
    shard = rank_shard(config, 0)
    phases = StartPhases(store, shard, config.tp_start_timeout_s)
    try:
        phases.reach("started", workers.alive)
        group = join_group(shard, store, torch.device(config.device), config.tp_timeout_s)
        connections = _accept(listener, size - 1, config.tp_timeout_s)
    except TensorParallelError:
        workers.stop(timeout_s=1.0)
        raise
    except (RuntimeError, OSError, ValueError, dist.DistError) as e:
        workers.stop(timeout_s=1.0)
        raise TensorParallelError(f"the tensor-parallel workers did not join: {e}") from e
    finally:
        listener.close()
    logger.info("tensor-parallel instance of %d ranks: every rank joined", size)
    return RankZero(group, connections, workers, phases)


class StartPhases:
    """The start-up waits of every rank, through rank 0's TCPStore: a rank marks a phase
    reached, then waits (`limit_s`) until every rank did."""

    def __init__(self, store: TCPStore, shard: Shard, limit_s: float) -> None:
        self.store = store
        self.shard = shard
        self.limit_s = limit_s

    def reach(self, phase: str, alive: Callable[[], bool] = lambda: True) -> None:
        """Mark `phase` reached by this rank and wait for the others; fail at once when
        `alive()` (the other ranks still run, as far as this one can tell) turns false."""
        self.store.set(f"pdserve/{phase}/{self.shard.rank}", "1")
        keys = [f"pdserve/{phase}/{rank}" for rank in range(self.shard.size)]
        deadline = time.monotonic() + self.limit_s
        while not self.store.check(keys):
            if not alive():
                raise TensorParallelError(f"a tensor-parallel rank exited before it {phase}")
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"not every tensor-parallel rank {phase} within {self.limit_s:g} s "
                    "(engine.tp_start_timeout_s)"
                )
            time.sleep(0.05)  # a poll: the store has no wait that also watches the processes


def _accept(listener: Listener, count: int, timeout_s: float) -> list[Connection]:
    """`count` authenticated control connections, ordered by the rank each one names."""
    listener._listener._socket.settimeout(timeout_s)  # type: ignore[attr-defined]
    by_rank: dict[int, Connection] = {}
    for _ in range(count):
        connection = listener.accept()
        if not connection.poll(timeout_s):
            raise TensorParallelError("a tensor-parallel worker connected but never named its rank")
        (rank,) = _RANK.unpack(connection.recv_bytes())
        by_rank[rank] = connection
    return [by_rank[rank] for rank in sorted(by_rank)]


def _receive_text(connection: Connection, timeout: timedelta) -> str:
    if not connection.poll(timeout.total_seconds()):
        raise TensorParallelError("a tensor-parallel worker did not report its KV cache in time")
    return connection.recv_bytes().decode()


@dataclass(frozen=True, slots=True)
class WorkerCache:
    tensor: torch.Tensor  # the worker's KV cache, mapped here
    shm_name: str  # its shared-memory segment; empty for a GPU's


def _cache_report(runner: ModelRunner) -> tuple[bytes, Any]:
    """What rank 0 needs to map this rank's KV cache (and the CUDA export to keep alive)."""
    if runner.segment is not None:
        return json.dumps({"shm": runner.segment.name}).encode(), None
    export = export_kv_cache(runner.kv_cache)
    if export is None:
        return json.dumps({}).encode(), None
    report = {"ipc": export.handle.hex(), "gpu_uuid": export.gpu_uuid}
    return json.dumps(report).encode(), export


def _map_cache(rank: int, report: dict[str, str], like: torch.Tensor) -> WorkerCache:
    if "shm" in report:
        return WorkerCache(map_segment(report["shm"], like), report["shm"])
    if "ipc" in report and like.device.type == "cuda":
        endpoints = KVEndpoints(
            cuda_ipc_handle=bytes.fromhex(report["ipc"]),
            gpu_uuid=report["gpu_uuid"],
            kv_bytes=like.numel() * like.element_size(),
        )
        peer = visible_gpus().get(report["gpu_uuid"])
        if peer is not None:
            mapped = open_peer_cache(endpoints, peer, like.device)
            return WorkerCache(mapped.view(like.dtype).view(like.shape), "")
    raise TensorParallelError(
        f"rank {rank}'s KV cache cannot be mapped by rank 0 (no room in /dev/shm, or its GPU "
        f"is not visible to rank 0 or not shareable over CUDA IPC: see rank {rank}'s log)"
    )


def serve_worker(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
    """Rank `rank`'s whole life: join, load, size, then run steps until told to stop."""
    from pdserve.engine.engine import load_and_size  # the engine's own loading and sizing

    logging.basicConfig(level=logging.INFO)  # a local worker's own process: its log lines
    timeout = timedelta(seconds=config.tp_timeout_s)
    store = TCPStore(
        rendezvous.host, rendezvous.store_port, rendezvous.size, is_master=False, timeout=timeout
    )
    shard = rank_shard(config, rank)
    phases = StartPhases(store, shard, config.tp_start_timeout_s)
    phases.reach("started")
    group = join_group(shard, store, torch.device(config.device), config.tp_timeout_s)
    connection = Client((rendezvous.host, rendezvous.control_port), authkey=rendezvous.authkey)
    connection.send_bytes(_RANK.pack(rank))
    loaded, plan, _ = load_and_size(config, group, lambda: phases.reach("loaded"))
    num_blocks = group.min(plan.num_blocks)
    runner = ModelRunner.create(loaded.model, num_blocks, config.block_size, loaded.dtype, True)
    report, export = _cache_report(runner)  # `export` holds the CUDA share while this runs
    connection.send_bytes(report)
    try:
        _run_steps(runner, group, connection)
    finally:
        del export
        runner.close()
        connection.close()
        group.close()


def _run_steps(runner: ModelRunner, group: TPGroup, connection: Connection) -> None:
    steps = 0
    with torch.inference_mode():
        while (inputs := receive(group, connection)) is not None:
            runner.run(inputs)
            steps += 1
    logger.info("tensor-parallel rank %d stops after %d steps", group.rank, steps)
