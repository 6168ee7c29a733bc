"""Persistent step inputs: block-table rows that live across steps, and a step's index tensors
built from per-sequence values (no Python list per token).

A running sequence owns one row of `BlockTables`' host buffer for as long as its KV
allocation lives: the row is written when the sequence first runs and then only appended to as
its table grows (a new block every `block_size` tokens), instead of copying and padding every
table every step. A step gathers its sequences' rows with one index. On CUDA the buffer is
pinned and the gathered rows go to the device in one asynchronous copy.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Row:
    index: int
    table: Sequence[int]  # the allocation's table object: a new object means a new allocation
    written: int  # entries of `table` already in the row


class BlockTables:
    """Rows of block ids by sequence id. Grows (rows and width) on demand. Not thread-safe."""

    def __init__(self, device: torch.device, rows: int = 64, width: int = 64) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = self._buffer(rows, width)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        """Sequences holding a row."""
        return len(self._rows)

    def seq_ids(self) -> list[str]:
        return list(self._rows)

    def row(self, seq_id: str, table: Sequence[int], num_blocks: int) -> int:
        """The row of `seq_id`, holding at least the first `num_blocks` entries of `table`.

        Tables only grow while their allocation lives (`KVCacheManager`); a different table
        object is a new allocation (after a preemption, say), whose row is written afresh."""
        row = self._rows.get(seq_id)
        if row is None or row.table is not table:
            row = self._claim(seq_id, table)
        if num_blocks > row.written:
            self._write(row, num_blocks)
        return row.index

    def scratch(self, table: Sequence[int], num_blocks: int) -> int:
        """A row for a sequence without an id (one step only: `release_scratch` after it)."""
        row = _Row(self._take(), table, 0)
        self._write(row, num_blocks)
        return row.index

    def release_scratch(self, index: int) -> None:
        self._free.append(index)

    def forget(self, seq_id: str) -> None:
        """Free the row of a sequence whose allocation ended. Unknown ids are ignored."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row.index)

    def gather(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """`[len(rows), width]` block ids on the device, the given rows in order."""
        index = torch.tensor(rows, dtype=torch.long)
        tables = self._host[:, :width].index_select(0, index)
        if self._pin:
            return tables.pin_memory().to(self.device, non_blocking=True)
        return tables.to(self.device)

    def _claim(self, seq_id: str, table: Sequence[int]) -> _Row:
        previous = self._rows.get(seq_id)
        row = _Row(previous.index if previous is not None else self._take(), table, 0)
        self._rows[seq_id] = row
        return row

    def _take(self) -> int:
        if not self._free:
            self._grow(rows=2 * self._host.shape[0], width=self._host.shape[1])
        return self._free.pop()

    def _write(self, row: _Row, num_blocks: int) -> None:
        if len(row.table) < num_blocks:
            raise ValueError(
                f"a block table of {len(row.table)} blocks cannot hold a step that needs "
                f"{num_blocks}"
            )
        if num_blocks > self._host.shape[1]:
            self._grow(self._host.shape[0], width=max(num_blocks, 2 * self._host.shape[1]))
        new = row.table[row.written : num_blocks]
        self._host[row.index, row.written : num_blocks] = torch.as_tensor(new, dtype=torch.long)
        row.written = num_blocks

    def _grow(self, rows: int, width: int) -> None:
        old = self._host
        self._host = self._buffer(rows, width)
        self._host[: old.shape[0], : old.shape[1]] = old
        self._free[:0] = range(rows - 1, old.shape[0] - 1, -1)  # popped last: old rows first

    def _buffer(self, rows: int, width: int) -> torch.Tensor:
        buffer = torch.zeros((rows, width), dtype=torch.long)
        return buffer.pin_memory() if self._pin else buffer


@dataclass(frozen=True, slots=True)
class TokenIndex:
    """Per-token tensors of a step, on the device."""

    positions: torch.Tensor  # [num_tokens]
    slot_blocks: torch.Tensor  # [num_tokens] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block


def token_index(
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_tokens: int,
    block_size: int,
    decode_only: bool,
) -> TokenIndex:
    """Positions and KV slots of every new token from the sequences' first new position
    (`starts`), new-token counts and block tables, with tensor ops only (no host sync:
    `num_tokens` is their sum, known on the host)."""
    seqs = torch.arange(starts.shape[0], device=starts.device)
    if decode_only:
        positions, seq_of_token = starts, seqs
    else:
        seq_of_token = torch.repeat_interleave(seqs, query_lens, output_size=num_tokens)
        first_token = torch.cumsum(query_lens, 0) - query_lens
        offsets = torch.arange(num_tokens, device=starts.device) - first_token[seq_of_token]
        positions = starts[seq_of_token] + offsets
    slot_blocks = block_tables[
        seq_of_token, torch.div(positions, block_size, rounding_mode="floor")
    ]
    return TokenIndex(positions, slot_blocks, positions % block_size)
