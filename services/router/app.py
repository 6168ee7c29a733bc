"""The OpenAI-compatible HTTP API (FastAPI): check at the edge -> convert -> delegate to
Router -> convert.

Errors use OpenAI's schema `{"error": {"message", "type", "param", "code"}}` with a 4xx status
for the caller's mistakes (401 without a valid API key when `router.api_keys` is set), 429 (with
Retry-After) past a key's rate or the admission queue's bounds, and 503 (with Retry-After) when
the cluster has no capacity.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any

import anyio
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from pdserve.config import RouterConfig
from pdserve.engine.request import SamplingParams, TokenLogprob
from pdserve.errors import (
    AuthenticationError,
    PdserveError,
    RateLimitedError,
    RequestAbortedError,
    http_error,
)
from pdserve.metrics import RouterMetrics
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability import tracing
from services.router import tool_calls
from services.router.api_keys import ApiKey, ApiKeys
from services.router.edge import RequestEdge
from services.router.membership import Role
from services.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIRequest,
    TokenizeRequest,
)
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router

logger = logging.getLogger(__name__)

Event = TokenDelta | Finished
ScrapeTargets = Callable[[str], list[dict[str, Any]]]
"""Prometheus HTTP service-discovery groups, given the router's own address."""
COUNTED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"}
)
# what the endpoints really answer besides 200 (FastAPI's 422 is never sent: see the handlers)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request (OpenAI error object)"},
    401: {"description": "no valid API key (with router.api_keys)"},
    404: {"description": "unknown model"},
    413: {"description": "request body too large"},
    429: {"description": "the API key's rate or the admission queue's bounds; see Retry-After"},
    503: {"description": "no capacity, retry after the Retry-After header"},
}


