"""``streamdata convert``: an image folder (torchvision ImageFolder layout) or a JSONL file into
WebDataset tar shards (with the sample index) or Parquet shards, at any fsspec URL.

Images are copied as they are (no decoding or re-encoding): ``<key>.<ext>`` plus ``<key>.cls``
(the class index: class directories sorted by name, as torchvision numbers them; the names
go to ``classes.txt`` beside the shards). A JSONL line becomes ``<key>.json``. Source files
are read by ``--workers`` threads at once, in order; finished shards upload in the background.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import posixpath
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from streamdata.cli.common import (
    UsageError,
    add_common,
    bar,
    fetch_options,
    human,
    parse_size,
    storage_options,
    write_out,
)

__all__ = ["IMAGE_SUFFIXES", "MEDIA_SUFFIXES", "add_parsers"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
# video and audio files, kept as members as they are (sd.video / sd.audio decode them)
MEDIA_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".wav", ".flac", ".ogg", ".opus", ".mp3",
                  ".m4a")
_VIDEO_SUFFIXES = MEDIA_SUFFIXES[:6]  # the rest are audio
_MEMBER_SUFFIXES = IMAGE_SUFFIXES + MEDIA_SUFFIXES
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="an image folder (ImageFolder layout) or a JSONL file into tar or Parquet shards",
        description="Convert SRC into shards at DEST. SRC is a directory of images (or video and audio "
                    "files, kept as they are), either with one "
                    "subdirectory per class (torchvision ImageFolder: <key>.<ext> + <key>.cls, class "
                    "names in classes.txt beside the shards) or flat (<key>.<ext> only), or a JSONL "
                    "file (<key>.json per line). DEST is a directory or prefix "
                    "(s3://bkt/train/ -> shard-000000.tar ...) or a pattern with %06d (tar) or "
                    "{shard:06d} (Parquet). Tar shards get the sample index (_streamdata.sdx); "
                    "Parquet shards carry their own counts in the footers.")
    p.add_argument("src", metavar="SRC", help="image directory or JSONL file (local path or URL)")
    p.add_argument("dest", metavar="DEST", help="output directory, prefix or shard name pattern")
    p.add_argument("--format", choices=("tar", "parquet"), default="tar", help="shard format (default tar)")
    p.add_argument("--maxcount", type=int, default=10000, metavar="N",
                   help="samples per shard at most (default 10000)")
    p.add_argument("--maxsize", type=parse_size, default=parse_size("1GiB"), metavar="BYTES",
                   help="tar: start a new shard once a shard holds this many bytes (default 1GiB; "
                        "500MB, 2GiB ... accepted)")
    p.add_argument("--compress", choices=("gz", "zst"), default=None,
                   help="tar: compress each shard (.tar.gz / .tar.zst; read whole, so no sample index)")
    p.add_argument("--workers", type=int, default=8, metavar="N",
                   help="source files read at once (default 8)")
    p.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                   help="write the samples in an order shuffled with SEED (default: sorted by path, "
                        "so an ImageFolder's shards would each hold one class)")
    add_common(p)
    p.set_defaults(run=run)


# ---- sources ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Source:
    """What to convert: ``items`` (image paths, or JSONL lines: read again on each iteration,
    never all held), ``count`` of them, ``load(item) -> sample``."""

    kind: str
    items: Iterable
    count: int
    load: Callable[[Any], dict]
    classes: list[str]
    total_bytes: int
    skipped: list[str] = dataclasses.field(default_factory=list)  # files that are not images
    what: str = ""  # what the summary line calls the samples (default: ``kind``)


def _open_source(src: str, options: dict) -> tuple[Any, Source]:
    from streamdata.store.backends import filesystem
    from streamdata.store.urls import split_url

    protocol, path = split_url(src)
    fs = filesystem(protocol, options if protocol != "file" else None)
    path = fs._strip_protocol(path)
    if fs.isfile(path):
        if not path.lower().endswith(JSONL_SUFFIXES):
            raise UsageError(f"{src}: a file to convert must be JSONL (one JSON object per line, "
                             f"{'/'.join(JSONL_SUFFIXES)}); or give an image directory")
        return fs, _jsonl(fs, path, src)
    if not fs.isdir(path):
        raise UsageError(f"{src}: no such file or directory")
    return fs, _images(fs, path, src)


def _images(fs: Any, root: str, src: str) -> Source:
    found = fs.find(root, detail=True)
    root = root.rstrip("/")
    images = sorted((name, info.get("size") or 0) for name, info in found.items()
                    if name.lower().endswith(_MEMBER_SUFFIXES))
    others = sorted(posixpath.relpath(name, root) for name in found
                    if not name.lower().endswith(_MEMBER_SUFFIXES))
    if not images:
        raise UsageError(f"{src}: no images ({', '.join(IMAGE_SUFFIXES)}) or media "
                         f"({', '.join(MEDIA_SUFFIXES)}) in it or below it")
    relative = [posixpath.relpath(name, root) for name, _ in images]
    top = [rel for rel in relative if "/" not in rel]
    nested = [rel for rel in relative if "/" in rel]
    if top and nested:
        raise UsageError(f"{src}: {len(top)} images at the top (e.g. {top[0]}) and {len(nested)} in "
                         "class directories: keep one layout (ImageFolder: every image in a class directory)")
    classes = sorted({rel.split("/", 1)[0] for rel in nested})
    if classes:  # torchvision numbers every class directory, and refuses one without images
        dirs = sorted(posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(root, detail=True)
                      if e.get("type") == "directory")
        empty = [d for d in dirs if d not in classes]
        if empty:
            raise UsageError(f"{src}: class directory {empty[0]!r} holds no images (torchvision's "
                             "ImageFolder refuses it too): remove it, or add its images")
    number = {name: i for i, name in enumerate(classes)}

    def load(item: tuple[str, str]) -> dict:
        name, rel = item
        ext = rel.rsplit(".", 1)[1].lower()
        sample: dict[str, Any] = {ext: fs.cat_file(name)}
        if classes:
            sample["cls"] = number[rel.split("/", 1)[0]]
        return sample

    items = [(name, rel) for (name, _), rel in zip(images, relative, strict=True)]
    what = _files_named(relative)
    if what == "images":  # torchvision's layout, or a flat folder of images
        return Source("imagefolder" if classes else "images", items, len(items), load, classes,
                      sum(s for _, s in images), others)
    return Source("mediafolder" if classes else "media", items, len(items), load, classes,
                  sum(s for _, s in images), others, what=what)


def _files_named(relative: list[str]) -> str:
    """What a folder's files are: ``images`` where all are, else each kind counted (``3 videos,
    2 audio files, 1 image``)."""
    kinds = {"video": 0, "audio": 0, "image": 0}
    for rel in relative:
        low = rel.lower()
        kinds["video" if low.endswith(_VIDEO_SUFFIXES) else
              "audio" if low.endswith(MEDIA_SUFFIXES) else "image"] += 1
    if kinds["image"] == len(relative):
        return "images"
    nouns = {"video": ("video", "videos"), "audio": ("audio file", "audio files"),
             "image": ("image", "images")}
    return ", ".join(f"{n} {nouns[k][n != 1]}" for k, n in kinds.items() if n)


class _Lines:
    """The non-blank lines of a JSONL file, read from the start on each iteration."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        with self.fs.open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if line:
                    yield number, line


