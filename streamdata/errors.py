"""The exception hierarchy of streamdata.

Every error we raise derives from :class:`StreamDataError` *and* from the built-in
exception an existing ``except`` clause would already catch (``OSError`` for I/O,
``ValueError`` for bad input, ``TimeoutError`` for time-outs), the way fsspec's
``FSTimeoutError`` subclasses ``asyncio.TimeoutError``.  Each carries the context a
user needs to find the problem: the URL, the sample key, the rank and worker.

Invariant (CONTEXT-ACROSS-PROCESSES): a DataLoader worker does not pickle the exception
it raises; torch sends its formatted traceback and the main process rebuilds it as
``type(text)``.  So ``str()`` of our errors always ends with the labelled context fields
(``[url: ...] [key: ...] [where: ...]``), and a constructor called with torch's text alone
reads them back from the traceback's last line: the rebuilt error has its type, ``url``,
``key`` and ``where``.  Pickling (``__reduce__``) keeps them too.

Invariant (REDACTED-AT-BIRTH): an error's message and ``url`` are redacted
(``redact.redact``: passwords, signatures, tokens, access key ids) when it is constructed,
so ``str()``, ``repr()``, ``.url``, pickles, log lines and the traceback text a worker sends
carry no secret. The exceptions it is chained to (``__cause__``, ``__context__``: a
botocore or aiohttp error can quote a presigned URL) are redacted when they are attached
and again when read, which is how ``traceback`` and torch's worker wrapper reach them.
"""


from __future__ import annotations

import re
import socket
import ssl
from typing import Any

from streamdata.redact import redact, redact_exception, redact_url

__all__ = [
    "AccessDeniedError",
    "BackendMissingError",
    "BadResponseError",
    "CertificateError",
    "ConnectFailedError",
    "ConnectRefusedError",
    "ConnectionLostError",
    "DecodeError",
    "FetchTimeoutError",
    "FormatError",
    "NameResolutionError",
    "ProxyAuthError",
    "ProxyError",
    "ShardFetchError",
    "ShardNotFoundError",
    "SharedMemoryError",
    "ShortBodyError",
    "ShortReadError",
    "SpecError",
    "StaleIndexError",
    "StreamDataError",
    "TransportError",
    "TransportTimeoutError",
]


class StreamDataError(Exception):
    """Base of every exception raised by streamdata.

    ``url`` names the object involved (or ``None``), ``where`` says which stage,
    rank and worker saw it (filled in when an error crosses a thread or process).
    """

    key: str | None = None
    _redacts_itself = True  # see redact.redact_exception

    def __init__(self, message: str, *, url: str | None = None, where: str | None = None) -> None:
        message = redact(message)  # REDACTED-AT-BIRTH
        super().__init__(message)
        self.message = message
        self.url = redact_url(url)
        self.where = where
        if url is None and where is None and _WORKER_TEXT in message:
            self.url, self.key, self.where = _context_from_traceback(type(self), message)

    def __str__(self) -> str:
        text = self.message
        if _WORKER_TEXT in text:  # rebuilt from a worker's traceback: the context is in it
            return text
        for label, value in (("url", self.url), ("key", self.key), ("where", self.where)):
            if value:
                text = f"{text} [{label}: {value}]"
        return redact(text)  # a message edited after construction, too

    # REDACTED-AT-BIRTH: the chained exceptions' text, for whatever prints the traceback
    @property
    def __cause__(self) -> BaseException | None:
        return _redacted_link(self, _CAUSE)

    @__cause__.setter
    def __cause__(self, value: BaseException | None) -> None:
        _CAUSE.__set__(self, redact_exception(value))

    @property
    def __context__(self) -> BaseException | None:
        return _redacted_link(self, _CONTEXT)

    @__context__.setter
    def __context__(self, value: BaseException | None) -> None:
        _CONTEXT.__set__(self, redact_exception(value))

    def __reduce__(self):  # keep the context when pickled across a DataLoader worker pipe
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


# the built-in descriptors behind the two links (getset descriptors: ``__get__``, ``__set__``)
_CAUSE: Any = BaseException.__dict__["__cause__"]
_CONTEXT: Any = BaseException.__dict__["__context__"]


def _redacted_link(err: BaseException, link: Any) -> BaseException | None:
    """The exception ``err`` is chained to through ``link``, redacted (``raise ... from``
    sets the link without going through the setter)."""
    raw = link.__get__(err)
    clean = redact_exception(raw)
    if clean is not raw:
        suppress = err.__suppress_context__
        link.__set__(err, clean)
        err.__suppress_context__ = suppress
    return clean


# what torch's ExceptionWrapper.reraise puts in the text it rebuilds a worker's error from
_WORKER_TEXT = "Original Traceback (most recent call last)"
_FIELDS = re.compile(r"(?: \[url: (?P<url>.+?)\])?(?: \[key: (?P<key>.+?)\])?"
                     r"(?: \[where: (?P<where>.+?)\])?$")


