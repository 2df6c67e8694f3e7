"""``streamdata bench``: read a real bucket at several worker and window settings through
``sd.loader``; print samples/s and MB/s per setting; draw them in a PNG.

Tar samples are measured as they stream: the dataset's ``map`` counts each sample's raw bytes
(and decodes it with ``--decode``), and a batch travels as two numbers, so the figures are
the fetch-and-parse rate of the settings, not of the IPC that carries big batches. Parquet
and Arrow batches are measured as the tensors they become (decoded bytes).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

import torch

from streamdata.cli.common import (
    UsageError,
    add_common,
    add_format,
    bar,
    dataset_class,
    fetch_options,
    list_shards,
    storage_options,
    write_out,
)
from streamdata.config import Fetch
from streamdata.metrics import MODALITIES, STAGES

__all__ = ["add_parsers"]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="read SPEC at several worker/window settings; samples/s, MB/s and a PNG",
        description="Read SPEC through sd.loader for --seconds at each combination of --workers "
                    "(DataLoader worker processes) and --window (shards in flight per worker), "
                    "epoch after epoch, and print samples/s and MB/s per setting with the time to "
                    "the first batch. Tar: raw sample bytes, fetched and parsed (decoded too with "
                    "--decode). Parquet/Arrow: the bytes of the tensors the batches become.")
    p.add_argument("spec", nargs="+", metavar="SPEC", help="URL, brace pattern, prefix or glob")
    add_format(p)
    p.add_argument("--workers", type=_ints, default=[0, 2, 4], metavar="N,N,...",
                   help="DataLoader worker counts to try (default 0,2,4)")
    p.add_argument("--window", type=_ints, default=[32], metavar="N,N,...",
                   help="prefetch windows to try: shards (Parquet/Arrow: row groups) in flight "
                        "per worker (default 32)")
    p.add_argument("--seconds", type=float, default=10.0, metavar="S",
                   help="time spent on each setting (default 10)")
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="samples per batch (default 64)")
    p.add_argument("--decode", action="store_true", help="tar: decode each sample too (images, npy, ...)")
    p.add_argument("--png", metavar="FILE", help="write a chart of the results to FILE (PNG)")
    add_common(p)
    p.set_defaults(run=run)


class _Measure:
    """The dataset's ``map`` for tar: a sample -> its raw bytes (decoded on the way, if asked)."""

    def __init__(self, decode: bool) -> None:
        from streamdata.formats.decode import make_decoder

        self.decoder = make_decoder(True) if decode else None

    def __call__(self, sample: dict) -> int:
        nbytes = sum(len(v) for k, v in sample.items() if isinstance(v, (bytes, bytearray)))
        if self.decoder is not None:
            self.decoder(sample)
        return nbytes


def _sizes(batch: list[int]) -> torch.Tensor:
    """A batch of byte counts -> ``tensor([samples, bytes])``."""
    return torch.tensor([len(batch), sum(batch)], dtype=torch.int64)


def _count(batch: Any) -> tuple[int, int]:
    if isinstance(batch, torch.Tensor):  # from _sizes
        return int(batch[0]), int(batch[1])
    rows = 0
    nbytes = 0
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            rows = rows or (int(value.shape[0]) if value.dim() else 1)
            nbytes += value.element_size() * value.numel()
        elif isinstance(value, list):
            rows = rows or len(value)
            nbytes += sum(len(v) for v in value if isinstance(v, (bytes, str)))
    return rows, nbytes


