"""Shard specs -> a list of ``Shard(url, size)``, through fsspec, with errors that say what to check.

A spec is a brace pattern (``s3://bkt/train-{000000..000127}.tar``), a glob, a prefix
(a directory, or the start of object names), a single object, or a list of any of these.
Expansion happens once, in the process that builds the dataset, before any worker starts;
sizes come from one listing per directory, so the fetcher needs no HEAD per shard.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from streamdata.config import FetchConfig
from streamdata.errors import AccessDeniedError, ShardNotFoundError, SpecError
from streamdata.store.backends import (
    call_with_deadline,
    close_filesystem,
    filesystem,
    lite_path,
    lite_s3,
    warm_imports,
)
from streamdata.store.urls import Shard, etag_of, split_url

__all__ = ["Shard", "Sightings", "brace_expand", "etag_of", "expand_spec", "listing_deadline", "split_url"]

Spec = str | Sequence[str]
_NO_LISTING = {"http", "https"}
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _join(protocol: str, path: str) -> str:
    return path if protocol == "file" else f"{protocol}://{path}"


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
        for value, lit in zip(combo, literals[1:], strict=True):
            pieces += [value, lit]
        out.append("".join(pieces))
    return out


class Sightings:
    """What a listing saw of objects with some names (``names``: base names),
    whatever the spec's suffixes keep. ``found``: the URLs of such objects listed; a directory
    the listing covered whole (:meth:`tells`) has none of those names where ``found`` has none
    there. Filled by :func:`expand_spec` (its ``sightings``); only the process that lists has it."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self.found: set[str] = set()
        self._dirs: set[tuple[str, bool]] = set()  # (directory URL without "/", recursive)

    def saw(self, directory: str, recursive: bool, urls: Iterable[str]) -> None:
        """The listing covered ``directory`` (and, ``recursive``, all below it), listing ``urls``."""
        self._dirs.add((directory.rstrip("/"), recursive))
        self.found.update(u for u in urls if u.rsplit("/", 1)[-1] in self.names)

    def tells(self, directory: str) -> bool:
        """Whether the listing covered ``directory`` (a URL, no trailing ``/``) whole."""
        return any(directory == d or (recursive and directory.startswith(d + "/"))
                   for d, recursive in self._dirs)


class _Backends:
    """Per protocol, what expanding a spec may use: the fsspec filesystem (made on first use
    where a LITE-S3 signer can list instead, so that s3fs is never imported then), the signer,
    and the one-time import of what readers will need (``backends.warm_imports``)."""

    def __init__(self, storage_options: Mapping[str, Any] | None, config: FetchConfig,
                 sightings: Sightings | None = None) -> None:
        self.options, self.config = storage_options, config
        self.sightings = sightings
        self.filesystems: dict[str, Any] = {}
        self._lite: dict[str, Any] = {}
        self.warmed: set[str] = set()

    def fs(self, protocol: str, url: str | None = None) -> Any:
        if protocol not in self.filesystems:
            self.filesystems[protocol] = filesystem(protocol, self.options, url=url,
                                                    timeout=self.config.timeout)
        return self.filesystems[protocol]

    def lite(self, protocol: str) -> Any:
        if protocol not in self._lite:
            self._lite[protocol] = lite_s3(protocol, self.options)
        return self._lite[protocol]

    def strip(self, protocol: str, path: str) -> str:
        if self.lite(protocol) is not None:
            return lite_path(path)
        return self.fs(protocol)._strip_protocol(path)

    def warm(self, protocol: str) -> None:
        if protocol not in self.warmed:
            self.warmed.add(protocol)
            warm_imports(protocol, self.options)

    def saw(self, protocol: str, directory: str, recursive: bool, urls: Iterable[str]) -> None:
        """A listing of ``directory`` (a path), for the :class:`Sightings` if there are any."""
        if self.sightings is not None:
            self.sightings.saw(_join(protocol, directory), recursive, urls)

    def close(self) -> None:
        for fs in self.filesystems.values():
            close_filesystem(fs)


def listing_deadline(config: FetchConfig) -> float:
    """Seconds one listing or stat of the constructor may take, its retries included: twice the
    per-request ``timeout``, at most ``retry_deadline``. Shorter than a part's deadline on
    purpose: a job that cannot list fails at its start, where trying again costs nothing, and a
    wrong endpoint is reported in seconds, not after the minutes a part is retried for."""
    return min(config.retry_deadline, 2 * config.timeout)