def _jsonl(fs: Any, path: str, src: str) -> Source:
    """A first pass checks every line (a bad one is reported before anything is written) and
    counts them; the conversion reads the file again, so no line is held meanwhile."""
    lines = _Lines(fs, path)
    count = nbytes = 0
    for number, line in lines:
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{src}: line {number} is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise UsageError(f"{src}: line {number} is not a JSON object")
        count, nbytes = count + 1, nbytes + len(line)
    if not count:
        raise UsageError(f"{src}: no JSON lines in it")
    return Source("jsonl", lines, count, lambda item: {"json": item[1]}, [], nbytes)


def _ordered(load: Callable[[Any], dict], items: Iterable, workers: int) -> Iterator[dict]:
    """``load(item)`` for each item, in order, ``workers`` at a time (a bounded window ahead)."""
    if workers <= 1:
        yield from map(load, items)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="streamdata-read") as pool:
        window: collections.deque = collections.deque()
        try:
            for item in items:
                window.append(pool.submit(load, item))
                if len(window) >= workers * 4:
                    yield window.popleft().result(timeout=600)
            while window:
                yield window.popleft().result(timeout=600)
        finally:
            for future in window:
                future.cancel()


# ---- destinations ---------------------------------------------------------------------------


def _pattern(dest: str, fmt: str, compress: str | None = None) -> str:
    """DEST -> a shard name pattern: ``%06d`` style for tar, ``{shard:06d}`` for Parquet."""
    if "%" in dest or "{shard" in dest:
        if fmt == "tar":
            return re.sub(r"\{shard(?::(0?\d*)d)?\}", lambda m: "%" + (m.group(1) or "") + "d", dest)
        return re.sub(r"%(0?\d*)d", lambda m: "{shard:" + m.group(1) + "d}", dest)
    name = "shard-%06d.tar" if fmt == "tar" else "shard-{shard:06d}.parquet"
    if fmt == "tar" and compress:
        name += ".gz" if compress == "gz" else ".zst"
    return dest.rstrip("/") + "/" + name


