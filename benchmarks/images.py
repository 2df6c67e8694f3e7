"""Images: JPEG shards -> random-resized crop 224 + flip -> ``uint8 [64, 3, 224, 224]`` batches.

The commonest job on a bucket, where the CPU and not the network sets the pace. The embedded
S3 server holds tar shards of JPEGs cut from scikit-image's photographs (``benchmarks/photos.py``:
about 500x375, quality 90, as ImageNet's), behind a :class:`~benchmarks.proxy.LatencyProxy`;
each method reads all of them once, 2 workers, batch 64, in a fresh process, in interleaved
rounds, at each one-way delay. Methods:

- ``streamdata``: ``sd.TarDataset(decode=sd.images.RandomResizedCrop(224))`` (the fast image path);
- ``streamdata-pil``: ``decode=True`` (every JPEG decoded in full) and the same PIL transform as map;
- ``streamdata-1x2`` / ``streamdata-2x2``: the fast path with ``decode_threads=2`` on 1 / 2 workers;
- ``webdataset``: ``wds.WebDataset(...).decode("pil")`` and the same PIL transform in its workers;
- ``litdata``: LitData's ``StreamingDataset`` (``transform=``) + ``StreamingDataLoader`` over the same
  JPEG bytes converted by ``litdata.optimize``, PIL decode and the same PIL transform in its workers;
- ``mosaic``: MosaicML Streaming's ``StreamingDataset`` (``__getitem__`` overridden) +
  ``StreamingDataLoader`` over the same JPEG bytes written by ``streaming.MDSWriter``, likewise;
- ``--gpu`` (a CUDA device): ``streamdata-cuda``, the fast path fed to the GPU
  (``sd.loader(device="cuda")``), against ``streamdata-gpu``, the same crops decoded on the GPU
  (``RandomResizedCrop(224, decode_on="device")``: the workers read headers, nvJPEG decodes),
  each round's ratios printed, and the device's name. The shards are local files there (the
  comparison is where the decode runs, not the network), or the S3 server's with ``--delays``.

The PIL transform is torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` on a PIL image
(Pillow's antialiased bilinear resize of the crop box), then a ``uint8 [3, H, W]`` tensor.
``images/s`` counts the whole run, from the dataset's constructor to the last batch; ``CPU ms/img``
is the CPU time of the run's process and its workers over the images.

LitData and MosaicML Streaming are not streamdata's dependencies (they pull torchvision, which does
not load on this CPU torch, and move numpy): they run from ``--peers-python PY``, an interpreter
of another virtualenv that has them (benchmarks/README.md gives the install), each conversion and
each run a subprocess of that interpreter; without it, or without the package, the method is
reported "not measured" with the reason. Their S3 clients (boto3) are pointed at the same
endpoint behind the same proxy: LitData by ``storage_options``, MosaicML Streaming by
``S3_ENDPOINT_URL`` and the ``AWS_*`` variables of its process.

    python -m benchmarks.images                  # 3 rounds, 0 and 100 ms (~10 min on 2 cores)
    python -m benchmarks.images --quick          # smoke run
    python -m benchmarks.images --peers-python /tmp/peers-venv/bin/python   # with LitData, Mosaic
    python -m benchmarks.images --micro          # per-image CPU of each path, one thread, no loader
    python -m benchmarks.images --gpu            # GPU decode against the CPU path (needs CUDA)
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
METHODS = ("streamdata", "streamdata-pil", "streamdata-1x2", "streamdata-2x2", "webdataset", "litdata",
           "mosaic")
GPU_METHODS = ("streamdata-cuda", "streamdata-gpu")  # --gpu: the CPU path and the GPU decode, both to CUDA
PEERS = ("webdataset", "litdata", "mosaic")
EXTERNAL = {"litdata": "litdata", "mosaic": "streaming"}  # run by --peers-python: method -> module
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


class _PeerTransform:
    """A LitData / Mosaic sample ``{"jpg": JPEG bytes, "cls": int}``: PIL decode + the PIL transform."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, sample: dict) -> dict:
        import PIL.Image

        image = PIL.Image.open(io.BytesIO(sample["jpg"]))
        return {"jpg": pil_random_resized_crop(image, self.rng), "cls": int(sample["cls"])}


