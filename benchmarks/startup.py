"""Start-up benchmark: from the dataset's constructor to the first batch, stage by stage.

Same dataset, server and proxy as ``benchmarks.latency`` (the embedded S3 server behind a
``LatencyProxy``). Each method runs in a fresh interpreter per round (so imports count; torch
and numpy, which a training job has imported already, are imported before the clock starts),
methods interleaved round by round (round k starting with the k-th method, so that none
always runs first). What a run is timed on:

- the child's own ``time.monotonic()`` stamps: before ``import <library>``, after it, after
  the dataset's constructor (and the part of it spent importing modules), ``iter(loader)``,
  each DataLoader worker's start (its ``worker_init_fn``), the first batch, the last batch;
- the proxy's event log (same clock): when each HTTP request reached it, when each response
  head was handed to the client; so the first shard GET's request and first byte, and the
  requests the constructor sent (the listing: count and kind).

Stages of the first batch (they add up to it): **import** (``import streamdata``),
**ctor imports** (modules the constructor imported), **listing** (the rest of the constructor),
**worker start** (``iter(loader)`` to the first worker's ``worker_init_fn``), **worker set-up**
(to the first data GET reaching the proxy), **first byte** (to its response head reaching the
client), **first batch** (to the batch in the training loop). ``wire``: a raw GET of the first
shard on a new connection (aiohttp, presigned: the issue's "raw GET of one shard"), then all
shards 32 at a time. ``webdataset``: ``pipe:curl`` over presigned URLs (its fastest path here;
signing is done by the orchestrator and not counted).

    python -m benchmarks.startup --rounds 3
    python -m benchmarks.startup --sd-trees base=/work/wt/base --rounds 5 --methods streamdata
    python -m benchmarks.startup --epochs 2      # also epoch 2's first batch (persistent workers)
    python -m benchmarks.startup --sd-options '{"listing": false}'   # expand_spec(listing=False)
    python -m benchmarks.startup --job-gc done   # the collection owed after `import torch` run first
    python -m benchmarks.startup --methods streamdata --sd-env '{"aiohttp": {"STREAMDATA_LITE_HTTP": "0"}}'

``--job-gc``: right after ``import torch`` Python owes a full garbage collection (some 170,000
objects, 0.07-0.1 s here) that runs wherever the next few hundred allocations happen; in a
training job that is usually while it builds its model, before any loader exists. ``due``
(the default, as in earlier runs) leaves it to land inside the clock; ``done`` runs it in
each child before the clock, every method alike.
"""

from __future__ import annotations

