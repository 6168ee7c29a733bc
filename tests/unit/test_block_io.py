"""BlockIO: whole KV blocks as bytes, written by runs of consecutive block ids."""

import torch

from pdserve.model.runner import BlockIO, consecutive_runs


def test_consecutive_runs_split_at_every_gap() -> None:
    assert list(consecutive_runs([])) == []
    assert list(consecutive_runs([7])) == [(0, 7, 1)]
    assert list(consecutive_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


def test_write_lands_each_block_where_its_id_says_and_nowhere_else() -> None:
    kv_cache = torch.zeros(12, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block, heads, dim]
    io = BlockIO(kv_cache)
    block_ids = [5, 6, 7, 1, 10, 11]
    data = bytes(range(256)) * (len(block_ids) * io.block_bytes // 256)
    io.write(block_ids, memoryview(data))

    read = io.read(block_ids)
    for i, view in enumerate(read):
        assert bytes(view) == data[i * io.block_bytes : (i + 1) * io.block_bytes]
    untouched = sorted(set(range(12)) - set(block_ids))
    assert all(not any(bytes(v)) for v in io.read(untouched))
