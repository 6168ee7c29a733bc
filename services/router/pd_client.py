"""PDClient: drives one request through a prefill instance and a decode instance over gRPC.

Prefill.Prefill (reservation on decode, prefill, KV transfer, first-token handoff), then
Decode.StreamTokens from the first token on. The router builds on it; tests and benchmarks use it
directly.
"""

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError, PdserveError, RequestNotFoundError
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.convert import FINISH_REASON_NAMES, ResourceExhaustedError, generate_request
from pdserve.transfer.base import KVTransferError
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    mixed_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    stop_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    prefill: prefill_pb2.PrefillResult | None  # None on a mixed instance


logger = logging.getLogger(__name__)

_ERRORS: dict[int, type[PdserveError]] = {
    common_pb2.ERROR_CODE_INVALID_REQUEST: InvalidRequestError,
    common_pb2.ERROR_CODE_TRANSFER_FAILED: KVTransferError,
    common_pb2.ERROR_CODE_NOT_FOUND: RequestNotFoundError,
}


def raise_error(error: common_pb2.Error) -> None:
    """Re-raise a stream error reply as the typed exception it came from."""
    if error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED:
        raise ResourceExhaustedError(error.message, error.retry_after_ms)
    raise _ERRORS.get(error.code, PdserveError)(error.message)


class PDClient:
    def __init__(self, channels: ChannelPool | None = None) -> None:
        self.channels = channels or ChannelPool()

    def generate(
        self,
        prefill_address: str,
        decode_address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Iterator[TokenDelta | Finished]:
        """Yield token deltas, then one Finished. Raises the typed error of a failed step."""
        request_id = request_id or uuid.uuid4().hex
        result = self.prefill(prefill_address, decode_address, prompt_token_ids, params, request_id)
        decode = decode_pb2_grpc.DecodeServiceStub(self.channels.get(decode_address))
        stream = decode.StreamTokens(decode_pb2.StreamTokensRequest(request_id=request_id))
        yield from _read_tokens(stream, result)

    def generate_mixed(
        self,
        address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> Iterator[TokenDelta | Finished]:
        """One request on a mixed instance (both phases on one engine)."""
        stub = mixed_pb2_grpc.MixedServiceStub(self.channels.get(address))
        stream = stub.Generate(generate_request(request_id, prompt_token_ids, params))
        yield from _read_tokens(stream, None)

    def prefill(
        self,
        prefill_address: str,
        decode_address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> prefill_pb2.PrefillResult:
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(prefill_address))
        message = prefill_pb2.PrefillRequest(
            request=generate_request(request_id, prompt_token_ids, params),
            decode_address=decode_address,
        )
        try:
            for reply in stub.Prefill(message):
                kind = reply.WhichOneof("reply")
                if kind == "final":
                    return reply.final
                if kind == "error":
                    raise_error(reply.error)
        except grpc.RpcError as e:
            raise KVTransferError(
                f"prefill instance {prefill_address} failed: {e.details()}"
            ) from e
        raise PdserveError(
            f"prefill instance {prefill_address} ended request {request_id} without a result"
        )

    def abort(self, prefill_address: str, decode_address: str | None, request_id: str) -> None:
        """Abort the request on the instances that may hold it (best effort: they may be gone).
        `decode_address` None means `prefill_address` is a mixed instance."""
        message = common_pb2.AbortRequest(request_id=request_id)
        channel = self.channels.get(prefill_address)
        stubs: tuple[Any, ...] = (mixed_pb2_grpc.MixedServiceStub(channel),)
        if decode_address is not None:
            stubs = (
                decode_pb2_grpc.DecodeServiceStub(self.channels.get(decode_address)),
                prefill_pb2_grpc.PrefillServiceStub(channel),
            )
        for stub in stubs:
            try:
                stub.Abort(message, timeout=5)
            except grpc.RpcError as e:
                logger.warning("abort of request %s failed: %s", request_id, e.details())

    def close(self) -> None:
        self.channels.close()


def _read_tokens(
    stream: Any, prefill: prefill_pb2.PrefillResult | None
) -> Iterator[TokenDelta | Finished]:
    """Token replies as events; raises the typed error of an error reply."""
    try:
        for reply in stream:
            kind = reply.WhichOneof("reply")
            if kind == "chunk":
                yield TokenDelta(tuple(reply.chunk.token_ids), reply.chunk.text)
            elif kind == "final":
                final = reply.final
                yield Finished(
                    FINISH_REASON_NAMES.get(final.finish_reason, "unknown"),
                    final.stop_reason,
                    final.num_prompt_tokens,
                    final.num_output_tokens,
                    prefill,
                )
                return
            else:
                raise_error(reply.error)
    except grpc.RpcError as e:
        raise KVTransferError(f"instance stream failed: {e.code().name}: {e.details()}") from e
    finally:
        stream.cancel()
