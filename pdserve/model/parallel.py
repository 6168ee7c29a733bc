"""Tensor parallelism: one model split across ranks (one device each) of one instance.

`Shard` says which part of every weight a rank holds: q/k/v and gate/up are split by output rows
(column-parallel: whole heads, whole MLP columns), o/down by input columns (row-parallel: each
rank's partial output is summed by an all-reduce), the embedding and the LM head by vocabulary
rows (each rank holds `ceil(vocab / size)` rows, the last padded with zeros). Norms and the
rotary tables are replicated. A rank's KV cache holds its `kv_heads / size` heads of every block.

`TPGroup` runs the collectives of one instance's ranks (NCCL on CUDA; on CPU shared memory,
`pdserve.model.shm_collectives`, with gloo for what does not fit) with a timeout each
(`engine.tp_timeout_s`): a failed or timed-out collective raises TensorParallelError and the
group is broken from then on (every later call raises at once: a rank that died or hangs fails
its instance's requests, never hangs them).

`StepChannel`: rank 0 (the instance: scheduler, KV manager, prefix cache, sampler) tells the
other ranks what to run. Each step's inputs (token ids, per-sequence starts, counts and context
lengths, the gathered block-table rows, the rows that need logits) are packed into one int64
tensor and broadcast once; its small header goes first over an authenticated connection to each
worker (`multiprocessing.connection`), on which an idle worker waits without a timeout (a
collective would time out while the instance is idle).
"""

