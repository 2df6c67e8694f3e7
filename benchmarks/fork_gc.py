"""Forked workers and the garbage collector: INHERITED-HEAP on and off.

A DataLoader worker inherits its parent's heap and its collector's counters. When the parent
owes a full collection at the fork (right after ``import torch``, or after any phase that
left many new long-lived objects), each worker runs it over everything it inherited before
the first line of its own code, and writes to every object's header on the way (copying the
parent's heap into the worker). ``streamdata/_alloc.py`` (INHERITED-HEAP) freezes what a
forked child inherited first thing after the fork; ``STREAMDATA_FREEZE_AT_FORK=0`` turns it
off. This benchmark runs, in fresh interpreters, a job that imports torch, builds a
``TarDataset`` over the embedded S3 server, then (``--state owed``, the default) allocates
long-lived objects until Python owes a full collection (``gc.get_count()[2]`` past its
threshold: the next few hundred allocations run it, unless too few objects are new since the
last one, which Python also checks and this cannot see: the "full GCs in workers" column shows
whether it happened; ``as-is`` leaves the collector as the
constructor left it, which here is usually some 8,000 allocations away), and reads one epoch through
``sd.loader(num_workers=2)``, the two settings alternating for ``--rounds`` rounds, and prints
per setting the medians of: the time from ``iter()`` to the first batch, the epoch, the full
collections the workers ran and their seconds (``gc.callbacks``), the workers' private memory
(USS) after the first batch; then the ratios on / off per round.

    python -m benchmarks.fork_gc [--rounds 5] [--state owed|as-is] [--samples 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import proxied_shards  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import gc, json, os, sys, time
import numpy, torch
cfg = json.loads(sys.argv[1])
log = cfg["log"]
starts = {}
def note(phase, info):  # inherited by the workers: every full collection, in any process
    if info["generation"] != 2:
        return
    if phase == "start":
        starts[os.getpid()] = time.perf_counter()
    elif os.getpid() in starts:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {time.perf_counter() - starts.pop(os.getpid())}\n")
gc.callbacks.append(note)
import streamdata as sd
import psutil
pids = cfg["pids"]
def stamp(worker_id):
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
ds = sd.TarDataset(cfg["spec"], storage_options=cfg["options"], batch_size=32)
loader = sd.loader(ds, num_workers=2, pin_memory=False, worker_init_fn=stamp)
held = []  # the job's own long-lived objects (its model, its vocabulary...)
if cfg["owed"]:  # allocate until Python owes a full collection: the next ~700 allocations run it
    while gc.get_count()[2] <= gc.get_threshold()[2]:
        held.append([len(held)])
counts = gc.get_count()
start = time.perf_counter()
first = uss = None
for batch in loader:
    if first is None:
        first = time.perf_counter() - start
        workers = [int(p) for p in open(pids).read().split()]
        uss = sum(psutil.Process(p).memory_full_info().uss for p in workers) / 2 / 1e6
epoch = time.perf_counter() - start
loader.close()
print(json.dumps({"first": first, "epoch": epoch, "uss_mb": uss, "parent": os.getpid(), "counts": counts}))
"""


def _one(spec: str, options: dict, owed: bool, freeze: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="sd-forkgc-") as tmp:
        log, pids = os.path.join(tmp, "gc.log"), os.path.join(tmp, "pids")
        cfg = {"spec": spec, "options": options, "owed": owed, "log": log, "pids": pids}
        env = dict(os.environ, STREAMDATA_FREEZE_AT_FORK="1" if freeze else "0",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise SystemExit(f"child failed: {out.stderr.strip().splitlines()[-3:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        lines = Path(log).read_text().splitlines() if os.path.exists(log) else []
        collections = [line.split() for line in lines]
        workers = [float(s) for pid, s in collections if int(pid) != row["parent"]]
        row.update(worker_full_gcs=len(workers), worker_full_gc_s=sum(workers))
        return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--state", choices=("owed", "as-is"), default="owed",
                        help="owed: the job allocates until a full collection is owed before iter(); "
                        "as-is: the collector as the constructor left it")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--sample-kib", type=int, default=96)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)

    rows: dict[bool, list[dict]] = {True: [], False: []}
    with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib) as bench:
        for k in range(args.rounds):
            for freeze in (True, False) if k % 2 == 0 else (False, True):
                row = _one(bench.spec, bench.options, args.state == "owed", freeze)
                rows[freeze].append(row)
                print(f"  [{k + 1}/{args.rounds}] freeze={int(freeze)}: first batch {row['first']:.3f} s, "
                      f"epoch {row['epoch']:.3f} s, worker full GCs {row['worker_full_gcs']} "
                      f"({row['worker_full_gc_s']:.3f} s), worker USS {row['uss_mb']:.0f} MB, parent's "
                      f"collector counts at iter() {tuple(row['counts'])}", flush=True)

    def med(freeze: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows[freeze])

    keys = ("first", "epoch", "worker_full_gcs", "worker_full_gc_s", "uss_mb")
    print(f"\n`python -m benchmarks.fork_gc {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print("| INHERITED-HEAP | first batch from iter() s | epoch s | full GCs in workers | their s "
          "| worker USS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for freeze in (True, False):
        print(f"| {'on' if freeze else 'off (STREAMDATA_FREEZE_AT_FORK=0)'} | "
              + " | ".join(f"{med(freeze, key):.3f}" if key != "uss_mb" else f"{med(freeze, key):.0f}"
                           for key in keys) + " |")
    for key in ("first", "epoch", "uss_mb"):
        ratios = [a[key] / b[key] for a, b in zip(rows[True], rows[False], strict=True) if b[key]]
        print(f"on / off, {key}, per round: median {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