import argparse
import builtins
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import replace_in_options, upstream  # noqa: E402
from benchmarks.latency import (  # noqa: E402
    _batch_size_of,
    _boto3_client,
    _bucket_key,
    _import_streamdata,
    _prepare,
    _sd_trees,
    _wds_collate,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
METHODS = ("wire", "streamdata", "webdataset")
STAGES = ("import", "ctor_imports", "listing", "worker_start", "worker_setup", "first_byte", "first_batch")


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------


class _ImportClock:
    """Seconds spent in outermost ``import`` statements that loaded new modules, while on."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._depth = 0
        self._real = builtins.__import__

    def __enter__(self) -> _ImportClock:
        builtins.__import__ = self._import
        return self

    def __exit__(self, *exc: object) -> None:
        builtins.__import__ = self._real

    def _import(self, *args: Any, **kwargs: Any) -> Any:
        if self._depth:
            return self._real(*args, **kwargs)
        before, t = len(sys.modules), time.perf_counter()
        self._depth += 1
        try:
            return self._real(*args, **kwargs)
        finally:
            self._depth -= 1
            if len(sys.modules) != before:
                self.spent += time.perf_counter() - t


class _Stamp:
    """A picklable ``worker_init_fn``: appends the worker's start time to a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        with open(self.path, "a") as f:
            f.write(f"{worker_id} {time.monotonic()!r}\n")


def _make_streamdata(cfg: dict, stamp: _Stamp, clock: _ImportClock) -> tuple[Any, float]:
    with clock:
        import streamdata as sd  # noqa: F401  (imported above, outside the clock)

        opts = dict(cfg.get("sd_options") or {})
        spec = cfg["shard_spec"]
        if opts.pop("listing", True) is False:  # NO-LISTING: sizes from the readers' first GETs
            spec = sd.expand_spec(spec, cfg["storage_options"], listing=False)
        ds = sd.TarDataset(spec, storage_options=cfg["storage_options"], batch_size=cfg["batch"], **opts)
    built = time.monotonic()
    options = dict(cfg.get("loader_options") or {})
    return sd.loader(ds, num_workers=cfg["workers"], pin_memory=False, worker_init_fn=stamp, **options), built


def _make_webdataset(cfg: dict, stamp: _Stamp, clock: _ImportClock) -> tuple[Any, float]:
    from torch.utils.data import DataLoader

    with clock:
        import webdataset as wds

        urls = [f"pipe:curl -s -f '{u}'" for u in cfg["signed_urls"]]
        ds = (wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode()
              .to_tuple("npy", "cls").batched(cfg["batch"], collation_fn=_wds_collate))
    built = time.monotonic()
    return DataLoader(ds, batch_size=None, num_workers=cfg["workers"], worker_init_fn=stamp,
                      persistent_workers=cfg["epochs"] > 1), built


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _run_loader(cfg: dict, stamps: str) -> dict[str, Any]:
    import numpy  # noqa: F401  (the training job's own imports: not timed)
    import torch  # noqa: F401

    if cfg.get("job_gc") == "done":
        # the full collection Python owes after ``import torch`` runs now, as it would in a
        # job's own start-up (building its model): "due" leaves it to land inside the clock
        import gc

        gc.collect()
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    if cfg["method"] == "streamdata":
        out: dict[str, Any] = {"streamdata_file": _import_streamdata(cfg.get("sd_path"))}
    else:
        import webdataset  # noqa: F401

        out = {}
    imported = time.monotonic()
    clock = _ImportClock()
    make = _make_streamdata if cfg["method"] == "streamdata" else _make_webdataset
    loader, built = make(cfg, _Stamp(stamps), clock)
    epochs = []
    for _ in range(cfg["epochs"]):
        start = time.monotonic()
        first = None
        n = first_n = 0
        times = []  # each batch's arrival (the longest gap between two)
        for batch in loader:
            k = _batch_size_of(batch)
            n += k
            times.append(time.monotonic())
            if first is None:
                first, first_n = times[-1], k
        end = time.monotonic()
        epochs.append({"iter": start, "first": first, "end": end, "samples": n, "first_n": first_n,
                       "longest_gap": max((b - a for a, b in zip(times, times[1:], strict=False)),
                                          default=0.0)})
    counts = getattr(getattr(loader, "dataset", None), "counts", None)
    if isinstance(counts, dict):
        out["budget_grown"] = counts.get("budget.grown")  # BUDGET-GROWTH, summed over workers
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    else:
        it = getattr(loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
    del loader
    out.update(t0=t0, imported=imported, ctor_imports=clock.spent, built=built, epochs=epochs,
               cpu_s=_cpu_s() - cpu0)
    return out


def _run_wire(cfg: dict) -> dict[str, Any]:
    import asyncio

    import aiohttp

    signed = cfg["signed_urls"]

    async def main() -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=300)
        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(signed[0]) as resp:
                resp.raise_for_status()
                await resp.read()
        alone = time.monotonic()
        first = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32),
                                         timeout=timeout) as session:
            async def get(url: str) -> None:
                nonlocal first
                async with session.get(url) as resp:
                    resp.raise_for_status()
                    async for _ in resp.content.iter_any():
                        pass
                first = first or time.monotonic()

            await asyncio.gather(*(get(u) for u in signed))
        return {"t0": t0, "alone": alone, "pass_start": alone, "pass_first": first, "end": time.monotonic()}

    return asyncio.run(main())


def run_one(cfg: dict, out_path: str) -> None:
    with tempfile.NamedTemporaryFile("r", prefix="sd-stamps-", delete=False) as f:
        stamps = f.name
    try:
        result = _run_wire(cfg) if cfg["method"] == "wire" else _run_loader(cfg, stamps)
        result["workers"] = [float(line.split()[1]) for line in Path(stamps).read_text().splitlines()]
    finally:
        os.unlink(stamps)
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# Orchestrator side
# ---------------------------------------------------------------------------------------------


