"""Each start-up and tuning mechanism switched off alone: what it gives a whole run.

The embedded S3 server (``streamdata.testing``) holds the large profile once (2048 samples of
256 KiB in 32 tar shards, as ``autotune.py``); for each one-way delay a ``LatencyProxy`` sits in
front of it. Every run is a fresh interpreter (torch, numpy and streamdata imported before the
clock) that builds ``sd.TarDataset(spec, decode=False, index=None)`` and reads it for
``--epochs`` epochs through ``sd.loader(ds, batch_size=16, num_workers=2)`` (persistent workers,
the defaults otherwise). Per run, counted from just before the dataset is built (the listing
included) to the last batch of the last epoch:

- whole-run samples/s: all samples over that time;
- steady samples/s: the samples after the first ``--skip`` (10%) of the run's samples, over
  the time from the batch that passed that mark to the last batch;
- CPU per sample: user + system seconds of the run's process and its DataLoader workers
  (``getrusage`` of the process and of its waited-for children, from before the dataset to
  after ``loader.close()``, so the workers' whole lives), over the samples.

Rounds are interleaved: in each round and delay the runs go ON, OFF(a), ON, OFF(b), ON, ...,
OFF(z), ON, the OFF mechanisms in an order rotated each round. ON is the package as it is (the
same for every mechanism). Each OFF is paired with the mean of the two ON runs either side of
it (drift cancels to first order); the table gives the per-round ratios ON / OFF (rates: above
1 means the mechanism helps; CPU per sample: below 1 means it saves CPU), medians with min-max.

What each OFF does (everything else as ON; the package is not changed):

- ``LITE-HTTP``: ``STREAMDATA_LITE_HTTP=0``: LITE-S3's GETs go over aiohttp (imported then).
- ``INHERITED-HEAP``: ``STREAMDATA_FREEZE_AT_FORK=0``: forked workers' collectors see the heap
  they inherited.

Mechanisms measured so and removed (benchmarks/README.md, "Mechanisms switched off one by
one"): the listing's connection and spares handed to the readers, connections opened ahead, the
tuner's near start, idle-window and queue-fit rules, and stage timings by sample.

    python -m benchmarks.switch_off --quick                      # smoke run: both, short
    python -m benchmarks.switch_off --rounds 3 --delays 0,100 --epochs 12
    python -m benchmarks.switch_off --only LITE-HTTP --rounds 5
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
    replace_in_options,
    run_in_tree,
    shard_pattern,
    upload_shards,
    upstream,
)

ROOT = Path(__file__).resolve().parents[1]

# the priority order (the first ones first where rounds are cut short)
MECHANISMS = ("LITE-HTTP", "INHERITED-HEAP")
ENV_OFF = {"LITE-HTTP": {"STREAMDATA_LITE_HTTP": "0"}, "INHERITED-HEAP": {"STREAMDATA_FREEZE_AT_FORK": "0"}}
SWITCHES = ("STREAMDATA_LITE_HTTP", "STREAMDATA_FREEZE_AT_FORK", "STREAMDATA_STAGE_TIMES",
            "STREAMDATA_AUTOTUNE")

CHILD = """
import json, os, resource, sys, time
import numpy, torch
import streamdata as sd
SWITCHES = ("STREAMDATA_LITE_HTTP", "STREAMDATA_FREEZE_AT_FORK", "STREAMDATA_STAGE_TIMES",
            "STREAMDATA_AUTOTUNE")
spec, options, epochs, off = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime
cpu0 = cpu()
start = time.perf_counter()
ds = sd.TarDataset(spec, storage_options=options, index=None, decode=False)
loader = sd.loader(ds, batch_size=16, num_workers=2, pin_memory=False)
built = time.perf_counter() - start
marks, n, epoch_ends = [], 0, []
for epoch in range(epochs):
    for batch in loader:
        n += len(batch["__key__"])
        marks.append((time.perf_counter() - start, n))
    epoch_ends.append((time.perf_counter() - start, n))
wall = time.perf_counter() - start
m = loader.metrics()
loader.close()
cpu1 = cpu()
print(json.dumps({"samples": n, "wall_s": wall, "built_s": built, "marks": marks, "epoch_ends": epoch_ends,
                  "cpu_main_s": cpu1[0] - cpu0[0], "cpu_workers_s": cpu1[1] - cpu0[1], "sd": sd.__file__,
                  "env": {k: os.environ.get(k) for k in SWITCHES},
                  "tuned": {k: v for k, v in m.items() if k.startswith(("tuned.", "budget.grown"))}}))
