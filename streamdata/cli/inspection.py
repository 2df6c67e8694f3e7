"""``streamdata inspect`` (what a spec holds: counts, fields, types, bytes, index status) and
``streamdata cat`` (one sample's fields, or one field's raw bytes)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from streamdata.cli.common import (
    UsageError,
    add_common,
    add_format,
    bar,
    dataset_class,
    fetch_options,
    human,
    list_shards,
    storage_options,
    write_out,
)
from streamdata.config import Fetch

__all__ = ["add_parsers", "describe"]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="shards, samples, fields, types/shapes/dtypes and bytes per field, index status",
        description="Summarise SPEC: objects and bytes; samples (exact from the sample index or "
                    "Parquet/Arrow footers, else counted in the first shard(s) and extrapolated "
                    "by size); each field's decoded type, shape and dtype in the first samples, and "
                    "its bytes per sample; whether a sample index exists and matches the listing.")
    p.add_argument("spec", nargs="+", metavar="SPEC", help="URL, brace pattern, prefix or glob")
    add_format(p)
    p.add_argument("--samples", type=int, default=5, metavar="N",
                   help="decode and describe the first N samples (default 5)")
    p.add_argument("--scan", type=int, default=1, metavar="K",
                   help="tar: read the first K shards whole to count samples and bytes per field (default 1)")
    add_common(p)
    p.set_defaults(run=run_inspect)

    c = sub.add_parser(
        "cat", help="one sample's fields (the first, or --key K), or the raw bytes of one field",
        description="Print one sample of SPEC, read in order: each field's size in bytes and its "
                    "decoded value in short. --field F writes that field's raw bytes to stdout "
                    "instead (e.g. streamdata cat SPEC --key s000003 --field jpg > s000003.jpg).")
    c.add_argument("spec", nargs="+", metavar="SPEC", help="URL, brace pattern, prefix or glob")
    add_format(c)
    which = c.add_mutually_exclusive_group()
    which.add_argument("--key", metavar="K",
                       help="the sample whose __key__ is K (shards are read in order until found)")
    which.add_argument("--row", type=int, metavar="N", default=0,
                       help="the N-th sample in reading order, from 0 (default 0: the first)")
    c.add_argument("--field", metavar="F", help="write only field F's raw bytes to stdout (tar: the "
                                                 "member's bytes; Parquet/Arrow: the value)")
    add_common(c)
    c.set_defaults(run=run_cat)


# ---- describing values -------------------------------------------------------------------------


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(value: Any, preview: bool = False) -> str:
    """A decoded value in one short line: type, shape and dtype (and, with ``preview``, a glimpse)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        out = f"Tensor {str(value.dtype).replace('torch.', '')} {list(value.shape)}"
        if preview and value.numel():
            out += "  " + _short(" ".join(str(value.flatten()[:8].tolist()).split()))
        return out
    if isinstance(value, np.ndarray):
        out = f"ndarray {value.dtype} {list(value.shape)}"
        if preview and value.size:
            out += "  " + _short(" ".join(np.array2string(value.ravel()[:8], precision=4).split()))
        return out
    if isinstance(value, (bool, int, float, np.generic)):
        return f"{type(value).__name__} {value}"
    if isinstance(value, str):
        return f"str [{len(value)}] {_short(repr(value))}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes [{len(value)}]" + (f" {_short(repr(bytes(value[:40])))}" if preview else "")
    if isinstance(value, (dict, list)):
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
        return f"{type(value).__name__} [{len(value)}] {_short(text)}"
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"{type(value).__name__} {value.size} {value.mode}"
    return f"{type(value).__name__} {_short(repr(value))}"