def _child(cfg: dict, timeout: float = 300) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sd-startup-") as tmp:
        cfg_path, out_path = Path(tmp, "cfg.json"), Path(tmp, "out.json")
        cfg_path.write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "benchmarks.startup", "--run-one", str(cfg_path), str(out_path)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   **cfg.get("env", {}))
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"error": " | ".join(tail) or f"exit {proc.returncode}"}
        return json.loads(out_path.read_text())


def _is_data(line: str) -> bool:
    """A GET of a tar shard (not a listing, a HEAD or an index probe)."""
    return line.startswith("GET ") and ".tar" in line.split(" ")[1].split("?")[0]


def stages(r: dict[str, Any], events: list[tuple[str, float, int, str]], n_samples: int) -> dict[str, Any]:
    """One run's stages (seconds), request counts and rates from its stamps and the proxy log."""
    requests = [e for e in events if e[0] == "request"]
    if "alone" in r:  # the wire
        first_req = min((e[1] for e in requests if _is_data(e[3])), default=float("nan"))
        first_resp = min((e[1] for e in events if e[0] == "response"), default=float("nan"))
        return {"first_batch_s": r["alone"] - r["t0"], "connect_request": first_req - r["t0"],
                "first_byte": first_resp - first_req, "rest_of_shard": r["alone"] - first_resp,
                "whole_sps": n_samples / (r["end"] - r["pass_start"]),
                "steady_sps": n_samples / (r["end"] - r["pass_first"]), "requests": len(requests)}
    e1 = r["epochs"][0]
    data_reqs = [e for e in requests if _is_data(e[3]) and e[1] >= e1["iter"]]
    first_req = min((e[1] for e in data_reqs), default=float("nan"))
    conns = {e[2] for e in data_reqs if e[1] == first_req}
    first_resp = min((e[1] for e in events if e[0] == "response" and e[2] in conns and e[1] >= first_req),
                     default=float("nan"))
    worker = min(r["workers"]) if r["workers"] else float("nan")
    ctor = r["built"] - r["imported"]
    before = [e[3].split(" ")[0] for e in requests if e[1] < e1["iter"]]
    out = {
        "import": r["imported"] - r["t0"], "ctor_imports": r["ctor_imports"],
        "listing": ctor - r["ctor_imports"], "worker_start": worker - r["built"],
        "worker_setup": first_req - worker, "first_byte": first_resp - first_req,
        "first_batch": e1["first"] - first_resp, "first_batch_s": e1["first"] - r["t0"],
        "from_iter_s": e1["first"] - e1["iter"],
        "whole_sps": e1["samples"] / (e1["end"] - r["t0"]),
        "steady_sps": (e1["samples"] - e1["first_n"]) / (e1["end"] - e1["first"]),
        "cpu_ms_per_sample": 1000 * r["cpu_s"] / max(1, sum(e["samples"] for e in r["epochs"])),
        "ctor_requests": len(before), "ctor_request_kinds": " ".join(sorted(before)),
        "samples": e1["samples"], "longest_gap_s": e1.get("longest_gap", float("nan")),
        "budget_grown": r.get("budget_grown"),
    }
    if len(r["epochs"]) > 1:
        e2, later = r["epochs"][1], r["epochs"][1:]
        out["epoch2_from_iter_s"] = e2["first"] - e2["iter"]
        # epochs after the first, from each one's iter() to its last batch (persistent workers)
        out["later_sps"] = sum(e["samples"] for e in later) / sum(e["end"] - e["iter"] for e in later)
    return out


