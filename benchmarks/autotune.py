"""AUTOTUNE against a hand-tuned grid: whole-run samples/s at several one-way delays.

The embedded S3 server holds tar shards once; for each one-way delay a ``LatencyProxy`` sits in
front of it, and each method reads the whole epoch through ``sd.loader`` (``num_workers``
workers, ``decode=False``) in a fresh interpreter:

- ``grid:W/R``: ``autotune=False``, ``window=W``, ``max_requests=R``, the byte budget fixed
  at the memory cap (``--cap``): the hand-tuned grid;
- ``auto``: the defaults (``autotune=True``: the knobs start at their defaults, the budget at
  ``byte_budget`` and grows up to ``byte_budget_max=--cap``);
- ``auto:smallest``: ``autotune=True`` started from the smallest settings: one shard ahead, one
  request, an 8 MiB budget (``tune_from={"window": 1, "max_requests": 1}``,
  ``byte_budget=8 MiB``: a start, not a bound), cap ``--cap``.

With ``--base NAME=PATH`` (a checkout of another tree, e.g. ``git archive <commit> | tar -x -C
PATH``), ``NAME:auto`` and ``NAME:auto:smallest`` run the same two settings on that tree's
``streamdata``: the tuner before a change, side by side with it.

Rounds are interleaved (each round runs every delay, its methods in a rotated order); the
ratios are per round: ``auto / best grid``, against the fastest grid point of that round and
delay (the best of several noisy points: a few percent above any one setting), and ``auto /
best grid setting``, against the grid point with the highest median over the rounds (the one a
hand-tuner would keep) in the same round. For ``auto:smallest`` (and, for comparison, every
method) it reports when it reached 90% of the round's best grid rate (the rate over the next
``--span`` of the epoch's samples from that batch on), as a fraction of the epoch, and each
method's peak RSS (the child's and its workers', summed) and the largest byte budget a reader
reached (``knob.byte_budget``, sampled from ``loader.metrics()``), against the cap.

    python -m benchmarks.autotune --quick     # 2 rounds, grid {1,32}x{1,32}, 128 MiB (~15 min loaded)
    python -m benchmarks.autotune --rounds 3 --grid 1,8,32 --samples 2048
    python -m benchmarks.autotune --quick --base before=/tmp/sd-before
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    MiB,
    replace_in_options,
    run_in_tree,
    shard_pattern,
    upload_shards,
    upstream,
)

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, threading, time
import psutil
import streamdata as sd
spec, options, workers = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
fetch = json.loads(sys.argv[4])
peak = {"rss": 0, "budget": 0}
def rss():
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total
ds = sd.TarDataset(spec, storage_options=options, index=None, decode=False, batch_size=16, **fetch)
loader = sd.loader(ds, num_workers=workers)
stop = threading.Event()
def sample():
    while not stop.wait(0.05):
        peak["rss"] = max(peak["rss"], rss())
        peak["budget"] = max(peak["budget"], ds.reader_stats() and max(
            r["knob.byte_budget"] for r in ds.reader_stats()) or 0)
threading.Thread(target=sample, daemon=True).start()
marks, n, start = [], 0, time.perf_counter()
for batch in loader:
    n += len(batch["__key__"])
    marks.append((time.perf_counter() - start, n))
wall = time.perf_counter() - start
m = loader.metrics()
stop.set()
loader.close()
print(json.dumps({"samples": n, "wall_s": wall, "marks": marks, "peak_rss": peak["rss"], "sd": sd.__file__,
                  "peak_budget": peak["budget"], "tuned": {k: v for k, v in m.items()
                  if k.startswith(("tuned.", "budget.grown"))},
                  "reader": {k: m.get(k, 0) for k in ("readers.wall_s", "readers.busy_s",
                                                      "stage.wait_bytes_s", "first_byte_s", "requests")}}))
"""


def _run(spec: str, options: dict, workers: int, fetch: dict, tree: Path = ROOT) -> dict:
    return run_in_tree(CHILD, [spec, json.dumps(options), str(workers), json.dumps(fetch)], tree)


def _methods(grid: list[int], cap: int, bases: dict[str, Path]) -> dict[str, tuple[dict, Path]]:
    out = {f"grid:{w}/{r}": ({"autotune": False, "window": w, "max_requests": r, "byte_budget": cap}, ROOT)
           for w in grid for r in grid}
    auto = {"byte_budget_max": cap}
    smallest = {"tune_from": {"window": 1, "max_requests": 1}, "byte_budget": 8 * MiB, "byte_budget_max": cap}
    for prefix, tree in [("", ROOT), *((f"{name}:", path) for name, path in bases.items())]:
        out[f"{prefix}auto"] = (auto, tree)
        out[f"{prefix}auto:smallest"] = (smallest, tree)
    return out


def _waiting(got: dict) -> float:
    """The share of the readers' wall time spent waiting for bytes."""
    reader = got.get("reader", {})
    return reader.get("stage.wait_bytes_s", 0.0) / (reader.get("readers.wall_s") or 1.0)


