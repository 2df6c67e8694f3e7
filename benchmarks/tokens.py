"""Token streams: ``sd.TokenDataset`` against whole-file reads of the same flat ``.bin`` files.

Writes ``--files`` nanoGPT-style ``.bin`` files of uint16 tokens to the embedded S3 server, puts a
:class:`~benchmarks.proxy.LatencyProxy` in front of it and measures, per one-way delay, tokens/s
over a whole epoch (dataset construction included) with ``--workers`` DataLoader workers, both
yielding ``[batch, seq_len + 1]`` int64 blocks:

- ``streamdata``: ``sd.TokenDataset(..., dtype="uint16", targets=True)`` through ``sd.loader``
  (the stream cut into sequences, each worker's span read in byte ranges by the prefetcher);
- ``whole-file``: what a training script does without a loader: each worker downloads its
  files whole with s3fs (``cat_file``) and cuts them into blocks (no exact epoch, no resume).

Rounds are interleaved (method A, B, A, B, ...) and the ratio is taken per round, so a noisy
machine moves both alike. With ``--epochs N`` it also records streamdata's resident memory
(main process + workers) after each epoch of one ``sd.loader`` with persistent workers.

    python -m benchmarks.tokens             # full run
    python -m benchmarks.tokens --quick     # smoke run

With ``--litdata-python PY`` (a Python that imports litdata; it is not one of streamdata's
dependencies), a third method: LitData's ``StreamingDataset`` with ``TokensLoader(block_size=
seq_len + 1)`` and its ``StreamingDataLoader``, over the same tokens converted to its chunk
format by its own ``litdata.optimize`` and uploaded beside the ``.bin`` files; each of its rounds
runs in a child process of that Python (its tokens/s timed inside the child, from the dataset's
construction on, like the others), with a fresh cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import upstream, write_report  # noqa: E402
from benchmarks.proxy import LatencyProxy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


class WholeFiles(torch.utils.data.IterableDataset):
    """The baseline: each worker downloads its files whole and cuts ``[batch, width]`` blocks."""

    def __init__(self, urls: list[str], width: int, batch: int, options: dict) -> None:
        super().__init__()
        self.urls, self.width, self.batch, self.options = urls, width, batch, options

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        import s3fs

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        for url in self.urls[worker::workers]:
            tokens = np.frombuffer(fs.cat_file(url[len("s3://"):]), np.uint16)
            n = len(tokens) // (self.width * self.batch) * self.width * self.batch
            blocks = tokens[:n].astype(np.int64).reshape(-1, self.batch, self.width)
            for block in blocks:
                yield {"input_ids": torch.from_numpy(block)}


def _loader(method: str, spec: str, urls: list[str], options: dict, args: argparse.Namespace,
            persistent: bool = False) -> Any:
    if method == "streamdata":
        import streamdata as sd

        ds = sd.TokenDataset(spec, seq_len=args.seq_len, targets=True, batch_size=args.batch,
                             dtype="uint16", storage_options=options)
        return sd.loader(ds, num_workers=args.workers, persistent_workers=persistent)
    baseline = WholeFiles(urls, args.seq_len + 1, args.batch, options)
    return torch.utils.data.DataLoader(baseline, batch_size=None, num_workers=args.workers,
                                       multiprocessing_context="fork", timeout=300)


def _measure(method: str, spec: str, urls: list[str], options: dict, args: argparse.Namespace) -> dict:
    """Tokens per second over one whole epoch, construction included, and the tokens."""
    start = time.perf_counter()
    tokens = 0
    loader = _loader(method, spec, urls, options, args)
    for batch in loader:
        tokens += batch["input_ids"].numel()
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return {"tokens": tokens, "tokens_per_s": tokens / (time.perf_counter() - start)}


def _memory(spec: str, urls: list[str], options: dict, args: argparse.Namespace) -> list[int]:
    """Resident bytes (main + workers) after each of ``args.epochs`` epochs of one loader."""
    import psutil

    loader = _loader("streamdata", spec, urls, options, args, persistent=True)
    out = []
    try:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            me = psutil.Process(os.getpid())
            out.append(me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True)
                                                   if c.name().startswith("python")))
    finally:
        loader.close()
    return out


def _litdata_tokens(path: str) -> Iterator[torch.Tensor]:
    """One file's tokens, as LitData's ``optimize`` takes them for ``TokensLoader``."""
    yield torch.from_numpy(np.fromfile(path, np.uint16).astype(np.int64))


def _litdata_child(cfg: dict) -> None:
    """Runs under ``--litdata-python``: ``convert`` (``litdata.optimize`` of the local ``.bin``
    files) or ``measure`` (one epoch, tokens/s printed as JSON)."""
    import tempfile

    import litdata as ld
    from litdata.streaming.item_loader import TokensLoader

    if cfg["do"] == "convert":
        ld.optimize(fn=_litdata_tokens, inputs=cfg["files"], output_dir=cfg["out"], chunk_size=cfg["chunk"],
                    item_loader=TokensLoader(), num_workers=1, verbose=False)
        return
    start = time.perf_counter()
    ds = ld.StreamingDataset(cfg["input_dir"], item_loader=TokensLoader(block_size=cfg["width"]),
                             cache_dir=tempfile.mkdtemp(prefix="litdata-cache-"),
                             storage_options=cfg["storage_options"])
    count = 0
    for batch in ld.StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"]):
        count += batch.numel()
    print(json.dumps({"tokens": count, "tokens_per_s": count / (time.perf_counter() - start)}))


def _litdata_call(args: argparse.Namespace, cfg: dict) -> dict:
    import subprocess

    child = [args.litdata_python, str(Path(__file__).resolve()), "--litdata-child", json.dumps(cfg)]
    done = subprocess.run(child, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the litdata child failed: {done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _litdata_prepare(server: Any, args: argparse.Namespace, bodies: list[bytes]) -> None:
    """The same tokens in LitData's chunk format, by its own tool, uploaded to ``lit/``."""
    import tempfile

    client = server.boto3_client()
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, body in enumerate(bodies):
            files.append(f"{tmp}/part-{i:03d}.bin")
            Path(files[-1]).write_bytes(body)
        _litdata_call(args, {"do": "convert", "files": files, "out": f"{tmp}/lit",
                             "chunk": (args.seq_len + 1) * 256})
        for path in sorted(Path(f"{tmp}/lit").iterdir()):
            client.put_object(Bucket="bench-tokens", Key=f"lit/{path.name}", Body=path.read_bytes())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from streamdata.testing import S3Server

    rows: list[dict[str, Any]] = []
    with S3Server() as server:
        server.create_bucket("bench-tokens")
        client = server.boto3_client()
        rng = np.random.default_rng(0)
        urls, bodies = [], []
        for i in range(args.files):
            bodies.append(rng.integers(0, 50257, args.tokens, dtype=np.uint16).tobytes())
            client.put_object(Bucket="bench-tokens", Key=f"bin/part-{i:03d}.bin", Body=bodies[-1])
            urls.append(f"s3://bench-tokens/bin/part-{i:03d}.bin")
        methods = ["streamdata", "whole-file"]
        if args.litdata_python:
            _litdata_prepare(server, args, bodies)
            methods.append("litdata")
        spec = "s3://bench-tokens/bin/"
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.0) as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
            for delay_ms in args.delays:
                proxy.set_delay(delay_ms / 1000)
                speeds: dict[str, list[float]] = {m: [] for m in methods}
                counts: dict[str, int] = {}
                for _ in range(args.reps):  # interleaved rounds
                    for method in methods:
                        if method == "litdata":
                            lit_options = {"endpoint_url": options["endpoint_url"],
                                           "region_name": "us-east-1", "aws_access_key_id": options["key"],
                                           "aws_secret_access_key": options["secret"]}
                            one = _litdata_call(args, {
                                "do": "measure", "input_dir": "s3://bench-tokens/lit",
                                "width": args.seq_len + 1, "batch": args.batch, "workers": args.workers,
                                "storage_options": lit_options})
                        else:
                            one = _measure(method, spec, urls, options, args)
                        speeds[method].append(one["tokens_per_s"])
                        counts[method] = one["tokens"]
                row: dict[str, Any] = {"delay_ms": delay_ms, "tokens_per_epoch": counts}
                row.update({f"{m}_tokens_per_s": statistics.median(v) for m, v in speeds.items()})
                for other in methods[1:]:  # streamdata / other, per round
                    ratios = [a / b for a, b in zip(speeds["streamdata"], speeds[other], strict=True)]
                    row[f"vs_{other}_median"], row[f"vs_{other}"] = statistics.median(ratios), ratios
                rows.append(row)
                speed = "  ".join(f"{m} {row[f'{m}_tokens_per_s']:>11,.0f} tok/s" for m in methods)
                ratio = ", ".join(f"{o}: {row[f'vs_{o}_median']:.2f} ("
                                  f"{', '.join(f'{r:.2f}' for r in row[f'vs_{o}'])})" for o in methods[1:])
                print(f"  {delay_ms:>5.0f} ms  {speed}  streamdata / {ratio}", flush=True)
            proxy.set_delay(0)
            memory = _memory(spec, urls, options, args) if args.epochs else []
            if memory:
                print(f"  resident MB after each epoch: {[round(m / 2**20) for m in memory]}")
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows,
            "rss_after_epoch": memory}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[0, 100])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1_000_000, help="tokens per file")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs of the memory run (0: none)")
    p.add_argument("--litdata-python", default=None, help="a Python that imports litdata: measure it too")
    p.add_argument("--quick", action="store_true", help="small data, one round, two epochs")
    p.add_argument("--out", type=Path, default=RESULTS / "tokens.json")
    args = p.parse_args(argv)
    if args.quick:
        args.files, args.tokens, args.reps, args.epochs, args.seq_len = 4, 100_000, 1, 2, 256
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--litdata-child"]:
        _litdata_child(json.loads(argv[1]))
        return
    args = parse_args(argv)
    report = run(args)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
