"""Blocking clients of the instance services: control calls (abort, stats, KV events) and the
prefill instance's calls to decode. A request's own calls (Prefill, Submit, the output
subscriptions) are the asyncio clients of `pdserve.rpc.aio`.

Each call has a deadline (`Deadlines`); streams that last as long as their peer (KV events,
output subscriptions) have none and rely on the channels' keepalive pings to notice a dead
peer. A failed call raises the exception the server raised (`pdserve.rpc.status`), or
InstanceUnavailableError when the peer could not be reached. The clients speak protobuf
messages: converting them to pdserve's dataclasses is the caller's job
(`pdserve.instance.convert`). Thread-safe.
"""

from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.status import error_from_rpc
from pdserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds each kind of call may take before it fails with InstanceUnavailableError."""

    control_s: float = 10.0  # Abort, GetStats, CommitKV, StartDecode, Submit
    reserve_s: float = 30.0  # Reserve (decode reads the storage tier before answering)
    prefill_s: float = 900.0  # Prefill: queueing, compute, reservation backoff and transfer


DEFAULT_DEADLINES = Deadlines()
Metadata = tuple[tuple[str, str], ...]  # a call's own gRPC metadata (the channel adds auth)


class _Client:
    def __init__(
        self, address: str, channels: ChannelPool, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self.address = address
        self._channels = channels
        self.deadlines = deadlines

    @property
    def _channel(self) -> grpc.Channel:
        """Taken from the pool at each call: a client kept across a request's steps never
        calls on a channel the pool forgot (and closed) meanwhile."""
        return self._channels.get(self.address)

    def _call(self, method: Any, message: Any, timeout: float, metadata: Metadata = ()) -> Any:
        try:
            return method(message, timeout=timeout, metadata=metadata or None)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from e


class InstanceClient(_Client):
    """InstanceService of any instance (prefill, decode, mixed)."""

    def abort(self, request_id: str) -> bool:
        stub = common_pb2_grpc.InstanceServiceStub(self._channel)
        reply = self._call(
            stub.Abort, common_pb2.AbortRequest(request_id=request_id), self.deadlines.control_s
        )
        return bool(reply.found)

    def stats(self) -> common_pb2.InstanceStats:
        stub = common_pb2_grpc.InstanceServiceStub(self._channel)
        stats: common_pb2.InstanceStats = self._call(
            stub.GetStats, common_pb2.StatsRequest(), self.deadlines.control_s
        )
        return stats

    def kv_events(self, epoch: int = 0, after_seq: int = 0) -> Any:
        """The instance's KV-event stream: a snapshot (or, resuming after event `after_seq` of
        `epoch`, the events since when the instance still holds them), then live events,
        digests and load reports. Cancel it to stop; iterating raises grpc.RpcError when the
        stream breaks (the caller resubscribes)."""
        stub = common_pb2_grpc.InstanceServiceStub(self._channel)
        return stub.SubscribeKVEvents(common_pb2.KVEventsRequest(epoch=epoch, after_seq=after_seq))


class DecodeClient(_Client):
    """A request's calls carry `metadata` (its trace context)."""

    def reserve(
        self, message: decode_pb2.ReserveRequest, metadata: Metadata = ()
    ) -> decode_pb2.ReserveReply:
        """Raises ResourceExhaustedError (with decode's retry-after) when refused."""
        stub = decode_pb2_grpc.DecodeServiceStub(self._channel)
        reply: decode_pb2.ReserveReply = self._call(
            stub.Reserve, message, self.deadlines.reserve_s, metadata
        )
        return reply

    def commit_kv(self, request_id: str, first_block: int, num_blocks: int) -> None:
        stub = decode_pb2_grpc.DecodeServiceStub(self._channel)
        message = decode_pb2.CommitKVRequest(
            request_id=request_id, first_block=first_block, num_blocks=num_blocks
        )
        self._call(stub.CommitKV, message, self.deadlines.control_s)

    def start_decode(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: common_pb2.TokenLogprob | None = None,
        metadata: Metadata = (),
    ) -> None:
        stub = decode_pb2_grpc.DecodeServiceStub(self._channel)
        message = decode_pb2.StartDecodeRequest(
            request_id=request_id, first_token_id=first_token_id, first_logprob=first_logprob
        )
        self._call(stub.StartDecode, message, self.deadlines.control_s, metadata)