def reached(marks: list[list[float]], total: int, rate: float, span: float) -> float | None:
    """The fraction of the epoch's samples after which the rate over the next ``span`` of them
    is at least ``rate``; None if never."""
    width = max(1, int(total * span))
    j = 0
    for t0, n0 in [(0.0, 0), *marks]:
        while j < len(marks) and marks[j][1] < n0 + width:
            j += 1
        if j >= len(marks):
            return None
        t1, n1 = marks[j]
        if t1 > t0 and (n1 - n0) / (t1 - t0) >= rate:
            return n0 / total
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="grid 1,32, 512 samples in 16 shards, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="3 (2 with --quick)")
    ap.add_argument("--delays", default="0,25,100,250", help="one-way delays, ms")
    ap.add_argument("--grid", default="1,8,32", help="window and max_requests values of the grid")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--sample-kib", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cap", type=int, default=128, help="memory cap, MiB (byte_budget_max)")
    ap.add_argument("--span", type=float, default=0.1, help="the share of the epoch a rate is taken over")
    ap.add_argument("--base", action="append", default=[], metavar="NAME=PATH",
                    help="also run auto and auto:smallest on the streamdata of the tree at PATH")
    ap.add_argument("--only", default=None, help="run only these methods (comma-separated names)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "autotune.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.grid, args.samples, args.shards = "1,32", 512, 16
    args.rounds = args.rounds or (2 if args.quick else 3)
    delays = [float(d) for d in args.delays.split(",")]
    bases = {name: Path(path) for name, _, path in (b.partition("=") for b in args.base)}
    methods = _methods([int(g) for g in args.grid.split(",")], args.cap * MiB, bases)
    if args.only:
        methods = {k: v for k, v in methods.items() if k in args.only.split(",")}

    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    rows: list[dict] = []
    with S3Server() as server:
        server.create_bucket("bench")
        upload_shards(server.boto3_client(), "bench", "tar/train", args.samples, args.shards,
                      args.sample_kib * 1024 + 128)
        spec = shard_pattern("bench", "tar/train", args.shards)
        names = list(methods)
        for r in range(args.rounds):
            for delay in delays:
                with LatencyProxy(*upstream(server.endpoint_url), delay_s=delay / 1000) as proxy:
                    options = replace_in_options(server.storage_options, server.endpoint_url,
                                                 proxy.url_for(server.endpoint_url))
                    shift = (r + int(delay)) % len(names)
                    for name in names[shift:] + names[:shift]:
                        fetch, tree = methods[name]
                        got = _run(spec, options, args.workers, fetch, tree)
                        assert got["samples"] == args.samples, got["samples"]
                        row = {"round": r, "delay_ms": delay, "method": name,
                               "rate": got["samples"] / got["wall_s"], **got}
                        rows.append(row)
                        print(f"round {r} delay {delay:g} ms {name:>14}: {row['rate']:8.1f} samples/s, "
                              f"peak RSS {got['peak_rss'] / MiB:.0f} MiB, "
                              f"budget {got['peak_budget'] / MiB:.0f} MiB"
                              f", readers wait for bytes {_waiting(got):.0%} {got['tuned']}", flush=True)
    summary: dict = {"when": time.strftime("%Y-%m-%d"), "args": vars(args), "delays": {}}
    for delay in delays:
        autos = [k for k in methods if not k.startswith("grid:")]
        ratios: dict[str, list[float]] = {k: [] for k in autos}
        # every method's, the grid's too: how soon a fixed setting itself gets there says what
        # noise and start-up alone do to this measure
        reach: dict[str, list[float | None]] = {k: [] for k in methods}
        for r in range(args.rounds):
            mine = {row["method"]: row for row in rows if row["round"] == r and row["delay_ms"] == delay}
            best = max(v["rate"] for k, v in mine.items() if k.startswith("grid:"))
            for k in ratios:
                ratios[k].append(mine[k]["rate"] / best)
            for k in reach:
                small = mine[k]
                reach[k].append(reached(small["marks"], small["samples"], 0.9 * best, args.span))
        at = [row for row in rows if row["delay_ms"] == delay]
        rate = {(row["method"], row["round"]): row["rate"] for row in at}
        setting = max((k for k in methods if k.startswith("grid:")),  # what a hand-tuner would keep
                      key=lambda k: statistics.median(rate[k, r] for r in range(args.rounds)))
        by_setting = {k: [rate[k, r] / rate[setting, r] for r in range(args.rounds)] for k in autos}
        summary["delays"][f"{delay:g}"] = {
            **{f"{k} / best grid": {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for k, v in ratios.items()},
            "best grid setting (highest median)": setting,
            **{f"{k} / best grid setting": {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for k, v in by_setting.items()},
            "best grid (most often)": statistics.mode(
                max((row for row in at if row["round"] == r and row["method"].startswith("grid:")),
                    key=lambda row: row["rate"])["method"] for r in range(args.rounds)),
            **{f"{k} reached 90% of the best grid at (epoch fraction)": v for k, v in reach.items()},
            # the bar, per method: in how many rounds it got there within the first --span, and
            # the median round (a round that never got there counts as the whole epoch)
            **{f"{k} reached it within the first {args.span:g} (rounds)":
               f"{sum(x is not None and x <= args.span for x in v)}/{len(v)}, median "
               f"{statistics.median(1.0 if x is None else x for x in v):.2f}" for k, v in reach.items()},
            "peak RSS MiB (max)": {k: max(row["peak_rss"] for row in at if row["method"] == k) / MiB
                                   for k in methods},
            "peak budget MiB": {k: max(row["peak_budget"] for row in at if row["method"] == k) / MiB
                                for k in autos},
            "tuned (summed over rounds)": {
                k: {c: sum(row["tuned"].get(c, 0) for row in at if row["method"] == k)
                    for c in sorted({c for row in at for c in row["tuned"]})} for k in autos},
        }
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row.pop("marks")
    Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