"""


def _run(spec: str, options: dict, epochs: int, off: str) -> dict:
    import os

    env_before = {k: os.environ.get(k) for k in SWITCHES}
    for key in SWITCHES:  # every run starts from the package's defaults ...
        os.environ.pop(key, None)
    os.environ.update(ENV_OFF.get(off, {}))  # ... and an OFF by switch sets its own
    try:
        return run_in_tree(CHILD, [spec, json.dumps(options), str(epochs), off], ROOT)
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def steady(marks: list[list[float]], skip: float) -> float:
    """Samples/s after the first ``skip`` of the run's samples: from the batch that passed the
    mark to the last batch."""
    total = marks[-1][1]
    t0, n0 = next(mark for mark in marks if mark[1] >= skip * total)
    t1, n1 = marks[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _fmt(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def summarize(rows: list[dict], names: list[str], delays: list[float], args: dict) -> dict:
    """Per mechanism and delay, the per-round ratios ON / OFF (each OFF against the mean of the ON
    runs either side of it), over the rounds that ran it; a markdown table of them."""
    summary: dict = {"when": time.strftime("%Y-%m-%d %H:%M"), "args": args, "pairs": {}}
    table = ["| mechanism | delay | whole-run ON/OFF | steady ON/OFF | CPU per sample ON/OFF | rounds |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in names:
        for delay in delays:
            ratios: dict[str, list[float]] = {"rate": [], "steady": [], "cpu_per_sample_ms": []}
            for r in sorted({row["round"] for row in rows}):
                mine = {row["pos"]: row for row in rows if row["round"] == r and row["delay_ms"] == delay}
                at = next((pos for pos, row in mine.items() if row["off"] == name), None)
                if at is None:
                    continue
                ons = [mine[p] for p in (at - 1, at + 1) if p in mine and mine[p]["off"] == "ON"]
                if not ons:
                    continue
                for key, values in ratios.items():
                    values.append(statistics.fmean(row[key] for row in ons) / mine[at][key])
            if not ratios["rate"]:
                continue
            summary["pairs"][f"{name} @ {delay:g} ms"] = {k: _stats(v) | {"rounds": v}
                                                          for k, v in ratios.items()}
            table.append(f"| {name} | {delay:g} ms | {_fmt(_stats(ratios['rate']))} | "
                         f"{_fmt(_stats(ratios['steady']))} | {_fmt(_stats(ratios['cpu_per_sample_ms']))} | "
                         f"{len(ratios['rate'])} |")
    for delay in delays:
        on = [row for row in rows if row["delay_ms"] == delay and row["off"] == "ON"]
        if on:
            summary[f"ON runs @ {delay:g} ms"] = {
                "rate": _stats([row["rate"] for row in on]), "wall_s": _stats([row["wall_s"] for row in on]),
                "cpu_per_sample_ms": _stats([row["cpu_per_sample_ms"] for row in on])}
    summary["table"] = table
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 512 samples in 16 shards, 1 epoch, LITE-HTTP and QUEUE-FIT, 1 round")
    ap.add_argument("--rounds", type=int, default=None, help="3 (1 with --quick)")
    ap.add_argument("--delays", default="0,100", help="one-way delays, ms")
    ap.add_argument("--epochs", type=int, default=12, help="epochs per run (persistent workers)")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--sample-kib", type=int, default=256)
    ap.add_argument("--skip", type=float, default=0.1, help="the share of the run the steady rate leaves out")
    ap.add_argument("--only", default=None, help="mechanisms to switch off (comma-separated; default all: "
                    + ",".join(MECHANISMS) + ")")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "switch_off.json"))
    ap.add_argument("--summarize", default=None, metavar="JSON",
                    help="only summarize the runs in this results file (an interrupted run's too)")
    args = ap.parse_args(argv)
    if args.summarize:
        done = json.loads(Path(args.summarize).read_text())
        ran, ran_args = done["rounds"], done.get("args") or done["summary"]["args"]
        summary = summarize(ran, [m for m in MECHANISMS if any(row["off"] == m for row in ran)],
                            sorted({row["delay_ms"] for row in ran}), ran_args)
        print("\n".join(summary["table"]))
        return
    if args.quick:
        args.samples, args.shards, args.epochs = 512, 16, 1
        args.only = args.only or "LITE-HTTP,INHERITED-HEAP"
    args.rounds = args.rounds or (1 if args.quick else 3)
    delays = [float(d) for d in args.delays.split(",")]
    names = [m for m in MECHANISMS if args.only is None or m in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(MECHANISMS) if args.only else set()
    if unknown:
        ap.error(f"unknown mechanisms {sorted(unknown)}; known: {', '.join(MECHANISMS)}")

    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    begun = time.perf_counter()
    with S3Server() as server:
        server.create_bucket("bench")
        upload_shards(server.boto3_client(), "bench", "tar/train", args.samples, args.shards,
                      args.sample_kib * 1024 + 128)
        spec = shard_pattern("bench", "tar/train", args.shards)
        for r in range(args.rounds):
            for delay in delays:
                shift = r % len(names)
                order = names[shift:] + names[:shift]
                with LatencyProxy(*upstream(server.endpoint_url), delay_s=delay / 1000) as proxy:
                    options = replace_in_options(server.storage_options, server.endpoint_url,
                                                 proxy.url_for(server.endpoint_url))
                    # ON, OFF(a), ON, OFF(b), ..., OFF(z), ON
                    sequence = [x for name in order for x in ("ON", name)] + ["ON"]
                    for pos, off in enumerate(sequence):
                        proxy.reset_counters()
                        got = _run(spec, options, args.epochs, off)
                        assert got["samples"] == args.samples * args.epochs, got["samples"]
                        row = {"round": r, "delay_ms": delay, "pos": pos, "off": off,
                               "rate": got["samples"] / got["wall_s"],
                               "steady": steady(got["marks"], args.skip),
                               "cpu_per_sample_ms": 1000 * (got["cpu_main_s"] + got["cpu_workers_s"])
                               / got["samples"],
                               "connections": proxy.connections, **got}
                        row.pop("marks")
                        rows.append(row)
                        print(f"[{time.perf_counter() - begun:6.0f} s] round {r} delay {delay:g} ms "
                              f"{'OFF ' + off if off != 'ON' else 'ON':>18}: wall {got['wall_s']:5.1f} s, "
                              f"{row['rate']:7.1f} samples/s, steady {row['steady']:7.1f}, "
                              f"CPU {row['cpu_per_sample_ms']:.3f} ms/sample (workers "
                              f"{got['cpu_workers_s']:.1f} s), {proxy.connections} connections, "
                              f"{got['tuned']}", flush=True)
                # what is done so far survives an interrupted run
                out.write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))

    summary = summarize(rows, names, delays, vars(args))
    print(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=1))
    print("\n".join(summary["table"]))
    out.write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
