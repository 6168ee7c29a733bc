"""CudaIpcKVTransport: KV blocks copied GPU -> GPU into a decode instance on the same host over
CUDA IPC, then committed over gRPC (`DecodeService.CommitKV`, as every direct write is).

A decode instance whose KV cache is on a GPU exports it once at start (`export_kv_cache`:
torch's CUDA IPC sharing of the cache's allocation, that is the allocation's handle, the cache's
offset in it and torch's reference counter, encoded by `IpcHandle`, never pickled) and sends it
with its GPU's UUID in every Reserve reply (`KVEndpoints`). A prefill instance maps it once per
decode instance (`open_peer_cache`): into its own GPU's context when the two GPUs reach each other
(same GPU, NVLink or PCIe peer access: no CUDA context on the peer's GPU), else on the peer's GPU
(the driver stages the copy through host memory). A transfer is then one device-to-device copy
per run of blocks consecutive on both sides, on a stream of its own, waited for before the
commit, so that decode only counts bytes that are in its cache.

No wait on the sender's compute stream is needed: the blocks sent belong to a request whose
first token was already read on the host (the sampler's `.tolist()` waits for the forward that
wrote its last KV), and they stay pinned until the send returns.

Reachable when the sender's cache is on CUDA, decode offers a handle, is on this host, its GPU is
one this process sees (matched by UUID, not index: each process numbers the GPUs it sees its own
way; the controller shows GPU actors every GPU of their node, their own first) and the mapping
opens. Otherwise `transport: auto` goes on to shared memory, Mooncake or gRPC, and the reason is
logged once per decode instance. Nothing here touches CUDA unless the sender's cache is on it.
"""

import functools
import logging
import struct
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.errors import KVTransferError
from pdserve.rpc.channels import ChannelPool
from pdserve.transfer.base import (
    KVEndpoints,
    KVSource,
    KVTarget,
    KVTransport,
    TransferResult,
    host_id,
)
from pdserve.transfer.direct import check_bounds, commit, copy_runs

logger = logging.getLogger(__name__)

_MAGIC = b"pdipc1"
_HEADER = struct.Struct("<6sQQQ?")  # magic, storage bytes, its offset, counter offset, event sync
_LENGTH = struct.Struct("<I")  # before each byte string (an expandable segment's is long)


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """What a peer needs to map a CUDA storage of another process (torch's `_share_cuda_`)."""

    memory: bytes  # the allocation's IPC handle (cudaIpcMemHandle_t, or an expandable segment's)
    size: int  # bytes of the shared storage (the KV cache)
    offset: int  # of the storage in the allocation (the caching allocator sub-allocates)
    ref_counter: bytes  # torch's shared-memory reference counter (a /dev/shm name)
    ref_counter_offset: int
    event: bytes  # IPC handle of the event the owner recorded when it shared the storage
    event_sync: bool

    def encode(self) -> bytes:
        header = _HEADER.pack(
            _MAGIC, self.size, self.offset, self.ref_counter_offset, self.event_sync
        )
        fields = (self.memory, self.ref_counter, self.event)
        return header + b"".join(_LENGTH.pack(len(f)) + f for f in fields)

    @classmethod
    def decode(cls, data: bytes) -> "IpcHandle":
        """Raises KVTransferError for bytes `encode` did not make (a peer of another version)."""
        try:
            magic, size, offset, counter_offset, event_sync = _HEADER.unpack_from(data)
            position, fields = _HEADER.size, []
            for _ in range(3):
                (length,) = _LENGTH.unpack_from(data, position)
                position += _LENGTH.size
                fields.append(data[position : position + length])
                position += length
        except struct.error as e:
            raise KVTransferError(f"malformed CUDA IPC handle from decode: {e}") from e
        if magic != _MAGIC or position != len(data):
            raise KVTransferError("malformed CUDA IPC handle from decode (another version?)")
        memory, counter, event = fields
        return cls(memory, size, offset, counter, counter_offset, event, event_sync)


