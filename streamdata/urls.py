"""Shard specs -> a list of ``Shard(url, size)``, through fsspec, with errors that say what to check.

A spec is a brace pattern (``s3://bkt/train-{000000..000127}.tar``), a glob, a prefix
(a directory, or the start of object names), a single object, or a list of any of these.
Expansion happens once, in the process that builds the dataset, before any worker starts;
sizes come from one listing per directory, so the fetcher needs no HEAD per shard.
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .errors import (
    AccessDeniedError,
    BackendMissingError,
    ShardFetchError,
    ShardNotFoundError,
    SpecError,
    StreamDataError,
)

__all__ = ["Shard", "brace_expand", "close_filesystem", "close_sessions", "expand_spec", "filesystem", "split_url",
           "translate_error"]

Spec = str | Sequence[str]

# protocol -> the pip extra / package that provides it, for BackendMissingError
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
             "https": "aiohttp", "hdfs": "pyarrow (and a Hadoop client: JAVA_HOME, HADOOP_HOME, CLASSPATH)"}
_NO_LISTING = {"http", "https"}
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


class Shard(NamedTuple):
    """One object to read: its full URL (with protocol) and its size in bytes, if known."""

    url: str
    size: int | None = None


def split_url(url: str) -> tuple[str, str]:
    """``"s3://bkt/key"`` -> ``("s3", "bkt/key")``; a plain path -> ``("file", "/abs/path")``."""
    if "://" in url:
        protocol, path = url.split("://", 1)
        protocol = protocol.lower()
        if protocol == "file":
            return "file", path
        return protocol, path
    if url.startswith(("s3:", "gs:", "gcs:", "hdfs:")):
        raise SpecError(f"malformed URL {url!r}: write the protocol as PROTOCOL://bucket/key")
    return "file", os.path.abspath(url)


def _join(protocol: str, path: str) -> str:
    return path if protocol == "file" else f"{protocol}://{path}"


def filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None, *,
               url: str | None = None, **extra: Any):
    """A fresh fsspec filesystem for ``protocol`` (never the instance cache: see LOOP-AFTER-FORK).

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
    env = {name: os.environ.get(name) for name in _SIGNER_ENV}
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
        from .errors import FetchTimeoutError

        err = FetchTimeoutError(f"cannot {action} {url}: timed out ({name}: {text})", url=url)
    else:
        err = ShardFetchError(f"cannot {action} {url}: {name}: {text}", url=url)
    err.__cause__ = exc
    return err


def brace_expand(pattern: str) -> list[str]:
    """Expand ``{a,b}`` lists and ``{000..127}`` ranges (zero padding kept), several per pattern."""
    parts = _BRACE.split(pattern)
    literals, groups = parts[0::2], parts[1::2]
    if any(c in lit for lit in literals for c in "{}"):
        raise SpecError(f"unbalanced or nested braces in {pattern!r}")
    choices: list[list[str]] = []
    for group in groups:
        m = _RANGE.match(group)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise SpecError(f"empty range {{{group}}} in {pattern!r}: the end is before the start")
            width = len(m.group(1)) if m.group(1).startswith("0") else 0
            choices.append([str(i).zfill(width) for i in range(lo, hi + 1)])
        elif "," in group:
            choices.append(group.split(","))
        else:
            raise SpecError(f"cannot expand {{{group}}} in {pattern!r}: use {{a,b,c}} or {{000..099}}")
    out = []
    for combo in itertools.product(*choices):
        pieces = [literals[0]]
        for value, lit in zip(combo, literals[1:]):
            pieces += [value, lit]
        out.append("".join(pieces))
    return out


def _list_sizes(fs, protocol: str, paths: list[str]) -> dict[str, int | None]:
    """Sizes for ``paths`` from one listing per parent directory (object stores list flat)."""
    if protocol in _NO_LISTING:
        return {p: None for p in paths}
    sizes: dict[str, int | None] = {}
    for parent in sorted({posixpath.dirname(p) for p in paths}):
        url = _join(protocol, parent)
        try:
            entries = fs.ls(parent, detail=True)
        except Exception as exc:
            raise translate_error(exc, url, "list") from None
        for e in entries:
            if e.get("type", "file") != "directory":
                sizes[fs._strip_protocol(e["name"])] = e.get("size")
    return sizes


