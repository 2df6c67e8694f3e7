"""Shared bits for the benchmarks: synthetic shards, uploads, timing, memory sampling."""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Layout",
    "ProxiedShards",
    "RssSampler",
    "mean_std",
    "proxied_shards",
    "replace_in_options",
    "sample_array",
    "shard_pattern",
    "upload_objects",
    "tar_bytes",
    "tar_shard",
    "upload_shards",
    "upstream",
    "write_report",
]

KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Layout:
    """Where one synthetic dataset lives: shard URLs and one-object-per-sample URLs."""

    bucket: str
    n_samples: int
    sample_bytes: int
    shard_spec: str  # brace pattern naming the shards (one listing call)
    shard_urls: list[str]
    object_prefix: str = ""
    object_urls: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.n_samples * self.sample_bytes


def sample_array(index: int, sample_bytes: int) -> np.ndarray:
    """A deterministic float32 array whose .npy payload is ``sample_bytes`` bytes."""
    rng = np.random.default_rng(index)
    return rng.random(sample_bytes // 4, dtype=np.float32)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def label_of(index: int) -> int:
    return index % 10


def tar_bytes(samples: Iterable[Mapping[str, Any]]) -> bytes:
    """One WebDataset tar of ``samples`` (dicts with ``__key__``), written with webdataset's TarWriter."""
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for sample in samples:
            sink.write(sample)
    return buf.getvalue()


def tar_shard(indices: Iterable[int], sample_bytes: int, extra: Mapping[str, bytes] = ()) -> bytes:
    """One WebDataset tar: ``.npy`` + ``.cls`` per sample (plus ``extra`` members)."""
    return tar_bytes(
        {"__key__": f"{i:08d}", "npy": _npy_bytes(sample_array(i, sample_bytes)),
         "cls": str(label_of(i)).encode(), **dict(extra)}
        for i in indices
    )


def _put_all(client: Any, bucket: str, items: list[tuple[str, Callable[[], bytes]]]) -> None:
    def put(item: tuple[str, Callable[[], bytes]]) -> None:
        key, make = item
        client.put_object(Bucket=bucket, Key=key, Body=make())

    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in pool.map(put, items, timeout=600):
            pass


def shard_pattern(bucket: str, prefix: str, n_shards: int) -> str:
    """The brace pattern of the shards ``upload_shards`` writes."""
    return f"s3://{bucket}/{prefix}-{{000000..{n_shards - 1:06d}}}.tar"


def upload_shards(
    client: Any,
    bucket: str,
    prefix: str,
    n_samples: int,
    n_shards: int,
    sample_bytes: int,
) -> list[str]:
    """Write ``n_samples`` in ``n_shards`` tar shards to ``s3://bucket/prefix-NNNNNN.tar``."""
    per = math.ceil(n_samples / n_shards)
    items = []
    for s in range(n_shards):
        idx = range(s * per, min(n_samples, (s + 1) * per))
        items.append((f"{prefix}-{s:06d}.tar", lambda idx=idx: tar_shard(idx, sample_bytes)))
    _put_all(client, bucket, items)
    return [f"s3://{bucket}/{key}" for key, _ in items]


def upload_objects(
    client: Any, bucket: str, prefix: str, n_samples: int, sample_bytes: int
) -> tuple[list[str], list[int]]:
    """One ``.npy`` object per sample at ``prefix/<label>/<key>.npy`` (label in the path)."""
    items, labels = [], []
    for i in range(n_samples):
        key = f"{prefix}/{label_of(i)}/{i:08d}.npy"
        items.append((key, lambda i=i: _npy_bytes(sample_array(i, sample_bytes))))
        labels.append(label_of(i))
    _put_all(client, bucket, items)
    return [f"s3://{bucket}/{key}" for key, _ in items], labels


def upstream(endpoint_url: str) -> tuple[str, int]:
    """``(host, port)`` of a server's endpoint URL: where a ``LatencyProxy`` forwards to."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint_url)
    return parts.hostname or "127.0.0.1", parts.port or 80


@dataclass(frozen=True)
class ProxiedShards:
    """What ``proxied_shards`` yields: the server, the shards' spec, the proxy and the options to read
    through it (``server.storage_options`` reads direct)."""

    server: Any
    spec: str
    proxy: Any
    options: dict


@contextmanager
def proxied_shards(
    delay_ms: float, samples: int, shards: int, sample_kib: int, *, index: bool = False
) -> Iterator[ProxiedShards]:
    """The embedded S3 server holding ``samples`` in ``shards`` tar shards at ``s3://bench/tar/train-*``
    (each sample ``sample_kib`` KiB + 128 bytes; indexed when ``index``), behind a ``LatencyProxy``
    with ``delay_ms`` one way."""
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    with S3Server() as server:
        server.create_bucket("bench")
        upload_shards(server.boto3_client(), "bench", "tar/train", samples, shards, sample_kib * 1024 + 128)
        spec = shard_pattern("bench", "tar/train", shards)
        if index:
            from streamdata.catalog.index import build_index

            build_index(spec, server.storage_options, progress=False)
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=delay_ms / 1000) as proxy:
            options = replace_in_options(server.storage_options, server.endpoint_url,
                                         proxy.url_for(server.endpoint_url))
            yield ProxiedShards(server, spec, proxy, options)


def replace_in_options(options: Any, old: str, new: str) -> Any:
    """A copy of nested ``storage_options`` with every string equal to ``old`` set to ``new``."""
    if isinstance(options, Mapping):
        return {k: replace_in_options(v, old, new) for k, v in options.items()}
    if isinstance(options, list):
        return [replace_in_options(v, old, new) for v in options]
    return new if options == old else options


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    """Write a benchmark's ``report`` to ``path`` as indented JSON (its folder made) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaNs are ignored."""
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


class RssSampler:
    """Samples the resident memory of this process and its descendants in a thread.

    ``peak_total`` is the largest sum over main + descendants seen in one sample (RSS counts
    pages shared after fork in every process, so the sum over-counts; compare like with like).
    ``peak_child`` is the largest single descendant (a DataLoader worker), ``child_base`` the
    smallest first-seen RSS of a descendant (its size before it did any work).
    ``exclude`` names pids (and their descendants) to leave out, e.g. servers.
    """

    def __init__(self, interval: float = 0.05, exclude: Iterable[int] = ()) -> None:
        self.interval = interval
        self.exclude = set(exclude)
        self.peak_total = 0
        self.peak_main = 0
        self.peak_child = 0
        self.child_base = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _procs(self) -> Iterator[Any]:
        import psutil

        me = psutil.Process(os.getpid())
        skip: set[int] = set()
        for child in me.children(recursive=True):
            if child.pid in self.exclude or child.ppid() in skip:
                skip.add(child.pid)
                continue
            yield child

    def sample(self) -> None:
        import psutil

        main = psutil.Process(os.getpid()).memory_info().rss
        total = main
        seen_base: list[int] = []
        for proc in self._procs():
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            self.peak_child = max(self.peak_child, rss)
            seen_base.append(rss)
        self.peak_main = max(self.peak_main, main)
        self.peak_total = max(self.peak_total, total)
        if seen_base and not self.child_base:
            self.child_base = min(seen_base)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a process vanished mid-read: skip this sample
                pass

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sample()


class Stopwatch:
    """``elapsed()`` since creation, in seconds (perf_counter)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def run_in_tree(child: str, argv: list[str], tree: Path, timeout: float = 900) -> dict:
    """Run the Python source ``child`` with ``argv`` in a fresh interpreter on the
    ``streamdata`` of ``tree`` (a checkout: ``--base`` runs side by side), one thread for
    torch; its last line of output, JSON with ``"sd"`` (``streamdata.__file__``), parsed. Raises
    if it failed or imported another tree's ``streamdata``."""
    # ``-c`` puts the working directory first on sys.path: the child runs in ``tree``
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", child, *argv], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["sd"]).resolve().is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"the child imported {out['sd']}, not {tree}'s streamdata")
    return out
