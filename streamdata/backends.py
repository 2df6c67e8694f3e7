"""Backend plumbing: fsspec filesystems per protocol, S3 sessions and signers, error translation.

What a URL means is ``urls``' business; this module turns a protocol and storage options
into a working filesystem, closes it cleanly, and maps backend exceptions to ours.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from typing import Any

from .config import env_snapshot
from .errors import (
    AccessDeniedError,
    BackendMissingError,
    FetchTimeoutError,
    ShardFetchError,
    ShardNotFoundError,
    SpecError,
    StreamDataError,
)

__all__ = ["close_filesystem", "close_sessions", "filesystem", "inherited_signer", "signer_key",
           "translate_error"]

# protocol -> the pip extra / package that provides it, for BackendMissingError
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
             "https": "aiohttp", "hdfs": "pyarrow (and a Hadoop client: JAVA_HOME, HADOOP_HOME, CLASSPATH)"}


def filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None, *,
               url: str | None = None, **extra: Any):
    """A fresh fsspec filesystem for ``protocol``, never the instance cache (LOOP-AFTER-FORK, ``_aio``).

    ``url`` contributes what the URL itself carries (an HDFS name node's host and port).
    """
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        need = _BACKENDS.get(protocol, "the fsspec backend for it")
        raise BackendMissingError(
            f"reading {protocol}:// URLs needs {need}: pip install 'streamdata' brings it, "
            f"or install it directly ({exc})") from exc
    except ValueError as exc:
        raise SpecError(f"unknown protocol {protocol!r}: use s3://, gs://, hdfs://, http(s)://, "
                        "file:// or a local path") from exc
    options = dict(cls._get_kwargs_from_urls(url)) if url else {}
    options.update(storage_options or {})
    options.update(extra)
    if protocol in ("s3", "s3a") and not {"session", "profile"} & set(options):
        options["session"] = _s3_session()
    try:
        fs = cls(skip_instance_cache=True, **options)
        fs._streamdata_signer_key = signer_key(protocol, storage_options)
        return fs
    except TypeError as exc:
        raise SpecError(f"storage_options not accepted by {cls.__name__}: {exc}") from exc
    except (ImportError, OSError) as exc:
        need = _BACKENDS.get(protocol, "its client libraries")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendMissingError(f"the {protocol}:// backend could not start ({first}); it needs "
                                  f"{need}", url=url) from exc


async def close_sessions(fs: Any) -> None:
    """Close an fsspec async backend's connections: s3fs's botocore client, or the aiohttp
    session of gcsfs and HTTP. Run on the filesystem's own loop."""
    creator = getattr(fs, "_s3creator", None)
    if creator is not None and hasattr(creator, "__aexit__"):
        key = getattr(fs, "_streamdata_signer_key", None)
        if key is not None and getattr(fs, "_s3", None) is not None:
            _SIGNERS.setdefault(key, fs._s3)  # still signs once closed: see inherited_signer
        await creator.__aexit__(None, None, None)
        fs._s3creator = fs._s3 = None
        _detach_finalizers(fs)
    session = getattr(fs, "_session", None)
    if session is not None and not session.closed:
        await session.close()


# SIGNER-REUSE: the botocore S3 client of a closed listing filesystem, kept by the storage
# options it was made with. Presigning a URL is CPU work only (no connection, no loop of its
# own), so the process that listed, and every DataLoader worker forked from it, signs with
# this client instead of building one: building it cost each worker 0.1-0.2 s of CPU per
# pass (botocore parses S3's endpoint rules anew for every client), all of it before the
# first request. Spawned workers start without it and build their own, as before.
_SIGNERS: dict[str, Any] = {}


# environment variables botocore reads when it builds a client: part of a signer's identity
_SIGNER_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
               "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_S3_ADDRESSING_STYLE")


def signer_key(protocol: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """The key of :data:`_SIGNERS` for these options (and the AWS environment);
    ``None`` where a signer is not shared."""
    options = dict(storage_options or {})
    if protocol not in ("s3", "s3a") or {"session", "cache_regions"} & set(options):
        return None
    env = env_snapshot(_SIGNER_ENV)
    try:
        return json.dumps([options, env], sort_keys=True)
    except (TypeError, ValueError):  # options that are not plain data (a credentials object...)
        return None


def inherited_signer(protocol: str, storage_options: Mapping[str, Any] | None) -> Any:
    """A closed S3 client that can presign URLs for these options, if this process has one."""
    key = signer_key(protocol, storage_options)
    return _SIGNERS.get(key) if key is not None else None


def _detach_finalizers(fs: Any) -> None:
    """Drop the ``weakref.finalize`` hooks s3fs registered to close ``fs``'s client: it is
    closed already. Left in place, the hook runs when ``fs`` is collected, and in a forked
    DataLoader worker it waits on the parent's loop, which looks running there but is not:
    measured, a worker stalled one second per such filesystem before its first request."""
    for hook in list(getattr(weakref.finalize, "_registry", {})):
        info = hook.peek()
        if info is not None and info[0] is fs:
            hook.detach()


def close_filesystem(fs: Any) -> None:
    """Close a sync fsspec filesystem's connections now, on its own loop.

    Left to the garbage collector, s3fs closes them from whatever thread collects, which
    may be another reader's loop thread ("attached to a different loop").
    """
    loop = getattr(fs, "loop", None)
    if getattr(fs, "asynchronous", True) or loop is None or not loop.is_running():
        return
    from fsspec.asyn import sync

    try:
        sync(loop, close_sessions, fs, timeout=5)
    except Exception:  # best effort: the listing already succeeded
        pass


_S3_SESSION: Any = None


def _s3_session() -> Any:
    """One aiobotocore session per process, shared by its S3 filesystems.

    A session holds parsed botocore models but no connection and no loop (clients do). Made
    in the main process by the listing, it is inherited by forked DataLoader workers, which
    then skip re-parsing botocore's JSON (measured 0.7 s per worker on a busy 2-core machine,
    all of it before the first request could go out).
    """
    global _S3_SESSION
    if _S3_SESSION is None:
        from aiobotocore.session import AioSession

        _S3_SESSION = AioSession()
    return _S3_SESSION


def translate_error(exc: BaseException, url: str, action: str = "read") -> StreamDataError:
    """Map a backend exception to ours, naming the URL and what to check."""
    if isinstance(exc, StreamDataError):
        return exc
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "NoSuchKey" in text:
        err: StreamDataError = ShardNotFoundError(
            f"cannot {action} {url}: no such bucket or object. Check the bucket name, the key, "
            f"and the endpoint in storage_options ({name}: {text})", url=url)
    elif isinstance(exc, PermissionError) or "Credentials" in name or "AccessDenied" in text \
            or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        err = AccessDeniedError(
            f"cannot {action} {url}: access denied. Check credentials (storage_options key/secret "
            f"or token, AWS_PROFILE / AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS) and the "
            f"bucket policy ({name}: {text})", url=url)
    elif isinstance(exc, TimeoutError):
        err = FetchTimeoutError(f"cannot {action} {url}: timed out ({name}: {text})", url=url)
    else:
        err = ShardFetchError(f"cannot {action} {url}: {name}: {text}", url=url)
    err.__cause__ = exc
    return err