import contextlib
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from pdserve.errors import ConfigError, TensorParallelError
from pdserve.model.config import ModelConfig, MoEConfig
from pdserve.model.shm_collectives import ShmCollectives
from pdserve.model.shm_collectives import supported as shm_supported

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`; with `expert_parallel` each rank holds whole experts of a
    mixture-of-experts layer (`pdserve.model.moe.ExpertPart`), else a slice of every one."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal part of `total`; ConfigError unless it divides."""
        if total % self.size:
            raise ConfigError(
                f"engine.tensor_parallel_size {self.size} does not divide the model's {what} "
                f"({total}): choose a size that divides it"
            )
        part = total // self.size
        return self.rank * part, part

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(first id, rows held) of this rank's vocabulary part: `ceil(vocab / size)` rows each,
        of which the last rank's may run past the vocabulary (padding)."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows


SINGLE = Shard()  # one rank: the whole model


def check_divides(shard: Shard, config: ModelConfig) -> None:
    """Refuse a size that does not split whole heads, MLP columns and experts (KV heads are
    split, not replicated: every rank must hold at least one)."""
    shard.split(config.num_heads, "attention heads")
    shard.split(config.num_kv_heads, "KV heads")
    if config.moe is None or len(config.moe.sparse_layers) < config.num_layers:
        shard.split(config.intermediate_size, "MLP width (intermediate_size)")
    if config.moe is not None:
        expert_part(shard, config.moe)
        if config.moe.shared_width:
            shard.split(config.moe.shared_width, "shared experts' width")
    if config.weight_block is not None:
        _check_blocks(shard, config, config.weight_block)


def _check_blocks(shard: Shard, config: ModelConfig, block: tuple[int, int]) -> None:
    """FP8 block-quantized weights: every part a rank holds of a split (or stacked) weight is
    whole blocks, so that its scales are whole rows or columns of the checkpoint's."""
    moe, mla, ranks = config.moe, config.mla, shard.size
    parts: dict[str, int] = {}
    if moe is None or len(moe.sparse_layers) < config.num_layers:
        parts["MLP width (intermediate_size)"] = config.intermediate_size // ranks
    if moe is not None:
        whole = shard.expert_parallel
        parts["experts' width"] = moe.intermediate_size // (1 if whole else ranks)
        if moe.shared_width:
            parts["shared experts' width"] = moe.shared_width // ranks
    if mla is not None:
        heads = config.num_heads // ranks
        parts["query rows"] = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        parts["kv_b_proj rows"] = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        parts["o_proj columns"] = heads * mla.v_head_dim
    for name, size in parts.items():
        if size % block[0] or size % block[1]:
            raise ConfigError(
                f"engine.tensor_parallel_size {ranks} leaves each rank {size} of the model's "
                f"{name}: not whole {block[0]}x{block[1]} blocks of its FP8 weights"
            )


@dataclass(frozen=True, slots=True)
class ExpertPart:
    """The experts one rank holds: `count` of the model's `num_experts` from `first`, and of each
    the width columns `width_start .. width_start + width`."""

    num_experts: int
    first: int
    count: int
    width_start: int
    width: int

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count


def expert_part(shard: Shard, moe: MoEConfig) -> ExpertPart:
    """The experts `shard`'s rank holds: whole experts with expert parallelism, else a slice of
    every expert's width; ConfigError when the ranks do not divide them."""
    if shard.expert_parallel:
        if moe.num_experts % shard.size:
            raise ConfigError(
                f"engine.expert_parallel_size {shard.size} does not divide the model's "
                f"{moe.num_experts} experts: choose a size that divides it"
            )
        count = moe.num_experts // shard.size
        return ExpertPart(moe.num_experts, shard.rank * count, count, 0, moe.intermediate_size)
    start, width = shard.split(moe.intermediate_size, "experts' width (moe_intermediate_size)")
    return ExpertPart(moe.num_experts, 0, moe.num_experts, start, width)


@dataclass(slots=True)
class CommStats:
    """Seconds spent in collectives, and their count (the benchmark's compute/comm split)."""

    seconds: float = 0.0
    calls: int = 0


class TPGroup:
    """One instance's ranks: a process group of their own (not torch.distributed's default
    one, so that several instances can live in one process), and on CPU the shared-memory
    collectives (`ShmCollectives`) for every tensor that fits their slots. Owned by the rank's
    engine thread (or worker loop)."""

    def __init__(
        self,
        shard: Shard,
        backend: Any,
        device: torch.device,
        timeout_s: float,
        shm: ShmCollectives | None = None,
    ) -> None:
        self.shard = shard
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.stats = CommStats()
        self._backend = backend
        self._shm = shm
        self._broken: str | None = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def check(self) -> None:
        """Raise TensorParallelError when a collective failed (the group is broken)."""
        if self._broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self._broken}")

    def _run(self, what: str, collective: Callable[[], T]) -> T:
        self.check()
        start = time.perf_counter()
        try:
            return collective()
        except (RuntimeError, dist.DistError, ValueError) as e:
            self._broken = f"{what} failed on rank {self.rank}: {e}"
            logger.error("%s", self._broken)
            raise TensorParallelError(self._broken) from e
        finally:
            self.stats.seconds += time.perf_counter() - start
            self.stats.calls += 1

    def _wait(self, work: Any) -> None:
        if self.device.type == "cuda":
            work.wait()  # stream-ordered (NCCL's watchdog enforces the timeout)
        else:
            work.wait(self.timeout)

    def _fast(self, x: torch.Tensor) -> ShmCollectives | None:
        """The shared-memory path for `x` (the same answer on every rank: same shapes)."""
        shm = self._shm
        if shm is None or not x.is_contiguous() or not shm.fits(x):
            return None
        return shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        shm, seconds = self._fast(x), self.timeout.total_seconds()
        if shm is not None:
            self._run("all_reduce", lambda: shm.all_reduce(x, seconds))
        else:
            self._run("all_reduce", lambda: self._wait(self._backend.allreduce([x])))
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` (`[rows, cols]`) side by side on rank 0 (`[rows, size x cols]`);
        None on the others."""
        x = x.contiguous()
        shm = self._fast(x)
        if shm is not None:
            return self._run("gather", lambda: shm.gather_columns(x, self.timeout.total_seconds()))
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._run("gather", lambda: self._wait(self._backend.gather(parts, [x], options)))
        return torch.cat(parts[0], dim=-1) if parts else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        shm = self._fast(x)
        if shm is not None:
            self._run("broadcast", lambda: shm.broadcast(x, self.timeout.total_seconds()))
            return x
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._run("broadcast", lambda: self._wait(self._backend.broadcast([x], options)))
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._run("all_reduce(min)", lambda: self._wait(self._backend.allreduce([tensor], options)))
        return int(tensor.item())

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise largest of every rank's `x` (a new tensor)."""
        tensor = x.to(self.device).clone()
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        self._run("all_reduce(max)", lambda: self._wait(self._backend.allreduce([tensor], options)))
        return tensor

    def close(self) -> None:
        """Leave the group (its connections close, rank 0 removes the shared segment).
        Idempotent."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._backend is not None:
            self._broken = self._broken or "closed"
            with contextlib.suppress(RuntimeError):
                self._backend.shutdown()
            self._backend = None


def join_group(shard: Shard, store: TCPStore, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the instance's process group through `store` (rank 0's TCPStore): NCCL on CUDA;
    on CPU gloo, and shared-memory collectives where they work (`_join_shm`)."""
    timeout = timedelta(seconds=timeout_s)
    backend: Any
    shm = None
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else 0)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, shard.rank, shard.size, options)
    else:
        backend = dist.ProcessGroupGloo(store, shard.rank, shard.size, timeout)
        shm = _join_shm(shard, store)
    name = "nccl" if device.type == "cuda" else "gloo" + (" + shared memory" if shm else "")
    logger.info("rank %d of %d joined its tensor-parallel group (%s)", shard.rank, shard.size, name)
    return TPGroup(shard, backend, device, timeout_s, shm)