def _one(fmt: str, shards: list, args: argparse.Namespace, workers: int, window: int) -> dict:
    from streamdata.feed.loader import loader

    measure: dict[str, Any] = {}
    if fmt == "tar":
        measure = {"decode": False, "map": _Measure(args.decode), "collate_fn": _sizes}
    ds = dataset_class(fmt)(shards, storage_options=storage_options(args), batch_size=args.batch_size,
                            fetch=Fetch(window=window), shuffle=True, **measure, **fetch_options(args))
    samples = nbytes = 0
    first = None
    start = time.perf_counter()
    with loader(ds, num_workers=workers, pin_memory=False, recycle_buffers=fmt != "tar") as feed:
        for epoch in itertools.count():
            feed.set_epoch(epoch)
            got = 0
            for batch in feed:
                if first is None:
                    first = time.perf_counter() - start
                n, b = _count(batch)
                samples, nbytes, got = samples + n, nbytes + b, got + n
                if time.perf_counter() - start >= args.seconds:
                    break
            if time.perf_counter() - start >= args.seconds or not got:
                break
        elapsed = time.perf_counter() - start
        m = feed.metrics()  # the stage table: each stage's seconds, summed over the workers
    return {"workers": workers, "window": window, "samples": samples, "bytes": nbytes,
            "seconds": elapsed, "samples_per_s": samples / elapsed, "mb_per_s": nbytes / elapsed / 1e6,
            "first_batch_s": first, "stall_fraction": m["stall_fraction"],
            "stages": {stage: m.get(f"stage.{stage}_s", 0.0) for stage in STAGES},
            "decode": {kind: m.get(f"stage.decode_{kind}_s", 0.0) for kind in MODALITIES}}


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.batch_size < 1:
        raise UsageError("--seconds must be > 0 and --batch-size >= 1")
    fmt, shards = list_shards(args, args.spec, args.format)
    settings = [(w, win) for win in args.window for w in args.workers]
    write_out(f"{len(shards)} {fmt} objects, {sum(s.size or 0 for s in shards) / 1e6:.1f} MB; "
              f"{args.seconds:g} s per setting, batch {args.batch_size}"
              + (", decoded" if args.decode and fmt == "tar" else ""))
    write_out(f"{'workers':>7}  {'window':>6}  {'samples':>9}  {'seconds':>7}  {'samples/s':>10}  "
              f"{'MB/s':>8}  {'first batch s':>13}")
    results = []
    with bar(args, len(settings), "bench", unit="setting") as pbar:
        for workers, window in settings:
            pbar.set_postfix_str(f"workers={workers} window={window}")
            r = _one(fmt, shards, args, workers, window)
            results.append(r)
            first = f"{r['first_batch_s']:.3f}" if r["first_batch_s"] is not None else "-"
            pbar.write(f"{workers:>7}  {window:>6}  {r['samples']:>9}  {r['seconds']:>7.2f}  "
                       f"{r['samples_per_s']:>10.0f}  {r['mb_per_s']:>8.3g}  {first:>13}", file=sys.stdout)
            pbar.update(1)
    write_out("stage seconds, summed over the workers (loader.metrics()); stall: the loop's wait for data")
    write_out(f"{'workers':>7}  {'window':>6}  {'stall':>6}  " + "  ".join(f"{s:>10}" for s in STAGES))
    for r in results:
        write_out(f"{r['workers']:>7}  {r['window']:>6}  {r['stall_fraction']:>6.1%}  "
                  + "  ".join(f"{r['stages'][s]:>10.3f}" for s in STAGES))
    if any(any(r["decode"].values()) for r in results):  # decode's parts, per kind of field
        write_out("decode seconds per kind of field (parts of decode)")
        write_out(f"{'workers':>7}  {'window':>6}  " + "  ".join(f"{k:>10}" for k in MODALITIES))
        for r in results:
            write_out(f"{r['workers']:>7}  {r['window']:>6}  "
                      + "  ".join(f"{r['decode'][k]:>10.3f}" for k in MODALITIES))
    if args.png:
        _chart(results, args.png, f"{' '.join(args.spec)} ({fmt}, batch {args.batch_size})")
        write_out(f"chart     {args.png}")
    return 0


def _chart(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from streamdata.redact import redact

    windows = sorted({r["window"] for r in results})
    workers = sorted({r["workers"] for r in results})
    fig, all_axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    axes = all_axes[:2]
    width = 0.8 / len(windows)
    for i, window in enumerate(windows):
        mine = {r["workers"]: r for r in results if r["window"] == window}
        xs = [j + i * width for j in range(len(workers))]
        for ax, key in zip(axes, ("samples_per_s", "mb_per_s"), strict=True):
            ax.bar(xs, [mine[w][key] if w in mine else 0 for w in workers], width, label=f"window {window}")
    for ax, label in zip(axes, ("samples/s", "MB/s"), strict=True):
        ax.set_xticks([j + width * (len(windows) - 1) / 2 for j in range(len(workers))],
                      [str(w) for w in workers])
        ax.set_xlabel("DataLoader workers")
        ax.set_ylabel(label)
        ax.legend()
    _stage_bars(all_axes[2], results)
    fig.suptitle(redact(title)[:100], fontsize=9)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _stage_bars(ax: Any, results: list[dict]) -> None:
    """Each setting's stage seconds (summed over its workers), stacked: where the readers' time went."""
    names = [f"{r['workers']}w/{r['window']}" for r in results]
    left = [0.0] * len(results)
    for stage in STAGES:
        secs = [r["stages"][stage] for r in results]
        ax.barh(names, secs, left=left, label=stage)
        left = [a + b for a, b in zip(left, secs, strict=True)]
    ax.set_xlabel("reader seconds, summed over workers")
    ax.set_ylabel("workers / window")
    ax.legend(fontsize=7)