def _context_from_traceback(cls: type, text: str) -> tuple[str | None, str | None, str | None]:
    """``(url, key, where)`` from the last line of a traceback that names ``cls``
    (see CONTEXT-ACROSS-PROCESSES); ``None`` for fields it does not carry."""
    header = f"\n{cls.__module__}.{cls.__qualname__}: "
    at = text.rfind(header)  # the exception raised last; its message may span lines
    if at < 0:
        return None, None, None
    match = _FIELDS.search(text[at + len(header):].rstrip().rsplit("\n", 1)[-1])
    if match is None:  # never: every group is optional and the pattern is anchored at the end
        return None, None, None
    return match.group("url"), match.group("key"), match.group("where")


def _rebuild(cls: type[StreamDataError], message: str, state: dict) -> StreamDataError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class SpecError(StreamDataError, ValueError):
    """A shard spec or option is unusable: empty expansion, unknown protocol, bad option."""


class StaleIndexError(SpecError):
    """A sample index no longer matches its shards (a size or ETag changed): build it again."""


class BackendMissingError(StreamDataError, ImportError):
    """The fsspec backend (or other optional package) a URL needs is not installed."""


class ShardFetchError(StreamDataError, OSError):
    """Reading an object failed after the configured retries."""


class ShortReadError(ShardFetchError):
    """An answer was complete but shorter than the range asked for: the object is shorter
    than listed, or changed. Retried twice at most (a blip), then final."""


class ShardNotFoundError(ShardFetchError, FileNotFoundError):
    """The object, prefix or bucket does not exist."""


class AccessDeniedError(ShardFetchError, PermissionError):
    """The storage refused the request: missing or wrong credentials, or no permission."""


class FetchTimeoutError(StreamDataError, TimeoutError):
    """A request, or a wait for fetched bytes, took longer than the configured limit."""


class DecodeError(StreamDataError, ValueError):
    """A sample could not be decoded; names the shard URL and the sample key."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None,
                 where: str | None = None) -> None:
        super().__init__(message, url=url, where=where)
        if key is not None:
            self.key = key


class FormatError(DecodeError):
    """A shard is corrupt or truncated (bad tar header, unreadable Parquet row group)."""


class SharedMemoryError(StreamDataError, RuntimeError):
    """A batch could not be placed in shared memory (``/dev/shm`` too small)."""


class TransportError(StreamDataError, OSError):
    """A request failed below HTTP: no complete answer came back. Raised by both HTTP sessions
    (``store.http1`` and the aiohttp adapter in ``store.session``), so ``store.retry.classify``
    decides by type. The tree (each also the built-in an existing ``except`` clause catches)::

        TransportError (OSError)                      retried: "connection"
        +-- ConnectFailedError (ConnectionError)      no connection could be opened
        |   +-- ConnectRefusedError (ConnectionRefusedError)
        |   +-- NameResolutionError (socket.gaierror)
        +-- ConnectionLostError (ConnectionResetError)  reset or closed before the answer's end
        +-- ShortBodyError (ConnectionError)          retried: "short": closed cleanly before
        |                                             the body's declared end
        +-- BadResponseError (ConnectionError)        an answer that is not readable HTTP/1.1
        +-- TransportTimeoutError (TimeoutError)      retried: "timeout": no connection or no
        |                                             bytes within the timeout
        +-- CertificateError (ssl.SSLCertVerificationError)  NOT retried: the server's TLS
        |                                             certificate is not trusted
        +-- ProxyError (ConnectionError)              the forward proxy would not open the way
            +-- ProxyAuthError (PermissionError)      NOT retried: the proxy wants credentials
    """


class ConnectFailedError(TransportError, ConnectionError):
    """No connection to the server could be opened (unreachable, a TLS handshake that failed)."""


class ConnectRefusedError(ConnectFailedError, ConnectionRefusedError):
    """The server refused the connection: nothing listens there (yet)."""


class NameResolutionError(ConnectFailedError, socket.gaierror):
    """The server's host name could not be resolved."""


class ConnectionLostError(TransportError, ConnectionResetError):
    """The connection was reset, or closed before the answer's head was complete."""


class ShortBodyError(TransportError, ConnectionError):
    """The connection ended cleanly before the body did (``Content-Length`` or chunked framing)."""


class BadResponseError(TransportError, ConnectionError):
    """The server's answer is not HTTP/1.1 this client can read; the connection is closed."""


class TransportTimeoutError(TransportError, TimeoutError):
    """No connection, or no bytes of an answer, within the request's timeout."""


class CertificateError(TransportError, ssl.SSLCertVerificationError):
    """The server's TLS certificate failed verification: a retry cannot fix it. Trust its CA
    (``AWS_CA_BUNDLE``, ``REQUESTS_CA_BUNDLE``, ``SSL_CERT_FILE``, or ``verify=`` in the storage
    options) or fix the endpoint."""


class ProxyError(TransportError, ConnectionError):
    """The forward proxy answered a ``CONNECT`` with an error (it could not reach the host)."""


class ProxyAuthError(ProxyError, PermissionError):
    """The forward proxy asked for credentials (407): give them in the proxy's URL."""
