"""The exception hierarchy of streamdata.

Every error we raise derives from :class:`StreamDataError` *and* from the built-in
exception an existing ``except`` clause would already catch (``OSError`` for I/O,
``ValueError`` for bad input, ``TimeoutError`` for time-outs), the way fsspec's
``FSTimeoutError`` subclasses ``asyncio.TimeoutError``.  Each carries the context a
user needs to find the problem: the URL, the shard, the worker.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "BackendMissingError",
    "DecodeError",
    "FetchTimeoutError",
    "FormatError",
    "ShardFetchError",
    "ShardNotFoundError",
    "SharedMemoryError",
    "SpecError",
    "StreamDataError",
]


class StreamDataError(Exception):
    """Base of every exception raised by streamdata.

    ``url`` names the object involved (or ``None``), ``where`` says which stage,
    rank and worker saw it (filled in when an error crosses a thread or process).
    """

    def __init__(self, message: str, *, url: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.where = where

    def __str__(self) -> str:
        text = self.message
        if self.url and self.url not in text:
            text = f"{text} [url: {self.url}]"
        if self.where:
            text = f"{text} [{self.where}]"
        return text

    def __reduce__(self):  # keep the context when pickled across a DataLoader worker pipe
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls: type, message: str, state: dict) -> StreamDataError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class SpecError(StreamDataError, ValueError):
    """A shard spec or option is unusable: empty expansion, unknown protocol, bad option."""


class BackendMissingError(StreamDataError, ImportError):
    """The fsspec backend (or other optional package) a URL needs is not installed."""


class ShardFetchError(StreamDataError, OSError):
    """Reading an object failed after the configured retries."""


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
        self.key = key


class FormatError(DecodeError):
    """A shard is corrupt or truncated (bad tar header, unreadable Parquet row group)."""


class SharedMemoryError(StreamDataError, RuntimeError):
    """A batch could not be placed in shared memory (``/dev/shm`` too small)."""
