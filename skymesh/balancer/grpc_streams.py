"""The answering side of a bidirectional gRPC stream between balancers (peer heartbeats,
sibling state): read the caller's messages into a handler while sending ours, and stop
sending once the caller's side ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any


async def answer_stream(incoming: AsyncIterable[Any], on_message: Callable[[Any], None],
                        outgoing: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Yield ``outgoing`` while ``incoming`` lasts, each incoming message to ``on_message``."""

    async def read() -> None:
        async for msg in incoming:
            on_message(msg)

    reader = asyncio.create_task(read())
    try:
        async for msg in outgoing:
            if reader.done():
                break
            yield msg
    finally:
        reader.cancel()