class _DeviceMemory:
    """`nbytes` of device memory at `address`, in the CUDA array interface: torch views memory
    it knows only by address (a `KVSource`'s blocks) without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,  # no stream: nothing to synchronise with on import
        }


def device_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 view of `nbytes` at `address` on `device` (no copy). Raises KVTransferError when
    torch places it elsewhere (the address is not on that device)."""
    view = torch.as_tensor(_DeviceMemory(address, nbytes))
    if view.data_ptr() != address or view.device != device or view.numel() != nbytes:
        raise KVTransferError(f"{nbytes} bytes at {address:#x} are not a view of {device}")
    return view


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> dict[str, int]:
    """UUID -> index of every GPU this process sees (call only when CUDA is in use)."""
    return {gpu_uuid(i): i for i in range(torch.cuda.device_count())}


@dataclass(frozen=True, slots=True)
class CudaIpcExport:
    handle: bytes  # `IpcHandle.encode()`
    gpu_uuid: str
    view: torch.Tensor  # the shared view of the cache, kept alive as long as the instance


def export_kv_cache(cache: torch.Tensor) -> CudaIpcExport | None:
    """Decode, at start: share its KV cache tensor over CUDA IPC (the allocation torch's caching
    allocator made for it: `_share_cuda_` reports the cache's offset inside it). None on CPU,
    or when it cannot be shared (logged: peers on this host then use Mooncake or gRPC)."""
    device = cache.device
    if device.type != "cuda":
        return None
    try:
        view = cache.view(-1).view(torch.uint8)
        torch.cuda.synchronize(device)  # the cache's zero fill is done: peers need not wait
        shared = view.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        _, memory, size, offset, counter, counter_offset, event, event_sync = shared
        if memory is None or counter is None:
            raise KVTransferError("torch shared no handle")
        handle = IpcHandle(
            memory, size, offset, counter, counter_offset, event or b"", bool(event_sync)
        )
        return CudaIpcExport(handle.encode(), gpu_uuid(view.device.index or 0), view)
    except (RuntimeError, TypeError, ValueError, struct.error, KVTransferError) as e:
        logger.warning(
            "the KV cache on %s cannot be shared over CUDA IPC (%s): prefill instances on this "
            "host send with Mooncake or gRPC",
            device,
            e,
        )
        return None


def open_peer_cache(endpoints: KVEndpoints, peer: int, own: torch.device) -> torch.Tensor:
    """Prefill: decode's KV cache (`endpoints.kv_bytes` uint8) mapped into this process, its GPU
    being this process's device `peer`. Mapped in `own`'s context when it can reach `peer` (no
    context on the peer's GPU; the owner's sharing event, which lives on the peer's GPU, is not
    waited for: the owner synchronised before sharing), else in the peer's. Raises
    KVTransferError."""
    handle = IpcHandle.decode(endpoints.cuda_ipc_handle)
    if handle.size < endpoints.kv_bytes:
        raise KVTransferError(
            f"decode shares {handle.size} bytes of KV cache but says it has {endpoints.kv_bytes}"
        )
    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        mine = own.index if own.index is not None else torch.cuda.current_device()
        index = mine if peer == mine or torch.cuda.can_device_access_peer(mine, peer) else peer
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            handle.memory,
            handle.size,
            handle.offset,
            handle.ref_counter,
            handle.ref_counter_offset,
            handle.event,
            handle.event_sync and index == peer,
        )
        cache = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        return cache.set_(storage, 0, (endpoints.kv_bytes,), (1,))
    except RuntimeError as e:
        raise KVTransferError(
            f"cannot map decode's KV cache (GPU {endpoints.gpu_uuid}): {e}"
        ) from e


def unreachable_reason(
    endpoints: KVEndpoints, device: torch.device, visible: Callable[[], Mapping[str, int]]
) -> str:
    """Why a KV cache on `device` cannot be copied into decode's over CUDA IPC ("" if it can,
    as far as the endpoints tell). `visible` (UUID -> index) is called only for a CUDA cache."""
    if device.type != "cuda":
        return "this instance's KV cache is not on a GPU"
    if not endpoints.cuda_ipc_handle:
        return "decode offers no CUDA IPC handle (its KV cache is not on a GPU)"
    if endpoints.host_id != host_id():
        return "decode is on another host"
    if endpoints.gpu_uuid not in visible():
        return (
            f"decode's GPU {endpoints.gpu_uuid} is not visible to this process "
            "(CUDA_VISIBLE_DEVICES)"
        )
    return ""


