"""Every third-party private API streamdata relies on, one function each, in one place.

A pinned version that changes one of these breaks its test in ``tests/test_compat.py`` rather
than a data loader in production. Each section imports its library inside its functions: the
functions run only where that library is in use already.
"""

from __future__ import annotations

from typing import Any

# --- aiohttp ---


def aiohttp_no_hidden_retry(session: Any) -> None:
    """Stop an aiohttp ``ClientSession`` from re-sending a GET, at once and unseen, when a
    reused connection drops before the answer: retries are ours (by deadline, throttled,
    counted). aiohttp has no public switch: its private ``_retry_connection`` flag."""
    session._retry_connection = False


def aiohttp_forget(session: Any) -> None:
    """Drop an aiohttp ``ClientSession`` inherited through fork without touching its
    connections: finalising it in the child would close the parent's keep-alive sockets under
    the parent (seen: the parent's next request hung until its time-out). Detaches the
    private ``_connector``, marked closed (``_closed``) with its idle connections (``_conns``)
    forgotten, so neither the session's nor the connector's finaliser closes a socket."""
    connector = session._connector
    if connector is not None:
        session._connector = None
        connector._closed = True
        connector._conns.clear()


def aiohttp_payload_reset(exc: BaseException) -> bool:
    """Whether an aiohttp ``ClientPayloadError`` (a body that ended early) ended because the
    connection was reset, not closed cleanly. aiohttp keeps the connection's error only in
    the message it builds (``"Response payload is not completed: <ContentLengthError ...>.
    ConnectionResetError(104, ...)"``); its ``__cause__`` is the parser's error either way."""
    text = str(exc)
    return any(name in text for name in ("ConnectionResetError", "ConnectionAbortedError",
                                          "BrokenPipeError"))


def aiohttp_session_of(fs: Any) -> Any:
    """The aiohttp ``ClientSession`` an fsspec filesystem keeps (HTTP's and gcsfs's private
    ``_session``, made by ``set_session``), or ``None`` (not made yet, or another backend)."""
    import sys

    aiohttp = sys.modules.get("aiohttp")  # a session exists only once aiohttp is imported
    session = getattr(fs, "_session", None)
    return session if aiohttp is not None and isinstance(session, aiohttp.ClientSession) else None