def _call(fs, config: FetchConfig, url: str, name: str, *args: Any, stat: bool = False,
          what: str = "list", **kwargs: Any) -> Any:
    """``fs.<name>(*args, **kwargs)`` within the config's time bounds, retried on transient
    errors (``backends.call_with_deadline``); a stat gets ``timeout``, a listing (all its
    pages) the listing deadline. An async backend's coroutine runs on its own loop and is
    cancelled when its time is up; a sync one (local files, HDFS) is called directly."""
    def attempt(limit: float) -> Any:
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, "_" + name), *args, timeout=limit, **kwargs)
        return getattr(fs, name)(*args, **kwargs)

    return call_with_deadline(attempt, timeout=config.timeout if stat else None,
                              deadline=listing_deadline(config), url=url, what=what,
                              retries=config.retries, backoff=config.backoff)


def _lite_list(b: _Backends, protocol: str, path: str, config: FetchConfig, *,
               delimiter: str | None = None, url: str | None = None) -> list[Shard] | None:
    """The objects whose path starts with ``path`` (``bucket/prefix``),
    listed by the LITE-S3 signer in one request per page; ``None`` where it cannot (use the
    filesystem). The first request overlaps the readers' imports (``warm_imports``)."""
    lite = b.lite(protocol)
    if lite is None:
        return None
    from streamdata.store.s3lite import LiteUnsupported

    bucket, _, prefix = path.partition("/")

    def warm() -> None:  # while the listing's first request is in flight
        b.warm(protocol)

    def attempt(limit: float) -> list[tuple[str, int, str | None]] | None:
        try:
            # each request bounded by ``timeout``, as the backend's own are (backends._bounded)
            return lite.list(bucket, prefix, timeout=min(config.timeout, limit), delimiter=delimiter,
                             while_waiting=warm)
        except LiteUnsupported:
            return None

    found = call_with_deadline(attempt, timeout=None, deadline=listing_deadline(config),
                               url=url or _join(protocol, path), what="list", retries=config.retries,
                               backoff=config.backoff)
    if found is None:  # a 4xx this signer may have caused: the filesystem from now on
        b._lite[protocol] = None
        return None
    return [Shard(_join(protocol, f"{bucket}/{key}"), size, etag) for key, size, etag in found
            if not key.endswith("/")]


def _list_sizes(b: _Backends, protocol: str, paths: list[str], config: FetchConfig) -> dict[str, Shard]:
    """Shards (sized, with ETags) for ``paths`` from one listing per parent directory (object
    stores list flat), keyed by path."""
    if protocol in _NO_LISTING:
        return {p: Shard(_join(protocol, p)) for p in paths}
    sizes: dict[str, Shard] = {}
    for parent in sorted({posixpath.dirname(p) for p in paths}):
        lite = _lite_list(b, protocol, parent + "/", config, delimiter="/", url=_join(protocol, parent))
        if lite is not None:
            sizes.update({split_url(shard.url)[1]: shard for shard in lite})
            b.saw(protocol, parent, False, (shard.url for shard in lite))
            continue
        fs = b.fs(protocol)
        entries = _call(fs, config, _join(protocol, parent), "ls", parent, detail=True)
        listed = []
        for e in entries:
            if e.get("type", "file") != "directory":
                path = fs._strip_protocol(e["name"])
                sizes[path] = Shard(_join(protocol, path), e.get("size"), etag_of(e))
                listed.append(sizes[path].url)
        b.saw(protocol, parent, False, listed)
    return sizes