PeerOpener = Callable[[KVEndpoints, int], torch.Tensor]


class CudaIpcKVTransport(KVTransport):
    """Thread-safe (the KVTransport contract): a lock guards the mappings and streams; request
    threads copy concurrently on the same streams, each waiting for its own event."""

    name = "cuda_ipc"

    def __init__(
        self,
        channels: ChannelPool,
        device: torch.device,
        gpus: Callable[[], Mapping[str, int]] = visible_gpus,
        opener: PeerOpener | None = None,
        stall_timeout_s: float = 10.0,
    ) -> None:
        """`device`: where this instance's KV cache (the source of every send) lives; `gpus` and
        `opener` are the CUDA queries (UUIDs seen here, mapping a peer's cache);
        `stall_timeout_s`: how long a commit may go unanswered."""
        self._channels = channels
        self._stall_timeout_s = stall_timeout_s
        self._device = device
        self._gpus = functools.cache(gpus)  # the visible set is fixed once CUDA started
        self._open = opener or functools.partial(open_peer_cache, own=device)
        self._peers: dict[str, tuple[bytes, torch.Tensor]] = {}  # address -> (handle, cache)
        self._refused: dict[str, tuple[bytes, str]] = {}  # address -> (handle, why)
        self._logged: set[tuple[str, str]] = set()
        self._streams: dict[int, torch.cuda.Stream] = {}  # device index -> copy stream
        self._lock = threading.Lock()

    def can_reach(self, target: KVTarget) -> bool:
        """Whether the pair can use CUDA IPC (mapping decode's cache on first use). Why a GPU
        pair on this host cannot is logged once per decode instance and reason; a CPU cache on
        either side, or another host, is no news."""
        endpoints = target.endpoints
        reason = unreachable_reason(endpoints, self._device, self._gpus)
        if not reason:
            try:
                self._peer(target)
            except KVTransferError as e:
                reason = str(e)
        notable = self._device.type == "cuda" and bool(endpoints.cuda_ipc_handle)
        if reason and notable and endpoints.host_id == host_id():
            with self._lock:
                if (target.address, reason) not in self._logged:
                    self._logged.add((target.address, reason))
                    logger.info("no CUDA IPC to %s: %s", target.address, reason)
        return not reason

    def _peer(self, target: KVTarget) -> torch.Tensor:
        """Decode's mapped KV cache: opened once per handle (a restarted decode instance offers
        a new one, which replaces the old mapping). Raises KVTransferError, and again for that
        handle without retrying."""
        endpoints, address = target.endpoints, target.address
        handle = endpoints.cuda_ipc_handle
        with self._lock:
            mapped = self._peers.get(address)
            if mapped is not None and mapped[0] == handle:
                return mapped[1]
            refused = self._refused.get(address)
            if refused is not None and refused[0] == handle:
                raise KVTransferError(refused[1])
            self._peers.pop(address, None)  # unmapped once the tensor goes
            index = self._gpus().get(endpoints.gpu_uuid)
            try:
                if index is None:
                    raise KVTransferError(f"decode's GPU {endpoints.gpu_uuid} is not visible")
                cache = self._open(endpoints, index)
            except KVTransferError as e:
                self._refused[address] = (handle, str(e))
                raise
            self._refused.pop(address, None)
            self._peers[address] = (handle, cache)
            return cache

    def send_blocks(
        self, target: KVTarget, source: KVSource, block_ids: Sequence[int]
    ) -> TransferResult:
        """Straight from the sender's KV cache on its GPU (no staging), then commit."""
        start = time.perf_counter()
        written = self.write_blocks(target, source, block_ids)
        commit(self._channels, target, written.num_blocks, self._stall_timeout_s)
        return TransferResult(written.num_blocks, written.num_bytes, time.perf_counter() - start)

    def write_blocks(
        self, target: KVTarget, source: KVSource, block_ids: Sequence[int]
    ) -> TransferResult:
        """Copy blocks `block_ids` of `source` (block b at `base_address + b x block_bytes`)
        into the reserved blocks and wait until they are there; no commit. Raises
        KVTransferError."""
        start = time.perf_counter()
        size = source.block_bytes
        check_bounds(target, len(block_ids), [size] * len(block_ids))
        if source.device != self._device:
            raise KVTransferError(f"the KV cache is on {source.device}, not {self._device}")
        target.check_deadline()
        cache = self._peer(target)
        addresses = [source.base_address + b * size for b in block_ids]
        if addresses:
            low = min(addresses)
            try:
                span = device_bytes(low, max(addresses) + size - low, self._device)
            except RuntimeError as e:
                raise KVTransferError(f"the KV cache at {low:#x} is not CUDA memory: {e}") from e
            self._copy(
                target,
                [
                    (cache[block_id * size : (block_id + count) * size], span, address - low)
                    for block_id, count, address in copy_runs(target.block_ids, addresses, size)
                ],
            )
        num_bytes = len(block_ids) * size
        return TransferResult(len(block_ids), num_bytes, time.perf_counter() - start)

    def send(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        """From host memory (one view per block) into decode's GPU, then commit."""
        start = time.perf_counter()
        written = self.write_views(target, blocks)
        commit(self._channels, target, written.num_blocks, self._stall_timeout_s)
        return TransferResult(written.num_blocks, written.num_bytes, time.perf_counter() - start)

    def write_views(self, target: KVTarget, blocks: Sequence[memoryview]) -> TransferResult:
        """Copy host views (one per block) into the reserved blocks and wait until they are
        there; no commit. Raises KVTransferError."""
        start = time.perf_counter()
        size = target.block_bytes
        check_bounds(target, len(blocks), [len(b) for b in blocks])
        target.check_deadline()
        cache = self._peer(target)
        with warnings.catch_warnings():  # read-only views are only read
            warnings.simplefilter("ignore", UserWarning)
            copies = [
                (cache[block_id * size : (block_id + 1) * size], _host_bytes(view), 0)
                for block_id, view in zip(target.block_ids, blocks, strict=True)
            ]
        self._copy(target, copies)
        return TransferResult(len(blocks), len(blocks) * size, time.perf_counter() - start)

    def _copy(
        self, target: KVTarget, copies: Sequence[tuple[torch.Tensor, torch.Tensor, int]]
    ) -> None:
        """Each (destination, source, offset in source), then wait for this call's copies only
        (an event). The transport's streams are current on both GPUs: torch copies device to
        device on the source's stream and makes the destination's wait for it, and host to
        device on the destination's, so the event (on the destination's) follows every copy.
        Raises KVTransferError."""
        try:
            mapped = copies[0][0].device if copies else self._device
            own, theirs = self._stream_on(self._device), self._stream_on(mapped)
            with torch.cuda.stream(own), torch.cuda.stream(theirs):
                for destination, source, offset in copies:
                    part = source[offset : offset + destination.numel()]
                    destination.copy_(part, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(theirs)
            done.synchronize()
        except RuntimeError as e:
            why = f"CUDA IPC copy of request {target.request_id} to {target.address} failed: {e}"
            with self._lock:  # later requests to that instance fall through to another transport
                self._peers.pop(target.address, None)
                self._refused[target.address] = (target.endpoints.cuda_ipc_handle, why)
            raise KVTransferError(why) from e

    def _stream_on(self, device: torch.device) -> torch.cuda.Stream:
        """The transport's copy stream on `device` (one per GPU, made on first use)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
                self._streams[index] = stream
            return stream

    def close(self) -> None:
        """Unmap every peer's cache (torch closes a handle when its last view goes)."""
        with self._lock:
            self._peers.clear()
            self._refused.clear()


def _host_bytes(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)
