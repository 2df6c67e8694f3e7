"""Corporate networks on loopback: :class:`ForwardProxy`, an HTTP forward proxy that knows host
names the machine cannot resolve, optionally behind Basic credentials. End-to-end tests use it
to check that the package works behind a proxy. An upstream the proxy cannot reach gets the
client a 502 (absolute-form) or a refused tunnel. The rules of every loop server:
:mod:`streamdata.testing._loop`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from streamdata.testing._loop import (
    _PEER_ERRORS,
    _REQUEST_HOP,
    _RESPONSE_HOP,
    _UNTIL_CLOSE,
    _authority,
    _BadMessage,
    _Head,
    _LoopServer,
    _relay_body,
    _request_framing,
    _response_framing,
    _splice,
    _within,
)

__all__ = ["ForwardProxy"]


@dataclass
class _Upstream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False


class ForwardProxy(_LoopServer):
    """An HTTP/1.1 forward proxy on a loopback port, as a corporate network has one.

    - ``http://`` URLs come as absolute-form requests (``GET http://host:port/path``): each
      is forwarded to its origin and the answer relayed, bodies streamed as framed
      (Content-Length, chunked, or up to the close); the client's connection is kept alive
      across requests, each client connection keeping one upstream connection per origin.
    - ``https://`` goes through ``CONNECT host:port`` tunnels (bytes spliced both ways).
    - ``hosts`` maps names to addresses that only the proxy knows (``{"bucket.corp.test":
      "127.0.0.1"}``); a ``"*.corp.test"`` key covers every name under ``corp.test`` (for
      virtual-hosted S3: ``<bucket>.s3.corp.test``); other names go to the system resolver.
    - ``auth=(user, password)`` requires ``Proxy-Authorization: Basic`` on every request and
      CONNECT, answering 407 with ``Proxy-Authenticate`` otherwise.
    - An origin that cannot be reached or fails before its answer gets the client a 502.

    Counters: ``requests`` ((method, target) of every request seen, denied ones included),
    ``connections`` (client connections accepted) and ``denied`` (407s sent).

    Clients take it as ``url`` (``url_with_auth`` carries the credentials) for both schemes:
    urllib ``ProxyHandler({"http": url, "https": url})``; botocore/boto3
    ``Config(proxies={"http": url, "https": url})``; s3fs ``config_kwargs={"proxies": {...}}``;
    aiohttp ``session.get(..., proxy=url)``; http.client a connection to the proxy with
    absolute URLs, or ``HTTPSConnection(proxy).set_tunnel(host, port, headers=...)``
    (``authorization`` is the header's value). Environment variables (``HTTP_PROXY``...)
    work for clients that read them, but ``NO_PROXY`` often lists 127.0.0.1 and localhost:
    use names from ``hosts``.
    """

    _kind = "proxy"

    def __init__(self, hosts: Mapping[str, str] | None = None, *, auth: tuple[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 60.0,
                 realm: str = "streamdata test proxy") -> None:
        super().__init__(host, port, timeout)
        # Lower-case names, without a trailing dot; may be changed while the proxy runs.
        self.hosts = {name.lower().rstrip("."): address for name, address in (hosts or {}).items()}
        self.auth = auth
        self.realm = realm
        self._requests: list[tuple[str, str]] = []
        self._denied = 0

    @property
    def url(self) -> str:
        host, port = self._address()
        return f"http://{host}:{port}"

    @property
    def url_with_auth(self) -> str:
        """``url`` with the credentials in it (``http://user:pass@host:port``); ``url`` without auth."""
        host, port = self._address()
        if self.auth is None:
            return self.url
        user, password = (quote(part, safe="") for part in self.auth)
        return f"http://{user}:{password}@{host}:{port}"

    @property
    def authorization(self) -> str | None:
        """The ``Proxy-Authorization`` value the proxy wants (for ``set_tunnel(headers=...)``)."""
        if self.auth is None:
            return None
        return "Basic " + base64.b64encode(":".join(self.auth).encode()).decode("ascii")

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._requests)

    @property
    def denied(self) -> int:
        with self._lock:
            return self._denied

    def reset_counters(self) -> None:
        super().reset_counters()
        with self._lock:
            self._requests.clear()
            self._denied = 0

    def resolve(self, name: str) -> str:
        """The address the proxy connects to for ``name``: its entry in ``hosts``, else the
        longest matching ``*.suffix`` entry there, else ``name`` itself (the system resolver)."""
        name = name.lower().rstrip(".")
        if name in self.hosts:
            return self.hosts[name]
        labels = name.split(".")
        for start in range(1, len(labels)):
            address = self.hosts.get("*." + ".".join(labels[start:]))
            if address is not None:
                return address
        return name

    def __repr__(self) -> str:
        return f"ForwardProxy(port={self.port}, hosts={self.hosts}, auth={self.auth is not None})"

    # -- one client connection ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstreams: dict[tuple[str, int], _Upstream] = {}
        try:
            while True:
                try:  # an idle keep-alive connection waits for its next request up to `timeout`
                    raw = await _within(self.timeout, reader.readuntil(b"\r\n\r\n"))
                except asyncio.IncompleteReadError:
                    return  # the client hung up between requests
                if not await self._request(raw, reader, writer, upstreams):
                    return
        finally:
            for upstream in upstreams.values():
                self._release(upstream.writer)

    async def _request(self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       upstreams: dict[tuple[str, int], _Upstream]) -> bool:
        """Answer one request; whether the client connection stays open for another."""
        try:
            head = _Head.parse(raw)
            method, target, version = head.line.split(" ")
            if not version.startswith("HTTP/1."):
                raise _BadMessage(f"not HTTP/1.x: {head.line[:80]!r}")
            with self._lock:
                self._requests.append((method, target))
            framing = _request_framing(head)
        except (ValueError, _BadMessage) as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return False
        if not self._authorized(head):
            with self._lock:
                self._denied += 1
            # With a body on its way the connection cannot be reused: this proxy reads none.
            close = framing != 0
            await self._answer(writer, 407, "Proxy Authentication Required",
                               "proxy authentication required\n", close=close,
                               fields=[("Proxy-Authenticate", f'Basic realm="{self.realm}"')])
            return not close
        if method == "CONNECT":
            await self._tunnel(target, reader, writer)
            return False
        return await self._forward(method, target, version, head, framing, reader, writer, upstreams)

    def _authorized(self, head: _Head) -> bool:
        if self.auth is None:
            return True
        scheme, _, token = (head.get("proxy-authorization") or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return given == ":".join(self.auth)

    async def _answer(self, writer: asyncio.StreamWriter, status: int, reason: str, text: str, *,
                      close: bool = True, fields: Iterable[tuple[str, str]] = ()) -> None:
        body = text.encode("utf-8", "replace")
        head = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                *fields, *([("Connection", "close")] if close else [])]
        writer.write(_Head.render(f"HTTP/1.1 {status} {reason}", head) + body)
        await _within(self.timeout, writer.drain())

    async def _tunnel(self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            host, port = _authority(target)
        except ValueError as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return
        try:
            up_reader, up_writer = await self._open(self.resolve(host), port)
        except OSError as err:
            await self._answer(writer, 502, "Bad Gateway", f"cannot reach {target}: {err!r}\n")
            return
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await _splice(reader, writer, up_reader, up_writer, self.timeout)
        finally:
            self._release(up_writer)

    async def _forward(self, method: str, target: str, version: str, head: _Head, framing: int,
                       reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       upstreams: dict[tuple[str, int], _Upstream]) -> bool:
        parts = urlsplit(target)
        try:
            if parts.scheme.lower() != "http" or not parts.hostname:
                raise ValueError(f"this proxy forwards http:// absolute-form requests and CONNECT, "
                                 f"not {target[:80]!r}")
            port = parts.port or 80
        except ValueError as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return False
        origin = (parts.hostname, port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        tokens = set(head.tokens("connection", "proxy-connection"))
        client_close = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        fields = [(k, v) for k, v in head.fields if k.lower() not in _REQUEST_HOP | tokens]
        if head.get("host") is None:
            fields.insert(0, ("Host", parts.netloc.rpartition("@")[2]))
        request = _Head.render(f"{method} {path} {version}", fields)

        may_retry = True
        while True:
            upstream = upstreams.pop(origin, None)
            if upstream is not None and (upstream.reader.at_eof() or upstream.writer.is_closing()):
                self._release(upstream.writer)
                upstream = None
            if upstream is None:
                try:
                    upstream = _Upstream(*await self._open(self.resolve(origin[0]), origin[1]))
                except OSError as err:
                    await self._answer(writer, 502, "Bad Gateway",
                                       f"cannot reach {origin[0]}:{origin[1]}: {err!r}\n")
                    return False
            upstream.writer.write(request)
            # The body goes up while the answer is awaited: an origin may answer
            # "100 Continue" first (the client waits for it) or a final status early.
            sender = (asyncio.create_task(_relay_body(reader, upstream.writer, framing, self.timeout))
                      if framing else None)
            try:
                status, answer = await self._answer_head(upstream, writer)
                response_framing = _response_framing(method, status, answer)
            except _PEER_ERRORS as err:
                self._release(upstream.writer)
                if sender is not None:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
                elif upstream.reused and may_retry:
                    may_retry = False  # a kept connection the origin had closed meanwhile:
                    continue           # once more on a new one (nothing was taken from the client)
                await self._answer(writer, 502, "Bad Gateway",
                                   f"{origin[0]}:{origin[1]} did not answer: {err!r}\n")
                return False
            break

        reply_tokens = set(answer.tokens("connection"))
        upstream_close = ("close" in reply_tokens or response_framing == _UNTIL_CLOSE
                          or (answer.line.startswith("HTTP/1.0") and "keep-alive" not in reply_tokens))
        client_close = client_close or response_framing == _UNTIL_CLOSE
        fields = [(k, v) for k, v in answer.fields if k.lower() not in _RESPONSE_HOP | reply_tokens]
        if client_close:
            fields.append(("Connection", "close"))
        try:
            writer.write(_Head.render(answer.line, fields))
            await _relay_body(upstream.reader, writer, response_framing, self.timeout)
            if sender is not None:
                await _within(self.timeout, sender)
        except _PEER_ERRORS:
            # Mid-body, or a request body not taken whole: neither connection is in step.
            self._release(upstream.writer)
            if sender is not None:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
            return False
        if upstream_close:
            self._release(upstream.writer)
        else:
            upstream.reused = True
            upstreams[origin] = upstream
        return not client_close

    async def _answer_head(self, upstream: _Upstream, writer: asyncio.StreamWriter) -> tuple[int, _Head]:
        """The origin's final status and head; interim (1xx) answers are relayed on the way."""
        while True:
            raw = await _within(self.timeout, upstream.reader.readuntil(b"\r\n\r\n"))
            head = _Head.parse(raw)
            version, _, rest = head.line.partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise _BadMessage(f"not an HTTP/1.x status line: {head.line[:80]!r}")
            status = int(code)
            if status == 101:
                raise _BadMessage("the origin switched protocols, which this relay does not follow")
            if status >= 200:
                return status, head
            writer.write(_Head.render(head.line, head.fields))