def _expand_one(b: _Backends, protocol: str, item: str, suffixes: tuple[str, ...],
                config: FetchConfig) -> list[Shard]:
    _, path = split_url(item)
    if "{" in path or "}" in path:
        paths = [b.strip(protocol, p) for p in brace_expand(path)]
        sizes = _list_sizes(b, protocol, paths, config)
        if protocol not in _NO_LISTING:
            missing = [p for p in paths if p not in sizes]
            if missing:
                raise ShardNotFoundError(
                    f"{len(missing)} of {len(paths)} shards of {item!r} do not exist, first: "
                    f"{_join(protocol, missing[0])}. Check the pattern's range and the bucket",
                    url=_join(protocol, missing[0]))
        return [sizes.get(p) or Shard(_join(protocol, p)) for p in paths]
    if protocol in _NO_LISTING:  # nothing to list; a "?" starts a query (a signed URL), not a glob
        return [Shard(item, None)]
    if not any(c in path for c in "*?["):
        lite = _lite_expand(b, protocol, path, config)
        if lite is not None:
            shards, one_object = lite
            return shards if one_object or not suffixes else [s for s in shards if s.url.endswith(suffixes)]
    fs = b.fs(protocol)

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        return _call(fs, config, item, name, *args, **kwargs)

    if any(c in path for c in "*?["):
        found = call("glob", path, detail=True)
        entries = [(n, e) for n, e in found.items() if e.get("type", "file") != "directory"]
    elif path.endswith("/") or call("isdir", path, stat=True, what="stat"):
        entries = list(call("find", path, detail=True).items())
        b.saw(protocol, fs._strip_protocol(path), True,
              (_join(protocol, fs._strip_protocol(n)) for n, _ in entries))
    elif call("isfile", path, stat=True, what="stat"):
        info = call("info", path, stat=True, what="stat")
        return [Shard(_join(protocol, fs._strip_protocol(path)), info.get("size"), etag_of(info))]
    else:  # the start of object names
        parent = posixpath.dirname(fs._strip_protocol(path))
        everything = [(e["name"], e) for e in call("ls", parent, detail=True)
                      if e.get("type", "file") != "directory"]
        b.saw(protocol, parent, False, (_join(protocol, fs._strip_protocol(n)) for n, _ in everything))
        entries = [(n, e) for n, e in everything
                   if fs._strip_protocol(n).startswith(fs._strip_protocol(path))]
    shards = sorted(Shard(_join(protocol, fs._strip_protocol(n)), e.get("size"), etag_of(e))
                    for n, e in entries)
    if suffixes:
        shards = [s for s in shards if s.url.endswith(suffixes)]
    return shards


def _lite_expand(b: _Backends, protocol: str, path: str,
                 config: FetchConfig) -> tuple[list[Shard], bool] | None:
    """A directory, single object or prefix in one listing (LITE-S3), meaning what it means
    to the filesystem: a directory's objects (recursive), else the object itself, else the
    objects whose names start with ``path`` (not inside a directory); and whether it was the
    single object. ``None``: the filesystem decides."""
    listed = _lite_list(b, protocol, path, config)
    if listed is None:
        return None
    found = [(split_url(s.url)[1], s) for s in listed]
    stem = path.rstrip("/")
    if "/" not in stem:  # a whole bucket
        b.saw(protocol, stem, True, (s.url for s in listed))
        return sorted(listed), False
    inside = [s for p, s in found if p.startswith(stem + "/")]
    exact = [s for p, s in found if p == stem]
    if path.endswith("/") or inside:  # a directory, listed whole (and all below it)
        b.saw(protocol, stem, True, (s.url for s in inside))
    if path.endswith("/") or inside or not exact:
        chosen = inside if path.endswith("/") or inside else [
            s for p, s in found if "/" not in p[len(stem):]]
        return sorted(chosen), False
    return exact, True


def _size_named_objects(b: _Backends, items: list[str],
                        config: FetchConfig) -> dict[str, Shard]:
    """Shards for plain object URLs of a list, sized by one listing per parent directory
    (not a stat per URL). Names not found as files are left to the general path."""
    plain = [i for i in items if not any(c in i for c in "{}*?[")]
    if len(plain) < 2:
        return {}
    out: dict[str, Shard] = {}
    for protocol in {split_url(i)[0] for i in plain}:
        if protocol in _NO_LISTING:
            continue
        mine = [i for i in plain if split_url(i)[0] == protocol]
        paths = {i: b.strip(protocol, split_url(i)[1]) for i in mine}
        try:
            sizes = _list_sizes(b, protocol, sorted(set(paths.values())), config)
        except (ShardNotFoundError, AccessDeniedError):
            continue  # e.g. a parent that is not listable: the general path reports it
        out.update({i: sizes[p] for i, p in paths.items() if p in sizes})
    return out


