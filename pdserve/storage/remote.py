"""Host-memory stores over gRPC: the owner serves its blocks (`StorageServicer`), peers read them
(`RemoteMemoryStore`). KV bytes go over the instances' own gRPC servers, never through Ray."""

from collections.abc import Iterable, Iterator

import grpc

from pdserve.errors import BlockStoreError
from pdserve.rpc.channels import ChannelPool
from pdserve.storage.keys import MEMORY_PREFIX, peer_address
from pdserve.storage.stores import BlockStore, HostMemoryStore
from pdserve.v1 import storage_pb2, storage_pb2_grpc

SERVICE_NAME = "pdserve.v1.StorageService"


class StorageServicer(storage_pb2_grpc.StorageServiceServicer):
    """Runs on gRPC handler threads; the HostMemoryStore it serves is thread-safe."""

    def __init__(self, store: HostMemoryStore) -> None:
        self.store = store

    def ReadBlocks(
        self, request: storage_pb2.ReadBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[storage_pb2.StoredBlock]:
        for key in request.keys:
            try:
                yield storage_pb2.StoredBlock(key=key, found=True, data=self.store.get(key))
            except BlockStoreError:
                yield storage_pb2.StoredBlock(key=key, found=False)


class RemoteMemoryStore(BlockStore):
    """Read-only view of another instance's host memory store (`mem:host:port`).

    Thread-safe: it holds only a shared ChannelPool.
    """

    writable = False

    def __init__(self, store_id: str, channels: ChannelPool, timeout_s: float = 10.0) -> None:
        """Raises BlockStoreError when `store_id` is not a well-formed `mem:host:port` (it comes
        from Redis: never dialled unchecked)."""
        self.store_id = store_id
        self._target = peer_address(store_id)
        self._address = store_id.removeprefix(MEMORY_PREFIX)  # for messages
        self._channels = channels
        self._timeout_s = timeout_s

    def get(self, key: str) -> bytes:
        stub = storage_pb2_grpc.StorageServiceStub(self._channels.get(self._target))
        try:
            for block in stub.ReadBlocks(
                storage_pb2.ReadBlocksRequest(keys=[key]), timeout=self._timeout_s
            ):
                if block.found:
                    return bytes(block.data)
        except grpc.RpcError as e:
            raise BlockStoreError(f"peer {self._address} did not serve block {key}: {e}") from e
        raise BlockStoreError(f"peer {self._address} no longer holds block {key}")

    def put(self, key: str, data: memoryview) -> None:
        raise BlockStoreError(f"{self.store_id} is another instance's store: read-only here")

    def delete(self, keys: Iterable[str]) -> None:
        pass  # its owner deletes its bytes

    def keys(self) -> set[str]:
        return set()
