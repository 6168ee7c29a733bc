"""CUDA IPC between instances on one host, on CPU: which transport `auto` picks (CUDA IPC only
for a decode instance on this host that offers a handle of a GPU this process sees, when this
instance's own KV cache is on a GPU; else shared memory, Mooncake, gRPC), what a forced
`cuda_ipc` does when it cannot reach, the handle's encoding and its trip through the Reserve
reply, and the CUDA_VISIBLE_DEVICES a GPU actor gives itself. The GPU copy itself runs in the GPU
check (benchmarks/_cuda_ipc_check.py); here the CUDA queries (visible GPUs, mapping a peer's
cache) are stand-ins handed to the real transport."""

import logging
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from credentials import channels

from pdserve.config import TransferConfig
from pdserve.errors import ConfigError, KVTransferError
from pdserve.instance.convert import endpoints_from_proto, endpoints_to_proto
from pdserve.transfer.base import KVEndpoints, KVTarget, host_id
from pdserve.transfer.cuda_ipc import (
    CudaIpcKVTransport,
    IpcHandle,
    export_kv_cache,
    unreachable_reason,
)
from pdserve.transfer.select import TransportSelector
from pdserve.v1 import decode_pb2
from services.controller import actors
from services.controller.actors import (
    NOSET_CUDA_VISIBLE_DEVICES,
    actor_runtime_env,
    claim_gpus,
    visible_devices,
)

DECODE_GPU = "3f1a9c2e-0000-4000-8000-00000000d0d0"
OTHER_GPU = "3f1a9c2e-0000-4000-8000-0000000000aa"
HANDLE = IpcHandle(b"\x01" * 64, 1 << 20, 4096, b"/torch_1_2", 8, b"\x02" * 64, True).encode()