def _expand_one(fs, protocol: str, item: str, suffixes: tuple[str, ...]) -> list[Shard]:
    _, path = split_url(item)
    if "{" in path or "}" in path:
        paths = [fs._strip_protocol(p) for p in brace_expand(path)]
        sizes = _list_sizes(fs, protocol, paths)
        if protocol not in _NO_LISTING:
            missing = [p for p in paths if p not in sizes]
            if missing:
                raise ShardNotFoundError(
                    f"{len(missing)} of {len(paths)} shards of {item!r} do not exist, first: "
                    f"{_join(protocol, missing[0])}. Check the pattern's range and the bucket",
                    url=_join(protocol, missing[0]))
        return [Shard(_join(protocol, p), sizes.get(p)) for p in paths]
    try:
        if any(c in path for c in "*?["):
            found = fs.glob(path, detail=True)
            entries = [(n, e) for n, e in found.items() if e.get("type", "file") != "directory"]
        elif protocol in _NO_LISTING:
            return [Shard(item, None)]
        elif path.endswith("/") or fs.isdir(path):
            entries = list(fs.find(path, detail=True).items())
        elif fs.isfile(path):
            return [Shard(_join(protocol, fs._strip_protocol(path)), fs.size(path))]
        else:  # the start of object names
            parent = posixpath.dirname(fs._strip_protocol(path))
            entries = [(e["name"], e) for e in fs.ls(parent, detail=True)
                       if fs._strip_protocol(e["name"]).startswith(fs._strip_protocol(path))
                       and e.get("type", "file") != "directory"]
    except StreamDataError:
        raise
    except Exception as exc:
        raise translate_error(exc, item, "list") from None
    shards = sorted(Shard(_join(protocol, fs._strip_protocol(n)), e.get("size")) for n, e in entries)
    if suffixes:
        shards = [s for s in shards if s.url.endswith(suffixes)]
    return shards


def _size_named_objects(filesystems: dict[str, Any], items: list[str]) -> dict[str, Shard]:
    """Shards for plain object URLs of a list, sized by one listing per parent directory
    (not a stat per URL). Names not found as files are left to the general path."""
    plain = [i for i in items if not any(c in i for c in "{}*?[")]
    if len(plain) < 2:
        return {}
    out: dict[str, Shard] = {}
    for protocol in {split_url(i)[0] for i in plain}:
        if protocol in _NO_LISTING:
            continue
        fs = filesystems[protocol]
        mine = [i for i in plain if split_url(i)[0] == protocol]
        paths = {i: fs._strip_protocol(split_url(i)[1]) for i in mine}
        try:
            sizes = _list_sizes(fs, protocol, sorted(set(paths.values())))
        except StreamDataError:
            continue  # e.g. a parent that is not listable: the general path reports it
        out.update({i: Shard(_join(protocol, p), sizes[p]) for i, p in paths.items() if p in sizes})
    return out


def expand_spec(spec: Spec, storage_options: Mapping[str, Any] | None = None, *,
                suffixes: Iterable[str] = ()) -> list[Shard]:
    """Expand ``spec`` into shards, validated and sized; raises our errors on any problem.

    ``suffixes`` filters what a prefix or glob lists (e.g. ``(".tar",)``); explicit names
    and brace patterns are taken as given.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise SpecError("the shard spec is an empty list: name at least one URL")
    suffixes = tuple(suffixes)
    shards: list[Shard] = []
    filesystems: dict[str, Any] = {}
    for raw in items:
        item = raw if isinstance(raw, Shard) else os.fspath(raw)
        if not isinstance(item, (str, Shard)) or not item:
            raise SpecError(f"shard spec items must be non-empty URL strings, got {raw!r}")
        protocol = split_url(item if isinstance(item, str) else item.url)[0]
        if protocol not in filesystems:
            filesystems[protocol] = filesystem(protocol, storage_options, url=item if isinstance(item, str) else item.url)
    known = _size_named_objects(filesystems, [i for i in items if isinstance(i, str)])
    for raw in items:
        if isinstance(raw, Shard) or raw in known:
            shards.append(raw if isinstance(raw, Shard) else known[raw])
            continue
        item = os.fspath(raw)
        protocol, _ = split_url(item)
        found = _expand_one(filesystems[protocol], protocol, item, suffixes)
        if not found:
            raise ShardNotFoundError(
                f"{item!r} matched no objects{' ending in ' + '/'.join(suffixes) if suffixes else ''}: "
                "check the prefix or glob, and the endpoint", url=item)
        shards.extend(found)
    for fs in filesystems.values():
        close_filesystem(fs)
    dupes = len(shards) - len({s.url for s in shards})
    if dupes:
        raise SpecError(f"the spec names {dupes} shard(s) more than once; each must appear once")
    return shards