def _tar_samples(path: str) -> Iterator[dict]:
    """One local tar shard's samples, in order, as the peers' writers take them."""
    import tarfile

    sample: dict = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, _, ext = member.name.partition(".")
            if sample and sample["__key__"] != key:
                yield {"jpg": sample["jpg"], "cls": int(sample["cls"])}
                sample = {}
            file = tar.extractfile(member)
            if file is not None:
                sample.update({"__key__": key, ext: file.read()})
    if sample:
        yield {"jpg": sample["jpg"], "cls": int(sample["cls"])}


def _import_streaming() -> Any:
    """MosaicML Streaming; its ``__init__`` imports its torchvision datasets (unused here), so where
    torchvision does not load, that one subpackage is left out."""
    import types

    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or built for another torch
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def _mosaic_dataset(**kwargs: Any) -> Any:
    streaming = _import_streaming()

    class MosaicImages(streaming.StreamingDataset):  # type: ignore[misc,name-defined]
        """The user's code: decode + the PIL transform in ``__getitem__`` (Mosaic has no transform=)."""

        peer_transform = _PeerTransform()

        def __getitem__(self, index: int) -> dict:
            return self.peer_transform(super().__getitem__(index))

    return MosaicImages(**kwargs)


def _peer_child(cfg: dict) -> dict:
    """Runs under ``--peers-python``: ``probe`` (the package's version) or ``convert`` (the local
    tar shards into the peer's own format, by the peer's own writer)."""
    method = cfg["method"]
    if cfg["do"] == "probe":
        module = _import_streaming() if method == "mosaic" else __import__(EXTERNAL[method])
        return {"version": getattr(module, "__version__", "?")}
    if method == "litdata":
        import litdata as ld

        ld.optimize(fn=_tar_samples, inputs=cfg["tars"], output_dir=cfg["out"], chunk_size=cfg["per_shard"],
                    num_workers=1, verbose=False)
    else:
        writer = _import_streaming().MDSWriter
        columns = {"jpg": "bytes", "cls": "int"}
        with writer(out=cfg["out"], columns=columns, size_limit=cfg["size_limit"]) as w:
            for tar in cfg["tars"]:
                for sample in _tar_samples(tar):
                    w.write(sample)
    return {}


