"""The storage tier's Prometheus families, from an InstanceStats snapshot (no server)."""

from pdserve.metrics import InstanceCollector
from pdserve.v1 import common_pb2


def samples(stats: common_pb2.InstanceStats) -> dict[tuple[str, str], float]:
    """(sample name, kind label) -> value, for the storage tier's families."""
    out = {}
    for family in InstanceCollector(lambda: stats).collect():
        for sample in family.samples:
            if sample.name.startswith("pdserve_storage_"):
                out[sample.name, sample.labels.get("kind", "")] = sample.value
    return out


def test_invalid_entries_are_exported_next_to_corrupt_reads_and_the_old_series_stays() -> None:
    storage = common_pb2.StorageStats(available=True, read_errors=3, invalid_entries=2)
    exported = samples(common_pb2.InstanceStats(role="mixed", storage=storage))
    assert exported["pdserve_storage_read_errors_total", "corrupt"] == 3
    assert exported["pdserve_storage_read_errors_total", "invalid_entry"] == 2
    assert exported["pdserve_storage_errors_total", "read"] == 3  # unchanged
    assert exported["pdserve_storage_available", ""] == 1