def run(args: argparse.Namespace) -> int:
    if args.maxcount < 1 or args.workers < 1:
        raise UsageError("--maxcount and --workers must be >= 1")
    options = storage_options(args)
    fs, source = _open_source(args.src, options)
    try:
        items = source.items
        if args.shuffle is not None:  # (JSONL lines are then held in memory)
            items = list(items)
            random.Random(args.shuffle).shuffle(items)
        if args.compress and args.format != "tar":
            raise UsageError("--compress is for tar shards (Parquet compresses its columns itself)")
        pattern = _pattern(args.dest, args.format, args.compress)
        start = time.perf_counter()
        with bar(args, source.count, f"convert {source.kind}", unit="sample") as pbar:
            samples = _keyed(_ordered(source.load, items, args.workers), pbar)
            if args.format == "tar":
                urls, index = _write_tar(samples, pattern, args, options)
            else:
                urls, index = _write_parquet(samples, pattern, args, options), None
        elapsed = time.perf_counter() - start
    finally:
        from streamdata.store.backends import close_filesystem

        close_filesystem(fs)
    if source.classes:
        _write_classes(pattern, source.classes, options)
    n = source.count
    what = (source.what or source.kind) + (f", {len(source.classes)} classes" if source.classes else "")
    write_out(f"wrote {n} samples ({what}, {human(source.total_bytes)} of source) to {len(urls)} "
              f"{args.format} shards in {elapsed:.1f} s ({n / max(elapsed, 1e-9):.0f} samples/s)")
    if source.skipped:
        write_out(f"skipped   {len(source.skipped)} files that are not images or media ({IMAGE_SUFFIXES[0]}, "
                  f"{MEDIA_SUFFIXES[0]}, ...): "
                  f"{', '.join(source.skipped[:3])}{', ...' if len(source.skipped) > 3 else ''}")
    from streamdata.redact import redact_url

    if urls:
        write_out(f"first     {redact_url(urls[0])}")
        write_out(f"last      {redact_url(urls[-1])}")
    if index:
        write_out(f"index     {redact_url(index)}")
    elif args.format == "tar" and urls:
        write_out("index     none: compressed shards are split by shard and read whole")
    return 0


def _keyed(samples: Iterator[dict], pbar: Any) -> Iterator[dict]:
    for n, sample in enumerate(samples):
        sample["__key__"] = f"{n:09d}"
        yield sample
        pbar.update(1)


def _write_classes(pattern: str, classes: list[str], options: dict) -> None:
    from streamdata.store.backends import close_filesystem, filesystem
    from streamdata.store.urls import split_url

    protocol, path = split_url(pattern)
    fs = filesystem(protocol, options if protocol != "file" else None)
    try:
        names = "\n".join(classes).encode() + b"\n"
        fs.pipe_file(posixpath.join(posixpath.dirname(path), "classes.txt"), names)
    finally:
        close_filesystem(fs)


def _write_tar(samples: Iterator[dict], pattern: str, args: argparse.Namespace,
               options: dict) -> tuple[list[str], str | None]:
    """Samples into ``sd.ShardWriter`` (uploads in the background, the sample index at close)."""
    from streamdata.catalog.index import default_index_url
    from streamdata.write.tar import ShardWriter

    with ShardWriter(pattern, maxcount=args.maxcount, maxsize=args.maxsize, storage_options=options,
                     compress=args.compress, progress=False, **fetch_options(args)) as out:
        for sample in samples:
            out.write(sample)
    if not out.urls:
        return [], None
    return out.urls, (default_index_url(out.urls) if out.codec is None else None)


def _write_parquet(samples: Iterator[dict], pattern: str, args: argparse.Namespace,
                   options: dict) -> list[str]:
    import pyarrow as pa

    from streamdata.write.tables import write_parquet

    def tables() -> Iterator[pa.Table]:
        chunk: list[dict] = []
        for sample in samples:
            chunk.append(_row(sample))
            if len(chunk) >= 1024:
                yield pa.Table.from_pylist(chunk)
                chunk = []
        if chunk:
            yield pa.Table.from_pylist(chunk)

    return write_parquet(tables(), pattern, rows_per_shard=args.maxcount,
                         row_group_size=min(args.maxcount, 1024), storage_options=options)


def _row(sample: dict) -> dict:
    """A sample as a Parquet row: JSON objects become columns; an image, ``image`` + ``format``."""
    if "json" in sample:
        return {"__key__": sample["__key__"], **json.loads(sample["json"])}
    row: dict[str, Any] = {"__key__": sample["__key__"]}
    for field, value in sample.items():
        if field == "cls":
            row["cls"] = value
        elif field != "__key__":
            row["image"], row["format"] = value, field
    return row
