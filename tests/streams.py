"""The router's async generators, driven from synchronous tests, and the async face of the
tests' fake PD clients (whose scripts are plain generators)."""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any


def collect(stream: AsyncGenerator[Any, None], into: list[Any] | None = None) -> list[Any]:
    """Every event of `stream` (appended to `into` as they come, so a test sees what arrived
    before an error)."""
    events = into if into is not None else []

    async def drain() -> None:
        async for event in stream:
            events.append(event)

    asyncio.run(drain())
    return events


class AsyncFace:
    """`agenerate` / `agenerate_mixed` over the fake's `generate` / `generate_mixed` (the
    prompt's hash chain the router sends along is not the fakes' business)."""

    def generate(self, *args: Any) -> Iterator[Any]:
        raise NotImplementedError

    def generate_mixed(self, *args: Any) -> Iterator[Any]:
        raise NotImplementedError

    async def agenerate(self, *args: Any) -> AsyncIterator[Any]:
        for event in self.generate(*args[:5]):
            yield event

    async def agenerate_mixed(self, *args: Any) -> AsyncIterator[Any]:
        for event in self.generate_mixed(*args[:4]):
            yield event
