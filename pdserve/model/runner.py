"""ModelRunner: owns the paged KV cache and runs one forward pass over a batch of chunks."""

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from pdserve.model.attention import AttentionMetadata
from pdserve.model.batch import BlockTables, token_index
from pdserve.model.graphs import Capture, DecodeGraphs, cuda_capture
from pdserve.model.llama import CausalLM
from pdserve.model.parallel import StepInputs, StepSender
from pdserve.model.shm_segments import (
    SHM_DIR,
    claim,
    new_name,
    release,
    remove_orphans,
    segment_path,
)
from pdserve.model.staging import (
    DEFAULT_STAGING_BYTES,
    CudaStreams,
    KVStager,
    SlicedKVStager,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """One sequence's share of a forward pass: tokens at positions `start_pos ...`."""

    token_ids: Sequence[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: Sequence[int]  # covers at least start_pos + len(token_ids) tokens
    needs_logits: bool  # compute logits for the last token (end of prefill, or decode)
    all_logits: bool = False  # also every position's (prompt logprobs)
    seq_id: str | None = None  # keeps the sequence's block-table row across steps (`BlockTables`)


def _shm_has_room(nbytes: int) -> bool:
    """Whether /dev/shm has `nbytes` free (touching pages beyond its size would kill us)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= nbytes


def _allocate_pages(name: str, nbytes: int) -> bool:
    """Give a new shared-memory segment its pages now (`posix_fallocate`): /dev/shm may fill up
    later, and touching a page it cannot back then kills the process (SIGBUS). Also keeps page
    allocation and zeroing off the KV transfer path. False (and a warning) when it has no room."""
    try:
        fd = os.open(segment_path(name), os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        logger.warning(
            "/dev/shm cannot hold the %d-byte KV cache (%s): keeping it private (no shm transfers)",
            nbytes,
            e,
        )
        return False
    return True


class ModelRunner:
    """Builds batch tensors from chunks, runs the model, returns logits. Not thread-safe."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        segment: shared_memory.SharedMemory | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        segment_claim: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.device = kv_cache.device
        self.segment = segment  # the KV cache's shared-memory segment, if it lives in one
        self._segment_claim = segment_claim  # `shm_segments.claim` on it
        streams = CudaStreams(self.device) if self.device.type == "cuda" else None
        self.stager = KVStager(kv_cache, streams, staging_bytes)  # every block <-> host copy
        self.block_tables = BlockTables(self.device)  # rows by sequence id, across steps
        self.graphs: DecodeGraphs | None = None  # `capture_graphs`
        self.tp: StepSender | None = None  # rank 0 of a tensor-parallel instance: its workers
        self.rank_segments: list[str] = []  # rank 0: the other ranks' KV cache segments

    @classmethod
    def create(
        cls,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        shared: bool = False,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> "ModelRunner":
        """A zeroed KV cache on the model's device, laid out as the model says for a model of
        `dtype` (`CausalLM.kv_layout`: its elements may be FP8); with `shared` (CPU only), in a
        new shared-memory segment that same-host peers can write into (`ShmKVTransport`);
        `staging_bytes` of pinned host memory for its transfers (CUDA)."""
        device = next(model.parameters()).device
        layout = model.kv_layout(dtype)
        shape, dtype = layout.shape(num_blocks, block_size), layout.dtype
        nbytes = math.prod(shape) * layout.element_size
        if shared and device.type == "cpu":
            remove_orphans()  # before measuring the room: a killed instance's cache takes some
            if not _shm_has_room(nbytes):
                logger.warning(
                    "/dev/shm cannot hold the %d-byte KV cache: keeping it private "
                    "(no shm transfers)",
                    nbytes,
                )
                shared = False
        if not shared or device.type != "cpu":
            return cls(model, torch.zeros(shape, dtype=dtype, device=device), None, staging_bytes)
        segment = shared_memory.SharedMemory(name=new_name("kv"), create=True, size=nbytes)
        held = claim(segment.name)
        if held is None:  # another pid namespace's sweep removed it before the claim
            segment.close()
            return cls(model, torch.zeros(shape, dtype=dtype, device=device))
        if not _allocate_pages(segment.name, nbytes):
            segment.close()
            segment.unlink()
            release(held)
            return cls(model, torch.zeros(shape, dtype=dtype, device=device))
        raw = torch.frombuffer(segment.buf, dtype=torch.uint8)[:nbytes]  # zeroed by the OS
        return cls(model, raw.view(dtype).view(shape), segment, segment_claim=held)

    def close(self) -> None:
        """Stop the tensor-parallel workers (and remove their KV segments); remove the KV
        cache's shared-memory segment (the mapping goes with the process)."""
        if self.tp is not None:
            self.tp.stop()  # the workers remove their own segments as they leave
            self.tp = None
        for name in self.rank_segments:  # a worker that was killed could not
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(name))
        self.rank_segments = []
        if self.segment is not None:
            self.segment.unlink()
            self.segment = None
            release(self._segment_claim)
            self._segment_claim = None

    def attach_ranks(
        self, tp: StepSender, others: Sequence[torch.Tensor], segments: Sequence[str]
    ) -> None:
        """Rank 0 of a tensor-parallel instance: send each step to the other ranks (`tp`) and
        move KV blocks as every rank's slices (`SlicedKVStager` over the other ranks' caches,
        mapped here; `segments`: their shared-memory names, empty for a GPU's)."""
        self.tp = tp
        self.stager = SlicedKVStager(self.kv_cache, others)
        self.rank_segments = list(segments)

    def capture_graphs(
        self, sizes: Sequence[int], max_blocks: int, capture: Capture | None = None
    ) -> None:
        """Capture the decode forward at `sizes` (`DecodeGraphs`) for contexts of up to
        `max_blocks` blocks. The cache's last block is the padding rows' scratch: it must be
        outside the block pool. `capture`: CUDA graphs unless given (tests pass eager)."""
        start = time.perf_counter()
        if capture is None:
            capture = cuda_capture(torch.cuda.graph_pool_handle())
        with torch.inference_mode():
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, sizes, max_blocks, self.kv_cache.shape[0] - 1, capture
            )
        logger.info(
            "captured the decode forward at %d batch sizes (up to %d) in %.1f s",
            len(sizes), max(sizes), time.perf_counter() - start,
        )  # fmt: skip

    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Write the chunks' KV into their slots and return fp32 logits `[n, vocab]` for the
        chunks with `needs_logits`, in order. Mutates the KV cache slots of the new tokens only."""
        return self.execute_all(chunks)[0]

    @torch.inference_mode()
    def execute_all(
        self, chunks: Sequence[SequenceChunk]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`execute`, plus fp32 logits `[len(tokens), vocab]` at every position of each chunk
        with `all_logits` (by chunk index). Tensor parallel (`tp`): the step's inputs go to
        every rank first, which run the same forward."""
        inputs = self._prepare(chunks)
        if self.tp is not None:
            self.tp.send(inputs)
        return self.run(inputs, use_graphs=not any(c.all_logits for c in chunks))

    def run(
        self, inputs: StepInputs, use_graphs: bool = False
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward of one step's inputs (a tensor-parallel worker's whole step): KV into
        the new tokens' slots, logits of `logit_rows` and of every position of the
        `all_logits` sequences."""
        positions, meta = self.metadata(inputs)
        self.stager.before_forward()
        hidden = None
        if self.graphs is not None and use_graphs:
            hidden = self.graphs.run(inputs.token_ids, positions, meta)
        if hidden is None:
            hidden = self.model(inputs.token_ids, positions, self.kv_cache, meta)
        self.stager.forward_done()
        every: dict[int, torch.Tensor] = {}
        firsts = list(itertools.accumulate(inputs.query_lens, initial=0))
        for chunk in inputs.all_logits.tolist():
            every[chunk] = self.model.compute_logits(hidden[firsts[chunk] : firsts[chunk + 1]])
        return self.model.compute_logits(hidden[inputs.logit_rows]), every

    def metadata(self, inputs: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata of a step's inputs, on the device."""
        per_seq, query_lens = inputs.per_seq, inputs.query_lens
        decode_only = all(n == 1 for n in query_lens)
        num_tokens = int(inputs.token_ids.shape[0])
        index = token_index(
            per_seq[0], per_seq[1], inputs.block_tables, num_tokens, self.block_size, decode_only
        )
        meta = AttentionMetadata(
            slot_blocks=index.slot_blocks,
            slot_offsets=index.slot_offsets,
            query_lens=query_lens,
            context_lens=inputs.context_lens,
            block_tables=inputs.block_tables,
            context_lens_tensor=per_seq[2],
            decode_only=decode_only,
        )
        return index.positions, meta

    def _prepare(self, chunks: Sequence[SequenceChunk]) -> StepInputs:
        """The step's inputs from per-sequence values: one host tensor of starts, new-token
        counts and context lengths, the token ids and the sequences' block-table rows go to the
        device (asynchronously on CUDA); positions and slots are computed there (`run`)."""
        size = self.block_size
        query_lens = [len(c.token_ids) for c in chunks]
        context_lens = [c.start_pos + n for c, n in zip(chunks, query_lens, strict=True)]
        blocks = [-(-n // size) for n in context_lens]
        rows = [
            self.block_tables.row(c.seq_id, c.block_table, n)
            if c.seq_id
            else self.block_tables.scratch(c.block_table, n)
            for c, n in zip(chunks, blocks, strict=True)
        ]
        block_tables = self.block_tables.gather(rows, max(blocks))
        for chunk, row in zip(chunks, rows, strict=True):
            if not chunk.seq_id:
                self.block_tables.release_scratch(row)
        per_seq = self._to_device([[c.start_pos for c in chunks], query_lens, context_lens])
        token_ids = self._to_device(
            list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        )
        ends = itertools.accumulate(query_lens)
        logit_rows = [end - 1 for c, end in zip(chunks, ends, strict=True) if c.needs_logits]
        every = [i for i, c in enumerate(chunks) if c.all_logits]
        return StepInputs(
            token_ids,
            per_seq,
            block_tables,
            self._to_device(logit_rows),
            torch.tensor(every, dtype=torch.long),
            query_lens,
            context_lens,
        )

    def _to_device(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host
