"""Images: JPEG shards -> random-resized crop 224 + flip -> ``uint8 [64, 3, 224, 224]`` batches.

The commonest job on a bucket, where the CPU and not the network sets the pace. The embedded
S3 server holds tar shards of JPEGs cut from scikit-image's photographs (``benchmarks/photos.py``:
about 500x375, quality 90, as ImageNet's), behind a :class:`~benchmarks.proxy.LatencyProxy`;
each method reads all of them once, 2 workers, batch 64, in a fresh process, in interleaved
rounds, at each one-way delay. Methods:

- ``streamdata``: ``sd.TarDataset(decode=sd.images.RandomResizedCrop(224))`` (the fast image path);
- ``streamdata-pil``: ``decode=True`` (every JPEG decoded in full) and the same PIL transform as map;
- ``streamdata-1x2`` / ``streamdata-2x2``: the fast path with ``decode_threads=2`` on 1 / 2 workers;
- ``webdataset``: ``wds.WebDataset(...).decode("pil")`` and the same PIL transform in its workers.

The PIL transform is torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` on a PIL image
(Pillow's antialiased bilinear resize of the crop box), then a ``uint8 [3, H, W]`` tensor.
``images/s`` counts the whole run, from the dataset's constructor to the last batch; ``CPU ms/img``
is the CPU time of the run's process and its workers over the images. LitData and MosaicML
Streaming are not installed here (``benchmarks/latency.py``'s ``NOT_FEASIBLE`` says why).

    python -m benchmarks.images                  # 3 rounds, 0 and 100 ms (~10 min on 2 cores)
    python -m benchmarks.images --quick          # smoke run
    python -m benchmarks.images --micro          # per-image CPU of each path, one thread, no loader
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
METHODS = ("streamdata", "streamdata-pil", "streamdata-1x2", "streamdata-2x2", "webdataset")
PEERS = ("webdataset",)
SIZE = 224


# ---- the transform every PIL-based method runs (the user's code) ------------------------------

def pil_random_resized_crop(image: Any, rng: random.Random) -> Any:
    """torchvision's RandomResizedCrop(224) + RandomHorizontalFlip on a PIL image -> uint8 [3, H, W]."""
    import numpy as np
    import PIL.Image
    import torch

    from streamdata.formats.images import random_resized_box

    x, y, w, h = random_resized_box(image.width, image.height, (0.08, 1.0), (3 / 4, 4 / 3), rng)
    image = image.convert("RGB").resize((SIZE, SIZE), PIL.Image.BILINEAR, box=(x, y, x + w, y + h))
    if rng.random() < 0.5:
        image = image.transpose(PIL.Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())