def expand_spec(spec: Spec, storage_options: Mapping[str, Any] | None = None, *,
                suffixes: Iterable[str] = (), config: FetchConfig | None = None,
                listing: bool = True, sightings: Sightings | None = None) -> list[Shard]:
    """Expand ``spec`` into shards, validated and sized; raises our errors on any problem.

    ``suffixes`` filters what a prefix or glob lists (e.g. ``(".tar",)``); explicit names
    and brace patterns are taken as given. ``config``'s ``timeout`` bounds each request
    (a stat gets that long; a listing, all its pages, :func:`listing_deadline`), and transient
    failures are retried with its ``retries`` and ``backoff`` within that deadline.

    ``listing=False`` (NO-LISTING): brace patterns and object names become shards of unknown
    size with no request at all (a reader learns each size from its first ranged GET's
    ``Content-Range``, HEAD-START in ``client``); a missing object is then reported when a
    reader requests it, not here. Globs, prefixes and directories need a listing: SpecError.

    ``sightings``: filled with what the listings saw of its names, e.g. the
    sample index's, which the suffixes leave out of the shards.
    """
    config = config or FetchConfig()
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise SpecError("the shard spec is an empty list: name at least one URL")
    if not listing:
        return _unlisted(items, storage_options)
    suffixes = tuple(suffixes)
    b = _Backends(storage_options, config, sightings)
    try:
        protocols = set()
        for raw in items:
            item = _spec_item(raw)
            url = item if isinstance(item, str) else item.url
            protocol = split_url(url)[0]
            protocols.add(protocol)
            if b.lite(protocol) is None:  # made now: an unknown protocol or a missing backend fails here
                b.fs(protocol, url)
        shards = _expand_items(items, b, suffixes, config)
        for protocol in protocols:  # what readers need, imported once here (inherited by workers)
            b.warm(protocol)
    finally:
        b.close()
    return _unique(shards)


def _spec_item(raw: Any) -> str | Shard:
    """One item of a spec list: a Shard, or its URL string (a path-like made one)."""
    item = raw if isinstance(raw, Shard) else os.fspath(raw)
    if not isinstance(item, (str, Shard)) or not item:
        raise SpecError(f"shard spec items must be non-empty URL strings, got {raw!r}")
    return item


def _unique(shards: list[Shard]) -> list[Shard]:
    """``shards``, after checking that none is named twice."""
    dupes = len(shards) - len({s.url for s in shards})
    if dupes:
        raise SpecError(f"the spec names {dupes} shard(s) more than once; each must appear once")
    return shards


def _unlisted(items: list[Any], storage_options: Mapping[str, Any] | None) -> list[Shard]:
    """NO-LISTING (``expand_spec(listing=False)``): the named objects, sizes unknown."""
    from fsspec.registry import known_implementations, registry

    shards: list[Shard] = []
    for raw in items:
        item = _spec_item(raw)
        if isinstance(item, Shard):
            shards.append(item)
            continue
        protocol, path = split_url(item)
        if protocol not in known_implementations and protocol not in registry:
            raise SpecError(f"unknown protocol {protocol!r} in {item!r}: use s3://, gs://, hdfs://, "
                            "http(s)://, file:// or a local path")
        if protocol not in _NO_LISTING and (any(c in path for c in "*?[") or path.endswith("/")):
            raise SpecError(f"{item!r} is a glob or a directory: it cannot be expanded with "
                            "listing=False. Name the shards (a brace pattern or a list of URLs), "
                            "or leave listing on")
        names = brace_expand(path) if "{" in path or "}" in path else [path]
        shards.extend(Shard(_join(protocol, p), None) for p in names)
    _unique(shards)
    for protocol in {split_url(s.url)[0] for s in shards}:  # inherited by forked workers
        warm_imports(protocol, storage_options)
    return shards


def _expand_items(items: list[Any], b: _Backends, suffixes: tuple[str, ...],
                  config: FetchConfig) -> list[Shard]:
    shards: list[Shard] = []
    known = _size_named_objects(b, [i for i in items if isinstance(i, str)], config)
    for raw in items:
        if isinstance(raw, Shard) or raw in known:
            shards.append(raw if isinstance(raw, Shard) else known[raw])
            continue
        item = os.fspath(raw)
        protocol, _ = split_url(item)
        found = _expand_one(b, protocol, item, suffixes, config)
        if not found:
            raise ShardNotFoundError(
                f"{item!r} matched no objects{' ending in ' + '/'.join(suffixes) if suffixes else ''}: "
                "check the prefix or glob, and the endpoint", url=item)
        shards.extend(found)
    return shards