def _peer_call(python: str, cfg: dict, timeout: float = 600) -> dict:
    """One ``_peer_child`` in a subprocess of the peers' interpreter; ``{"error": why}`` on failure."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run([python, "-m", "benchmarks.images", "--peer-child", json.dumps(cfg)], cwd=REPO,
                              env=env, timeout=timeout, capture_output=True, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])}
    return dict(json.loads(lines[-1]))


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
    if method == "litdata":
        import litdata as ld

        lit = ld.StreamingDataset(cfg["peer_url"], cache_dir=cfg["cache_dir"],
                                  storage_options=cfg["peer_options"], transform=_PeerTransform())
        return ld.StreamingDataLoader(lit, batch_size=cfg["batch"], num_workers=workers)
    if method == "mosaic":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        mds = _mosaic_dataset(remote=cfg["peer_url"], local=cfg["cache_dir"], batch_size=cfg["batch"],
                              shuffle=False)
        return _import_streaming().StreamingDataLoader(mds, batch_size=cfg["batch"], num_workers=workers)
    import streamdata as sd

    threads = 1
    if method in GPU_METHODS:
        decode_on = "device" if method == "streamdata-gpu" else "worker"
        ds = sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"], batch_size=cfg["batch"],
                           decode=sd.images.RandomResizedCrop(SIZE, decode_on=decode_on))
        return sd.loader(ds, num_workers=workers, device="cuda")
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

    import streamdata  # noqa: F401

    if cfg["method"] == "mosaic":
        _import_streaming()
    elif cfg["method"] in EXTERNAL:
        __import__(EXTERNAL[cfg["method"]])
    else:
        import webdataset  # noqa: F401
    cache = tempfile.TemporaryDirectory(prefix="sd-images-peer-cache-")
    cfg = {**cfg, "cache_dir": cache.name}
    cpu0, start = os.times(), time.perf_counter()
    loader = _loader(cfg)
    it = iter(loader)
    n = 0
    shape = None
    first: tuple[float, Any, int] | None = None  # after the first batch: time, this process's CPU, images
    for batch in it:
        images = batch["jpg"]
        assert images.dtype == torch.uint8, images.dtype
        shape = list(images.shape)
        n += images.shape[0]
        if first is None:
            if cfg["method"] in GPU_METHODS:
                torch.cuda.synchronize()
            first = (time.perf_counter(), os.times(), n)
    device = None
    if cfg["method"] in GPU_METHODS:
        torch.cuda.synchronize()  # the last batch's decode and copy are done
        device = torch.cuda.get_device_name()
    end = time.perf_counter()
    shutdown = getattr(it, "_shutdown_workers", None) or getattr(loader, "close", None)
    if shutdown is not None:
        shutdown()
    del it
    cpu1 = os.times()
    cache.cleanup()
    cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
           - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system)
    main = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    out = {"images": n, "seconds": end - start, "images_per_s": n / (end - start),
           "cpu_ms_per_image": 1e3 * cpu / max(n, 1), "main_cpu_ms_per_image": 1e3 * main / max(n, 1),
           "batch_shape": shape, **({"device": device} if device else {})}
    if first is not None and n > first[2]:  # the rate once running: start-up (CUDA, nvJPEG) left out
        t1, c1, n1 = first
        main1 = cpu1.user + cpu1.system - c1.user - c1.system
        out.update(first_batch_s=t1 - start, steady_images_per_s=(n - n1) / (end - t1),
                   steady_main_cpu_ms_per_image=1e3 * main1 / (n - n1))
    return out


def _child(cfg: dict, timeout: float, python: str | None = None, env_extra: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="sd-images-") as tmp:
        cfg_path, out_path = Path(tmp, "cfg.json"), Path(tmp, "out.json")
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   **(env_extra or {}))
        try:
            proc = subprocess.run([python or sys.executable, "-m", "benchmarks.images", "--run-one",
                                   str(cfg_path), str(out_path)], cwd=REPO, env=env, timeout=timeout,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_path.exists():
            return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}
        return json.loads(out_path.read_text())


# ---- the orchestrator ----------------------------------------------------------------------------

def _bodies(n_images: int, per_shard: int) -> list[bytes]:
    """The benchmark's tar shards: ``n_images`` photographs, ``per_shard`` to a shard."""
    from benchmarks.common import tar_bytes
    from benchmarks.photos import jpeg_photos

    photos = jpeg_photos(n_images, seed=0)
    return [tar_bytes({"__key__": f"{i:08d}", "jpg": photos[i], "cls": str(i % 10).encode()}
                      for i in range(s * per_shard, min(n_images, (s + 1) * per_shard)))
            for s in range(math.ceil(n_images / per_shard))]


def _upload(server: Any, n_images: int, per_shard: int) -> tuple[str, list[str], list[bytes]]:
    bodies = _bodies(n_images, per_shard)
    client = server.boto3_client()
    for s, body in enumerate(bodies):
        client.put_object(Bucket="bench", Key=f"img/train-{s:06d}.tar", Body=body)
    urls = [f"s3://bench/img/train-{s:06d}.tar" for s in range(len(bodies))]
    return f"s3://bench/img/train-{{000000..{len(bodies) - 1:06d}}}.tar", urls, bodies


def _write_local(root: Path, n_images: int, per_shard: int) -> tuple[str, list[str]]:
    """The same shards as files under ``root`` (``--gpu``: where the decode runs, not the network)."""
    bodies = _bodies(n_images, per_shard)
    urls = []
    for s, body in enumerate(bodies):
        urls.append(str(root / f"train-{s:06d}.tar"))
        Path(urls[-1]).write_bytes(body)
    return str(root / f"train-{{000000..{len(bodies) - 1:06d}}}.tar"), urls


