"""PDClient: drives one request through a prefill instance and a decode instance over gRPC.

Prefill.Prefill (reservation on decode, prefill, KV transfer, first-token handoff) and
Decode.StreamTokens, which replays every output from the first token on: the router opens it
alongside Prefill (it waits on decode for the attempt's reservation). A request's calls are
`grpc.aio` calls on the router's event loop (`pdserve.rpc.aio`); abort, stats and KV events are
blocking calls from other threads. Every call goes through the per-service clients: deadlines
on every RPC, errors raised as the class the instance raised.
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.request import SamplingParams, TokenLogprob
from pdserve.errors import DecodeUnavailableError, InstanceUnavailableError, PdserveError
from pdserve.instance.convert import FINISH_REASON_NAMES, generate_request, logprob_from_proto
from pdserve.kvcache.hashing import PromptHashes
from pdserve.rpc.aio import AioChannelPool, AioClients
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import DEFAULT_DEADLINES, Deadlines, InstanceClient
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
    """One channel per peer, shared. `generate` and `generate_mixed` run on one event loop
    (their channels are its own); the blocking methods are thread-safe. Same credentials."""

    def __init__(
        self, channels: ChannelPool | None = None, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self.channels = channels or ChannelPool()
        self.deadlines = deadlines
        self.aio = AioClients(AioChannelPool(self.channels.secret, self.channels.tls), deadlines)

    def instance(self, address: str) -> InstanceClient:
        """InstanceService of any instance (abort, stats, KV events)."""
        return InstanceClient(address, self.channels, self.deadlines)

    async def generate(
        self,
        prefill_address: str,
        decode_address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hashes: PromptHashes | None = None,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """Yield token deltas, then one Finished (`hashes`: the prompt's chain, sent along);
        raises the typed error of a failed step. Decode's token stream is opened alongside
        Prefill, for this attempt's reservation, so the first token reaches the caller as soon
        as decode emits it (with prompt logprobs asked for, once Prefill's reply brought them).
        A Prefill that fails before the first token fails the request with its own error
        (decode's side is aborted); one that fails after it costs only its report
        (`Finished.prefill` None)."""
        attempt = uuid.uuid4().hex
        message = _prefill_request(
            decode_address, prompt_token_ids, params, request_id, hashes, attempt
        )
        prefill = asyncio.ensure_future(self.aio.prefill(prefill_address, message))
        replies = self.aio.stream_tokens(decode_address, request_id, attempt)
        events = _Events(None)
        delivered = False
        try:
            first = await _first_reply(replies, prefill)
            if params.prompt_logprobs is not None or isinstance(first, common_pb2.TokenFinal):
                events.attach(await prefill)
            yield events.of(first)
            delivered = True
            async for reply in replies:
                if isinstance(reply, common_pb2.TokenFinal):
                    events.attach(await _report(prefill, request_id))
                yield events.of(reply)
        except PdserveError as error:
            if not delivered and _failed(prefill):  # the stream ended because Prefill failed
                await asyncio.to_thread(self._abort_quietly, decode_address, request_id)
                raise prefill.exception() from None  # type: ignore[misc]
            if isinstance(error, InstanceUnavailableError) and not isinstance(
                error, DecodeUnavailableError
            ):  # the token stream broke: decode's side
                raise DecodeUnavailableError(str(error), error.retry_after_ms) from error
            raise
        finally:
            prefill.cancel()  # a no-op once it answered; else the call (and its prefill) ends
            await replies.aclose()  # type: ignore[attr-defined]

    async def generate_mixed(
        self,
        address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hashes: PromptHashes | None = None,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """One request on a mixed instance (both phases on one engine)."""
        message = generate_request(request_id, prompt_token_ids, params, hashes)
        events = _Events(None)
        async for reply in self.aio.generate_mixed(address, message):
            yield events.of(reply)

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


def _prefill_request(
    decode_address: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    hashes: PromptHashes | None = None,
    attempt: str = "",
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request=generate_request(request_id, prompt_token_ids, params, hashes, attempt),
        decode_address=decode_address,
    )


async def _first_reply(
    replies: AsyncIterator[common_pb2.TokenChunk | common_pb2.TokenFinal],
    prefill: "asyncio.Future[prefill_pb2.PrefillResult]",
) -> common_pb2.TokenChunk | common_pb2.TokenFinal:
    """The token stream's first reply; Prefill's error when Prefill fails first (the stream
    would wait for a reservation that never comes)."""
    first = asyncio.ensure_future(anext(replies))
    try:
        await asyncio.wait((first, prefill), return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and _failed(prefill):
            raise prefill.exception()  # type: ignore[misc]
        return await first
    finally:
        first.cancel()  # a no-op once it is done


def _failed(future: "asyncio.Future[Any]") -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


async def _report(
    prefill: "asyncio.Future[prefill_pb2.PrefillResult]", request_id: str
) -> prefill_pb2.PrefillResult | None:
    """Prefill's result for the final event; None when it failed after decode took over (the
    generation itself succeeded)."""
    try:
        return await prefill
    except PdserveError as e:
        logger.warning("prefill of request %s failed after its handoff: %s", request_id, e)
        return None


class _Events:
    """Token replies as events. The prompt's logprobs (from prefill's result, or a mixed
    instance's first chunk) ride on the first delta."""

    def __init__(self, prefill: prefill_pb2.PrefillResult | None) -> None:
        self._prefill: prefill_pb2.PrefillResult | None = None
        self._prompt: Sequence[common_pb2.TokenLogprob] = ()
        self.attach(prefill)

    def attach(self, prefill: prefill_pb2.PrefillResult | None) -> None:
        """Prefill's result, once it came (its prompt logprobs go on the next delta)."""
        self._prefill = prefill
        self._prompt = prefill.prompt_logprobs if prefill is not None else ()

    def of(self, reply: common_pb2.TokenChunk | common_pb2.TokenFinal) -> TokenDelta | Finished:
        if isinstance(reply, common_pb2.TokenChunk):
            logprobs = tuple(logprob_from_proto(lp) for lp in reply.logprobs)
            prompt = tuple(logprob_from_proto(lp) for lp in self._prompt or reply.prompt_logprobs)
            self._prompt = ()
            return TokenDelta(tuple(reply.token_ids), reply.text, logprobs, prompt)
        return Finished(
            FINISH_REASON_NAMES.get(reply.finish_reason, "unknown"),
            reply.stop_reason,
            reply.num_prompt_tokens,
            reply.num_output_tokens,
            self._prefill,
        )
