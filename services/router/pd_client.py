"""PDClient: drives one request through a prefill instance and a decode instance over gRPC.

Prefill.Prefill (reservation on decode, prefill, KV transfer, first-token handoff); the request's
outputs come on decode's output subscription (`OutputSubscriptions`: one stream per instance,
one message per engine step, every request of this router on it), registered under the
attempt before Prefill starts. A mixed instance takes Submit and answers on its subscription
the same way. A request's calls are `grpc.aio` calls on the router's event loop
(`pdserve.rpc.aio`); abort, stats and KV events are blocking calls from other threads. Every
call goes through the per-service clients: deadlines on every RPC, errors raised as the class
the instance raised; a lost output subscription is DecodeUnavailableError.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.request import SamplingParams, TokenLogprob
from pdserve.errors import PdserveError
from pdserve.instance.convert import FINISH_REASON_NAMES, generate_request, logprob_from_proto
from pdserve.kvcache.hashing import PromptHashes
from pdserve.rpc.aio import AioChannelPool, AioClients
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import DEFAULT_DEADLINES, Deadlines, InstanceClient, Metadata
from pdserve.transfer.base import PrefixSource
from pdserve.v1 import common_pb2, prefill_pb2
from services.router.outputs import OutputSubscriptions, RequestReplies

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
    timings: common_pb2.StageTimings | None = None  # the streaming instance's stages
    # one message between the router and an instance, one way: half the Prefill call's round
    # trip less the time prefill reported spending on it (None: no Prefill result)
    message_s: float | None = None


class PDClient:
    """One channel per peer, shared. `generate` and `generate_mixed` run on one event loop
    (their channels are its own); the blocking methods are thread-safe. Same credentials."""

    def __init__(
        self, channels: ChannelPool | None = None, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self.channels = channels or ChannelPool()
        self.deadlines = deadlines
        self.aio = AioClients(AioChannelPool(self.channels.secret, self.channels.tls), deadlines)
        self.outputs = OutputSubscriptions(self.aio)  # on the event loop of `aio`
        self._aborting: set[asyncio.Task[None]] = set()

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
        metadata: Metadata = (),
        route_seq: int = 0,
        source: PrefixSource | None = None,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """Yield token deltas, then one Finished (`hashes`: the prompt's chain, sent along;
        `metadata`: the attempt's own, its trace context, sent with Prefill; `route_seq`: the
        attempt's number, which the instances' load reports acknowledge; `source`: a decode
        instance prefill pulls the prompt's cached prefix from);
        raises the typed error of a failed step. The attempt's outputs come on decode's output
        subscription, registered before Prefill starts, so the first token reaches the caller
        as soon as decode emits it (with prompt logprobs asked for, once Prefill's reply
        brought them). A Prefill that fails before the first token fails the request with its
        own error (decode's side is aborted first); one that fails after it costs only its
        report (`Finished.prefill` None). Left unfinished, the attempt is aborted on decode."""
        attempt = uuid.uuid4().hex
        finished = False
        prefill: asyncio.Future[_Prefilled] | None = None
        try:
            replies = await self.outputs.register(decode_address, request_id, attempt)
            message = _prefill_request(
                decode_address, prompt_token_ids, params, request_id, hashes, attempt,
                self.outputs.subscriber, route_seq, source,
            )  # fmt: skip
            prefill = asyncio.ensure_future(self._call_prefill(prefill_address, message, metadata))
            try:
                replied = await _first_replies(replies, prefill)
            except PdserveError:
                if _failed(prefill):  # the outputs never came because Prefill failed
                    await self._abort(decode_address, request_id, attempt)
                    raise prefill.exception() from None  # type: ignore[misc]
                raise
            events = _Events()
            if _ends(replied) or params.prompt_logprobs is not None:
                events.attach(await prefill)
            while True:
                finished = _ends(replied)  # before the caller may stop at its event
                for event in events.of(replied):
                    yield event
                if finished:
                    return
                replied = await replies.get()
                if _ends(replied):
                    events.attach(await _report(prefill, request_id))
        finally:
            if prefill is not None:
                prefill.cancel()  # a no-op once it answered; else the call (and its prefill) ends
            self.outputs.unregister(decode_address, request_id, attempt)
            if not finished:
                self._abort_later(decode_address, request_id, attempt)

    async def _call_prefill(
        self, address: str, message: prefill_pb2.PrefillRequest, metadata: Metadata
    ) -> "_Prefilled":
        sent = time.perf_counter()
        result = await self.aio.prefill(address, message, metadata)
        return _Prefilled(result, time.perf_counter() - sent)

    async def generate_mixed(
        self,
        address: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hashes: PromptHashes | None = None,
        metadata: Metadata = (),
        on_decode: bool = False,
        route_seq: int = 0,
    ) -> AsyncGenerator[TokenDelta | Finished, None]:
        """One request on a mixed instance (both phases on one engine), or (`on_decode`) on a
        decode instance that computes the prompt itself, its outputs on the instance's output
        subscription. Left unfinished, the attempt is aborted there."""
        attempt = uuid.uuid4().hex
        finished = False
        try:
            replies = await self.outputs.register(address, request_id, attempt)
            message = generate_request(
                request_id, prompt_token_ids, params, hashes, attempt, self.outputs.subscriber,
                route_seq,
            )  # fmt: skip
            await self.aio.submit(address, message, metadata, on_decode)
            events = _Events()
            while not finished:
                replied = await replies.get()
                finished = _ends(replied)  # before the caller may stop at its event
                for event in events.of(replied):
                    yield event
        finally:
            self.outputs.unregister(address, request_id, attempt)
            if not finished:
                self._abort_later(address, request_id, attempt)

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
                logger.warning("abort of request %s on %s failed: %s", request_id, address, e,
                               extra={"request_id": request_id})  # fmt: skip

    async def _abort(self, address: str, request_id: str, attempt: str) -> None:
        """Abort the attempt on `address`, best effort: it may be gone too, and then nothing
        of the request is left there to free."""
        try:
            await self.aio.abort(address, request_id, attempt)
        except PdserveError as e:
            logger.info("abort of request %s on %s failed: %s", request_id, address, e,
                        extra={"request_id": request_id})  # fmt: skip

    def _abort_later(self, address: str, request_id: str, attempt: str) -> None:
        """`_abort` without waiting for it (it names the attempt: a retry under the same
        request id is left alone)."""
        task = asyncio.ensure_future(self._abort(address, request_id, attempt))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def aclose(self) -> None:
        """End the output subscriptions, let pending aborts finish, close the asyncio channels
        (on their event loop, before it stops)."""
        await self.outputs.close()
        await asyncio.gather(*self._aborting, return_exceptions=True)
        await self.aio.channels.close()

    def forget(self, address: str, keep: Callable[[], bool] = lambda: False) -> None:
        """Close both channels to `address` (from any thread) unless `keep()`, asked as each
        is dropped, says the instance is back: for an instance that is gone."""
        self.channels.forget(address, keep)
        self.aio.channels.forget(address, keep)

    def close(self) -> None:
        self.channels.close()


def _prefill_request(
    decode_address: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    hashes: PromptHashes | None,
    attempt: str,
    subscriber: str,
    route_seq: int,
    source: PrefixSource | None,
) -> prefill_pb2.PrefillRequest:
    message = prefill_pb2.PrefillRequest(
        request=generate_request(
            request_id, prompt_token_ids, params, hashes, attempt, subscriber, route_seq
        ),
        decode_address=decode_address,
    )
    if source is not None:
        message.kv_source.address, message.kv_source.num_blocks = source.address, source.num_blocks
    return message


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """Prefill's result and how long its call took, as the router saw it."""

    result: prefill_pb2.PrefillResult
    call_s: float

    def message_s(self) -> float:
        """One message's time, one way: the call less the stages prefill reported (from
        its start to its handoff's end), halved; the call's other costs (serialization, a
        busy process's wait for a thread, the GIL or a core) are the messages'."""
        t = self.result.timings
        spent = t.reserve_s + t.queue_s + t.compute_s + t.transfer_s + t.handoff_s
        return max(0.0, self.call_s - spent) / 2


async def _first_replies(
    replies: RequestReplies, prefill: "asyncio.Future[_Prefilled]"
) -> list[common_pb2.RequestOutputs]:
    """The attempt's first outputs; Prefill's error when Prefill fails first (decode would
    wait for a first token that never comes)."""
    first = asyncio.ensure_future(replies.get())
    try:
        await asyncio.wait((first, prefill), return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and _failed(prefill):
            raise prefill.exception()  # type: ignore[misc]
        return await first
    finally:
        first.cancel()  # a no-op once it is done


def _ends(replies: Sequence[common_pb2.RequestOutputs]) -> bool:
    """Whether the request's final output is among `replies` (it is the last of them)."""
    return replies[-1].HasField("final")


def _failed(future: "asyncio.Future[Any]") -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


async def _report(prefill: "asyncio.Future[_Prefilled]", request_id: str) -> "_Prefilled | None":
    """Prefill's result for the final event; None when it failed after decode took over (the
    generation itself succeeded)."""
    try:
        return await prefill
    except PdserveError as e:
        logger.warning("prefill of request %s failed after its handoff: %s", request_id, e,
                       extra={"request_id": request_id})  # fmt: skip
        return None


class _Events:
    """An attempt's outputs as events. The prompt's logprobs (from prefill's result, or a
    mixed instance's first chunk) ride on the first delta."""

    def __init__(self) -> None:
        self._prefill: _Prefilled | None = None  # `attach`ed once it came
        self._first = True

    def attach(self, prefill: _Prefilled | None) -> None:
        """Prefill's result, once it came."""
        self._prefill = prefill

    def of(self, replies: Sequence[common_pb2.RequestOutputs]) -> list[TokenDelta | Finished]:
        """One delta for the chunks of the outputs that came together (a reader that fell
        behind catches up in one event), then the final event when they end the request."""
        events: list[TokenDelta | Finished] = []
        chunks = [reply.chunk for reply in replies if reply.HasField("chunk")]
        if chunks:
            events.append(self._delta(chunks))
        last = replies[-1]
        if last.HasField("final"):
            final, prefilled = last.final, self._prefill
            events.append(
                Finished(
                    FINISH_REASON_NAMES.get(final.finish_reason, "unknown"),
                    final.stop_reason,
                    final.num_prompt_tokens,
                    final.num_output_tokens,
                    prefilled.result if prefilled else None,
                    final.timings if final.HasField("timings") else None,
                    prefilled.message_s() if prefilled else None,
                )
            )
        return events

    def _delta(self, chunks: Sequence[common_pb2.TokenChunk]) -> TokenDelta:
        prompt: Sequence[common_pb2.TokenLogprob] = ()
        if self._first:
            from_prefill = self._prefill.result.prompt_logprobs if self._prefill else ()
            prompt = from_prefill or chunks[0].prompt_logprobs
            self._first = False
        logprobs: Sequence[common_pb2.TokenLogprob]
        if len(chunks) == 1:
            chunk = chunks[0]
            token_ids, text, logprobs = tuple(chunk.token_ids), chunk.text, chunk.logprobs
        else:
            token_ids = tuple(t for chunk in chunks for t in chunk.token_ids)
            text = "".join(chunk.text for chunk in chunks)
            logprobs = [lp for chunk in chunks for lp in chunk.logprobs]
        return TokenDelta(
            token_ids,
            text,
            tuple(logprob_from_proto(lp) for lp in logprobs) if logprobs else (),
            tuple(logprob_from_proto(lp) for lp in prompt) if prompt else (),
        )