def _presign(server_options: dict, urls: list[str]) -> list[str]:
    client = _boto3_client(server_options)
    out = []
    for url in urls:
        bucket, key = _bucket_key(url)
        out.append(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                 ExpiresIn=3600))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    methods = list(args.methods) + [f"streamdata@{t}" for t in args.sd_trees or {}]
    methods += [f"streamdata%{v}" for v in args.sd_env or {}]
    rows: dict[tuple[float, str], list[dict[str, Any]]] = {}
    with S3Server() as server:
        layout = _prepare(server, args)
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.0) as proxy:
            proxied = proxy.url_for(server.endpoint_url)
            options = replace_in_options(server.storage_options, server.endpoint_url, proxied)
            base = {"storage_options": options, "shard_spec": args.spec or layout.shard_spec,
                    "signed_urls": _presign(options, layout.shard_urls), "batch": args.batch,
                    "workers": args.workers, "epochs": args.epochs, "sd_options": args.sd_options,
                    "job_gc": args.job_gc, "loader_options": args.loader_options}
            for delay in args.delays:
                proxy.set_delay(delay / 1000)
                for k in range(args.rounds):
                    # each round starts with another method: no method always runs first (or
                    # right after the same one)
                    for method in methods[k % len(methods):] + methods[:k % len(methods)]:
                        if method == "webdataset" and delay not in args.peer_delays:
                            continue
                        cfg = dict(base, method=method.split("@")[0].split("%")[0], delay_ms=delay)
                        if "%" in method:  # this tree with environment variables of its own
                            cfg["env"] = {k: str(v) for k, v in args.sd_env[method.split("%", 1)[1]].items()}
                        if "@" in method:
                            cfg["sd_path"] = args.sd_trees[method.split("@", 1)[1]]["path"]
                        proxy.record_events(True)
                        r = _child(cfg)
                        events = list(proxy.events or [])
                        proxy.record_events(False)
                        row = {"error": r["error"]} if "error" in r else stages(r, events, layout.n_samples)
                        row.update(method=method, delay_ms=delay, round=k)
                        rows.setdefault((delay, method), []).append(row)
                        print(f"  {delay:g} ms [{k + 1}/{args.rounds}] {method}: " + (
                            f"ERROR {row['error']}" if "error" in row else
                            f"first batch {row['first_batch_s']:.3f} s, whole {row['whole_sps']:,.0f} "
                            f"samples/s, longest gap {row.get('longest_gap_s', float('nan')):.3f}, "
                            f"budget grown {row.get('budget_grown')}"
                            + "".join(f", {s} {row[s]:.3f}" for s in STAGES if s in row)
                            + (f", ctor requests {row['ctor_request_kinds'] or '-'}"
                               if "ctor_request_kinds" in row else "")), flush=True)
    return {"rows": [r for rs in rows.values() for r in rs]}


def _med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if key in r and r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def _cell(x: float, digits: int = 2) -> str:
    return "—" if x != x else f"{x:,.{digits}f}"