def _join_shm(shard: Shard, store: TCPStore) -> ShmCollectives | None:
    """Rank 0 makes the segment and names it in the store ("" when it cannot: every rank then
    uses gloo alone); every rank maps it, then records its process id there (the liveness
    checks); once all did, rank 0 removes the name, so a crash leaves nothing in /dev/shm."""
    shm = None
    if shard.rank == 0:
        try:
            shm = ShmCollectives.create(shard.size) if shm_supported() else None
        except OSError as e:
            logger.warning("no shared-memory collectives (%s): gloo alone", e)
        store.set("pdserve/shm", str(shm.path) if shm is not None else "")
    path = store.get("pdserve/shm").decode()
    if path and shm is None:
        shm = ShmCollectives(Path(path), shard.rank, shard.size, owner=False)
    store.set(f"pdserve/pid/{shard.rank}", str(os.getpid()))  # mapped, if there is a segment
    pids = [int(store.get(f"pdserve/pid/{r}")) for r in range(shard.size)]
    if shm is not None:
        shm.register(pids)
        shm.forget_name()  # every rank mapped it: it lives as long as the mappings
    return shm


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; tokens of other ranks' rows embed as zeros
    here, and the all-reduce sums in the one rank's row each token has."""

    def __init__(self, vocab: int, hidden: int, shard: Shard, group: "TPGroup | None") -> None:
        super().__init__()
        self.first, rows = shard.vocab_rows(vocab)
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        if self.group is not None:
            self.group.all_reduce(out)
        return out


# -- the step inputs rank 0 sends -------------------------------------------------------------

STEP, STOP = 1, 2
_HEADER = struct.Struct("<7q")  # kind, tokens, seqs, width, logit rows, prompt-logit chunks, 0


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What every rank needs to run one forward like rank 0."""

    token_ids: torch.Tensor  # [tokens]
    per_seq: torch.Tensor  # [3, seqs]: starts, new-token counts, context lengths
    block_tables: torch.Tensor  # [seqs, width]
    logit_rows: torch.Tensor  # [rows] the hidden rows whose logits are sampled
    all_logits: torch.Tensor  # [chunks] indices of the sequences wanting every position's
    query_lens: list[int] = field(default_factory=list)  # per_seq[1] and [2], on the host
    context_lens: list[int] = field(default_factory=list)


def pack(step: StepInputs) -> tuple[bytes, torch.Tensor]:
    """The header and the one int64 payload of a step."""
    parts = [
        step.token_ids.reshape(-1),
        step.per_seq.reshape(-1),
        step.block_tables.reshape(-1),
        step.logit_rows.reshape(-1),
        step.all_logits.reshape(-1),
    ]
    payload = torch.cat([p.to(torch.long).cpu() for p in parts])
    seqs, width = step.block_tables.shape
    header = _HEADER.pack(
        STEP,
        step.token_ids.numel(),
        seqs,
        width,
        step.logit_rows.numel(),
        step.all_logits.numel(),
        0,
    )
    return header, payload


def unpack(header: tuple[int, ...], payload: torch.Tensor) -> StepInputs:
    _, tokens, seqs, width, rows, chunks, _ = header
    sizes = [tokens, 3 * seqs, seqs * width, rows, chunks]
    token_ids, per_seq, tables, logit_rows, all_logits = torch.split(payload, sizes)
    per_seq = per_seq.view(3, seqs)
    host = per_seq.tolist()
    return StepInputs(
        token_ids, per_seq, tables.view(seqs, width), logit_rows, all_logits, host[1], host[2]
    )


def payload_size(header: tuple[int, ...]) -> int:
    _, tokens, seqs, width, rows, chunks, _ = header
    return int(tokens + 3 * seqs + seqs * width + rows + chunks)


class StepSender(Protocol):
    """What rank 0's model runner calls (`pdserve.engine.tensor_parallel.RankZero`)."""

    def send(self, inputs: StepInputs) -> None: ...

    def check(self) -> None:
        """Raise TensorParallelError when a rank failed."""
        ...

    def stop(self) -> None: ...


class StepChannel:
    """Rank 0's side: the header to every worker's connection, then the payload broadcast."""

    def __init__(self, group: TPGroup, workers: Sequence[Connection]) -> None:
        self.group = group
        self.workers = list(workers)

    def send(self, step: StepInputs) -> None:
        header, payload = pack(step)
        self._tell(header)
        self.group.broadcast(payload.to(self.group.device))

    def _tell(self, header: bytes) -> None:
        for connection in self.workers:
            try:
                connection.send_bytes(header)
            except OSError as e:
                raise TensorParallelError(f"a tensor-parallel worker is gone: {e}") from e

    def stop(self) -> None:
        """Tell every worker to leave (best effort: a dead one is already gone)."""
        header = _HEADER.pack(STOP, 0, 0, 0, 0, 0, 0)
        for connection in self.workers:
            with contextlib.suppress(OSError):
                connection.send_bytes(header)


def receive(group: TPGroup, connection: Connection) -> StepInputs | None:
    """A worker's next step (waits without limit for its header); None when rank 0 said stop or
    is gone."""
    try:
        header = _HEADER.unpack(connection.recv_bytes())
    except (EOFError, OSError):
        return None
    if header[0] == STOP:
        return None
    payload = torch.empty(payload_size(header), dtype=torch.long, device=group.device)
    group.broadcast(payload)
    return unpack(header, payload)
