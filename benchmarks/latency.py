"""Latency benchmark: streamdata against the wire limit and the usual alternatives.

One run starts the embedded S3 server, writes the dataset once (tar shards and one object
per sample), puts a :class:`~benchmarks.proxy.LatencyProxy` in front of it and, for each
one-way delay, measures every method in a fresh subprocess (so memory figures do not leak
from one method into the next). See ``benchmarks/README.md`` for the columns.

    python -m benchmarks.latency            # full run (~10 min on 2 cores)
    python -m benchmarks.latency --quick    # smoke run (~2 min)
    python -m benchmarks.latency --rss      # a worker's peak RSS vs. byte budget, 1..256 MB shards

A/B against another version of the package (e.g. the previous commit), in the same rounds:

    git worktree add /tmp/sd-prev <commit>
    python -m benchmarks.latency --delays 0,100 --methods wire,streamdata --sd-trees prev=/tmp/sd-prev \
        --rounds 5 --reps 1 --sweep-workers ""

``--sd-trees NAME=PATH[,NAME=PATH...]`` runs each entry as one more method,
``streamdata@NAME``: the ``streamdata`` method's settings (``--sd-options`` included), with the
``streamdata`` package imported from the checkout at PATH (a directory holding
``streamdata/``). Its child process puts PATH first on ``sys.path`` before it imports
``streamdata``, fails if the package came from anywhere else, and records the file it
imported (``streamdata_file`` in the results). The benchmark's own code (``benchmarks.*``)
and the S3 server (``streamdata.testing``, in this process) stay those of this tree. The
per-round table then gives ``streamdata@NAME / wire`` next to ``streamdata / wire``, and
``streamdata / streamdata@NAME`` round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Layout,
    MiB,
    RssSampler,
    mean_std,
    replace_in_options,
    shard_pattern,
    upload_objects,
    upload_shards,
    upstream,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
METHODS = ("wire", "streamdata", "webdataset", "wire_objects", "mapstyle", "objects")
COLORS = dict(zip(METHODS, ("black", "tab:orange", "tab:green", "tab:gray", "tab:red", "tab:purple"),
                  strict=True))
NOT_FEASIBLE = {
    "mosaicml-streaming": "installing it pulls transformers, torchvision, oci, azure and downgrades numpy",
    "litdata": "reads only its own optimize() format (not these shards); pulls torchvision and obstore",
    "s3torchconnector": "1.5.0 is published as an sdist only (its Rust client has a wheel)",
}


# ---------------------------------------------------------------------------------------------
# Runner side: one method, one configuration, several repetitions, in a fresh process
# ---------------------------------------------------------------------------------------------


def _batch_size_of(batch: Any) -> int:
    """Number of samples in a collated batch (dict, tuple/list or tensor)."""
    if isinstance(batch, dict):
        batch = batch.get("__key__", next(iter(batch.values())))
    elif isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        batch = batch[0]
    return int(batch.shape[0]) if hasattr(batch, "shape") else len(batch)


def _drain(make_loader: Callable[[], Iterable[Any]], max_seconds: float) -> dict[str, float]:
    """Build the loader, iterate until exhausted or ``max_seconds`` after the first batch.

    The time to first batch counts from before the dataset is built (listing included);
    ``setup_s`` is the part spent building it.
    """
    start = time.perf_counter()
    loader = make_loader()
    setup = time.perf_counter() - start
    it = iter(loader)
    first_at, first_n, n = None, 0, 0
    for batch in it:
        k = _batch_size_of(batch)
        n += k
        now = time.perf_counter()
        if first_at is None:
            first_at, first_n = now, k
        elif now - first_at >= max_seconds:
            break
    end = time.perf_counter()
    shutdown = getattr(it, "_shutdown_workers", None) or getattr(loader, "close", None)
    if shutdown is not None:
        shutdown()
    del it
    first_at = end if first_at is None else first_at
    steady = (n - first_n) / (end - first_at) if end > first_at and n > first_n else float("nan")
    return {"ttfb_s": first_at - start, "setup_s": setup, "total_s": end - start, "samples": n,
            "steady_sps": steady}


def _boto3_client(storage_options: dict) -> Any:
    """A boto3 S3 client for the endpoint and credentials in s3fs ``storage_options``."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=storage_options["endpoint_url"],
        aws_access_key_id=storage_options.get("key"),
        aws_secret_access_key=storage_options.get("secret"),
        region_name=storage_options.get("client_kwargs", {}).get("region_name", "us-east-1"),
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=64),
    )


def _bucket_key(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def _npy_tensor(data: bytes) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))


def _label_from_url(url: str) -> int:
    return int(url.rsplit("/", 2)[-2])


