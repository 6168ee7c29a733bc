"""KVStager: whole KV blocks to and from host memory, in order with the forwards.

On CPU the stager uses the cache directly. Its device path (pinned rows, a copy stream, events)
runs here over fake streams whose work runs only when an event is waited for, as a GPU's
would run later: a missing wait leaves stale bytes, which these tests see.
"""

from collections.abc import Callable

import torch

from pdserve.model.staging import KVStager, PinnedRows, SlicedKVStager, consecutive_runs
from pdserve.transfer.direct import address_of

BLOCK = 64  # bytes per block in these tests


class FakeEvent:
    def __init__(self, streams: "FakeStreams", stream: str, index: int) -> None:
        self.streams, self.stream, self.index = streams, stream, index

    def query(self) -> bool:
        return self.streams.ran[self.stream] >= self.index

    def synchronize(self) -> None:
        self.streams.run(self.stream, self.index)


class FakeStreams:
    """A compute and a copy queue; queued work runs when an event after it is waited for."""

    def __init__(self) -> None:
        self.queues: dict[str, list[Callable[[], None]]] = {"compute": [], "copy": []}
        self.ran = {"compute": 0, "copy": 0}

    def run(self, stream: str, until: int) -> None:
        while self.ran[stream] < until:
            work = self.queues[stream][self.ran[stream]]
            self.ran[stream] += 1
            work()

    def run_all(self, stream: str) -> None:
        self.run(stream, len(self.queues[stream]))

    def _record(self, stream: str) -> FakeEvent:
        return FakeEvent(self, stream, len(self.queues[stream]))

    def record_compute(self) -> FakeEvent:
        return self._record("compute")

    def record_copy(self) -> FakeEvent:
        return self._record("copy")

    def on_copy(self, work: Callable[[], None]) -> None:
        self.queues["copy"].append(work)

    def forward(self, work: Callable[[], None]) -> None:  # what a forward pass would queue
        self.queues["compute"].append(work)

    def copy_wait(self, event: FakeEvent) -> None:  # type: ignore[override]
        self.queues["copy"].append(event.synchronize)

    def compute_wait(self, event: FakeEvent) -> None:  # type: ignore[override]
        self.queues["compute"].append(event.synchronize)


def device_stager(blocks: int = 8, staging_blocks: int = 4) -> tuple[KVStager, FakeStreams]:
    streams = FakeStreams()
    kv_cache = torch.zeros(blocks, BLOCK, dtype=torch.uint8)
    return KVStager(kv_cache, streams, staging_blocks * BLOCK), streams  # type: ignore[arg-type]


def fill(value: int) -> bytes:
    return bytes([value]) * BLOCK