class Opener:
    """Stands in for mapping a peer's cache (a CUDA driver call): records what it was asked."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[bytes, int]] = []
        self.fail = fail

    def __call__(self, endpoints: KVEndpoints, index: int) -> torch.Tensor:
        self.calls.append((endpoints.cuda_ipc_handle, index))
        if self.fail:
            raise KVTransferError(self.fail)
        return torch.zeros(endpoints.kv_bytes, dtype=torch.uint8)


def endpoints(**changes: Any) -> KVEndpoints:
    """A GPU decode instance on this host (a GPU cache is never in shared memory)."""
    fields: dict[str, Any] = {
        "host_id": host_id(),
        "kv_bytes": 1 << 20,
        "cuda_ipc_handle": HANDLE,
        "gpu_uuid": DECODE_GPU,
        **changes,
    }
    return KVEndpoints(**fields)


def target(ends: KVEndpoints, address: str = "decode:1") -> KVTarget:
    return KVTarget(address, "r", 0, (0, 1), 4096, ends)


def selector(
    transport: str = "auto",
    device: str = "cuda:0",
    gpus: Mapping[str, int] | None = None,
    opener: Opener | None = None,
    mooncake: bool = False,
) -> tuple[TransportSelector, list[int]]:
    """A selector whose CUDA IPC transport sends from a cache on `device` and sees `gpus`
    (UUID -> index); also returns how often the visible GPUs were asked for."""
    asked: list[int] = []

    def visible() -> Mapping[str, int]:
        asked.append(1)
        return {DECODE_GPU: 1} if gpus is None else gpus

    pool = channels()
    cuda_ipc = CudaIpcKVTransport(pool, torch.device(device), visible, opener or Opener())
    engine: Any = SimpleNamespace(engines=[None]) if mooncake else None  # only counted
    chosen = TransportSelector(TransferConfig(transport=transport), pool, 2**20, engine, cuda_ipc)
    return chosen, asked


def test_auto_copies_gpu_to_gpu_when_decode_is_here_and_its_gpu_visible() -> None:
    opener = Opener()
    chooser, _ = selector(opener=opener, mooncake=True)
    ends = endpoints(mooncake_session="decode:9", shm_name="kv")  # every way offered: IPC first
    assert chooser.choose(target(ends)).name == "cuda_ipc"
    assert chooser.choose(target(ends)).name == "cuda_ipc"
    assert opener.calls == [(HANDLE, 1)]  # mapped once, on this process's index of its GPU


@pytest.mark.parametrize(
    ("device", "ends", "gpus", "expected"),
    [
        ("cpu", endpoints(shm_name="kv"), None, "shm"),  # sender's cache on the host
        ("cuda:0", endpoints(host_id="elsewhere/1", mooncake_session="d:9"), None, "mooncake"),
        ("cuda:0", endpoints(mooncake_session="d:9"), {OTHER_GPU: 0}, "mooncake"),
        ("cuda:0", endpoints(cuda_ipc_handle=b"", shm_name="kv"), None, "shm"),
        ("cuda:0", endpoints(cuda_ipc_handle=b"", mooncake_session="d:9"), None, "mooncake"),
        ("cuda:0", endpoints(host_id="elsewhere/1"), None, "grpc"),
        ("cuda:0", endpoints(), {}, "grpc"),
    ],
    ids=[
        "sender-on-cpu",
        "other-host",
        "gpu-not-visible",
        "cpu-decode-on-this-host",
        "no-handle",
        "nothing-direct",
        "no-gpus-visible",
    ],
)
def test_auto_falls_through_to_shm_mooncake_then_grpc(
    device: str, ends: KVEndpoints, gpus: Mapping[str, int] | None, expected: str
) -> None:
    opener = Opener()
    chooser, _ = selector(device=device, gpus=gpus, opener=opener, mooncake=True)
    assert chooser.choose(target(ends)).name == expected
    assert opener.calls == []


def test_auto_without_mooncake_goes_from_cuda_ipc_to_grpc() -> None:
    chooser, _ = selector(gpus={OTHER_GPU: 0})
    assert chooser.choose(target(endpoints())).name == "grpc"


def test_a_cpu_sender_never_asks_cuda_which_gpus_it_sees_nor_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chooser, asked = selector(device="cpu")
    with caplog.at_level(logging.DEBUG, logger="pdserve.transfer.cuda_ipc"):
        assert chooser.choose(target(endpoints())).name == "grpc"
    assert asked == []
    assert caplog.records == []


def test_a_gpu_on_this_host_that_is_not_visible_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chooser, _ = selector(gpus={OTHER_GPU: 0})
    with caplog.at_level(logging.INFO, logger="pdserve.transfer.cuda_ipc"):
        for _ in range(2):
            chooser.choose(target(endpoints()))
        chooser.choose(target(endpoints(host_id="elsewhere/1")))  # another host: no news
    assert [r.getMessage() for r in caplog.records] == [
        f"no CUDA IPC to decode:1: decode's GPU {DECODE_GPU} is not visible to this process "
        "(CUDA_VISIBLE_DEVICES)"
    ]


def test_a_mapping_that_fails_falls_through_once_logged_and_is_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opener = Opener(fail="cannot map decode's KV cache: invalid context")
    chooser, _ = selector(opener=opener, mooncake=True)
    ends = endpoints(mooncake_session="decode:9")
    with caplog.at_level(logging.INFO, logger="pdserve.transfer.cuda_ipc"):
        for _ in range(3):
            assert chooser.choose(target(ends)).name == "mooncake"
    assert len(opener.calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "no CUDA IPC to decode:1: cannot map decode's KV cache: invalid context"
    ]
    restarted = endpoints(mooncake_session="decode:9", cuda_ipc_handle=HANDLE + b"x")
    chooser.choose(target(restarted))  # a new handle (decode restarted) is tried again
    assert len(opener.calls) == 2


def test_a_restarted_decode_instance_is_mapped_again() -> None:
    opener = Opener()
    chooser, _ = selector(opener=opener)
    chooser.choose(target(endpoints()))
    new_handle = IpcHandle(b"\x05" * 64, 1 << 20, 0, b"/torch_9_9", 0, b"", False).encode()
    assert chooser.choose(target(endpoints(cuda_ipc_handle=new_handle))).name == "cuda_ipc"
    assert [handle for handle, _ in opener.calls] == [HANDLE, new_handle]


def test_forced_cuda_ipc_that_cannot_reach_is_a_transfer_error() -> None:
    chooser, _ = selector(transport="cuda_ipc", gpus={OTHER_GPU: 0})
    with pytest.raises(KVTransferError, match="cuda_ipc, which cannot reach decode decode:1"):
        chooser.choose(target(endpoints()))
    forced, _ = selector(transport="cuda_ipc")
    assert forced.choose(target(endpoints())).name == "cuda_ipc"


def test_forced_cuda_ipc_without_the_transport_is_a_transfer_error() -> None:
    pool = channels()
    chooser = TransportSelector(TransferConfig(transport="cuda_ipc"), pool, 2**20)
    with pytest.raises(KVTransferError, match="cannot reach"):
        chooser.choose(target(endpoints()))


def test_cuda_ipc_is_a_transport_the_config_accepts() -> None:
    assert TransferConfig(transport="cuda_ipc").transport == "cuda_ipc"
    with pytest.raises(ConfigError):
        TransferConfig(transport="nvlink")


def test_the_reasons_name_what_is_missing() -> None:
    cuda = torch.device("cuda", 0)

    def visible() -> Mapping[str, int]:
        return {DECODE_GPU: 0}

    assert unreachable_reason(endpoints(), cuda, visible) == ""
    assert "not on a GPU" in unreachable_reason(endpoints(), torch.device("cpu"), visible)
    assert "no CUDA IPC handle" in unreachable_reason(endpoints(cuda_ipc_handle=b""), cuda, visible)
    assert "another host" in unreachable_reason(endpoints(host_id="x/y"), cuda, visible)
    assert "CUDA_VISIBLE_DEVICES" in unreachable_reason(
        endpoints(gpu_uuid=OTHER_GPU), cuda, visible
    )


def test_a_send_into_an_expiring_lease_maps_and_copies_nothing() -> None:
    opener = Opener()
    transport = CudaIpcKVTransport(
        channels(), torch.device("cuda", 0), lambda: {DECODE_GPU: 1}, opener
    )
    source: Any = SimpleNamespace(
        block_bytes=4096, base_address=1 << 40, device=torch.device("cuda", 0)
    )
    expired = KVTarget("decode:1", "r", 0, (0, 1), 4096, endpoints(), deadline=0.0)
    with pytest.raises(KVTransferError, match="about to expire"):
        transport.send_blocks(expired, source, [5, 6])
    live = KVTarget("decode:1", "r", 0, (0, 1), 4096, endpoints())
    with pytest.raises(KVTransferError, match="3 blocks to send, 2 reserved"):
        transport.send_blocks(live, source, [5, 6, 7])
    outside = KVTarget("decode:1", "r", 0, (0, 256), 4096, endpoints())
    with pytest.raises(KVTransferError, match="outside decode's cache"):
        transport.send_blocks(outside, source, [5, 6])
    assert opener.calls == []


def test_the_handle_survives_its_encoding_and_refuses_other_bytes() -> None:
    handle = IpcHandle(b"\x07" * 64, 123456789, 512, b"/torch_42_7_0", 24, b"\x09" * 64, True)
    assert IpcHandle.decode(handle.encode()) == handle
    for broken in (handle.encode()[:-1], handle.encode() + b"\x00", b"", b"x" * 40):
        with pytest.raises(KVTransferError, match="malformed CUDA IPC handle"):
            IpcHandle.decode(broken)
    other_version = b"pdipc9" + handle.encode()[6:]
    with pytest.raises(KVTransferError, match="another version"):
        IpcHandle.decode(other_version)


def test_endpoints_carry_the_handle_and_gpu_through_the_reserve_reply() -> None:
    ends = endpoints(shm_name="", mooncake_session="decode:9", mooncake_base=1 << 33)
    wire = endpoints_to_proto(ends).SerializeToString()
    assert endpoints_from_proto(decode_pb2.KVEndpoints.FromString(wire)) == ends
    assert endpoints_from_proto(decode_pb2.KVEndpoints()) == KVEndpoints()


def test_a_cpu_kv_cache_offers_no_handle() -> None:
    cache = torch.zeros(4096, dtype=torch.uint8)
    assert export_kv_cache(cache) is None


# -- the CUDA_VISIBLE_DEVICES of a GPU actor ---------------------------------------------------


def ids(*gpus: int | str) -> Callable[[], list[int | str]]:
    return lambda: list(gpus)


def never() -> int:
    raise AssertionError("the node's GPU count is not needed when CUDA_VISIBLE_DEVICES is set")


@pytest.mark.parametrize(
    ("assigned", "inherited", "node_gpus", "expected"),
    [
        (ids(2), None, 4, "2,0,1,3"),  # Ray's ids 0..n-1: its own GPU first
        (ids(0), None, 1, "0"),
        (ids("3"), "1,3,5", None, "3,1,5"),  # raylet started with CUDA_VISIBLE_DEVICES=1,3,5
        (ids("GPU-b"), "GPU-a,GPU-b", None, "GPU-b,GPU-a"),  # UUIDs stay UUIDs
        (ids("2"), "2", None, "2"),  # Ray narrowed it anyway (NOSET ignored): isolation kept
        (ids(), None, 4, None),  # no GPU assigned: nothing to set
    ],
)
def test_a_gpu_actor_sees_its_own_gpu_first_then_the_nodes_others(
    assigned: Callable[[], list[int | str]],
    inherited: str | None,
    node_gpus: int | None,
    expected: str | None,
) -> None:
    count: Callable[[], int] = never if node_gpus is None else (lambda: node_gpus)
    assert visible_devices(assigned, inherited, count) == expected


def test_claim_gpus_sets_the_variable_only_when_the_controller_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [1])
    monkeypatch.setattr(actors, "_node_gpu_count", never)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.delenv(NOSET_CUDA_VISIBLE_DEVICES, raising=False)
    claim_gpus()
    assert actors.os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"  # a CPU actor, a test
    monkeypatch.setenv(NOSET_CUDA_VISIBLE_DEVICES, "1")
    claim_gpus()
    assert actors.os.environ["CUDA_VISIBLE_DEVICES"] == "1,0,2"


def test_only_gpu_actors_keep_ray_from_narrowing_their_devices() -> None:
    assert actor_runtime_env(0) is None
    for gpus in (1, 0.5):
        assert actor_runtime_env(gpus) == {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
