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


def test_every_storage_failure_is_exported_once_by_kind() -> None:
    storage = common_pb2.StorageStats(
        available=True, read_errors=3, invalid_entries=2, write_errors=4, redis_errors=5,
        writes_dropped=6,
    )  # fmt: skip
    exported = samples(common_pb2.InstanceStats(role="mixed", storage=storage))
    errors = {kind: v for (name, kind), v in exported.items() if name.endswith("_errors_total")}
    assert errors == {"read": 3, "invalid_entry": 2, "write": 4, "redis": 5, "dropped": 6}
    assert exported["pdserve_storage_available", ""] == 1


def test_no_two_families_export_the_same_name() -> None:
    stats = common_pb2.InstanceStats(role="decode", storage=common_pb2.StorageStats())
    names = [family.name for family in InstanceCollector(lambda: stats).collect()]
    assert len(names) == len(set(names))