def _nbytes(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogateescape"))
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    return len(json.dumps(value, default=str).encode()) if isinstance(value, (dict, list)) else 8


# ---- reading samples in order ----------------------------------------------------------------


def _tar_samples(args: argparse.Namespace, shards: list, window: int = 1) -> Iterator[dict]:
    """Raw tar samples in order: one shard at a time with ``window`` 1 (nothing fetched beyond
    need), else one pass over all of them with that many shards in flight (a search). Whole
    shards, without the sample index (``index=None``: no GET for it per dataset)."""
    from streamdata.datasets.tar import TarDataset

    options = storage_options(args)
    for group in [shards] if window > 1 else [[shard] for shard in shards]:
        it = iter(TarDataset(group, storage_options=options, decode=False, fetch=Fetch(window=window),
                             index=None, **fetch_options(args)))
        try:
            yield from it
        finally:
            it.close()


def _table_samples(args: argparse.Namespace, fmt: str, shards: list) -> tuple[Any, Iterator[dict]]:
    ds = dataset_class(fmt)(shards, storage_options=storage_options(args), **fetch_options(args))
    return ds, iter(ds)


def _is_field(name: str) -> bool:
    return not (name.startswith("__") and name.endswith("__"))


# ---- inspect --------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    fmt, shards = list_shards(args, args.spec, args.format)
    total = sum(s.size or 0 for s in shards)
    unknown = sum(s.size is None for s in shards)
    write_out(f"format    {fmt}")
    write_out(f"objects   {len(shards)}, {total} bytes ({human(total)})"
              + (f", {unknown} of unknown size" if unknown else ""))
    if fmt == "tar":
        _inspect_tar(args, shards, total)
    else:
        _inspect_table(args, fmt, shards)
    return 0


def kind(value: Any) -> tuple[str, tuple[int, ...] | None]:
    """A value's type without its contents: ``("ndarray float32", (8,))``, ``("int", None)``."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor {str(value.dtype).replace('torch.', '')}", tuple(value.shape)
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype}", tuple(value.shape)
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"{type(value).__name__} {value.mode}", tuple(value.size)
    return type(value).__name__, None


def media(name: str, value: Any) -> tuple[tuple[str, tuple[int, ...]], str] | None:
    """A video or audio member's kind and summary from its header (``sd.video`` / ``sd.audio``'s
    probes, nothing decoded): ``(("video h264", (frames, H, W)), "4.00 s, 25 fps, 64x64")``;
    ``None`` for other fields, or where the header does not read (or its backend is missing)."""
    import io

    from streamdata.errors import StreamDataError
    from streamdata.formats import audio, video

    ext = name[name.rfind(".") + 1:].lower()
    if not isinstance(value, (bytes, bytearray)) or ext not in video.EXTENSIONS | audio.EXTENSIONS:
        return None
    try:
        if ext in video.EXTENSIONS:
            v = video.probe(io.BytesIO(value))
            return ((f"video {v.codec}", (v.num_frames, v.height, v.width)),
                    f"{v.duration:.2f} s, {v.fps:g} fps, {v.width}x{v.height}, {v.codec}")
        a = audio.probe(io.BytesIO(value))
        return ((f"audio {a.codec}", (a.channels, a.frames)),
                f"{a.duration:.2f} s, {a.sample_rate} Hz, {a.channels} ch, {a.codec}")
    except (StreamDataError, ValueError, OSError, RuntimeError, EOFError):
        return None


def _merge(kinds: list[tuple[str, tuple[int, ...] | None]]) -> str:
    """One line for a field's kinds over several samples: shapes that differ become ranges."""
    labels = sorted({label for label, _ in kinds})
    shapes = [shape for _, shape in kinds]
    if len(labels) > 1:
        return "varies: " + " | ".join(labels[:4]) + (" | ..." if len(labels) > 4 else "")
    sized = [s for s in shapes if s is not None]
    if len(sized) < len(shapes):  # no shape (or not for every sample)
        return labels[0]
    if len({len(s) for s in sized}) > 1:
        return f"{labels[0]} (ndim varies: {sorted({len(s) for s in sized})})"
    dims = [f"{min(d)}" if min(d) == max(d) else f"{min(d)}..{max(d)}" for d in zip(*sized, strict=True)]
    return f"{labels[0]} [{', '.join(dims)}]"