def test_consecutive_runs_split_at_every_gap() -> None:
    assert list(consecutive_runs([])) == []
    assert list(consecutive_runs([7])) == [(0, 7, 1)]
    assert list(consecutive_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


def test_on_cpu_writes_land_by_block_id_and_reads_are_views_of_the_cache() -> None:
    kv_cache = torch.zeros(12, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block, heads, dim]
    stager = KVStager(kv_cache)
    block_ids = [5, 6, 7, 1, 10, 11]
    data = bytes(range(256)) * (len(block_ids) * stager.block_bytes // 256)
    stager.write(block_ids, memoryview(data))

    with stager.staged(block_ids) as views:
        for i, view in enumerate(views):
            assert bytes(view) == data[i * stager.block_bytes : (i + 1) * stager.block_bytes]
            expected = kv_cache.data_ptr() + block_ids[i] * stager.block_bytes
            assert address_of(view) == expected  # no copy
    untouched = sorted(set(range(12)) - set(block_ids))
    with stager.staged(untouched) as views:
        assert all(not any(bytes(v)) for v in views)


def test_a_read_waits_for_the_forward_that_wrote_the_blocks() -> None:
    stager, streams = device_stager()
    kv = stager._bytes
    streams.forward(lambda: kv[3].fill_(7))  # the forward computing block 3, not yet run
    stager.forward_done()
    with stager.staged([3, 5]) as views:
        assert [bytes(v) for v in views] == [fill(7), fill(0)]
        assert address_of(views[0]) != kv.data_ptr() + 3 * BLOCK  # a staged copy
    assert stager.rows.num_free == 4  # given back


def test_the_next_forward_waits_for_a_copy_out_of_blocks_it_may_overwrite() -> None:
    stager, streams = device_stager()
    kv = stager._bytes
    kv[2].fill_(1)
    copy = stager.copy_out([2])  # published block 2 goes to storage...
    assert copy is not None
    stager.before_forward()
    streams.forward(lambda: kv[2].fill_(9))  # ...and is evicted and reused by the next forward
    stager.forward_done()
    streams.run_all("compute")  # the device runs the forward
    copy.ready()
    assert bytes(copy.views[0]) == fill(1)
    copy.release()
    copy.release()  # idempotent
    assert stager.rows.num_free == 4


def test_a_copy_out_without_free_staging_rows_is_refused_not_waited_for() -> None:
    stager, _ = device_stager(staging_blocks=2)
    first = stager.copy_out([0, 1])
    assert first is not None
    assert stager.copy_out([2]) is None  # the engine thread never waits
    assert stager.copy_out([0, 1, 2]) is None  # more than the ring holds
    first.release()
    assert stager.copy_out([2]) is not None


def test_the_next_forward_waits_for_a_load_and_its_rows_come_back_after() -> None:
    stager, streams = device_stager()
    kv = stager._bytes
    stager.load([4, 6], [fill(5), fill(6)])
    assert stager.rows.num_free == 2  # held until the copy ran
    stager.before_forward()
    seen: list[bytes] = []
    streams.forward(lambda: seen.extend(bytes(kv[b].numpy().data) for b in (4, 6)))
    streams.run_all("compute")
    assert seen == [fill(5), fill(6)]
    stager.before_forward()
    assert stager.rows.num_free == 4


def test_a_received_write_is_in_the_cache_when_write_returns() -> None:
    stager, _ = device_stager()
    stager.write([1, 2, 7], memoryview(fill(1) + fill(2) + fill(3)))
    assert [bytes(stager._bytes[b].numpy().data) for b in (1, 2, 7)] == [fill(1), fill(2), fill(3)]
    assert stager.rows.num_free == 4


def test_more_blocks_than_the_ring_holds_go_through_a_one_off_buffer() -> None:
    stager, _ = device_stager(staging_blocks=2)
    stager.write([0, 1, 2], memoryview(fill(1) + fill(2) + fill(3)))
    with stager.staged([2, 1, 0]) as views:
        assert [bytes(v) for v in views] == [fill(3), fill(2), fill(1)]
    assert stager.rows.num_free == 2


def test_pinned_rows_are_handed_out_first_fit_and_merged_when_given_back() -> None:
    rows = PinnedRows(8, BLOCK, pin=False)
    assert [rows.take(3, wait=False), rows.take(2, wait=False), rows.take(3, wait=False)] == [
        0,
        3,
        5,
    ]
    assert rows.take(1, wait=False) is None
    rows.give(0, 3)
    rows.give(5, 3)
    assert rows.take(4, wait=False) is None  # 3 + 3 free, not consecutive
    rows.give(3, 2)
    assert rows.take(8, wait=False) == 0
    assert rows.take(9, wait=True) is None  # never fits: not waited for


def test_a_sliced_cache_moves_a_block_as_every_ranks_slice_in_rank_order() -> None:
    """Rank 0's view of a tensor-parallel cache: a written block lands split across the ranks'
    caches (rank 0's bytes first), and every read (sends, copy-outs) joins them back."""
    shape = (6, 2, 2, 4, 1, 8)  # blocks, layers, K/V, block size, this rank's KV heads, dim
    own, other = torch.zeros(shape), torch.zeros(shape)
    stager = SlicedKVStager(own, [other])
    width = own[0].numel() * 4
    assert stager.block_bytes == 2 * width and not stager.direct_writes
    data = torch.randint(0, 256, (2, 2 * width), dtype=torch.uint8)
    stager.write([4, 1], memoryview(data.numpy().tobytes()))
    for tensor, half in ((own, data[:, :width]), (other, data[:, width:])):
        rows = tensor.view(6, -1).view(torch.uint8)
        assert torch.equal(rows[4], half[0]) and torch.equal(rows[1], half[1])
    with stager.staged([1, 4]) as views:
        assert [bytes(v) for v in views] == [data[1].numpy().tobytes(), data[0].numpy().tobytes()]
    copy = stager.copy_out([4])
    assert copy is not None and bytes(copy.views[0]) == data[0].numpy().tobytes()
    stager.load([0], [data[1].numpy().tobytes()])
    with stager.slices[1].staged([0]) as [rank1]:  # a rank's own slice, for direct writes
        assert bytes(rank1) == data[1, width:].numpy().tobytes()
