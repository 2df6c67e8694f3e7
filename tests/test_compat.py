"""Every third-party private API in ``streamdata/_compat.py`` still does what we use it for,
against the pinned version: each test fails if the library changes the private."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from streamdata._compat import (
    aiohttp_forget,
    aiohttp_no_hidden_retry,
    aiohttp_payload_reset,
    aiohttp_session_of,
)
from tests.store.test_h1 import Script, ok, script  # noqa: F401  (the fixture)

# --- aiohttp ---


def test_aiohttp_no_hidden_retry_stops_the_silent_resend(script) -> None:  # noqa: F811
    import aiohttp

    def answer(c, i, head):
        if i == 0:
            c.sendall(ok(b"first"))
            return True
        return False  # read the second request, close without an answer

    server = script(answer)

    async def go():
        async with aiohttp.ClientSession() as session:
            assert session._retry_connection is True  # the private aiohttp re-sends by
            aiohttp_no_hidden_retry(session)
            async with session.get(server.url()) as resp:
                assert await resp.read() == b"first"
            with pytest.raises(aiohttp.ServerDisconnectedError):
                async with session.get(server.url()) as resp:
                    await resp.read()

    asyncio.run(go())
    assert len(server.requests) == 2 and server.connections == 1  # sent once, never re-sent


def test_aiohttp_forget_leaves_the_connections_open(script) -> None:  # noqa: F811
    import aiohttp

    server = script(lambda c, i, head: c.sendall(ok(b"v")) or True)

    async def go():
        session = aiohttp.ClientSession()
        async with session.get(server.url()) as resp:
            await resp.read()  # its connection now idle in the pool
        aiohttp_forget(session)
        assert session.connector is None
        await session.close()  # as a finaliser would: it must not close the inherited socket

    asyncio.run(go())
    time.sleep(0.2)
    assert server.connections == 1 and server.threads[1].is_alive()  # the server never saw EOF


@pytest.mark.parametrize("reset", [True, False])
def test_aiohttp_payload_reset_tells_a_reset_from_a_clean_cut(script, reset: bool) -> None:  # noqa: F811
    import aiohttp

    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"z" * 1000)
        if reset:
            time.sleep(0.3)  # the client has read the bytes sent and waits for more
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        return False

    server = script(answer)

    async def go():
        async with aiohttp.ClientSession() as session, session.get(server.url()) as resp:
            async for _ in resp.content.iter_chunks():
                pass

    with pytest.raises(aiohttp.ClientPayloadError) as info:
        asyncio.run(go())
    assert aiohttp_payload_reset(info.value) is reset


def test_aiohttp_session_of_finds_fsspec_http_session() -> None:
    from fsspec.implementations.http import HTTPFileSystem

    async def go():
        fs = HTTPFileSystem(asynchronous=True, skip_instance_cache=True)
        assert aiohttp_session_of(fs) is None  # not made yet
        session = await fs.set_session()
        assert aiohttp_session_of(fs) is session
        await session.close()

    asyncio.run(go())
    assert aiohttp_session_of(object()) is None
