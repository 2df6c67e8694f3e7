"""Epochs after the first: what a persistent worker costs per epoch, with and without
``reuse_worker_memory`` (WORKER-MEMORY, ``streamdata/_alloc.py``).

Starts the embedded S3 server, writes 2048 samples of 96 KiB in 32 tar shards (the latency
benchmark's data), then runs ``sd.loader(TarDataset(...), num_workers=2)`` for several
epochs with persistent workers, once with each setting, the two runs alternating for
``--rounds`` rounds (``--file-system`` adds a third: ``sharing_strategy="file_system"``,
batches passed by file name). Per epoch after the first it records the workers' page
faults, their user and system CPU seconds, the CPU of the main thread (which receives the
batches) and the epoch's wall time; it prints the medians per setting and their ratios,
and writes ``benchmarks/results/epochs-<stamp>.json``.

    python -m benchmarks.epochs [--epochs 8] [--rounds 3] [--delay-ms 0] [--file-system]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from benchmarks.common import proxied_shards  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SETTINGS: dict[str, dict] = {"reuse": {}, "glibc defaults": {"reuse_worker_memory": False}}
FILE_SYSTEM = {"reuse, file_system": {"sharing_strategy": "file_system"}}


def _faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt


def _workers_state(workers: list[psutil.Process]) -> tuple[int, float, float]:
    faults = user = system = 0.0
    for w in workers:
        faults += _faults(w.pid)
        t = w.cpu_times()
        user, system = user + t.user, system + t.system
    return int(faults), user, system


def run_setting(spec: str, options: dict, loader_options: dict, epochs: int) -> list[dict]:
    """One persistent loader, ``epochs`` epochs; per-epoch costs of its workers and of the
    main process's thread that receives the batches."""
    import torch.multiprocessing

    import streamdata as sd

    strategy = torch.multiprocessing.get_sharing_strategy()  # sd.loader may set it here
    try:
        return _run_setting(sd, spec, options, loader_options, epochs)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def _run_setting(sd, spec: str, options: dict, loader_options: dict, epochs: int) -> list[dict]:
    me = psutil.Process()
    others = {p.pid for p in me.children()}
    ds = sd.TarDataset(spec, storage_options=options, batch_size=32)
    rows = []
    with sd.loader(ds, num_workers=2, pin_memory=False, **loader_options) as feed:
        workers: list[psutil.Process] = []
        for epoch in range(epochs):
            before = _workers_state(workers) if workers else None
            start, main_cpu = time.perf_counter(), time.thread_time()
            n = sum(len(batch["__key__"]) for batch in feed)
            wall, main_cpu = time.perf_counter() - start, time.thread_time() - main_cpu
            if not workers:
                workers = [p for p in me.children() if p.pid not in others]
                continue  # the first epoch starts the workers: nothing to compare
            after = _workers_state(workers)
            rows.append({"epoch": epoch, "samples": n, "wall_s": wall, "main_s": main_cpu,
                         "faults": after[0] - before[0],
                         "user_s": after[1] - before[1], "system_s": after[2] - before[2]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8, help="epochs per loader (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each setting")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of the latency proxy")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--sample-kib", type=int, default=96)
    parser.add_argument("--file-system", action="store_true",
                        help="also run with sharing_strategy='file_system' (batches passed by file name)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    settings = {**SETTINGS, **(FILE_SYSTEM if args.file_system else {})}

    rows: dict[str, list[dict]] = {name: [] for name in settings}
    with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib) as bench:
        for k in range(args.rounds):
            for name, loader_options in settings.items():
                got = run_setting(bench.spec, bench.options, loader_options, args.epochs)
                rows[name] += got
                print(f"  round {k + 1}/{args.rounds} {name:15s}: faults/epoch "
                      f"{statistics.median(r['faults'] for r in got):8.0f}, workers' CPU s/epoch "
                      f"{statistics.median(r['user_s'] + r['system_s'] for r in got):.2f}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)  # the data first: nothing below may lose it
    out = args.out / f"epochs-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))

    def med(name: str, key: str) -> float:
        if key == "cpu_s":
            return statistics.median(r["user_s"] + r["system_s"] for r in rows[name])
        return statistics.median(r[key] for r in rows[name])

    def ratio(a: str, b: str, key: str) -> str:
        den = med(b, key)  # CPU times come in 10 ms ticks: a median can be 0
        return f"{med(a, key) / den:.2f}" if den else "—"

    header = (f"{datetime.date.today()} · {os.cpu_count()} cores · `python -m benchmarks.epochs "
              f"{' '.join(sys.argv[1:])}`".rstrip())
    lines = [header, "", "Medians over epochs 2.. of every round, 2 persistent workers:", "",
             "| setting | page faults / epoch (both workers) | user s | system s | workers' CPU s "
             "| main thread CPU s | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in settings:
        lines.append(f"| {name} | {med(name, 'faults'):,.0f} | {med(name, 'user_s'):.2f} | "
                     f"{med(name, 'system_s'):.2f} | {med(name, 'cpu_s'):.2f} | "
                     f"{med(name, 'main_s'):.3f} | {med(name, 'wall_s'):.3f} |")
    lines.append("")
    names = list(settings)
    for a, b in [(names[0], names[1])] + [(n, names[0]) for n in names[2:]]:
        lines.append(f"{a} / {b}: workers' CPU per epoch {ratio(a, b, 'cpu_s')}, system time "
                     f"{ratio(a, b, 'system_s')}, main thread CPU {ratio(a, b, 'main_s')}, "
                     f"wall per epoch {ratio(a, b, 'wall_s')}")
    print("\n" + "\n".join(lines) + f"\n\nresults: {out}")


if __name__ == "__main__":
    main()
