"""Persistent block-table rows and the tensor-built token index of a step."""

import random

import torch

from pdserve.model.batch import BlockTables, token_index

CPU = torch.device("cpu")


def test_a_row_is_written_once_and_then_only_appended_to() -> None:
    tables = BlockTables(CPU, rows=2, width=4)
    table = [5, 6]
    row = tables.row("a", table, 2)
    table.append(9)  # the allocation grew by one block
    tables._host[row, 0] = -1  # a rewrite of the whole row would restore this entry
    assert tables.row("a", table, 3) == row
    assert tables.gather([row], 3).tolist() == [[-1, 6, 9]]  # only the new entry was written


def test_a_new_allocation_of_the_same_sequence_is_written_afresh() -> None:
    tables = BlockTables(CPU)
    row = tables.row("a", [1, 2, 3], 3)
    again = tables.row("a", [7, 8], 2)  # freed and allocated again (preempted, re-admitted)
    assert again == row
    assert tables.gather([row], 2).tolist() == [[7, 8]]


def test_forgotten_rows_are_reused_and_the_buffer_grows_past_its_size() -> None:
    tables = BlockTables(CPU, rows=2, width=2)
    expected = {f"s{i}": [random.Random(i).randrange(100) for _ in range(i + 1)] for i in range(9)}
    rows = {sid: tables.row(sid, table, len(table)) for sid, table in expected.items()}
    assert len(set(rows.values())) == 9 and len(tables) == 9  # grew to 16 rows, width 9
    for sid, table in expected.items():
        assert tables.gather([rows[sid]], len(table)).tolist() == [table]
    tables.forget("s3")
    tables.forget("unknown")
    assert tables.row("new", [4], 1) == rows["s3"]
    scratch = tables.scratch([1, 2], 2)
    assert scratch not in rows.values()
    tables.release_scratch(scratch)
    assert tables.scratch([3], 1) == scratch


def test_the_token_index_matches_positions_and_slots_computed_per_token() -> None:
    rng = random.Random(0)
    size = 4
    starts = [rng.randrange(0, 20) for _ in range(6)]
    counts = [rng.randrange(1, 9) for _ in range(6)]
    tables = [
        [rng.randrange(50) for _ in range(-(-(s + n) // size))]
        for s, n in zip(starts, counts, strict=True)
    ]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    index = token_index(
        torch.tensor(starts), torch.tensor(counts), padded, sum(counts), size, decode_only=False
    )
    positions = [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)]
    blocks = [
        t[p // size]
        for s, n, t in zip(starts, counts, tables, strict=True)
        for p in range(s, s + n)
    ]
    assert index.positions.tolist() == positions
    assert index.slot_blocks.tolist() == blocks
    assert index.slot_offsets.tolist() == [p % size for p in positions]
    decode = token_index(
        torch.tensor(starts), torch.ones(6, dtype=torch.long), padded, 6, size, True
    )
    assert decode.positions.tolist() == starts
    assert decode.slot_blocks.tolist() == [
        t[s // size] for s, t in zip(starts, tables, strict=True)
    ]