def create_app(
    router: Router,
    config: RouterConfig,
    scrape_targets: Callable[[], list[dict[str, Any]]] = list,
) -> FastAPI:
    """The API over `router`; `scrape_targets()` answers `/prometheus/targets`. Raises
    ConfigError when `router.api_keys` names a keys file that does not load."""
    edge = RequestEdge(router.model)
    keys = ApiKeys(config.api_keys) if config.api_keys else None

    def caller(http: Request) -> ApiKey | None:
        """The API key of the request (None without `router.api_keys`), within its rate."""
        if keys is None:
            return None
        try:
            key = keys.authenticate(http.headers.get("authorization"))
        except AuthenticationError:
            router.metrics.rejections.labels("unauthenticated", "").inc()
            raise
        try:
            keys.check_rate(key)
        except RateLimitedError:
            router.metrics.rejections.labels("rate_limited", key.name).inc()
            raise
        return key

    Caller = Annotated[ApiKey | None, Depends(caller)]

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await router.queue.close()  # its pump ticker runs on this loop
        await router.client.aclose()  # its subscriptions and channels belong to this loop

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    _install_error_handlers(app)
    app.add_middleware(_RequestGate, metrics=router.metrics, max_bytes=config.max_body_bytes)

    _add_info_endpoints(app, router, scrape_targets, caller)
    _add_token_endpoints(app, edge, caller)
    model_id, tokenizer = router.model.model_id, router.model.tokenizer

    @app.post("/v1/completions", response_model=None, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, http: Request, key: Caller) -> Response:
        edge.check_model(body.model)
        prompt = body.single_prompt()
        ids = edge.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        fmt = _CompletionFormat(model_id, tokenizer)
        if body.echo:
            text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            fmt.echo = _Echo(ids[0], text, body.prompt_only)
        return await _serve(router, edge, http, body, ids, fmt, key)

    tool_family = config.tool_parser or tool_calls.family_of(tokenizer.chat_template)

    @app.post("/v1/chat/completions", response_model=None, responses=ERROR_RESPONSES)
    async def chat(body: ChatCompletionRequest, http: Request, key: Caller) -> Response:
        edge.check_model(body.model)
        ids = edge.tokenize_chat(body.chat_messages(), body.template_tools())
        fmt = _ChatFormat(model_id, tokenizer, _tool_parsers(body, tool_family))
        return await _serve(router, edge, http, body, ids, fmt, key)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_info_endpoints(
    app: FastAPI,
    router: Router,
    targets: Callable[[], list[dict[str, Any]]],
    caller: Callable[[Request], ApiKey | None],
) -> None:
    """Health, Prometheus discovery and metrics (open), the model list (behind `caller`'s
    key check)."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        prefill, decode = (len(router.membership.members(role)) for role in Role)
        return {"status": "ok", "prefill": prefill, "decode": decode}

    @app.get("/prometheus/targets")
    async def scrape_targets() -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: every endpoint of the cluster to scrape."""
        return targets()

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, not the API
    async def metrics() -> Response:
        router.export_load()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(caller)])
    async def models() -> dict[str, Any]:
        card = {"id": router.model.model_id, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": router.model.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}


def _tool_parsers(
    body: ChatCompletionRequest, family: str | None
) -> Callable[[], tool_calls.CallParser] | None:
    """A parser factory for the request's tool calls; None when it has no tools to call."""
    if body.tool_mode() == "none":
        return None
    names = frozenset(tool.function.name for tool in body.tools or ())
    return tool_calls.parser_factory(body.tool_mode(), names, family, body.named_tool())


def _add_token_endpoints(
    app: FastAPI, edge: RequestEdge, caller: Callable[[Request], ApiKey | None]
) -> None:
    """vLLM's `/tokenize` and `/detokenize` (behind `caller`'s key check)."""

    @app.post("/tokenize", responses=ERROR_RESPONSES, dependencies=[Depends(caller)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            edge.check_model(body.model)
        if body.messages is not None:
            ids = edge.tokenize_chat([m.template_message() for m in body.messages])
        else:
            ids = edge.model.tokenizer.encode(
                body.prompt or "", add_special_tokens=body.add_special_tokens
            )
        return {"count": len(ids), "max_model_len": edge.model.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=ERROR_RESPONSES, dependencies=[Depends(caller)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            edge.check_model(body.model)
        return {"prompt": edge.detokenize(body.tokens)}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without its 422 responses: validation errors are 400 here."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in document.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = document
    return app.openapi_schema


def _openai(event: Event) -> Event:
    """`event`, with OpenAI's finish reasons only: a generation aborted upstream (an operator,
    an instance shutting down) ends with an error instead of `finish_reason: "abort"`."""
    if isinstance(event, Finished) and event.finish_reason == "abort":
        raise RequestAbortedError("the request was aborted before it finished; retry it")
    return event


async def _serve(
    router: Router,
    edge: RequestEdge,
    http: Request,
    body: OpenAIRequest,
    ids: list[int],
    fmt: "_Format",
    key: ApiKey | None,
) -> Response:
    """Run the request's choices (`n`, or `best_of` to rank) and answer in OpenAI's shapes,
    once the router admits them (`key`: the caller's API key, who takes turns in the admission
    queue and how urgently). The first choice runs alone until its first token, so that the
    prompt's KV is computed once: the others find it in the prefix cache."""
    params = body.params()  # type: ignore[attr-defined]
    edge.validate(ids, params)
    count = body.generations()
    if key is not None:
        await router.admit(count, len(ids), key.name, key.priority_for(body.priority), key.name)
    else:
        await router.admit(count, len(ids), body.user or "", body.priority)
    request_id = uuid.uuid4().hex
    choice_ids = [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]
    ranked = count > body.n
    choice_params = [_choice_params(params, i, ranked) for i in range(count)]

    def generation(i: int) -> AsyncGenerator[Event, None]:
        return router.generate(choice_ids[i], ids, choice_params[i], arrival=started, parent=parent)

    def start(i: int, first: Event | None = None) -> AsyncGenerator[Event, None]:
        events = generation(i) if i else leader
        return _observed(router.metrics, events, started, first)

    def abort_all() -> None:
        for choice_id in choice_ids:
            router.abort(choice_id)

    started = time.perf_counter()
    parent = tracing.extract(http.headers)  # the caller's W3C traceparent, when tracing
    leader = generation(0)
    try:
        first = _openai(await anext(leader))  # errors before the first token -> an HTTP error
    except BaseException:
        await leader.aclose()
        raise
    streams = [start(0, first), *(start(i) for i in range(1, count))]
    if body.stream:
        state = _StreamState()
        sse = _sse(state, streams, fmt, request_id, body.include_usage, len(ids))
        return _AbortingStream(sse, state, abort_all)
    collected = await _until_done_or_disconnected(http, abort_all, streams)
    if ranked:
        collected = _best(collected, body.n, keep_logprobs=params.logprobs is not None)
    return JSONResponse(fmt.complete(request_id, collected, len(ids)))


def _choice_params(params: SamplingParams, index: int, ranked: bool) -> SamplingParams:
    """Choice `index`'s own seed stream (seed + index), and the logprobs ranking needs."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    logprobs = params.logprobs if not ranked else max(params.logprobs or 0, 0)
    return replace(params, seed=seed, logprobs=logprobs)


def _best(choices: list[list[Event]], n: int, keep_logprobs: bool) -> list[list[Event]]:
    """`best_of`: the `n` choices of highest cumulative logprob, best first (usage still
    counts every choice generated: the last element carries the rest's tokens)."""

    def score(events: list[Event]) -> float:
        return sum(lp.logprob for lp in _all_logprobs(events))

    ranked = sorted(choices, key=score, reverse=True)
    best = ranked[:n]
    if not keep_logprobs:
        best = [[replace(e, logprobs=()) if isinstance(e, TokenDelta) else e for e in c]
                for c in best]  # fmt: skip
    extra = sum(_collect(c)[1].num_output_tokens for c in ranked[n:])
    last = best[-1]
    final = _collect(last)[1]
    best[-1] = [*last[:-1], replace(final, num_output_tokens=final.num_output_tokens + extra)]
    return best


async def _until_done_or_disconnected(
    http: Request, abort: Callable[[], None], streams: Sequence[AsyncGenerator[Event, None]]
) -> list[list[Event]]:
    tasks = [asyncio.ensure_future(_collect_events(stream)) for stream in streams]
    while True:
        done, _ = await asyncio.wait(tasks, timeout=0.25)
        if len(done) == len(tasks):
            return [task.result() for task in tasks]
        if any(task.exception() for task in done):
            await run_in_threadpool(abort)  # one choice failed: stop the others, report it
            await asyncio.gather(*tasks, return_exceptions=True)
            return [task.result() for task in tasks]
        if await http.is_disconnected():
            await run_in_threadpool(abort)
            return [await task for task in tasks]


async def _collect_events(stream: AsyncGenerator[Event, None]) -> list[Event]:
    return [event async for event in stream]


async def _observed(
    metrics: RouterMetrics,
    events: AsyncGenerator[Event, None],
    started: float,
    first: Event | None = None,
) -> AsyncGenerator[Event, None]:
    """One generation's events as the client gets them (`first`: already read from `events`),
    with OpenAI's finish reasons only (`_openai`); TTFT, inter-token and end-to-end latency
    are observed as they pass. One generator for all of it: every layer costs each token."""
    last = started
    tokens = 0

    def observe(event: Event) -> Event:
        nonlocal last, tokens
        now = time.perf_counter()
        if isinstance(event, Finished):
            metrics.e2e.observe(now - started)
        elif tokens == 0:
            metrics.ttft.observe(now - started)
        else:
            metrics.inter_token.observe(now - last)
        tokens += 1
        last = now
        return _openai(event)

    try:
        if first is not None:
            yield observe(first)
        async for event in events:
            yield observe(event)
    finally:
        await events.aclose()


class _StreamState:
    finished = False


class _AbortingStream(StreamingResponse):
    """An SSE response that aborts its request when it ends before the generation did (the
    client went away): Starlette does not reliably close the body iterator on disconnect."""

    def __init__(
        self, content: AsyncIterator[bytes], state: _StreamState, abort: Callable[[], None]
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._state = state
        self._abort = abort

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._state.finished:
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(self._abort)


async def _sse(
    state: _StreamState,
    streams: list[AsyncGenerator[Event, None]],
    fmt: "_Format",
    request_id: str,
    include_usage: bool,
    num_prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """Every choice's events as they come (chunks carry the choice's index), then usage."""
    finals: dict[int, Finished] = {}

    def chunk(index: int, item: Event) -> bytes | None:
        if isinstance(item, Finished):
            finals[index] = item
            return _data(fmt.envelope(request_id, [fmt.choice_finish(index, item)], True))
        choice = fmt.choice_delta(index, item)
        return None if choice is None else _data(fmt.envelope(request_id, [choice], True))

    merged = _merged(streams) if len(streams) > 1 else None
    try:
        starts = [c for i in range(len(streams)) if (c := fmt.choice_start(i)) is not None]
        if starts:
            yield _data(fmt.envelope(request_id, starts, chunk=True))
        if merged is None:  # one choice: its events straight, no merging layer
            async for event in streams[0]:
                if (data := chunk(0, event)) is not None:
                    yield data
        else:
            async for index, event in merged:
                if (data := chunk(index, event)) is not None:
                    yield data
        if len(finals) < len(streams):
            raise PdserveError("the generation ended without a final event")
        state.finished = True
        if include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            yield _data(fmt.usage_chunk(request_id, ordered, num_prompt_tokens))
        yield b"data: [DONE]\n\n"
    except PdserveError as e:
        state.finished = len(streams) == 1  # other choices may still run: the stream aborts them
        error = http_error(e)
        yield _data(_openai_error(error.message, error.type, error.code))
        yield b"data: [DONE]\n\n"
    finally:
        await (merged or streams[0]).aclose()


async def _merged(
    streams: list[AsyncGenerator[Event, None]],
) -> AsyncGenerator[tuple[int, Event], None]:
    """Several choices' events, interleaved as they come; a failed choice raises its error."""
    queue: asyncio.Queue[tuple[int, Event | PdserveError | None]] = asyncio.Queue()

    async def pump(index: int, events: AsyncGenerator[Event, None]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
        except PdserveError as e:
            await queue.put((index, e))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, events)) for i, events in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, PdserveError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _Format:
    """One response's shapes: choice dicts for deltas, finishes and whole choices, wrapped in
    chunk or response envelopes. Holds per-choice state (logprobs' text offsets)."""

    object_name = ""
    prefix = ""

    def __init__(self, model_id: str, tokenizer: Tokenizer) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}
        self._envelopes: dict[tuple[str, bool], dict[str, Any]] = {}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def envelope(
        self, request_id: str, choices: list[dict[str, Any]], chunk: bool
    ) -> dict[str, Any]:
        fields = self._envelopes.get((request_id, chunk))
        if fields is None:  # one per response: a stream's chunks share it
            fields = self._envelopes[(request_id, chunk)] = {
                "id": f"{self.prefix}-{request_id}",
                "object": f"{self.object_name}{'.chunk' if chunk else ''}",
                "created": self.created,
                "model": self.model_id,
            }
        return {**fields, "choices": choices}

    def choice_start(self, index: int) -> dict[str, Any] | None:
        return None

    def choice_delta(self, index: int, event: TokenDelta) -> dict[str, Any] | None:
        """The choice of a chunk for `event`; None when it shows nothing yet."""
        raise NotImplementedError

    def choice_finish(self, index: int, event: Finished) -> dict[str, Any]:
        raise NotImplementedError

    def choice_complete(self, index: int, events: list[Event]) -> dict[str, Any]:
        raise NotImplementedError

    def complete(
        self, request_id: str, choices: list[list[Event]], num_prompt: int
    ) -> dict[str, Any]:
        payload = self.envelope(
            request_id, [self.choice_complete(i, e) for i, e in enumerate(choices)], chunk=False
        )
        payload["usage"] = _usage(num_prompt, [_collect(e)[1] for e in choices])
        return payload

    def usage_chunk(
        self, request_id: str, finals: list[Finished], num_prompt: int
    ) -> dict[str, Any]:
        payload = self.envelope(request_id, [], chunk=True)
        payload["usage"] = _usage(num_prompt, finals)
        return payload


@dataclass(frozen=True, slots=True)
class _Echo:
    """`echo`: the prompt goes before each choice's completion (with its logprobs: the first
    token has none); `prompt_only` (`max_tokens: 0`): nothing generated is shown."""

    first_token: int
    text: str
    prompt_only: bool


class _CompletionFormat(_Format):
    object_name = "text_completion"
    prefix = "cmpl"
    echo: _Echo | None = None

    def choice_delta(self, index: int, event: TokenDelta) -> dict[str, Any]:
        text, logprobs = self._shown(event.text, event.logprobs)
        if self.echo is not None and index not in self._text_offsets:  # its first delta
            text = self.echo.text + text
            prompt = self._prompt_entries(event.prompt_logprobs)
            return _text_choice(index, text, None, self._logprobs(index, logprobs, prompt))
        return _text_choice(index, text, None, self._logprobs(index, logprobs))

    def choice_finish(self, index: int, event: Finished) -> dict[str, Any]:
        reason = (
            "length" if self.echo is not None and self.echo.prompt_only else event.finish_reason
        )
        return _text_choice(index, "", reason, None)

    def choice_complete(self, index: int, events: list[Event]) -> dict[str, Any]:
        text, final = _collect(events)
        text, logprobs = self._shown(text, _all_logprobs(events))
        prompt = None
        if self.echo is not None:
            text = self.echo.text + text
            first = next((e for e in events if isinstance(e, TokenDelta)), None)
            prompt = self._prompt_entries(first.prompt_logprobs if first else ())
        reason = self.choice_finish(index, final)["finish_reason"]
        return _text_choice(index, text, reason, self._logprobs(index, logprobs, prompt))

    def complete(
        self, request_id: str, choices: list[list[Event]], num_prompt: int
    ) -> dict[str, Any]:
        payload = super().complete(request_id, choices, num_prompt)
        if self.echo is not None and self.echo.prompt_only:  # the one token run is not shown
            payload["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": 0,
                                "total_tokens": num_prompt}  # fmt: skip
        return payload

    def _shown(
        self, text: str, logprobs: Sequence[TokenLogprob]
    ) -> tuple[str, Sequence[TokenLogprob]]:
        if self.echo is not None and self.echo.prompt_only:
            return "", ()
        return text, logprobs

    def _prompt_entries(
        self, logprobs: Sequence[TokenLogprob]
    ) -> list[tuple[int, float | None, dict[str, float] | None]] | None:
        """The echoed prompt's (token, logprob, top) entries; None when not asked for."""
        if self.echo is None or not logprobs:
            return None
        entries: list[tuple[int, float | None, dict[str, float] | None]] = [
            (self.echo.first_token, None, None)
        ]
        for lp in logprobs:
            entries.append((lp.token_id, lp.logprob, {self._token_text(t): v for t, v in lp.top}))
        return entries

    def _logprobs(
        self,
        index: int,
        logprobs: Sequence[TokenLogprob],
        prompt: list[tuple[int, float | None, dict[str, float] | None]] | None = None,
    ) -> dict[str, Any] | None:
        """OpenAI's completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        entries = list(prompt or [])
        entries += [
            (lp.token_id, lp.logprob, {self._token_text(t): v for t, v in lp.top})
            for lp in logprobs
        ]
        offset = self._text_offsets.get(index, 0)
        if not entries:
            self._text_offsets[index] = offset
            return None
        tokens, offsets = [], []
        for token_id, _, _ in entries:
            tokens.append(self._token_text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [value for _, value, _ in entries],
            "top_logprobs": [top for _, _, top in entries],
            "text_offset": offsets,
        }


def _text_choice(
    index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


class _ChatFormat(_Format):
    """Chat shapes; with tools, each choice's text goes through its own tool-call parser."""

    object_name = "chat.completion"
    prefix = "chatcmpl"

    def __init__(
        self,
        model_id: str,
        tokenizer: Tokenizer,
        tool_parsers: Callable[[], tool_calls.CallParser] | None = None,
    ) -> None:
        super().__init__(model_id, tokenizer)
        self._new_parser = tool_parsers
        self._parsers: dict[int, tool_calls.CallParser] = {}

    def _parser(self, index: int) -> tool_calls.CallParser | None:
        if self._new_parser is not None and index not in self._parsers:
            self._parsers[index] = self._new_parser()
        return self._parsers.get(index)

    def choice_start(self, index: int) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def choice_delta(self, index: int, event: TokenDelta) -> dict[str, Any] | None:
        logprobs = self._logprobs(event.logprobs)
        parser = self._parser(index)
        if parser is None:
            delta: dict[str, Any] = {"content": event.text}
        else:
            delta = tool_calls.stream_delta(parser.feed(event.text))
            if not delta and logprobs is None:
                return None  # held back: it may be the start of a call
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def choice_finish(self, index: int, event: Finished) -> dict[str, Any]:
        parser = self._parser(index)
        if parser is None:
            delta, reason = {}, event.finish_reason
        else:
            delta = tool_calls.stream_delta(parser.finish())
            reason = parser.finish_reason(event.finish_reason)
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def choice_complete(self, index: int, events: list[Event]) -> dict[str, Any]:
        text, final = _collect(events)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = final.finish_reason
        parser = self._parser(index)
        if parser is not None:
            content, calls = tool_calls.assemble(parser.feed(text) + parser.finish())
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
            reason = parser.finish_reason(reason)
        logprobs = self._logprobs(_all_logprobs(events))
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": reason}  # fmt: skip

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and top alternatives."""
        if not logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}


def _collect(events: list[Event]) -> tuple[str, Finished]:
    final = events[-1]
    if not isinstance(final, Finished):
        raise PdserveError("the generation ended without a final event")
    return "".join(e.text for e in events if isinstance(e, TokenDelta)), final


def _all_logprobs(events: list[Event]) -> list[TokenLogprob]:
    return [lp for e in events if isinstance(e, TokenDelta) for lp in e.logprobs]


def _usage(num_prompt: int, finals: Sequence[Finished]) -> dict[str, int]:
    completion = sum(f.num_output_tokens for f in finals)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": completion,
        "total_tokens": num_prompt + completion,
    }


# -- errors --------------------------------------------------------------------------------------


def _openai_error(
    message: str, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
            location = ""  # its `loc` is a character offset, not a field
        else:
            message = f"{location or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(
            _openai_error(message, "invalid_request_error", None, location or None), 400
        )

    @app.exception_handler(PdserveError)
    async def pdserve_error(_: Request, exc: PdserveError) -> JSONResponse:
        error = http_error(exc)
        headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
        body = _openai_error(error.message, error.type, error.code)
        return JSONResponse(body, error.status, headers=headers)


class _RequestGate:
    """Pure ASGI middleware: refuses bodies over `max_bytes` (413, by Content-Length) and counts
    every /v1/ response by status. Not a BaseHTTPMiddleware: that wraps `receive` and hides the
    client's disconnect from the endpoints, so non-streaming requests ran on after their client
    had gone."""

    def __init__(self, app: Any, metrics: RouterMetrics, max_bytes: int) -> None:
        self.app, self.metrics, self.max_bytes = app, metrics, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, status = scope["path"], 500

        async def send_counted(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                message = f"the request body is larger than {self.max_bytes} bytes"
                body = _openai_error(message, "invalid_request_error", "request_too_large")
                await JSONResponse(body, 413)(scope, receive, send_counted)
                return
            await self.app(scope, receive, send_counted)
        finally:
            if path.startswith("/v1/") or path in COUNTED_PATHS:
                endpoint = path if path in COUNTED_PATHS else "other"  # bounded label values
                self.metrics.requests.labels(endpoint, str(status)).inc()