def _prepare_peers(server: Any, args: argparse.Namespace, methods: list[str], bodies: list[bytes]) -> dict:
    """LitData's and Mosaic's copies of the same shards, each by its own writer, uploaded beside
    them (``lit/``, ``mds/``); ``{method: why}`` for each one that cannot be measured."""
    missing: dict[str, str] = {}
    client = server.boto3_client()
    for method in [m for m in methods if m in EXTERNAL]:
        if not args.peers_python:
            missing[method] = "no --peers-python given"
            continue
        if not Path(args.peers_python).exists():
            missing[method] = f"--peers-python {args.peers_python} does not exist"
            continue
        probe = _peer_call(args.peers_python, {"do": "probe", "method": method}, timeout=120)
        if "error" in probe:
            why = probe["error"]
            missing[method] = f"{EXTERNAL[method]} does not import under {args.peers_python}: {why}"
            continue
        print(f"{method}: {EXTERNAL[method]} {probe['version']} under {args.peers_python}", flush=True)
        with tempfile.TemporaryDirectory(prefix="sd-images-peer-") as tmp:
            tars = []
            for i, body in enumerate(bodies):
                tars.append(f"{tmp}/train-{i:06d}.tar")
                Path(tars[-1]).write_bytes(body)
            out = Path(tmp, "out")
            done = _peer_call(args.peers_python, {"do": "convert", "method": method, "tars": tars,
                                                  "out": str(out), "per_shard": args.per_shard,
                                                  "size_limit": max(len(b) for b in bodies) + (1 << 16)})
            if "error" in done:
                missing[method] = f"its conversion failed: {done['error']}"
                continue
            prefix = "lit" if method == "litdata" else "mds"
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                key = f"{prefix}/{path.relative_to(out)}"
                client.put_object(Bucket="bench", Key=key, Body=path.read_bytes())
    return missing


def _peer_cfg(method: str, options: dict) -> tuple[dict, dict]:
    """The peer's URL and client options (LitData) or its process's environment (Mosaic's boto3
    reads ``S3_ENDPOINT_URL``), pointed at the endpoint ``options`` name (the proxy's)."""
    env = {"AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
           "AWS_DEFAULT_REGION": options["client_kwargs"]["region_name"]}
    if method == "litdata":
        lit = {"endpoint_url": options["endpoint_url"], "region_name": env["AWS_DEFAULT_REGION"],
               "aws_access_key_id": options["key"], "aws_secret_access_key": options["secret"]}
        return {"peer_url": "s3://bench/lit", "peer_options": lit}, env
    return {"peer_url": "s3://bench/mds"}, {**env, "S3_ENDPOINT_URL": options["endpoint_url"]}