def _field_table(first: list[dict], raw_bytes: dict[str, int], counted: int, what: str) -> None:
    from streamdata.formats.decode import make_decoder

    decode = make_decoder(True) if what == "tar" else None
    kinds: dict[str, list] = {}
    examples: dict[str, str] = {}
    for sample in first:
        decoded = decode(dict(sample)) if decode is not None else sample
        for name, value in decoded.items():
            if _is_field(name):
                header = media(name, sample.get(name))  # a video / audio member: its header's figures
                kinds.setdefault(name, []).append(header[0] if header else kind(value))
                examples.setdefault(name, header[1] if header else describe(value, preview=True))
    names = sorted(set(kinds) | set(raw_bytes))
    width = max([5, *map(len, names)])
    unit = "bytes/sample" if what == "tar" else "bytes/row"
    write_out(f"fields    {len(names)}: types over the first {len(first)} sample(s), {unit} over "
              f"{counted}{'' if what == 'tar' else ' (decoded)'}")
    write_out(f"  {'field':<{width}}  {unit}  {'type':<28}  first sample")
    for name in names:
        per = raw_bytes.get(name, 0) / max(counted, 1)
        merged = _merge(kinds[name]) if name in kinds else "-"
        write_out(f"  {name:<{width}}  {per:>{len(unit)}.1f}  {merged:<28}  {examples.get(name, '-')}")


def _inspect_tar(args: argparse.Namespace, shards: list, total: int) -> None:
    status, indexed = _index_status(args, shards)
    first: list[dict] = []
    raw_bytes: dict[str, int] = {}
    counted = scanned = 0
    with bar(args, min(max(args.scan, 1), len(shards)), "reading", unit="shard") as pbar:
        for shard in shards:  # the first --scan shards, and more while too few samples were seen
            if scanned >= max(args.scan, 1) and len(first) >= args.samples:
                break
            for sample in _tar_samples(args, [shard]):
                counted += 1
                if len(first) < args.samples:
                    first.append(sample)
                for name, value in sample.items():
                    if _is_field(name):
                        raw_bytes[name] = raw_bytes.get(name, 0) + len(value)
            pbar.update(1)
            scanned += 1
    scanned_bytes = sum(s.size or 0 for s in shards[:scanned])
    if indexed is not None:
        write_out(f"samples   {indexed} (from the index)")
    elif scanned == len(shards):
        write_out(f"samples   {counted} (counted)")
    elif scanned_bytes:
        estimate = counted * total / scanned_bytes
        write_out(f"samples   about {estimate:.0f} ({counted} in the first {scanned} shard(s), "
                  f"{human(scanned_bytes)}, scaled by size; `streamdata index` makes it exact)")
    else:
        write_out(f"samples   unknown ({counted} in the first {scanned} shard(s))")
    write_out(f"index     {status}")
    _field_table(first, raw_bytes, counted, "tar")


def _inspect_table(args: argparse.Namespace, fmt: str, shards: list) -> None:
    ds, rows = _table_samples(args, fmt, shards)
    first: list[dict] = []
    sizes: dict[str, int] = {}
    try:
        for row in rows:
            first.append(row)
            for name, value in row.items():
                if _is_field(name):
                    sizes[name] = sizes.get(name, 0) + _nbytes(value)
            if len(first) >= max(args.samples, 1):
                break
    finally:
        getattr(rows, "close", lambda: None)()
    units = ds.units()
    if fmt == "parquet":
        write_out(f"samples   {ds.num_rows} rows in {len(units)} row groups (from the footers)")
    elif (counts := ds.sample_counts()) is not None:
        write_out(f"samples   {int(counts.sum())} rows in {len(units)} record batches "
                  "(from their headers)")
    else:
        streams = sum(1 for u in units if u.index < 0)
        write_out(f"samples   unknown before reading: {len(units) - streams} record batches in files, "
                  f"{streams} stream object(s) (each read whole)")
    write_out("index     not needed: " + ("row counts come from the footers" if fmt == "parquet"
                                          else "record batches are the units read"))
    _field_table(first, sizes, len(first), fmt)