def format_tables(rows: list[dict[str, Any]]) -> str:
    """Medians per (delay, method); then per-round ratios (median, min–max)."""
    good = [r for r in rows if "error" not in r]
    keys = sorted({(r["delay_ms"], r["method"]) for r in good})
    lines = ["| delay | method | " + " | ".join(STAGES) + " | first batch s | from iter s | whole samples/s "
             "| steady samples/s | longest gap s | CPU ms/sample | ctor requests |",
             "|---:|---|" + "---:|" * (len(STAGES) + 6) + "---|"]
    for delay, method in keys:
        rs = [r for r in good if (r["delay_ms"], r["method"]) == (delay, method)]
        if method == "wire":
            st = ["—"] * 4 + [_cell(_med(rs, "connect_request")), _cell(_med(rs, "first_byte")),
                              _cell(_med(rs, "rest_of_shard"))]
        else:
            st = [_cell(_med(rs, s)) for s in STAGES]
        kinds = rs[0].get("ctor_request_kinds", "") if rs else ""
        lines.append(f"| {delay:g} ms | {method} | " + " | ".join(st)
                     + f" | {_cell(_med(rs, 'first_batch_s'))} | {_cell(_med(rs, 'from_iter_s'))} "
                     f"| {_cell(_med(rs, 'whole_sps'), 0)} "
                     f"| {_cell(_med(rs, 'steady_sps'), 0)} | {_cell(_med(rs, 'longest_gap_s'))} "
                     f"| {_cell(_med(rs, 'cpu_ms_per_sample'), 3)} "
                     f"| {kinds or '—'} |")
    if any("epoch2_from_iter_s" in r for r in good):
        lines += ["", "| delay | method | epoch 2 first batch from iter s | epochs 2.. samples/s |",
                  "|---:|---|---:|---:|"]
        for delay, method in keys:
            rs = [r for r in good if (r["delay_ms"], r["method"]) == (delay, method)]
            lines.append(f"| {delay:g} ms | {method} | {_cell(_med(rs, 'epoch2_from_iter_s'))} "
                         f"| {_cell(_med(rs, 'later_sps'), 0)} |")
    methods = sorted({m for _, m in keys})
    pairs = [("streamdata", "webdataset", "whole_sps"), ("streamdata", "wire", "whole_sps")]
    pairs += [("streamdata", m, k) for m in methods if m.startswith(("streamdata@", "streamdata%"))
              for k in ("whole_sps", "steady_sps", "first_batch_s", "cpu_ms_per_sample",
                        "epoch2_from_iter_s", "later_sps")]
    lines += ["", "Per round: median (min–max)", "", "| delay | ratio | median | min–max | rounds |",
              "|---:|---|---:|---:|---:|"]
    for delay in sorted({d for d, _ in keys}):
        for a, b, key in pairs:
            mine = {r["round"]: r.get(key) for r in good if r["delay_ms"] == delay and r["method"] == a}
            theirs = {r["round"]: r.get(key) for r in good if r["delay_ms"] == delay and r["method"] == b}
            ratios = [mine[k] / theirs[k] for k in mine if k in theirs and mine[k] and theirs[k]]
            if ratios:
                lines.append(f"| {delay:g} ms | {a} / {b}, {key} | {statistics.median(ratios):.2f} | "
                             f"{min(ratios):.2f}–{max(ratios):.2f} | {len(ratios)} |")
        wire = [r for r in good if r["delay_ms"] == delay and r["method"] == "wire"]
        sd_ = [r for r in good if r["delay_ms"] == delay and r["method"] == "streamdata"]
        if wire and sd_:
            target = _med(wire, "first_batch_s") + 2 * delay / 1000 + 0.15
            lines.append(f"| {delay:g} ms | first batch target: wire first shard + one round trip + "
                         f"0.15 s = {target:.2f} s; streamdata from iter(loader) "
                         f"{_med(sd_, 'from_iter_s'):.2f} s, from before import "
                         f"{_med(sd_, 'first_batch_s'):.2f} s | | | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[0, 100])
    p.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=list(METHODS))
    p.add_argument("--peer-delays", type=lambda s: [float(x) for x in s.split(",")], default=[0],
                   help="delays at which webdataset runs (it reads ~250 samples/s at 100 ms)")
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--sample-kib", type=int, default=96)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (2: epoch 2's first batch too)")
    p.add_argument("--spec", default=None, help="streamdata's spec instead of the brace pattern (e.g. a "
                   "JSON list of URLs)", type=lambda s: json.loads(s) if s.startswith("[") else s)
    p.add_argument("--sd-options", type=json.loads, default=None, help="JSON options for sd.TarDataset")
    p.add_argument("--loader-options", type=json.loads, default=None, help="JSON options for sd.loader")
    p.add_argument("--sd-env", type=json.loads, default=None, metavar="JSON",
                   help='variants of this tree with environment variables: {"name": {"VAR": "value"}}, '
                        'run as method streamdata%%name')
    p.add_argument("--sd-trees", type=_sd_trees, default=None, metavar="NAME=PATH[,NAME=PATH...]",
                   help="each also runs as streamdata@NAME, imported from the checkout at PATH")
    p.add_argument("--job-gc", choices=("due", "done"), default="due",
                   help="due: the full garbage collection Python owes after `import torch` lands "
                   "inside the clock (wherever the next allocations are); done: each child runs it "
                   "before the clock, as a job's own start-up does (every method alike)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--run-one", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sample_bytes = args.sample_kib * 1024 + 128
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run_one:
        run_one(json.loads(Path(args.run_one[0]).read_text()), args.run_one[1])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.startup " + " ".join(sys.argv[1:])
    data = run(args)
    table = format_tables(data["rows"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"startup-{stamp}.json"
    data.update(command=command, sd_trees=args.sd_trees or {})
    out.write_text(json.dumps(data, indent=1))
    print(f"\n{datetime.date.today()} · `{command.strip()}`\n\n{table}\n\nresults: {out}")


if __name__ == "__main__":
    main()