class _TensorMap:
    """``decode=True``'s ``[3, H, W]`` tensor back to PIL, then the PIL transform (today's path)."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, sample: dict) -> dict:
        import PIL.Image

        sample["jpg"] = pil_random_resized_crop(PIL.Image.fromarray(sample["jpg"].permute(1, 2, 0).numpy()),
                                                self.rng)
        return sample


def _wds_transform(sample: tuple) -> tuple:
    image, label = sample
    return pil_random_resized_crop(image, _WDS_RNG), label


_WDS_RNG = random.Random(0)


def _wds_collate(samples: list) -> dict:
    import torch

    images, labels = zip(*samples, strict=True)
    return {"jpg": torch.stack(images), "cls": torch.tensor(labels)}


# ---- one run, in a fresh process ---------------------------------------------------------------

def _loader(cfg: dict) -> Any:
    method, workers = cfg["method"], cfg["workers"]
    if method == "webdataset":
        import importlib

        import webdataset as wds
        from torch.utils.data import DataLoader

        from benchmarks.latency import _WdsOpener

        importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = _WdsOpener(cfg["storage_options"])
        ds = (wds.WebDataset(cfg["shard_urls"], shardshuffle=False, empty_check=False)
              .decode("pil").to_tuple("jpg", "cls").map(_wds_transform)
              .batched(cfg["batch"], collation_fn=_wds_collate))
        return DataLoader(ds, batch_size=None, num_workers=workers)
    import streamdata as sd

    threads = 1
    if method == "streamdata-pil":
        options: dict = {"decode": True, "map": _TensorMap()}
    else:
        options = {"decode": sd.images.RandomResizedCrop(SIZE)}
        if method in ("streamdata-1x2", "streamdata-2x2"):
            threads, workers = 2, 1 if method == "streamdata-1x2" else 2
    ds = sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"], batch_size=cfg["batch"],
                       decode_threads=threads, **options)
    return sd.loader(ds, num_workers=workers, pin_memory=False)


def run_one(cfg: dict) -> dict:
    """One whole run: constructor to last batch; images/s and CPU per image (this process and
    its workers, reaped before the second reading)."""
    import torch  # noqa: F401  (imports are not what is timed)
    import webdataset  # noqa: F401

    import streamdata  # noqa: F401

    cpu0, start = os.times(), time.perf_counter()
    loader = _loader(cfg)
    it = iter(loader)
    n = 0
    shape = None
    for batch in it:
        images = batch["jpg"]
        assert images.dtype == torch.uint8, images.dtype
        shape = list(images.shape)
        n += images.shape[0]
    end = time.perf_counter()
    shutdown = getattr(it, "_shutdown_workers", None) or getattr(loader, "close", None)
    if shutdown is not None:
        shutdown()
    del it
    cpu1 = os.times()
    cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
           - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system)
    main = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    return {"images": n, "seconds": end - start, "images_per_s": n / (end - start),
            "cpu_ms_per_image": 1e3 * cpu / max(n, 1), "main_cpu_ms_per_image": 1e3 * main / max(n, 1),
            "batch_shape": shape}


def _child(cfg: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="sd-images-") as tmp:
        cfg_path, out_path = Path(tmp, "cfg.json"), Path(tmp, "out.json")
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.images", "--run-one", str(cfg_path),
                                   str(out_path)], cwd=REPO, env=env, timeout=timeout, capture_output=True,
                                  text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_path.exists():
            return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}
        return json.loads(out_path.read_text())


# ---- the orchestrator ----------------------------------------------------------------------------

def _upload(server: Any, n_images: int, per_shard: int) -> tuple[str, list[str]]:
    from benchmarks.common import tar_bytes
    from benchmarks.photos import jpeg_photos

    photos = jpeg_photos(n_images, seed=0)
    client = server.boto3_client()
    n_shards = math.ceil(n_images / per_shard)
    for s in range(n_shards):
        body = tar_bytes({"__key__": f"{i:08d}", "jpg": photos[i], "cls": str(i % 10).encode()}
                         for i in range(s * per_shard, min(n_images, (s + 1) * per_shard)))
        client.put_object(Bucket="bench", Key=f"img/train-{s:06d}.tar", Body=body)
    urls = [f"s3://bench/img/train-{s:06d}.tar" for s in range(n_shards)]
    return f"s3://bench/img/train-{{000000..{n_shards - 1:06d}}}.tar", urls


def micro(count: int = 200, rounds: int = 5) -> None:
    """Per-image CPU (best of ``rounds``, one thread, no loader) of: the fast path (libjpeg-turbo,
    and Pillow's draft), the PIL transform on a full decode (the peers'), today's ``decode=True``
    then the PIL transform; and the copy of one result into a shared-memory batch row (the copy
    the fast path leaves: each sample is copied into its batch as it arrives)."""
    import PIL.Image
    import torch

    from benchmarks.photos import jpeg_photos
    from streamdata.formats import decode as D
    from streamdata.formats import images as I

    torch.set_num_threads(1)
    photos = jpeg_photos(count, seed=1)
    fast = I.RandomResizedCrop(SIZE).for_pass(0, 0)
    real_sj = I._simplejpeg

    def fast_sj(i: int, data: bytes) -> Any:
        return fast.image(data, key=str(i))

    def fast_pillow(i: int, data: bytes) -> Any:
        I._simplejpeg = lambda: None
        try:
            return fast.image(data, key=str(i))
        finally:
            I._simplejpeg = real_sj

    rng = random.Random(0)

    def peer(i: int, data: bytes) -> Any:
        return pil_random_resized_crop(PIL.Image.open(io.BytesIO(data)), rng)

    def today(i: int, data: bytes) -> Any:
        full = D.fast_image(".jpg", data)
        return pil_random_resized_crop(PIL.Image.fromarray(full.permute(1, 2, 0).numpy()), rng)

    paths = {"fast (libjpeg-turbo)": fast_sj, "fast (Pillow draft)": fast_pillow,
             "PIL transform (peers)": peer, "decode=True + PIL map (today)": today}
    best = {name: math.inf for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.process_time()
            for i, data in enumerate(photos):
                fn(i, data)
            best[name] = min(best[name], (time.process_time() - start) / count * 1e3)
    batch = torch.empty((64, 3, SIZE, SIZE), dtype=torch.uint8).share_memory_()
    one = fast_sj(0, photos[0])
    rows = batch.numpy()
    start = time.process_time()
    for i in range(5000):
        rows[i % 64] = one.numpy()
    copy_us = (time.process_time() - start) / 5000 * 1e6
    base = best["PIL transform (peers)"]
    for name, ms in best.items():
        print(f"{name:32s} {ms:6.2f} ms/image  {ms / base:5.2f}x the peers' transform")
    print(f"{'copy into a batch row':32s} {copy_us / 1e3:6.3f} ms/image  ({one.numel()} bytes)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-one", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=2560)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--delays", default="0,100", help="one-way delays in ms")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round, 0 ms, 512 images")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--micro", action="store_true", help="per-image CPU of each path, no loader")
    args = parser.parse_args(argv)
    if args.micro:
        micro()
        return
    if args.run_one:
        cfg = json.loads(Path(args.run_one[0]).read_text())
        Path(args.run_one[1]).write_text(json.dumps(run_one(cfg)))
        return
    if args.quick:  # one round at 0 ms; 512 images unless --images says otherwise
        args.rounds, args.delays = 1, "0"
        if args.images == parser.get_default("images"):
            args.images, args.per_shard = 512, 128
    from benchmarks.common import replace_in_options, upstream
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    methods = [m for m in args.methods.split(",") if m]
    delays = [float(d) for d in args.delays.split(",") if d]
    results: dict[tuple[str, float], list[dict]] = {}
    with S3Server() as server:
        server.create_bucket("bench")
        spec, urls = _upload(server, args.images, args.per_shard)
        proxies = {d: LatencyProxy(*upstream(server.endpoint_url), delay_s=d / 1000).__enter__()
                   for d in delays}
        try:
            for r in range(args.rounds):
                for d in delays:
                    options = replace_in_options(server.storage_options, server.endpoint_url,
                                                 proxies[d].url_for(server.endpoint_url))
                    order = methods if r % 2 == 0 else methods[::-1]  # interleaved, alternating order
                    for m in order:
                        cfg = {"method": m, "spec": spec, "shard_urls": urls, "storage_options": options,
                               "workers": args.workers, "batch": args.batch}
                        out = _child(cfg, timeout=600)
                        results.setdefault((m, d), []).append(out)
                        print(f"round {r} delay {d:g} ms {m}: {out}", flush=True)
        finally:
            for proxy in proxies.values():
                proxy.__exit__(None, None, None)
    _report(results, methods, delays, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{m}@{d:g}": v for (m, d), v in results.items()}, indent=1))


def _report(results: dict, methods: list[str], delays: list[float], rounds: int) -> None:
    def med(values: list[float]) -> float:
        values = [v for v in values if v == v]
        return statistics.median(values) if values else float("nan")

    print(f"\n{'delay':>6} {'method':16} {'images/s':>9} {'CPU ms/img':>11} {'x peer img/s':>13} "
          f"{'x peer CPU':>11}")
    for d in delays:
        peer = [p for p in PEERS if (p, d) in results]
        for m in methods:
            runs = results.get((m, d), [])
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(f"{d:6g} {m:16} {'failed: ' + str(runs[0].get('error') if runs else '-')}")
                continue
            rate, cpu = med([r["images_per_s"] for r in ok]), med([r["cpu_ms_per_image"] for r in ok])
            ratios = ""
            if peer and m not in PEERS:  # per-round ratios against the best peer of that round
                rr, cr = [], []
                for i in range(rounds):
                    mine = runs[i] if i < len(runs) else {"error": 1}
                    theirs = [results[(p, d)][i] for p in peer if i < len(results[(p, d)])
                              and "error" not in results[(p, d)][i]]
                    if "error" in mine or not theirs:
                        continue
                    rr.append(mine["images_per_s"] / max(t["images_per_s"] for t in theirs))
                    cr.append(mine["cpu_ms_per_image"] / min(t["cpu_ms_per_image"] for t in theirs))
                ratios = f"{med(rr):13.2f} {med(cr):11.2f}"
            print(f"{d:6g} {m:16} {rate:9.0f} {cpu:11.2f} {ratios}")


if __name__ == "__main__":
    main()
