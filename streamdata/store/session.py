"""The one GET contract of the store layer, aiohttp adapted to it, and transport errors typed.

A ``Session`` sends one GET (``async with session.get(url, headers, timeout) as resp``) and
hands back a ``Response``: its ``status``, its ``headers`` (``get`` takes any case), its body
as the chunks that arrived (``chunks()``, or ``read()`` for all of it) and ``release()``
(done by the ``async with``): the connection is reused only if the body was read to its end.
Two sessions implement it: our HTTP/1.1 client (``http1.Pool``, LITE-HTTP) and aiohttp's
``ClientSession`` through ``AiohttpSession``. Neither re-sends anything: retries are the
caller's (``client.AsyncClient._retrying``, by deadline, counted).

Invariant (TYPED-TRANSPORT-ERRORS): a request that fails below HTTP raises one of
``errors.TransportError``'s subclasses from either session, the same type for the same fault
(``transport_error`` translates aiohttp's exceptions and the socket's at each session's
boundary), and ``retry.classify`` decides by that type alone.
"""

from __future__ import annotations

import errno
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from streamdata._compat import aiohttp_forget, aiohttp_no_hidden_retry, aiohttp_payload_reset
from streamdata.errors import (
    CertificateError,
    ConnectFailedError,
    ConnectionLostError,
    ConnectRefusedError,
    NameResolutionError,
    ShortBodyError,
    StreamDataError,
    TransportError,
    TransportTimeoutError,
)
from streamdata.store.network import Network, certificate_hint, resolution_hint

__all__ = ["AiohttpSession", "Response", "Session", "connect_error", "transport_error"]


class Response(Protocol):
    """One answer: status and headers read, the body still on the connection."""

    status: int

    @property
    def headers(self) -> Mapping[str, str]:
        """By name, any case."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes in the pieces they arrived in."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def release(self, failed: bool = False) -> None:
        """Give the connection back: reused only if the body was read to its end and not
        ``failed``; else closed. Idempotent."""
        ...


class Session(Protocol):
    """Sends GETs on connections of its own (kept alive, at most ``limit`` in use), through
    the proxies and with the trust its ``network`` decides (``network``;
    ``None``: direct, the system's trust store)."""

    network: Network | None

    def get(self, url: str, headers: Mapping[str, str] | None = None,
            timeout: float | None = None) -> AbstractAsyncContextManager[Response]:
        """``async with session.get(url, headers, timeout) as resp``: one GET, never re-sent;
        ``timeout`` bounds connecting and each wait for bytes (the session's own if ``None``).
        Failures below HTTP raise ``TransportError``'s subclasses."""
        ...

    async def close(self) -> None:
        """Close every connection (on the session's loop)."""
        ...

    def forget(self) -> None:
        """FORK-RESET in a child: drop the inherited connections without closing them."""
        ...


# ---- aiohttp behind the contract ---------------------------------------------------------------


class AiohttpSession:
    """An aiohttp ``ClientSession`` as a ``Session``: its errors translated (``transport_error``),
    its hidden re-send off. ``options``: keyword arguments every request takes (fsspec HTTP's
    ``client_kwargs``: auth, ssl, ...)."""

    def __init__(self, session: Any, options: Mapping[str, Any] | None = None, *, owned: bool = True,
                 network: Network | None = None) -> None:
        self.session = session
        self.options = dict(options or {})
        self.owned = owned  # closed by ``close``; a borrowed one (fsspec's) is its owner's to close
        self.network = network  # proxies and certificates (``network``) per request; None: aiohttp's own
        aiohttp_no_hidden_retry(session)

    @classmethod
    def new(cls, limit: int, network: Network | None = None) -> AiohttpSession:
        """A session of its own, at most ``limit`` connections in use."""
        import aiohttp

        return cls(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)), network=network)

    def get(self, url: Any, headers: Mapping[str, str] | None = None,
            timeout: float | None = None) -> _AiohttpGet:
        """As ``Session.get``; ``url`` may be a ``yarl.URL`` too (fsspec HTTP's ``encode_url``:
        sent as it is encoded)."""
        return _AiohttpGet(self, url, dict(headers or {}), timeout)

    async def close(self) -> None:
        if self.owned:
            await self.session.close()

    def forget(self) -> None:
        aiohttp_forget(self.session)