def _loader_streamdata(cfg: dict) -> Any:
    import streamdata as sd

    opts = dict(cfg.get("sd_options") or {})
    loader_opts = opts.pop("loader", {})
    ds = sd.TarDataset(
        cfg["shard_spec"],
        storage_options=cfg["storage_options"],
        batch_size=cfg["batch"],
        decode=opts.pop("decode", True),
        **opts,
    )
    return sd.loader(ds, num_workers=cfg["workers"], pin_memory=False, **loader_opts)


class _WdsOpener:
    """webdataset gopen handler for ``s3://``: an s3fs file (one per worker process)."""

    def __init__(self, storage_options: dict) -> None:
        self.storage_options = storage_options
        self._fs: Any = None
        self._pid = -1

    def __call__(self, url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        if self._pid != os.getpid():
            import s3fs

            self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
            self._pid = os.getpid()
        return self._fs.open(url, "rb")


def _wds_collate(samples: list[tuple[Any, int]]) -> dict[str, Any]:
    import numpy as np
    import torch

    arrays, labels = zip(*samples, strict=True)  # (array, label) pairs
    return {"npy": torch.from_numpy(np.stack(arrays)), "cls": torch.tensor(labels)}


def _loader_webdataset(cfg: dict) -> Any:
    import webdataset as wds
    from torch.utils.data import DataLoader

    importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = _WdsOpener(cfg["storage_options"])
    ds = (
        wds.WebDataset(cfg["shard_urls"], shardshuffle=False, empty_check=False)
        .decode()
        .to_tuple("npy", "cls")
        .batched(cfg["batch"], collation_fn=_wds_collate)
    )
    return DataLoader(ds, batch_size=None, num_workers=cfg["workers"])


class _OneGetPerSample:
    """The plain map-style baseline: ``__getitem__`` does one blocking boto3 GET."""

    def __init__(self, urls: list[str], storage_options: dict) -> None:
        self.urls = urls
        self.storage_options = storage_options
        self._client: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self._pid != os.getpid():
            self._client = _boto3_client(self.storage_options)
            self._pid = os.getpid()
        url = self.urls[index]
        bucket, key = _bucket_key(url)
        body = self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return _npy_tensor(body), _label_from_url(url)


def _loader_mapstyle(cfg: dict) -> Any:
    from torch.utils.data import DataLoader

    ds = _OneGetPerSample(cfg["object_urls"], cfg["storage_options"])
    return DataLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"])


def _with_label(sample: dict) -> dict:
    sample["cls"] = _label_from_url(sample.pop("__url__"))
    return sample


def _loader_objects(cfg: dict) -> Any:
    import streamdata as sd

    ds = sd.ObjectDataset(cfg["object_spec"], storage_options=cfg["storage_options"], map=_with_label)
    return sd.loader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"], pin_memory=False)


class _OneItem:
    """An IterableDataset yielding one tiny batch: its first batch time is worker start-up."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        import torch

        yield {"cls": torch.zeros(1)}


def _loader_startup(cfg: dict) -> Any:
    from torch.utils.data import DataLoader, IterableDataset

    ds = type("OneItem", (_OneItem, IterableDataset), {})()
    return DataLoader(ds, batch_size=None, num_workers=cfg["workers"])


LOADERS: dict[str, Callable[[dict], Any]] = {
    "streamdata": _loader_streamdata,
    "webdataset": _loader_webdataset,
    "mapstyle": _loader_mapstyle,
    "objects": _loader_objects,
    "startup": _loader_startup,
}


async def _wire_get(cfg: dict, urls: list[str], n_samples: int, concurrency: int) -> dict[str, float]:
    """Raw concurrent GETs of ``urls`` (presigned), bytes counted and dropped.

    First one URL alone on a new connection (the wire's time to first shard), then all of
    them, ``concurrency`` at a time; the rate counts from the first byte of the second.
    """
    import aiohttp

    client = _boto3_client(cfg["storage_options"])
    signed = []
    for url in urls:
        bucket, key = _bucket_key(url)
        signed.append(client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600))
    first_byte: float | None = None
    first_done: float | None = None
    total = 0
    timeout = aiohttp.ClientTimeout(total=300)
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(signed[0]) as resp:
            resp.raise_for_status()
            await resp.read()
    alone = time.perf_counter() - start
    start = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=max(1, concurrency))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def get(url: str) -> None:
            nonlocal first_byte, first_done, total
            async with session.get(url) as resp:
                resp.raise_for_status()
                async for chunk in resp.content.iter_any():
                    if first_byte is None:
                        first_byte = time.perf_counter()
                    total += len(chunk)
            if first_done is None:
                first_done = time.perf_counter()

        await asyncio.gather(*(get(u) for u in signed))
    end = time.perf_counter()
    assert first_byte is not None and first_done is not None
    return {
        "ttfb_s": alone,
        "first_shard_concurrent_s": first_done - start,
        "first_byte_s": first_byte - start,
        "total_s": end - start,
        "samples": n_samples,
        "steady_sps": n_samples / (end - first_byte),
        "bytes": total,
    }


def _wire(cfg: dict) -> dict[str, float]:
    if cfg["method"] == "wire":
        return asyncio.run(_wire_get(cfg, cfg["shard_urls"], cfg["n_samples"], cfg["wire_concurrency"]))
    urls = cfg["object_urls"][: cfg["wire_objects"]]
    return asyncio.run(_wire_get(cfg, urls, len(urls), cfg["wire_object_concurrency"]))


def _import_streamdata(sd_path: str | None) -> str:
    """Import ``streamdata`` (from the checkout at ``sd_path`` when given); its ``__file__``.

    With ``python -m`` the working directory (this tree) is ``sys.path[0]``, so PYTHONPATH
    would not win: ``sd_path`` goes in front of it, before anything imports ``streamdata``.
    ``benchmarks`` is imported by then and stays this tree's. DataLoader workers fork here (and
    inherit the module); spawned or forkserver ones would get this ``sys.path``, so the same
    ``streamdata`` (but PATH's ``benchmarks.latency`` as their ``__main__``, if it has one).
    """
    if sd_path is None:
        return importlib.import_module("streamdata").__file__ or "?"
    root = Path(sd_path).resolve()
    if "streamdata" in sys.modules:
        raise RuntimeError(f"streamdata was imported before sd_path {root} could be put first: "
                           f"{sys.modules['streamdata'].__file__}")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    module = importlib.import_module("streamdata")
    where = Path(module.__file__ or "").resolve()
    if not where.is_relative_to(root / "streamdata"):
        raise RuntimeError(f"streamdata came from {where}, not from sd_path {root}")
    here = Path(sys.modules["benchmarks"].__file__ or "").resolve()
    if not here.is_relative_to(REPO):
        raise RuntimeError(f"benchmarks came from {here}, not from this tree {REPO}")
    return str(where)


def run_one(cfg: dict) -> list[dict[str, Any]]:
    """All repetitions of one (method, delay, workers) configuration, in this process."""
    streamdata_file = _import_streamdata(cfg.get("sd_path"))
    for module in ("torch", "numpy", "aiohttp", "boto3", "s3fs", "webdataset"):
        importlib.import_module(module)  # imports are not what we time
    reps = []
    for _ in range(cfg["reps"]):
        with RssSampler(interval=0.05) as rss:
            if cfg["method"].startswith("wire"):
                result = _wire(cfg)
            else:
                result = _drain(lambda: LOADERS[cfg["method"]](cfg), cfg["max_seconds"])
        result.update(
            peak_rss_mb=rss.peak_total / MiB,
            main_rss_mb=rss.peak_main / MiB,
            worker_peak_mb=rss.peak_child / MiB,
            worker_base_mb=rss.child_base / MiB,
        )
        result["steady_mbps"] = result["steady_sps"] * cfg["sample_bytes"] / 1e6
        # whole pass: loaders from iter(loader) (the dataset's listing left out), the wire
        # from its first request: both pay connection set-up and the first round trip
        span = result["total_s"] - result.get("setup_s", 0.0)
        result["pass_sps"] = result["samples"] / span if span > 0 else float("nan")
        result["streamdata_file"] = streamdata_file
        reps.append(result)
    return reps


# ---------------------------------------------------------------------------------------------
# Orchestrator side
# ---------------------------------------------------------------------------------------------


def _run_child(cfg: dict, timeout: float) -> list[dict[str, Any]]:
    """Run one configuration in a fresh interpreter; return its repetitions (or an error)."""
    with tempfile.TemporaryDirectory(prefix="sd-bench-") as tmp:
        cfg_path, out_path = Path(tmp, "cfg.json"), Path(tmp, "out.json")
        cfg_path.write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "benchmarks.latency", "--run-one", str(cfg_path), str(out_path)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return [{"error": f"timed out after {timeout:.0f} s"}]
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return [{"error": " | ".join(tail) or f"exit {proc.returncode}"}]
        return json.loads(out_path.read_text())


def _summarise(reps: list[dict[str, Any]]) -> dict[str, Any]:
    if any("error" in r for r in reps):
        return {"error": reps[0].get("error", "failed")}
    out: dict[str, Any] = {"reps": len(reps)}
    for key in ("steady_sps", "pass_sps", "steady_mbps", "ttfb_s", "setup_s", "total_s",
                "first_shard_concurrent_s", "peak_rss_mb", "worker_peak_mb", "worker_base_mb", "samples"):
        out[key], out[key + "_std"] = mean_std([float(r.get(key, float("nan"))) for r in reps])
    out["streamdata_file"] = reps[0].get("streamdata_file") if reps else None
    out["raw"] = reps
    return out


def _measure(label: str, base_cfg: dict, proxy: Any, **changes: Any) -> dict[str, Any]:
    cfg = dict(base_cfg, **changes)
    proxy.reset_counters()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    timeout = cfg["reps"] * (cfg["max_seconds"] + 120) + 60
    summary = _summarise(_run_child(cfg, timeout))
    summary.update(
        method=cfg["method"],
        delay_ms=cfg["delay_ms"],
        workers=cfg["workers"],
        wall_s=time.perf_counter() - started,
        load_before=load,
        load_after=os.getloadavg()[0],
        wire_mb_per_rep=proxy.bytes_down / 1e6 / max(1, cfg["reps"]),
        connections_per_rep=proxy.connections / max(1, cfg["reps"]),
    )
    if "error" in summary:
        print(f"  {label}: ERROR {summary['error']}", flush=True)
    else:
        print(
            f"  {label}: {summary['steady_sps']:8.0f} ± {summary['steady_sps_std']:5.0f} samples/s"
            f"  ttfb {summary['ttfb_s']:.2f} s  peak RSS {summary['peak_rss_mb']:.0f} MB"
            f"  ({summary['wall_s']:.0f} s)"
            + (f"  streamdata from {summary['streamdata_file']}" if cfg.get("sd_path") else ""),
            flush=True,
        )
    return summary


_ROUND_KEYS = ("steady_sps", "pass_sps", "ttfb_s", "setup_s")


def _merge_rounds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary over every repetition of the rounds that completed, keeping each of
    those rounds' means under its round number (an error row only if every round failed)."""
    good = [(k, s) for k, s in enumerate(summaries) if "error" not in s]
    if len(summaries) == 1 or not good:
        return summaries[0]
    merged = _summarise([r for _, s in good for r in s["raw"]])
    first = summaries[0]
    merged.update(
        method=first["method"], delay_ms=first["delay_ms"], workers=first["workers"],
        wall_s=sum(s["wall_s"] for s in summaries), load_before=first["load_before"],
        load_after=summaries[-1]["load_after"],
        wire_mb_per_rep=statistics.mean(s["wire_mb_per_rep"] for _, s in good),
        connections_per_rep=statistics.mean(s["connections_per_rep"] for _, s in good),
        rounds=[{"round": k, **{key: s[key] for key in _ROUND_KEYS}} for k, s in good],
        failed_rounds=len(summaries) - len(good),
    )
    return merged


def _paired(a: dict | None, b: dict | None, key: str) -> list[float]:
    """a/b round by round (the methods of a round run back to back), for the rounds both
    completed with a number."""
    if not a or not b or "rounds" not in a or "rounds" not in b:
        return []
    theirs = {r["round"]: r[key] for r in b["rounds"]}
    out = []
    for mine in a["rounds"]:
        x, y = mine[key], theirs.get(mine["round"], float("nan"))
        if x == x and y == y and y:  # NaN != NaN
            out.append(x / y)
    return out


def format_paired(results: list[dict[str, Any]]) -> str:
    """Per-round ratios (methods interleaved within a round): median, and min–max."""
    by_delay: dict[float, dict[str, dict]] = {}
    for r in results:
        by_delay.setdefault(r["delay_ms"], {})[r["method"]] = r
    pairs = [("streamdata", "wire", "steady_sps", "streamdata / wire"),
             ("streamdata", "wire", "pass_sps", "same, whole pass"),
             ("streamdata", "webdataset", "steady_sps", "streamdata / webdataset"),
             ("objects", "mapstyle", "steady_sps", "objects / map-style")]
    variants = sorted({r["method"] for r in results if r["method"].startswith("streamdata:")})
    for v in variants:
        pairs += [(v, "wire", "steady_sps", f"{v} / wire"), (v, "wire", "pass_sps", "same, whole pass")]
    trees = sorted({r["method"] for r in results if r["method"].startswith("streamdata@")})
    for t in trees:  # another checkout of the package: its ratio to the wire, and this tree's to it
        pairs += [(t, "wire", "steady_sps", f"{t} / wire"), (t, "wire", "pass_sps", "same, whole pass"),
                  ("streamdata", t, "steady_sps", f"streamdata / {t}"),
                  ("streamdata", t, "pass_sps", "same, whole pass")]
    used = [p for p in pairs
            if any(_paired(rows.get(p[0]), rows.get(p[1]), p[2]) for rows in by_delay.values())]
    if not used:
        return ""
    n = max(len(r.get("rounds", [])) for r in results)
    lines = [f"Per round ({n} rounds, methods interleaved): median (min–max)", "",
             "| delay | " + " | ".join(p[3] for p in used) + " |", "|---:|" + "---:|" * len(used)]
    for delay, rows in sorted(by_delay.items()):
        cells = []
        for a, b, key, _ in used:
            ratios = _paired(rows.get(a), rows.get(b), key)
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"
                         if ratios else "—")
        lines.append(f"| {delay:g} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _prepare(server: Any, args: argparse.Namespace) -> Layout:
    client = server.boto3_client()
    bucket = "bench"
    server.create_bucket(bucket)
    t = time.perf_counter()
    shard_urls = upload_shards(client, bucket, "tar/train", args.samples, args.shards, args.sample_bytes)
    spec = shard_pattern(bucket, "tar/train", args.shards)
    object_urls, labels = [], []
    if {"mapstyle", "objects", "wire_objects"} & set(args.methods):
        object_urls, labels = upload_objects(client, bucket, "objects", args.samples, args.sample_bytes)
    print(f"dataset written in {time.perf_counter() - t:.1f} s: {len(shard_urls)} shards, "
          f"{len(object_urls)} objects, {args.samples} samples of {args.sample_bytes} B", flush=True)
    return Layout(bucket, args.samples, args.sample_bytes, spec, shard_urls, f"s3://{bucket}/objects/",
                  object_urls, labels)


def _ratio(a: dict | None, b: dict | None, key: str = "steady_sps") -> float:
    if not a or not b or "error" in a or "error" in b or not b.get(key) or key not in a:
        return float("nan")
    return a[key] / b[key]


def _fmt(value: float, std: float | None = None, digits: int = 0) -> str:
    if value != value:
        return "—"
    text = f"{value:,.{digits}f}"
    return text if std is None else f"{text} ± {std:,.{digits}f}"


def format_table(results: list[dict[str, Any]], startup: dict[str, Any]) -> str:
    """A Markdown table of the delay runs, then the ratios per delay."""
    lines = [
        "| delay | method | samples/s | MB/s | whole pass samples/s | first batch s | of which setup s "
        "| peak RSS MB (main+workers) | worker peak RSS MB | wire MB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_delay: dict[float, dict[str, dict]] = {}
    for r in results:
        by_delay.setdefault(r["delay_ms"], {})[r["method"]] = r
    for delay, rows in sorted(by_delay.items()):
        for method, r in rows.items():
            if "error" in r:
                lines.append(f"| {delay:g} ms | {method} | error: {r['error'][:60]} | | | | | | | |")
                continue
            lines.append(
                f"| {delay:g} ms | {method} | {_fmt(r['steady_sps'], r['steady_sps_std'])} | "
                f"{_fmt(r['steady_mbps'], r['steady_mbps_std'])} | "
                f"{_fmt(r.get('pass_sps', float('nan')), r.get('pass_sps_std'))} | "
                f"{_fmt(r['ttfb_s'], r['ttfb_s_std'], 2)} | {_fmt(r['setup_s'], digits=2)} | "
                f"{_fmt(r['peak_rss_mb'])} | {_fmt(r['worker_peak_mb'] or float('nan'))} | "
                f"{_fmt(r['wire_mb_per_rep'])} |"
            )
    lines += [
        "",
        "| delay | streamdata / wire | same, whole pass | streamdata / webdataset | "
        "objects / map-style | objects / wire_objects | "
        "streamdata first batch / (wire first shard + start-up) | same, from iter(loader) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for delay, rows in sorted(by_delay.items()):
        sd_, wire = rows.get("streamdata"), rows.get("wire")
        ttfb_ratio = iter_ratio = float("nan")
        if sd_ and wire and "error" not in sd_ and "error" not in wire and "error" not in startup:
            floor = wire["ttfb_s"] + startup["ttfb_s"]
            ttfb_ratio = sd_["ttfb_s"] / floor
            # without building the dataset (its one listing happens once, before training)
            iter_ratio = (sd_["ttfb_s"] - sd_["setup_s"]) / floor
        lines.append(
            f"| {delay:g} ms | {_fmt(_ratio(sd_, wire), digits=2)} | "
            f"{_fmt(_ratio(sd_, wire, 'pass_sps'), digits=2)} | "
            f"{_fmt(_ratio(sd_, rows.get('webdataset')), digits=2)} | "
            f"{_fmt(_ratio(rows.get('objects'), rows.get('mapstyle')), digits=1)} | "
            f"{_fmt(_ratio(rows.get('objects'), rows.get('wire_objects')), digits=2)} | "
            f"{_fmt(ttfb_ratio, digits=2)} | {_fmt(iter_ratio, digits=2)} |"
        )
    return "\n".join(lines)


def format_sweep(sweep: list[dict[str, Any]]) -> str:
    lines = ["| delay | method | workers | samples/s | first batch s |", "|---:|---|---:|---:|---:|"]
    for r in sweep:
        if "error" in r:
            lines.append(f"| {r['delay_ms']:g} ms | {r['method']} | {r['workers']} | error | |")
            continue
        lines.append(
            f"| {r['delay_ms']:g} ms | {r['method']} | {r['workers']} | "
            f"{_fmt(r['steady_sps'], r['steady_sps_std'])} | {_fmt(r['ttfb_s'], r['ttfb_s_std'], 2)} |"
        )
    return "\n".join(lines)



def _plot_methods(ax: Any, rows_in: list[dict[str, Any]], x: str) -> None:
    """One error-bar line of steady samples/s per method against ``x`` (delay or workers)."""
    for method in METHODS:
        rows = sorted((r for r in rows_in if r["method"] == method and "error" not in r),
                      key=lambda r: r[x])
        if rows:
            ax.errorbar([r[x] for r in rows], [r["steady_sps"] for r in rows],
                        yerr=[r["steady_sps_std"] for r in rows], marker="o", capsize=3,
                        label=method, linestyle="--" if method.startswith("wire") else "-",
                        color=COLORS[method])

def plot(results: list[dict], sweep: list[dict], path: Path, title: str) -> None:
    """Throughput vs. delay and vs. num_workers, error bars = std over repetitions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    _plot_methods(ax1, results, "delay_ms")
    ax1.set(xlabel="one-way delay (ms)", ylabel="samples/s (96 KiB each)", yscale="log",
            title="throughput vs. delay")
    ax1.grid(True, which="both", alpha=0.3)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend()
    _plot_methods(ax2, sweep, "workers")
    ax2.set_xticks(sorted({r["workers"] for r in sweep}) or [1])
    delays = sorted({r["delay_ms"] for r in sweep})
    ax2.set(xlabel="num_workers", ylabel="samples/s", yscale="log",
            title=f"throughput vs. num_workers at {', '.join(f'{d:g}' for d in delays)} ms")
    ax2.grid(True, which="both", alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine() -> str:
    return f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    results: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    with S3Server() as server:
        layout = _prepare(server, args)
        link = args.link_mbps * 1e6 if args.link_mbps else None
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.0, link_bandwidth=link) as proxy:
            if link:
                print(f"one link of {args.link_mbps:g} MB/s per direction, shared by all connections",
                      flush=True)
            proxied = proxy.url_for(server.endpoint_url)
            base = {
                "storage_options": replace_in_options(server.storage_options, server.endpoint_url, proxied),
                "endpoint_url": proxied,
                "shard_spec": layout.shard_spec,
                "shard_urls": layout.shard_urls,
                "object_spec": layout.object_urls if args.objects_from == "list" else layout.object_prefix,
                "object_urls": layout.object_urls,
                "n_samples": layout.n_samples,
                "sample_bytes": layout.sample_bytes,
                "batch": args.batch,
                "reps": args.reps,
                "max_seconds": args.max_seconds,
                "wire_concurrency": args.wire_concurrency,
                "wire_objects": args.wire_objects,
                "wire_object_concurrency": args.wire_object_concurrency,
                "sd_options": args.sd_options,
            }
            for name, tree in (args.sd_trees or {}).items():
                print(f"streamdata@{name}: streamdata from {tree['path']} (commit {tree['commit']})",
                      flush=True)
            print(f"DataLoader start-up, {args.workers} workers:", flush=True)
            startup = _measure("startup", base, proxy, method="startup", delay_ms=0, workers=args.workers)
            for delay in args.delays:
                proxy.set_delay(delay / 1000)
                print(f"one-way delay {delay:g} ms, {args.workers} workers:", flush=True)
                # rounds interleave the methods (A B C, A B C, ...), so that a slow spell of
                # this shared machine hits every method alike; ratios are then taken per round
                methods = (list(args.methods) + [f"streamdata:{v}" for v in args.sd_variants or {}]
                           + [f"streamdata@{t}" for t in args.sd_trees or {}])
                rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
                for k in range(args.rounds):
                    for method in methods:
                        label = method if args.rounds == 1 else f"{method} [{k + 1}/{args.rounds}]"
                        changes: dict[str, Any] = {"method": method}
                        if ":" in method:  # a streamdata variant: its options over --sd-options
                            variant = args.sd_variants[method.split(":", 1)[1]]
                            changes = {"method": "streamdata",
                                       "sd_options": {**(args.sd_options or {}), **variant}}
                        elif "@" in method:  # another checkout of the package, same settings
                            changes = {"method": "streamdata",
                                       "sd_path": args.sd_trees[method.split("@", 1)[1]]["path"]}
                        summary = _measure(label, base, proxy, delay_ms=delay, workers=args.workers,
                                           **changes)
                        summary["method"] = method
                        rounds[method].append(summary)
                results.extend(_merge_rounds(rounds[m]) for m in methods)
            for delay in args.sweep_delays:
                proxy.set_delay(delay / 1000)
                print(f"num_workers sweep at {delay:g} ms:", flush=True)
                for method in args.sweep_methods:
                    for workers in args.sweep_workers:
                        if method == "wire" and workers != args.sweep_workers[0]:
                            continue
                        reuse = [r for r in results if r["method"] == method
                                 and r["delay_ms"] == delay and r["workers"] == workers]
                        sweep.append(dict(reuse[0]) if reuse else _measure(
                            f"{method} x{workers}", base, proxy, method=method, delay_ms=delay,
                            workers=workers))
            for r in sweep:  # the wire does not depend on workers: draw it across the sweep
                if r["method"] == "wire":
                    sweep.extend(dict(r, workers=w) for w in args.sweep_workers[1:])
                    break
    return {"results": results, "sweep": sweep, "startup": startup, "sd_trees": args.sd_trees or {},
            "layout": {k: v for k, v in asdict(layout).items() if not k.endswith("urls") and k != "labels"}}


def run_rss(args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of one streamdata worker reading one shard of each size, small byte budget."""
    import webdataset as wds

    from benchmarks.common import tar_shard  # noqa: F401  (documents the writer used)
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    rows = []
    with S3Server() as server:
        client = server.boto3_client()
        server.create_bucket("rss")
        urls = {}
        for size_mb in args.rss_sizes:
            buf = io.BytesIO()
            member = args.rss_member_kib * 1024
            with wds.TarWriter(buf) as sink:
                for i in range(max(1, size_mb * MiB // member)):
                    sink.write({"__key__": f"{i:08d}", "bin": os.urandom(member)})
            key = f"rss/{size_mb:05d}mb.tar"
            client.put_object(Bucket="rss", Key=key, Body=buf.getvalue())
            urls[size_mb] = f"s3://rss/{key}"
            del buf
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=args.rss_delay / 1000) as proxy:
            proxied = proxy.url_for(server.endpoint_url)
            opts = replace_in_options(server.storage_options, server.endpoint_url, proxied)
            budget = args.rss_budget_mb * MiB
            sd_options = dict(args.sd_options or {}, byte_budget=budget, decode=False)
            for size_mb, url in urls.items():
                cfg = {"method": "streamdata", "shard_spec": url, "shard_urls": [url],
                       "storage_options": opts, "endpoint_url": proxied, "n_samples": 0,
                       "sample_bytes": args.rss_member_kib * 1024,
                       "batch": 1, "reps": 1, "max_seconds": 600.0, "workers": 1,
                       "wire_concurrency": 1, "sd_options": sd_options, "delay_ms": args.rss_delay}
                reps = _run_child(cfg, timeout=600)
                r = reps[0]
                row = {"shard_mb": size_mb, "budget_mb": args.rss_budget_mb, **r}
                if "error" not in r:
                    row["worker_growth_mb"] = r["worker_peak_mb"] - r["worker_base_mb"]
                    print(f"  shard {size_mb:4d} MB: worker peak {r['worker_peak_mb']:.0f} MB, "
                          f"growth {row['worker_growth_mb']:.0f} MB (budget {args.rss_budget_mb} MB)",
                          flush=True)
                else:
                    print(f"  shard {size_mb} MB: ERROR {r['error']}", flush=True)
                rows.append(row)
    return {"rss": rows}


def format_rss(rows: list[dict]) -> str:
    lines = ["| shard MB | byte budget MB | worker base MB | worker peak MB | growth MB "
             "| growth − budget MB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shard_mb']} | {r['budget_mb']} | error: {r['error'][:60]} | | | |")
            continue
        lines.append(f"| {r['shard_mb']} | {r['budget_mb']} | {r['worker_base_mb']:.0f} | "
                     f"{r['worker_peak_mb']:.0f} | {r['worker_growth_mb']:.0f} | "
                     f"{r['worker_growth_mb'] - r['budget_mb']:.0f} |")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sd_trees(text: str) -> dict[str, dict[str, str]]:
    """``NAME=PATH[,NAME=PATH...]`` -> {name: {"path": resolved PATH, "commit": its git HEAD}}."""
    trees: dict[str, dict[str, str]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, path = entry.partition("=")
        name, root = name.strip(), Path(path.strip()).expanduser().resolve()
        if not sep or not name or not path.strip():
            raise argparse.ArgumentTypeError(f"{entry!r}: expected NAME=PATH")
        if not name.replace("-", "").replace("_", "").isalnum() or name in trees:
            raise argparse.ArgumentTypeError(f"{name!r}: names are letters, digits, - and _, once each")
        if not (root / "streamdata" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{root} has no streamdata/__init__.py")
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True)
        trees[name] = {"path": str(root), "commit": head.stdout.strip() if head.returncode == 0 else "?"}
    return trees


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=_floats, default=[0, 25, 100], help="one-way delays, ms")
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--samples", type=int, default=2048, help="samples in the dataset")
    p.add_argument("--sample-kib", type=int, default=96, help="float32 payload per sample (.npy)")
    p.add_argument("--shards", type=int, default=32, help="tar shards the samples are split into")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers for the delay runs")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="cap the proxy at one link of this many MB/s per direction, shared by all "
                        "connections (default: no cap; the wire is then the server's and proxy's CPU)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per configuration (and round)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the delay runs this many times, methods interleaved; adds per-round ratios")
    p.add_argument("--max-seconds", type=float, default=4.0,
                   help="stop a loader this long after its first batch (slow baselines)")
    p.add_argument("--wire-concurrency", type=int, default=32, help="shard GETs in flight (wire)")
    p.add_argument("--wire-objects", type=int, default=512,
                   help="per-sample objects fetched by the wire_objects method")
    p.add_argument("--wire-object-concurrency", type=int, default=64,
                   help="object GETs in flight (wire_objects)")
    p.add_argument("--sweep-workers", type=_ints, default=[1, 2, 4], help="num_workers sweep")
    p.add_argument("--sweep-delays", type=_floats, default=[100], help="delays (ms) of the sweep")
    p.add_argument("--sweep-methods", type=lambda s: s.split(","),
                   default=["wire", "streamdata", "webdataset"], help="methods in the sweep")
    p.add_argument("--objects-from", choices=("prefix", "list"), default="prefix",
                   help="sd.ObjectDataset over a prefix (one listing) or the explicit URL list")
    p.add_argument("--sd-options", type=json.loads, default=None,
                   help='JSON keyword options for sd.TarDataset, e.g. \'{"window": 8}\'')
    p.add_argument("--sd-variants", type=json.loads, default=None,
                   help='JSON {name: options}: each also runs as method "streamdata:name", e.g. '
                        '\'{"budget32": {"byte_budget": 33554432}}\' (A/B of settings in one run)')
    p.add_argument("--sd-trees", type=_sd_trees, default=None, metavar="NAME=PATH[,NAME=PATH...]",
                   help="each also runs as method \"streamdata@NAME\" (the streamdata method's settings) "
                        "with the streamdata package imported from the checkout at PATH, e.g. "
                        "prev=/tmp/sd-prev after `git worktree add /tmp/sd-prev <commit>`")
    p.add_argument("--quick", action="store_true", help="small data, one rep, two delays")
    p.add_argument("--rss", action="store_true", help="only the worker-RSS vs byte-budget check")
    p.add_argument("--rss-sizes", type=_ints, default=[1, 4, 16, 64, 256], help="shard sizes, MB")
    p.add_argument("--rss-budget-mb", type=int, default=16, help="byte_budget for --rss")
    p.add_argument("--rss-member-kib", type=int, default=1024, help="tar member size for --rss")
    p.add_argument("--rss-delay", type=float, default=25.0, help="one-way delay for --rss, ms")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--run-one", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; options given on the command line still win
        quick = dict(delays=[0, 100], samples=512, shards=8, reps=1, sweep_workers=[1, 2],
                     max_seconds=3.0, wire_objects=256, rss_sizes=[1, 16])
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.sample_bytes = args.sample_kib * 1024 + 128  # .npy payload: header + float32 data
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run_one:
        cfg = json.loads(Path(args.run_one[0]).read_text())
        Path(args.run_one[1]).write_text(json.dumps(run_one(cfg)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    command = "python -m benchmarks.latency " + " ".join(sys.argv[1:])
    header = f"{datetime.date.today()} · {_machine()} · `{command.strip()}`"
    started = time.perf_counter()
    if args.rss:
        data = run_rss(args)
        table = format_rss(data["rss"])
    else:
        for name, why in NOT_FEASIBLE.items():
            print(f"note: skipping {name}: {why}", flush=True)
        data = run_latency(args)
        table = format_table(data["results"], data["startup"]) + "\n\n" + format_sweep(data["sweep"])
        paired = format_paired(data["results"])
        if paired:
            table += "\n\n" + paired
        if "error" not in data["startup"]:
            table += ("\n\nDataLoader start-up (first batch of an empty dataset): "
                      f"{data['startup']['ttfb_s']:.2f} s")
        png = args.out / f"latency-{stamp}.png"
        plot(data["results"], data["sweep"], png, header)
        print(f"plot: {png}")
    data.update(command=command, machine=_machine(), date=str(datetime.date.today()),
                wall_s=time.perf_counter() - started, load_after=os.getloadavg()[0],
                args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    out = args.out / f"{'rss' if args.rss else 'latency'}-{stamp}.json"
    out.write_text(json.dumps(data, indent=1))
    print(f"\n{header}\n\n{table}\n\nresults: {out}  ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
