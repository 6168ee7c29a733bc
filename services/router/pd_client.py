"""PDClient: drives one request through a prefill instance and a decode instance over gRPC.

Prefill.Prefill (reservation on decode, prefill, KV transfer, first-token handoff), then
Decode.StreamTokens, which replays every output from the first token on. The router
builds on it; tests and benchmarks use it directly. Every call goes through the per-service
clients of `pdserve.rpc.clients`: deadlines on every RPC, errors raised as the class the
instance raised.
"""

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.engine.request import SamplingParams, TokenLogprob
from pdserve.errors import DecodeUnavailableError, InstanceUnavailableError, PdserveError
from pdserve.instance.convert import FINISH_REASON_NAMES, generate_request, logprob_from_proto
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import (
    DEFAULT_DEADLINES,
    Deadlines,
    DecodeClient,
    InstanceClient,
    MixedClient,
    PrefillClient,
    TokenStream,
)
from pdserve.v1 import common_pb2, prefill_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., on the first delta


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    stop_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    prefill: prefill_pb2.PrefillResult | None  # None on a mixed instance


class PDClient:
    """Thread-safe: one channel per peer, shared."""

    def __init__(
        self, channels: ChannelPool | None = None, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self.channels = channels or ChannelPool()
        self.deadlines = deadlines

    def instance(self, address: str) -> InstanceClient:
        """InstanceService of any instance (abort, stats, KV events)."""
        return InstanceClient(address, self.channels, self.deadlines)

    def generate(
        self,
        prefill_address: str,
        decode_address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Iterator[TokenDelta | Finished]:
        """Yield token deltas, then one Finished. Raises the typed error of a failed step. When
        the prefill fails (its instance may have died holding a reservation on decode), the
        request is aborted on decode at once rather than left to the reservation's lease."""
        request_id = request_id or uuid.uuid4().hex
        try:
            result = self.prefill(
                prefill_address, decode_address, prompt_token_ids, params, request_id
            )
        except PdserveError:
            self._abort_quietly(decode_address, request_id)
            raise
        decode = DecodeClient(decode_address, self.channels, self.deadlines)
        try:
            yield from _read_tokens(decode.stream_tokens(request_id), result)
        except DecodeUnavailableError:
            raise
        except InstanceUnavailableError as e:  # the token stream broke: decode's side
            raise DecodeUnavailableError(str(e), e.retry_after_ms) from e

    def generate_mixed(
        self,
        address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> Iterator[TokenDelta | Finished]:
        """One request on a mixed instance (both phases on one engine)."""
        mixed = MixedClient(address, self.channels, self.deadlines)
        stream = mixed.generate(generate_request(request_id, prompt_token_ids, params))
        yield from _read_tokens(stream, None)

    def prefill(
        self,
        prefill_address: str,
        decode_address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> prefill_pb2.PrefillResult:
        message = prefill_pb2.PrefillRequest(
            request=generate_request(request_id, prompt_token_ids, params),
            decode_address=decode_address,
        )
        return PrefillClient(prefill_address, self.channels, self.deadlines).prefill(message)

    def abort(self, prefill_address: str, decode_address: str | None, request_id: str) -> None:
        """Abort the request on the instances that may hold it (best effort: they may be gone).
        `decode_address` None means `prefill_address` is a mixed instance."""
        addresses = (
            [prefill_address] if decode_address is None else [decode_address, prefill_address]
        )
        for address in addresses:
            try:
                self.instance(address).abort(request_id)
            except PdserveError as e:
                logger.warning("abort of request %s on %s failed: %s", request_id, address, e)

    def _abort_quietly(self, address: str, request_id: str) -> None:
        try:
            self.instance(address).abort(request_id)
        except PdserveError as e:  # gone too: nothing of the request is left there to free
            logger.info("abort of request %s on %s failed: %s", request_id, address, e)

    def close(self) -> None:
        self.channels.close()


def _read_tokens(
    stream: TokenStream, prefill: prefill_pb2.PrefillResult | None
) -> Iterator[TokenDelta | Finished]:
    """Token replies as events; raises the typed error of an error reply or a broken stream.
    The prompt's logprobs (from prefill's result, or a mixed instance's first chunk) ride on
    the first delta."""
    prompt = prefill.prompt_logprobs if prefill is not None else ()
    for reply in stream:
        if isinstance(reply, common_pb2.TokenChunk):
            logprobs = tuple(logprob_from_proto(lp) for lp in reply.logprobs)
            prompt_logprobs = tuple(
                logprob_from_proto(lp) for lp in prompt or reply.prompt_logprobs
            )
            prompt = ()
            yield TokenDelta(tuple(reply.token_ids), reply.text, logprobs, prompt_logprobs)
        else:
            yield Finished(
                FINISH_REASON_NAMES.get(reply.finish_reason, "unknown"),
                reply.stop_reason,
                reply.num_prompt_tokens,
                reply.num_output_tokens,
                prefill,
            )
            return
