"""What every command shares: storage options, the spec's format and shards, sizes, progress.

A user mistake is a :class:`UsageError` (or one of our ``StreamDataError``): ``main`` prints it
as one line on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from streamdata.config import Retry
from streamdata.progress import progress

if TYPE_CHECKING:
    from streamdata.datasets.sharded import ShardedDataset

__all__ = ["FORMATS", "UsageError", "add_common", "add_format", "bar", "busy", "dataset_class",
           "fetch_options", "format_of", "human", "list_shards", "parse_size", "parse_storage_options",
           "storage_options", "write_out"]

FORMATS = ("tar", "parquet", "arrow")


class UsageError(Exception):
    """A mistake in the command line or its input: one line on stderr, exit code 2."""


# ---- options shared by the commands ---------------------------------------------------------


def add_common(parser: argparse.ArgumentParser, *, quiet: bool = True) -> None:
    """``--storage-options/-o`` and ``--quiet/-q``, the same on every command."""
    group = parser.add_argument_group("storage and output")
    group.add_argument(
        "-o", "--storage-options", action="append", default=[], metavar="OPTIONS",
        help="fsspec options for the URLs: a JSON object ('{\"anon\": true}') or key=value "
             "(repeatable; the value is read as JSON when it parses, so anon=true is a boolean "
             "and timeout=5 a number; a dotted key nests: client_kwargs.region_name=eu-west-1). "
             "Credentials come from the environment as fsspec reads them")
    group.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="seconds per request (default 60); a listing gives up after twice that")
    if quiet:
        group.add_argument("-q", "--quiet", action="store_true",
                           help="no progress bars (they are drawn only when stderr is a terminal)")
    group.add_argument("--debug", action="store_true",
                       help="print the full traceback of an unexpected error")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_storage_options(values: Sequence[str]) -> dict[str, Any]:
    """``-o`` values, in order, merged into one dict: JSON objects, or ``key=value`` items
    (several may be separated by commas only inside JSON; one ``key=value`` per ``-o``)."""
    options: dict[str, Any] = {}
    for raw in values:
        text = raw.strip()
        if text.startswith("{"):
            try:
                found = json.loads(text)
            except ValueError as exc:
                raise UsageError(f"--storage-options: not valid JSON ({exc}): {raw!r}") from None
            if not isinstance(found, dict):
                raise UsageError(f"--storage-options: the JSON must be an object, got {raw!r}")
            options.update(found)
            continue
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--storage-options: expected a JSON object or key=value, got {raw!r}")
        target = options
        *parents, leaf = key.split(".")
        for name in parents:
            child = target.setdefault(name, {})
            if not isinstance(child, dict):
                raise UsageError(f"--storage-options: {name!r} is set to a value, not an object: {raw!r}")
            target = child
        target[leaf] = _parse_value(value)
    return options


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return parse_storage_options(getattr(args, "storage_options", []) or [])


def fetch_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fetch options the command line sets (``timeout``), for datasets and writers: option
    groups (``retry=Retry(timeout=...)``)."""
    timeout = getattr(args, "timeout", None)
    if timeout is not None and timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {timeout:g}")
    return {} if timeout is None else {"retry": Retry(timeout=timeout)}


def _quiet(args: argparse.Namespace) -> bool | None:
    return False if getattr(args, "quiet", False) else None


def bar(args: argparse.Namespace, total: float | None, desc: str, unit: str = "it", **options: Any) -> Any:
    """A progress bar for ``args``' command (off with ``--quiet`` or when stderr is no terminal)."""
    return progress(total, desc=desc, unit=unit, enabled=_quiet(args), **options)


@contextlib.contextmanager
def busy(args: argparse.Namespace, desc: str) -> Iterator[Any]:
    """A bar with no total for one long call (a listing): its clock ticks while the call runs
    (a thread refreshes it, only when it is drawn; joined on exit)."""
    with bar(args, None, desc, unit="obj") as pbar:
        stop = threading.Event()
        ticker = None
        if not pbar.disable:
            def tick() -> None:
                while not stop.wait(0.2):
                    pbar.refresh()
            ticker = threading.Thread(target=tick, name="streamdata-cli-ticker", daemon=True)
            ticker.start()
        try:
            yield pbar
        finally:
            stop.set()
            if ticker is not None:
                ticker.join(timeout=5)


# ---- formats and shards -----------------------------------------------------------------------


def dataset_class(fmt: str) -> type[ShardedDataset]:
    """The dataset class reading ``fmt`` (its ``suffixes`` are the listing rules)."""
    if fmt == "tar":
        from streamdata.datasets.tar import TarDataset

        return TarDataset
    from streamdata.datasets.parquet import ArrowDataset, ParquetDataset

    return ParquetDataset if fmt == "parquet" else ArrowDataset


def _suffixes() -> dict[str, tuple[str, ...]]:
    """Each format's listing suffixes (its dataset class's)."""
    return {fmt: tuple(dataset_class(fmt).suffixes) for fmt in FORMATS}


def format_of(url: str, suffixes: dict[str, tuple[str, ...]] | None = None) -> str | None:
    """The format whose dataset would read ``url`` from a listing (by its ``suffixes``), if any."""
    for fmt, ends in (suffixes or _suffixes()).items():
        if url.endswith(ends):
            return fmt
    return None


def list_shards(args: argparse.Namespace, spec: Sequence[str] | str, fmt: str = "auto") -> tuple[str, list]:
    """``(format, shards)``: what the dataset of ``fmt`` would read for ``spec``, listed with
    that dataset's suffix rules. ``auto`` lists with every format's suffixes and takes the one
    format found (a listing holding two is a UsageError; names matching none are read as tar,
    as ``TarDataset`` reads any name it is given)."""
    from streamdata.catalog.specs import expand_spec
    from streamdata.config import FetchConfig

    options = storage_options(args)
    config = FetchConfig.resolve(None, **fetch_options(args))
    by_format = _suffixes()  # once, not per shard listed
    suffixes = by_format[fmt] if fmt != "auto" else tuple(s for ends in by_format.values() for s in ends)
    with busy(args, "listing") as pbar:
        shards = expand_spec(list(spec) if not isinstance(spec, str) else spec, options, suffixes=suffixes,
                             config=config)
        pbar.update(len(shards))
    if fmt != "auto":
        return fmt, shards
    found: dict[str, int] = {}
    for shard in shards:
        kind = format_of(shard.url, by_format) or "tar"
        found[kind] = found.get(kind, 0) + 1
    if len(found) > 1:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(found.items()))
        raise UsageError(f"the spec holds objects of several formats ({counts}): "
                         "choose one with --format, or narrow the spec")
    return next(iter(found), "tar"), shards


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("auto", *FORMATS), default="auto",
                        help="which dataset's rules to list with: tar (TarDataset), parquet "
                             "(ParquetDataset), arrow (ArrowDataset); auto: the one format found "
                             "(default)")


# ---- numbers -----------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"500MB"`` -> 500_000_000, ``"1GiB"`` -> 1 << 30, ``"4096"`` -> 4096 (for argparse)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 500MB, 1GiB)")
    power = " kmgt".index(m.group(2).lower() or " ")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** power)


def human(nbytes: float | None) -> str:
    """Bytes for people: ``1234567`` -> ``"1.2 MB"``."""
    if nbytes is None:
        return "?"
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def write_out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
