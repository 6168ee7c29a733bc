"""CUDA graphs of the decode forward (`engine.cuda_graphs`): the model's forward over one new
token per sequence is captured once for each of a set of batch sizes, and a decode batch replays
the graph of the next size up, its extra rows padding. A replay launches the whole forward (every
layer's kernels) in one call, which is what a decode step of small batches spends its time on
without graphs (kernel launches from Python).

A graph reads and writes fixed addresses, so its inputs live in static buffers that each step
copies into: token ids, positions, KV slots, block tables (`max_blocks` wide: the longest
context) and context lengths. The attention plan is made once per size before capture, for the
longest context (the kernels read each row's real length from the context-lengths buffer).
Padding rows write their K/V into one scratch slot of a block that no request is given (the
runner's last) and attend that one token; their outputs are dropped.

Capture itself is a `Capture` function: `cuda_capture` records CUDA graphs; `eager_capture`
runs the same forward on the same static buffers at every replay, so that the padding and
buffer logic is tested on CPU against the unpadded forward.
"""

import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch

from pdserve.model.attention import AttentionMetadata, AttentionStep
from pdserve.model.llama import CausalLM

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]
Replay = Callable[[], None]
Capture = Callable[[Forward], tuple[Replay, torch.Tensor]]
"""Records `forward` (which reads and writes static buffers) and returns a function that runs it
again and the tensor its output is in after each run."""


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to `max_num_seqs`."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def eager_capture(forward: Forward) -> tuple[Replay, torch.Tensor]:
    """No graph: each replay runs `forward` again and copies its output into the first one's."""
    output = forward()

    def replay() -> None:
        output.copy_(forward())

    return replay, output


def cuda_capture(pool: torch.cuda._POOL_HANDLE) -> Capture:
    """Records CUDA graphs that share the memory pool `pool` (`torch.cuda.graph_pool_handle()`):
    two warm-up runs on a side stream (kernel compilation, lazy buffers), then the capture."""

    def capture(forward: Forward) -> tuple[Replay, torch.Tensor]:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
        return graph.replay, output

    return capture


class DecodeGraphs:
    """Captured decode forwards by batch size, over static input buffers. Not thread-safe."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        sizes: Sequence[int],
        max_blocks: int,
        pad_block: int,
        capture: Capture,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive batch sizes, got {list(sizes)}")
        self.model, self.kv_cache = model, kv_cache
        self.sizes = tuple(sorted(set(sizes)))
        self.max_blocks, self.pad_block = max_blocks, pad_block
        biggest, device = self.sizes[-1], kv_cache.device
        self._ids = torch.zeros(biggest, dtype=torch.long, device=device)
        self._positions = torch.zeros(biggest, dtype=torch.long, device=device)
        self._slot_blocks = torch.full((biggest,), pad_block, dtype=torch.long, device=device)
        self._slot_offsets = torch.zeros(biggest, dtype=torch.long, device=device)
        self._tables = torch.full((biggest, max_blocks), pad_block, dtype=torch.long, device=device)
        self._context = torch.ones(biggest, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        for size in reversed(self.sizes):  # the largest first: smaller ones reuse its memory
            step = model.attention.plan(self._metadata(size))
            self._graphs[size] = capture(partial(self._forward, size, step))

    def size_for(self, batch: int) -> int | None:
        """The captured size a decode batch of `batch` sequences runs at (None: too large)."""
        return next((size for size in self.sizes if size >= batch), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Final hidden states `[batch, hidden]` of a decode batch by replaying its size's
        graph; None (nothing run) when the batch is not decode-only, is larger than every
        captured size or attends more blocks than the buffers hold."""
        batch = input_ids.shape[0]
        size = self.size_for(batch)
        width = meta.block_tables.shape[1]
        if size is None or not meta.decode_only or width > self.max_blocks:
            return None
        self._ids[:batch].copy_(input_ids)
        self._positions[:batch].copy_(positions)
        self._slot_blocks[:batch].copy_(meta.slot_blocks)
        self._slot_offsets[:batch].copy_(meta.slot_offsets)
        self._tables[:batch, :width].copy_(meta.block_tables)
        self._context[:batch].copy_(meta.context_lens_tensor)
        self._pad(batch, size)
        replay, hidden = self._graphs[size]
        replay()
        return hidden[:batch]

    def _pad(self, batch: int, size: int) -> None:
        """Rows `batch..size` attend one token in the scratch slot (previous steps' values
        would otherwise point anywhere)."""
        if batch == size:
            return
        self._ids[batch:size].zero_()
        self._positions[batch:size].zero_()
        self._slot_blocks[batch:size].fill_(self.pad_block)
        self._slot_offsets[batch:size].zero_()
        self._tables[batch:size, 0].fill_(self.pad_block)
        self._context[batch:size].fill_(1)

    def _metadata(self, size: int) -> AttentionMetadata:
        longest = self.max_blocks * self.kv_cache.shape[3]  # the plan covers every context
        return AttentionMetadata(
            slot_blocks=self._slot_blocks[:size],
            slot_offsets=self._slot_offsets[:size],
            query_lens=[1] * size,
            context_lens=[longest] * size,
            block_tables=self._tables[:size],
            context_lens_tensor=self._context[:size],
            decode_only=True,
        )

    def _forward(self, size: int, step: AttentionStep) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self._ids[:size], self._positions[:size], self.kv_cache, step=step
        )
        return hidden
