"""The one builder of serving stacks for tests: real prefill, decode or mixed instances (gRPC on
port 0, in this process) behind a real router (HTTP on port 0, its own event loop), as
production runs them.

`stack.generate` and `stack.stream` drive `Router.generate` on the router's event loop: the
request path every HTTP request takes, without the OpenAI formatting; `stack.url` is the HTTP
API. Leaving `pd_stack` checks that nothing leaked before it stops anything: no request left
on the router, every lease released, every instance's integrity, all blocks free or cached and
no reservation left.
"""

import asyncio
import contextlib
import queue
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from credentials import SECRET, channels
from waiting import wait_for

from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    PrefillConfig,
    RouterConfig,
    StorageConfig,
    TransferConfig,
)
from pdserve.engine.request import SamplingParams
from pdserve.rpc.channels import ChannelPool
from services.decode.servicer import serve_decode
from services.mixed.servicer import serve_mixed
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router
from services.router.server import RunningRouter, serve_router

Event = TokenDelta | Finished
MODEL = "tiny"  # the served model name


@dataclass
class Member:
    """One instance and its gRPC server."""

    instance: Any  # PrefillInstance | DecodeInstance | MixedInstance
    server: Any
    port: int
    stopped: bool = False  # stopped by the test: not checked at the end

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop its server and the instance (a test's failure, not the stack's teardown)."""
        self.stopped = True
        self.server.stop(0).wait()
        self.instance.stop()


@dataclass
class Generation:
    """One request's events through the router."""

    events: list[Event]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenDelta) for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenDelta))

    @property
    def final(self) -> Finished:
        final = self.events[-1]
        assert isinstance(final, Finished), "the stream ended without a final event"
        return final


@dataclass
class Stack:
    running: RunningRouter
    prefill: list[Member] = field(default_factory=list)
    decode: list[Member] = field(default_factory=list)
    mixed: list[Member] = field(default_factory=list)
    channels: ChannelPool = field(default_factory=channels)  # the tests' own, for raw stubs

    @property
    def router(self) -> Router:
        return self.running.router

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def members(self) -> list[Member]:
        return [*self.prefill, *self.decode, *self.mixed]

    def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Generation:
        """Every event of one request; raises the router's error."""
        return Generation(list(self.stream(prompt, params, request_id)))

    def stream(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Iterator[Event]:
        """The request's events as the router yields them; leaving the loop early closes the
        router's generator (as a client that goes away does)."""
        events = self.router.generate(request_id or uuid.uuid4().hex, prompt, params)
        replies: queue.Queue[tuple[str, Any]] = queue.Queue()
        pump = asyncio.run_coroutine_threadsafe(_pump(events, replies), self.running.loop)
        try:
            while True:
                kind, item = replies.get(timeout=300)
                if kind == "error":
                    raise item
                if kind == "end":
                    return
                yield item
        finally:
            pump.cancel()

    def check(self) -> None:
        """Raise unless the stack is back to rest: nothing running, leased or reserved."""
        router = self.router
        wait_for(lambda: router.num_running == 0 and router.attempts.load.snapshot() == {})
        router.attempts.load.check_integrity()
        live = [m for m in self.members if not m.stopped]
        for member in self.decode:
            if not member.stopped:
                wait_for(lambda m=member: m.instance.stats().num_running == 0)
        for member in live:
            member.instance.check_integrity()
            stats = member.instance.stats()
            assert stats.num_free_blocks == stats.num_blocks, f"{stats.role} leaked blocks"
            assert stats.num_reservations == 0, f"{stats.role} kept a reservation"


async def _pump(
    events: AsyncGenerator[Event, None], replies: "queue.Queue[tuple[str, Any]]"
) -> None:
    try:
        async for event in events:
            replies.put(("event", event))
        replies.put(("end", None))
    except Exception as e:  # handed to the reading thread
        replies.put(("error", e))
    finally:
        await events.aclose()


@contextlib.contextmanager
def pd_stack(
    model_dir: Path,
    *,
    prefill: int = 1,
    decode: int = 1,
    mixed: int = 0,
    engine: dict[str, Any] | None = None,
    decode_engine: dict[str, Any] | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_config: DecodeConfig | None = None,
    transfer: TransferConfig | None = None,
    storage: StorageConfig | None = None,
    router: dict[str, Any] | None = None,
) -> Iterator[Stack]:
    """A router over `prefill` + `decode` instances (or `mixed` ones) on the model in
    `model_dir`; `engine` and `router` override EngineConfig's and RouterConfig's fields,
    `decode_engine` the decode instances' engine fields over `engine`.
    Checks the stack at rest (`Stack.check`) before stopping it."""
    settings = {"model": str(model_dir), "num_kv_blocks": 256, **(engine or {})}
    engine_config = EngineConfig(**settings)
    decode_engine_config = EngineConfig(**{**settings, **(decode_engine or {})})
    members: dict[str, list[Member]] = {"prefill": [], "decode": [], "mixed": []}
    try:
        for _ in range(mixed):
            members["mixed"].append(
                Member(*serve_mixed(engine_config, storage=storage, secret=SECRET))
            )
        for _ in range(prefill if not mixed else 0):
            members["prefill"].append(Member(*serve_prefill(
                engine_config, prefill_config or PrefillConfig(), storage=storage,
                transfer=transfer, secret=SECRET,
            )))  # fmt: skip
        for _ in range(decode if not mixed else 0):
            members["decode"].append(Member(*serve_decode(
                decode_engine_config, decode_config or DecodeConfig(), storage=storage,
                transfer=transfer, secret=SECRET,
            )))  # fmt: skip
        addresses = {role: [m.address for m in group] for role, group in members.items()}
        with routed(engine_config, **addresses, router=router, members=members) as stack:
            yield stack
    finally:
        for member in (m for group in members.values() for m in group if not m.stopped):
            member.server.stop(0)
            member.instance.stop()


@contextlib.contextmanager
def routed(
    engine_config: EngineConfig,
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
    mixed: Sequence[str] = (),
    *,
    router: dict[str, Any] | None = None,
    members: dict[str, list[Member]] | None = None,
) -> Iterator[Stack]:
    """A router over the instances at these addresses: `members` when this process runs them
    (`pd_stack`), else started elsewhere (Ray actors; the caller checks them). Checks the stack
    at rest (`Stack.check`) before stopping the router. Every prompt goes through a prefill
    instance (`disaggregation: always`: the PD path these stacks test) unless `router` says
    otherwise."""
    defaults = {"port": 0, "model_name": MODEL, "stats_interval_s": 0.1,
                "disaggregation": "always"}  # fmt: skip
    routing = RouterConfig(**{**defaults, **(router or {})})
    running = serve_router(
        routing, engine_config, list(prefill), list(decode), list(mixed), secret=SECRET
    )
    stack = Stack(running, **(members or {}))
    try:
        yield stack
        stack.check()
    finally:
        stack.channels.close()
        running.stop()
        # its KV-event subscriptions end with it, not at their next event
        assert not running.router.kv_events.alive(), "a KV-event follower outlived the router"