class _AiohttpGet:
    def __init__(self, owner: AiohttpSession, url: Any, headers: dict[str, str],
                 timeout: float | None) -> None:
        self.owner, self.url, self.headers, self.timeout = owner, url, headers, timeout
        self.where = str(url)  # for errors
        self.resp: _AiohttpResponse | None = None

    async def __aenter__(self) -> _AiohttpResponse:
        options = dict(self.owner.options)
        options["headers"] = {**(options.get("headers") or {}), **self.headers}
        if self.timeout is not None:
            import aiohttp

            options["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                                       sock_read=self.timeout)
        net = self.owner.network
        if net is not None:
            proxy = net.proxy(self.where)
            if proxy is not None and "proxy" not in options:
                options["proxy"] = f"http://{proxy.host}:{proxy.port}"
                if proxy.authorization:
                    options["proxy_headers"] = {"Proxy-Authorization": proxy.authorization}
            if self.where.startswith("https:") and "ssl" not in options:
                options["ssl"] = net.ssl_context(self.where)
        try:
            raw = await self.owner.session.get(self.url, **options)
        except Exception as exc:
            raise connect_error(exc, self.where, net) from exc
        self.resp = _AiohttpResponse(raw, self.where)
        return self.resp

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self.resp is not None:
            self.resp.release(failed=kind is not None)


class _AiohttpResponse:
    def __init__(self, raw: Any, url: str) -> None:
        self.raw, self.url = raw, url
        self.status: int = raw.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.raw.headers  # a case-insensitive multidict

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for piece, _ in self.raw.content.iter_chunks():
                yield piece
        except Exception as exc:
            raise transport_error(exc, self.url) from exc

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def release(self, failed: bool = False) -> None:
        if failed:
            self.raw.close()  # the connection is dropped, never reused half read
        else:
            self.raw.release()  # reused only if the body was read to its end (aiohttp's rule)


# ---- transport errors by type -------------------------------------------------------------------

_LOST = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE})
_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN,
                          errno.EHOSTDOWN})


def transport_error(exc: BaseException, url: str | None = None) -> BaseException:
    """``exc`` as one of ours if it is a failure below HTTP (aiohttp's client errors, the
    socket's, ssl's), chained to it; any other exception unchanged. By type only."""
    if isinstance(exc, StreamDataError):
        return exc
    kind = _foreign_kind(exc)
    if kind is None:
        return exc
    err = kind(f"GET {url or 'a URL'}: {type(exc).__name__}: {exc}", url=url)
    code = getattr(exc, "errno", None)
    if isinstance(code, int):
        err.errno = code
    err.__cause__ = exc
    return err


def connect_error(exc: BaseException, url: str, network: Network | None = None,
                  via: str = "") -> BaseException:
    """``transport_error(exc, url)``, its message saying what to do where that is known: an
    untrusted certificate (``network.certificate_hint``), a host name that does not resolve
    (``network.resolution_hint``: whether a proxy is configured, which variable routes it).
    ``via``: how the connection went (" through proxy ..."), for the message."""
    err = transport_error(exc, url)
    if not isinstance(err, TransportError) or isinstance(exc, StreamDataError):
        return err
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or url
    hint = None
    if isinstance(err, CertificateError):
        hint = certificate_hint(host, network)
    elif isinstance(err, NameResolutionError) and not via:
        hint = resolution_hint(host, url, network)
    if not (via or hint):
        return err
    text = f"GET {url}{via}: {type(exc).__name__}: {exc}" + (f"; {hint}" if hint else "")
    hinted = type(err)(text, url=url)
    hinted.errno = err.errno
    hinted.__cause__ = exc
    return hinted


def _foreign_kind(exc: BaseException) -> type[TransportError] | None:
    aiohttp = sys.modules.get("aiohttp")  # an aiohttp error exists only once aiohttp is imported
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return CertificateError
        if isinstance(exc, aiohttp.ClientConnectorError):
            return _builtin_kind(exc.os_error, connecting=True) or ConnectFailedError
        if isinstance(exc, aiohttp.ServerTimeoutError):
            return TransportTimeoutError
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            return ConnectionLostError
        if isinstance(exc, aiohttp.ClientPayloadError):
            return ConnectionLostError if aiohttp_payload_reset(exc) else ShortBodyError
        if isinstance(exc, aiohttp.ClientOSError):
            return _builtin_kind(exc) or TransportError
        if isinstance(exc, aiohttp.ClientConnectionError):
            return TransportError
        return None  # a status error (ClientResponseError), a bad URL: not the transport's
    return _builtin_kind(exc)


def _builtin_kind(exc: BaseException, connecting: bool = False) -> type[TransportError] | None:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return CertificateError
    if isinstance(exc, socket.gaierror):
        return NameResolutionError
    if isinstance(exc, ConnectionRefusedError):
        return ConnectRefusedError
    if isinstance(exc, TimeoutError):
        return TransportTimeoutError
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return ConnectionLostError
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if code == errno.ECONNREFUSED:
        return ConnectRefusedError
    if code in _LOST:
        return ConnectionLostError
    if code in _UNREACHABLE:
        return ConnectFailedError
    if isinstance(exc, ssl.SSLError):  # a TLS handshake or record that failed
        return ConnectFailedError if connecting else ConnectionLostError
    if isinstance(exc, ConnectionError):
        return TransportError
    return None