def micro(count: int = 200, rounds: int = 5) -> None:
    """Per-image CPU (best of ``rounds``, one thread, no loader) of: the fast path (libjpeg-turbo,
    and Pillow's draft), the PIL transform on a full decode (the peers'), today's ``decode=True``
    then the PIL transform; ``decode_on="device"``'s two halves (the worker's header read and box,
    and the device step run on the CPU: a full decode, crop, resize); and the copy of one result
    into a shared-memory batch row (the copy the fast path leaves: each sample is copied into its
    batch as it arrives)."""
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

    on_device = I.RandomResizedCrop(SIZE, decode_on="device").for_pass(0, 0)

    def device_worker(i: int, data: bytes) -> Any:
        return on_device.image(data, key=str(i))

    def device_step_on_cpu(i: int, data: bytes) -> Any:
        from streamdata.batch.collate import collate
        from streamdata.feed.images import finish

        return finish(collate([device_worker(i, data)]), "cpu")

    paths = {"fast (libjpeg-turbo)": fast_sj, "fast (Pillow draft)": fast_pillow,
             "PIL transform (peers)": peer, "decode=True + PIL map (today)": today,
             "decode_on=device: the worker's part": device_worker,
             "decode_on=device: its device step on the CPU": device_step_on_cpu}
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
        print(f"{name:46s} {ms:6.2f} ms/image  {ms / base:5.2f}x the peers' transform")
    print(f"{'copy into a batch row':46s} {copy_us / 1e3:6.3f} ms/image  ({one.numel()} bytes)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-one", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--peer-child", help=argparse.SUPPRESS)
    parser.add_argument("--peers-python", default=None,
                        help="a Python with litdata and mosaicml-streaming: measure them too")
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
    parser.add_argument("--gpu", action="store_true",
                        help="GPU decode against the CPU path, both fed to CUDA (0 ms unless --delays)")
    args = parser.parse_args(argv)
    if args.micro:
        micro()
        return
    if args.peer_child:
        print(json.dumps(_peer_child(json.loads(args.peer_child))))
        return
    if args.run_one:
        cfg = json.loads(Path(args.run_one[0]).read_text())
        Path(args.run_one[1]).write_text(json.dumps(run_one(cfg)))
        return
    if args.quick:  # one round at 0 ms; 512 images unless --images says otherwise
        args.rounds, args.delays = 1, "0"
        if args.images == parser.get_default("images"):
            args.images, args.per_shard = 512, 128
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu: not measured: no CUDA device here (torch.cuda.is_available() is False)")
            return
        args.methods = ",".join(GPU_METHODS)
        if args.delays == parser.get_default("delays"):
            args.delays = "0"
    methods = [m for m in args.methods.split(",") if m]
    delays = [float(d) for d in args.delays.split(",") if d]
    results: dict[tuple[str, float], list[dict]] = {}
    missing: dict[str, str] = {}
    if args.gpu and delays == [0.0]:  # no network between: the shards are local files
        with tempfile.TemporaryDirectory(prefix="sd-images-gpu-") as root:
            spec, urls = _write_local(Path(root), args.images, args.per_shard)
            _rounds(args, methods, [0.0], results, lambda d: ({}, spec, urls), missing)
    else:
        _remote(args, methods, delays, results, missing)
    _report(results, methods, delays, args.rounds, missing)
    if args.gpu:
        _report_gpu(results, delays, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{m}@{d:g}": v for (m, d), v in results.items()}, indent=1))


def _remote(args: argparse.Namespace, methods: list[str], delays: list[float], results: dict,
            missing: dict[str, str]) -> None:
    """Every method against the embedded S3 server, behind one latency proxy per delay."""
    from benchmarks.common import replace_in_options, upstream
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    with S3Server() as server:
        server.create_bucket("bench")
        spec, urls, bodies = _upload(server, args.images, args.per_shard)
        missing.update(_prepare_peers(server, args, methods, bodies))
        for m, why in missing.items():
            print(f"{m}: not measured: {why}", flush=True)
        proxies = {d: LatencyProxy(*upstream(server.endpoint_url), delay_s=d / 1000).__enter__()
                   for d in delays}
        try:
            _rounds(args, methods, delays, results,
                    lambda d: (replace_in_options(server.storage_options, server.endpoint_url,
                                                  proxies[d].url_for(server.endpoint_url)), spec, urls),
                    missing)
        finally:
            for proxy in proxies.values():
                proxy.__exit__(None, None, None)


def _rounds(args: argparse.Namespace, methods: list[str], delays: list[float], results: dict,
            source: Callable[[float], tuple[dict, str, list[str]]], missing: dict[str, str]) -> None:
    """Interleaved rounds: each method once per round and delay, in a fresh process, the order
    reversed every other round; ``source(delay)`` gives the storage options, spec and shard URLs."""
    run_methods = [m for m in methods if m not in missing]
    for r in range(args.rounds):
        for d in delays:
            options, spec, urls = source(d)
            order = run_methods if r % 2 == 0 else run_methods[::-1]  # interleaved, alternating
            for m in order:
                cfg = {"method": m, "spec": spec, "shard_urls": urls, "storage_options": options,
                       "workers": args.workers, "batch": args.batch}
                python, env = None, None
                if m in EXTERNAL:
                    peer, env = _peer_cfg(m, options)
                    cfg, python = {**cfg, **peer}, args.peers_python
                out = _child(cfg, timeout=600, python=python, env_extra=env)
                results.setdefault((m, d), []).append(out)
                print(f"round {r} delay {d:g} ms {m}: {out}", flush=True)


def _report(results: dict, methods: list[str], delays: list[float], rounds: int,
            missing: dict[str, str]) -> None:
    def med(values: list[float]) -> float:
        values = [v for v in values if v == v]
        return statistics.median(values) if values else float("nan")

    print(f"\n{'delay':>6} {'method':16} {'images/s':>9} {'CPU ms/img':>11} {'x peer img/s':>13} "
          f"{'x peer CPU':>11}")
    for d in delays:
        peer = [p for p in PEERS if (p, d) in results]
        for m in methods:
            if m in missing:
                print(f"{d:6g} {m:16} not measured: {missing[m]}")
                continue
            runs = results.get((m, d), [])
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(f"{d:6g} {m:16} {'failed: ' + str(runs[0].get('error') if runs else '-')}")
                continue
            rate, cpu = med([r["images_per_s"] for r in ok]), med([r["cpu_ms_per_image"] for r in ok])
            ratios = ""
            if peer and m not in PEERS:  # per-round ratios against the best peer of that round
                # (the fastest one for images/s, the cheapest one for CPU per image)
                rr, cr = [], []
                for i in range(rounds):
                    mine = runs[i] if i < len(runs) else {"error": 1}
                    theirs = [results[(p, d)][i] for p in peer if i < len(results[(p, d)])
                              and "error" not in results[(p, d)][i]]
                    if "error" in mine or not theirs:
                        continue
                    rr.append(mine["images_per_s"] / max(t["images_per_s"] for t in theirs))
                    cr.append(mine["cpu_ms_per_image"] / min(t["cpu_ms_per_image"] for t in theirs))
                rounds_ = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(rr, cr, strict=True))
                ratios = f"{med(rr):13.2f} {med(cr):11.2f}  rounds (img/s/CPU): {rounds_}"
            print(f"{d:6g} {m:16} {rate:9.0f} {cpu:11.2f} {ratios}")


def _report_gpu(results: dict, delays: list[float], rounds: int) -> None:
    """``--gpu``: the GPU decode over the CPU path, per round (interleaved), and the device."""
    for d in delays:
        gpu, cpu = results.get(("streamdata-gpu", d), []), results.get(("streamdata-cuda", d), [])
        pairs = [(g, c) for g, c in zip(gpu, cpu, strict=False) if "error" not in g and "error" not in c]
        if not pairs:
            print(f"{d:6g} ms gpu / cpu path: no round where both ran")
            continue
        rate = [g["images_per_s"] / c["images_per_s"] for g, c in pairs]
        cpu_ratio = [g["cpu_ms_per_image"] / c["cpu_ms_per_image"] for g, c in pairs]
        main_ratio = [g["main_cpu_ms_per_image"] / c["main_cpu_ms_per_image"] for g, c in pairs]
        med = statistics.median
        per_round = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(rate, cpu_ratio, strict=True))
        print(f"{d:6g} ms gpu / cpu path on {pairs[0][0].get('device', '?')}: images/s x{med(rate):.2f}, "
              f"CPU per image x{med(cpu_ratio):.2f} (main process x{med(main_ratio):.2f}); "
              f"{len(pairs)} of {rounds} rounds (img/s/CPU): {per_round}")
        steady = [(g, c) for g, c in pairs if "steady_images_per_s" in g and "steady_images_per_s" in c]
        if steady:
            for name, runs in (("gpu", [g for g, _ in steady]), ("cpu path", [c for _, c in steady])):
                first_s = med([r["first_batch_s"] for r in runs])
                print(f"{d:6g} ms {name:8}: first batch {first_s:.2f} s, then "
                      f"{med([r['steady_images_per_s'] for r in runs]):.0f} images/s, main process "
                      f"{med([r['steady_main_cpu_ms_per_image'] for r in runs]):.2f} ms CPU per image")
            rate = [g["steady_images_per_s"] / c["steady_images_per_s"] for g, c in steady]
            print(f"{d:6g} ms gpu / cpu path after the first batch: images/s x{med(rate):.2f}; rounds: "
                  + ", ".join(f"{r:.2f}" for r in rate))


if __name__ == "__main__":
    main()
