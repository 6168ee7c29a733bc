"""The router's async generators, driven from synchronous tests."""

import asyncio
from collections.abc import AsyncGenerator
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