def _index_status(args: argparse.Namespace, shards: list) -> tuple[str, int | None]:
    """``(status line, samples or None)`` from the sample index, when one exists, read once for
    both the line and the counts (the counts: when it covers every shard and none is stale)."""
    from streamdata.catalog import index as sdindex
    from streamdata.config import FetchConfig
    from streamdata.errors import StreamDataError

    options = storage_options(args)
    config = FetchConfig.resolve(None, **fetch_options(args))
    read: dict[str, Any] = {}

    def read_once(url: str, *rest: Any) -> Any:
        if url not in read:
            read[url] = sdindex.read_index(url, *rest)
        return read[url]

    status = sdindex.index_status(shards, storage_options=options, config=config, read=read_once)
    status = status[len("index: "):] if status.startswith("index: ") else status
    if status.startswith(("none", "unavailable")):
        return status, None
    try:  # the counts, if the index covers every shard and none is stale
        found = sdindex.lookup(shards, "auto", options, config, read=read_once)
    except StreamDataError:
        return status, None
    return status, None if found is None else int(found.counts.sum())


# ---- cat ------------------------------------------------------------------------------------


def run_cat(args: argparse.Namespace) -> int:
    fmt, shards = list_shards(args, args.spec, args.format)
    if args.row < 0:
        raise UsageError(f"--row must be >= 0, got {args.row}")
    if fmt == "tar":
        search = args.key is not None or args.row > 0  # then several shards in flight
        sample = _find(args, _tar_samples(args, shards, window=8 if search else 1), fmt)
    else:
        _, rows = _table_samples(args, fmt, shards)
        sample = _find(args, rows, fmt)
    if args.field is not None:
        _write_field(sample, args.field)
        return 0
    _print_sample(sample, fmt)
    return 0


def _find(args: argparse.Namespace, samples: Iterator[dict], fmt: str) -> dict:
    found = None
    with bar(args, None, "searching", unit="sample") as pbar:
        try:
            for n, sample in enumerate(samples):
                if args.key is not None and fmt != "tar" and "__key__" not in sample:
                    raise UsageError("--key needs a __key__ column; these rows have none: use --row N")
                if (sample.get("__key__") == args.key) if args.key is not None else n == args.row:
                    found = sample
                    break
                pbar.update(1)
        finally:
            getattr(samples, "close", lambda: None)()
    if found is None:
        what = f"no sample with key {args.key!r}" if args.key is not None else f"no sample number {args.row}"
        raise UsageError(f"{what} in {' '.join(args.spec)}")
    return found


def _write_field(sample: dict, field: str) -> None:
    if field not in sample:
        names = ", ".join(sorted(k for k in sample if _is_field(k)))
        raise UsageError(f"sample {sample.get('__key__', '')!r} has no field {field!r}; fields: {names}")
    value = sample[field]
    if hasattr(value, "numpy") and not isinstance(value, (bytes, str)):
        value = value.numpy()
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif hasattr(value, "tobytes"):
        data = value.tobytes()
    else:
        data = (value if isinstance(value, str) else json.dumps(value, default=str)).encode()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def _print_sample(sample: dict, fmt: str) -> None:
    from streamdata.formats.decode import make_decoder
    from streamdata.redact import redact_url

    decode = make_decoder(True) if fmt == "tar" else None
    decoded = decode(dict(sample)) if decode is not None else sample
    names = sorted(k for k in sample if _is_field(k))
    width = max([7, *map(len, names)])
    for meta in ("__key__", "__url__"):
        if meta in sample:
            value = sample[meta]
            write_out(f"{meta:<{width}}  {redact_url(value) if meta == '__url__' else value}")
    for name in names:
        header = media(name, sample[name])
        text = header[1] if header else describe(decoded[name], preview=True)
        write_out(f"{name:<{width}}  {_nbytes(sample[name]):>9} B  {text}")
