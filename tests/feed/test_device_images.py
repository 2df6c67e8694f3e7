"""sd.images' ``decode_on="device"`` path, every part but the GPU's decoder exercised on the CPU:
the worker's header read with the CPU path's box and flip (IMAGE-SEED), the EncodedBatch layout
gathered at collation, the device step's decode, crop, resize and flip (here with the CPU
decoder) against the CPU path, sd.loader with workers (every image once, the same crops across
runs and after a resume), and the errors: a truncated JPEG refused in the worker (or skipped and
counted), a corrupt one on the device named by key and URL, a refusing decoder's CPU fallback,
and a CUDA device without a decoder. The nvJPEG run is tests/feed/test_device_images_cuda.py."""

from __future__ import annotations

import io
import sys
import types
import warnings

import pytest
import torch
from PIL import Image

import streamdata as sd
from streamdata.batch.batches import batches
from streamdata.batch.collate import collate
from streamdata.batch.encoded import JPEG, PIXELS, EncodedBatch
from streamdata.feed import images as F
from streamdata.formats import images as I
from tests.formats.test_images import _encode, _image_shards, _picture, _psnr
from tests.helpers import doc_blocks


def _samples(n: int = 6, size: tuple[int, int] = (320, 240)) -> list[dict]:
    return [{"__key__": f"k{i}", "__url__": "s3://bkt/train-0.tar", "jpg": _encode(_picture(i, size))}
            for i in range(n)]


def test_the_worker_reads_the_header_and_draws_the_cpu_paths_box_and_flip():
    t = I.RandomResizedCrop(48, decode_on="device").for_pass(7, 2)
    flips = set()
    for sample in _samples(12, (200, 150)):
        got = t(sample)["jpg"]
        assert isinstance(got, I.EncodedImage) and got.data == sample["jpg"] and got.pixels is None
        rng = I.sample_rng(7, 2, I.sample_key(sample))
        box = t.box(200, 150, rng)
        assert got.box == box and got.size == (48, 48) and got.flip == (rng.random() < 0.5)
        assert (got.key, got.url) == (sample["__key__"], sample["__url__"])
        flips.add(got.flip)
    assert flips == {True, False}


@pytest.mark.parametrize("fmt,mode", [("PNG", None), ("WEBP", None), ("JPEG", "CMYK")])
def test_images_the_device_does_not_take_travel_as_the_cpu_paths_pixels(fmt, mode):
    sample = {"__key__": "k1", "__url__": "s3://bkt/a.tar", "png": _encode(_picture(4), fmt, mode)}
    cpu = I.RandomResizedCrop(40, field="png").for_pass(1, 0)
    dev = I.RandomResizedCrop(40, field="png", decode_on="device").for_pass(1, 0)
    got = dev(sample)["png"]
    assert got.data is None and torch.equal(got.pixels, cpu(sample)["png"])
    batch = collate([dev(sample), dev(sample)])["png"]
    assert batch.kinds.tolist() == [PIXELS, PIXELS]
    assert torch.equal(F.finish(batch, "cpu")[1], cpu(sample)["png"])


@pytest.mark.parametrize("how", ["collate", "batches"])
def test_a_batch_finished_on_the_cpu_is_the_cpu_paths(how):
    """The EncodedBatch layout, and the device step's output against the CPU path: the same box and
    flip, so equal where the CPU path decoded at full size, within 30 dB PSNR where it took a DCT
    scale (DCT-SCALE: the device decodes in full)."""
    samples = _samples(7)
    samples[3]["jpg"] = _encode(_picture(3), "PNG")  # one the worker finishes
    cpu = I.RandomResizedCrop(32).for_pass(0, 1)
    dev = I.RandomResizedCrop(32, decode_on="device").for_pass(0, 1)
    records = [dev(s) for s in samples]
    batch = collate(records) if how == "collate" else next(batches(records, 7))
    enc = batch["jpg"]
    assert isinstance(enc, EncodedBatch) and len(enc) == 7
    assert batch["__key__"] == [s["__key__"] for s in samples]
    assert enc.kinds.tolist() == [JPEG, JPEG, JPEG, PIXELS, JPEG, JPEG, JPEG]
    offsets = enc.offsets.tolist()
    for i in (0, 6):
        assert bytes(enc.data[offsets[i]:offsets[i + 1]].numpy()) == samples[i]["jpg"]
    assert enc.keys == [s["__key__"] for s in samples] and enc.sizes.tolist() == [[32, 32]] * 7
    out = sd.finish_images(batch, torch.device("cpu"))
    images = out["jpg"]
    assert images.shape == (7, 3, 32, 32) and images.dtype == torch.uint8
    exact = 0
    for i, sample in enumerate(samples):
        want = cpu(sample)["jpg"]
        assert _psnr(images[i], want.numpy()) >= 30, i
        exact += torch.equal(images[i], want)
    assert exact >= 2  # the PNG, and the crops the CPU path decoded at full size


def test_a_truncated_jpeg_is_refused_in_the_worker_naming_its_sample():
    sample = _samples(1)[0]
    sample["jpg"] = sample["jpg"][: len(sample["jpg"]) // 2]
    with pytest.raises(sd.DecodeError) as info:
        I.RandomResizedCrop(32, decode_on="device")(sample)
    assert info.value.key == "k0" and "train-0.tar" in str(info.value) and "truncated" in str(info.value)
    with pytest.raises(sd.DecodeError):
        I.RandomResizedCrop(32, decode_on="device")({**sample, "jpg": b"\xff\xd8\xff" + b"\x00" * 50})


def _corrupt_scan(data: bytes) -> bytes:
    """A JPEG whose header reads and whose end marker is there, but whose scan does not decode."""
    sos = data.index(b"\xff\xda")
    return data[: sos + 20] + b"\xff\xd0" * 200 + data[-2:]


def test_a_jpeg_the_device_cannot_decode_is_a_decode_error_naming_its_sample():
    samples = _samples(3)
    samples[1]["jpg"] = _corrupt_scan(samples[1]["jpg"])
    dev = I.RandomResizedCrop(32, decode_on="device")
    batch = collate([dev(s) for s in samples])  # the header reads: the worker lets it through
    with pytest.raises(sd.DecodeError) as info:
        sd.finish_images(batch, torch.device("cpu"))
    assert info.value.key == "k1" and info.value.url == "s3://bkt/train-0.tar"
    assert "'k1'" in str(info.value) and "on cpu" in str(info.value)


def test_an_image_the_device_decoder_refuses_is_decoded_on_the_cpu_and_counted():
    """A device decoder (registered by device type) that fails the batch and refuses one image: the
    others come from it, the refused one from the CPU decoder, counted."""
    calls = []

    def picky(datas, device):
        calls.append(len(datas))
        if len(datas) > 1:
            raise RuntimeError("the batched call fails")
        out = F.decode_on_cpu(datas, device)
        return [None] if bytes(datas[0].numpy()) == refused else out

    samples = _samples(4)
    refused = samples[2]["jpg"]
    dev = I.RandomResizedCrop(24, decode_on="device")
    batch = collate([dev(s) for s in samples])
    before = F.counts()["cpu_fallback"]
    F.register_decoder("cpu", picky)
    try:
        got = sd.finish_images(batch, torch.device("cpu"))["jpg"]
    finally:
        F.register_decoder("cpu", None)
    assert calls == [4, 1, 1, 1, 1] and F.counts()["cpu_fallback"] == before + 1
    assert torch.equal(got, sd.finish_images(batch, torch.device("cpu"))["jpg"])


def test_a_cuda_device_without_a_decoder_says_what_to_install():
    for name in ("torchvision.io", "nvidia.nvimgcodec"):
        try:
            __import__(name)
        except Exception:
            continue
        pytest.skip(f"{name} imports here")
    with pytest.raises(sd.BackendMissingError, match="torchvision.*nvImageCodec"):
        F.decoder_for(torch.device("cuda"))


def test_a_torchvision_whose_image_library_does_not_load_falls_back_to_importing_it(tmp_path, monkeypatch):
    """The device step loads torchvision's image library alone (its import is seconds); a library
    that does not load (another torch's build) is passed over, and the import's failure is what
    the user is told."""
    import importlib.machinery

    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    (package / f"image{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a library")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = types.ModuleType("torchvision.io")  # as where a torchvision was imported before
    imported.decode_jpeg, imported.ImageReadMode = object(), object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision.io", imported)
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)  # an imported torchvision.io would be used as it is
    assert F._nvjpeg_op() is None
    try:
        import nvidia.nvimgcodec  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        F._cuda_decoder.cache_clear()
        with pytest.raises(sd.BackendMissingError, match="built for another torch"):
            F.decoder_for(torch.device("cuda"))


def test_a_batch_of_several_output_sizes_is_a_decode_error():
    dev = I.CenterCrop(64, decode_on="device")  # a plain crop: smaller images give smaller crops
    records = [dev({"__key__": "a", "jpg": _encode(_picture(1, (96, 96)))}),
               dev({"__key__": "b", "jpg": _encode(_picture(2, (40, 40)))})]
    with pytest.raises(sd.DecodeError, match="comes out"):
        collate(records)
    with pytest.raises(sd.SpecError):
        I.Resize(32, decode_on="gpu")


# ---- through sd.loader's workers (the loopback S3 server) -----------------------------------------

@pytest.fixture
def device_bucket(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = _image_shards(fs, f"{bucket}/img", [6, 6, 6, 6])
    spec = f"s3://{bucket}/img/shard-{{000..003}}.tar"
    sd.build_index(spec, server.storage_options, progress=False)  # an exact epoch: an exact resume
    return server, spec, keys


def _loader(server, spec: str, decode_on: str, device: str | None = "cpu", **kw) -> sd.Loader:
    ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=3, shuffle=True, seed=4,
                       decode=sd.images.RandomResizedCrop(32, decode_on=decode_on), **kw)
    return sd.loader(ds, num_workers=2, device=device)


def _by_key(loader: sd.Loader, stop: int | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for step, batch in enumerate(loader, 1):
        assert isinstance(batch["jpg"], torch.Tensor) and batch["jpg"].dtype == torch.uint8
        for key, image in zip(batch["__key__"], batch["jpg"], strict=True):
            assert key not in out, key
            out[key] = image.clone()
        if step == stop:
            break
    return out


def test_sd_loader_finishes_device_batches_every_image_once_and_resumes(device_bucket):
    server, spec, keys = device_bucket
    with _loader(server, spec, "worker") as cpu_loader:
        cpu_loader.set_epoch(1)
        want = _by_key(cpu_loader)
    with _loader(server, spec, "device") as whole:
        whole.set_epoch(1)
        full = _by_key(whole)
    assert sorted(full) == keys == sorted(want)
    # the same boxes and flips; the shards' images are under 3 x 32 px high, so the CPU path
    # decoded them at full size too (no DCT-SCALE): the same pixels
    assert all(torch.equal(full[k], want[k]) for k in keys)
    with _loader(server, spec, "device") as first:
        first.set_epoch(1)
        seen = _by_key(first, stop=3)
        state = first.state_dict()
    with warnings.catch_warnings():  # "cuda" on a machine without it: the CPU finishes (said once)
        warnings.simplefilter("ignore", RuntimeWarning)
        no_cuda = "cuda" if not torch.cuda.is_available() else "cpu"
        with _loader(server, spec, "device", device=no_cuda) as second:
            second.load_state_dict(state)
            rest = _by_key(second)
    assert sorted([*seen, *rest]) == keys and not set(seen) & set(rest)
    assert all(torch.equal(full[k], v) for k, v in {**seen, **rest}.items())  # the same crops


def test_a_truncated_jpeg_in_a_shard_is_skipped_and_counted(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = _image_shards(fs, f"{bucket}/img", [4, 4], corrupt={"img00005"})
    spec = f"s3://{bucket}/img/shard-{{000..001}}.tar"
    with _loader(server, spec, "device", on_error="skip") as loader:
        got = _by_key(loader)
        assert loader.skipped["decode"] == 1 and sum(loader.skipped.values()) == 1
    assert sorted(got) == [k for k in keys if k != "img00005"]
    without_device = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=4,
                                   decode=sd.images.RandomResizedCrop(16, decode_on="device"))
    with pytest.raises(sd.DecodeError) as info:
        list(without_device)
    assert info.value.key == "img00005" and info.value.url.endswith("shard-001.tar")


def test_pillow_reads_the_header_without_simplejpeg(monkeypatch):
    data = _encode(_picture(2, (120, 90)))
    monkeypatch.setattr(I, "_simplejpeg", lambda: None)
    assert I.jpeg_layout(data)[:2] == (120, 90) == Image.open(io.BytesIO(data)).size
    assert I.jpeg_layout(b"not a jpeg") is None


def test_the_docs_gpu_recipe_runs(s3_bucket, monkeypatch):
    """docs/images.md's decode_on="device" recipe as written (its bucket pointed at the test
    server's): on this machine device="cuda" finishes on the CPU; two epochs, every image each,
    uint8 [n, 3, 224, 224] batches with int64 labels."""

    import s3fs

    from tests.helpers import s3_environment

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = _image_shards(fs, f"{bucket}/imagenet", [3, 3, 3, 3])
    for i in range(4):
        fs.mv(f"{bucket}/imagenet/shard-{i:03d}.tar", f"{bucket}/imagenet/train-{i:06d}.tar")
    code = doc_blocks("docs/images.md", '## Decoding on the GPU: `decode_on="device"`')[0].replace(
        "s3://bkt/", f"s3://{bucket}/")
    s3_environment(monkeypatch, server.storage_options)
    seen: list[tuple] = []
    namespace = {"train_step": lambda images, labels: seen.append((images.clone(), labels.clone()))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no CUDA here: said once
        exec(compile(code, "docs/images.md", "exec"), namespace)  # noqa: S102 - the page's recipe, run
    assert sum(len(labels) for _, labels in seen) == 2 * len(keys)
    assert all(images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, 224, 224) for images, _ in seen)
    assert all(labels.dtype == torch.int64 for _, labels in seen)


def test_a_hugging_face_image_column_decoded_on_the_device(s3_bucket):
    """A Parquet ``struct<bytes, path>`` column with ``decoders={"image": ...(decode_on="device")}``
    or the same transform as ``decode=`` (found by type):
    one EncodedBatch per batch, finished by sd.loader's device step as the CPU path crops it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    images = [_encode(_picture(i, (80, 60)), "PNG" if i % 3 == 0 else "JPEG") for i in range(10)]
    column = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)],
                      type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    with fs.open(f"{bucket}/hf/train-0.parquet", "wb") as f:
        pq.write_table(pa.table({"image": column, "label": pa.array(range(10), pa.int64())}), f,
                       row_group_size=5)
    url = f"s3://{bucket}/hf/train-0.parquet"

    def crops(decode_on: str) -> dict:
        return {"image": sd.images.RandomResizedCrop(24, decode_on=decode_on)}

    def run(decode_on: str, by_type: bool = False) -> torch.Tensor:
        how = {"decode": crops(decode_on)["image"]} if by_type else {"decoders": crops(decode_on)}
        ds = sd.ParquetDataset(url, storage_options=server.storage_options, batch_size=5, **how)
        with sd.loader(ds, num_workers=1, device="cpu") as loader:
            got = list(loader)
        assert torch.cat([b["label"] for b in got]).tolist() == list(range(10))
        return torch.cat([b["image"] for b in got])

    assert torch.equal(run("device"), run("worker"))
    assert torch.equal(run("device", by_type=True), run("worker"))  # decode=: the column found by type
    raw = sd.ParquetDataset(url, storage_options=server.storage_options, batch_size=5,
                            decoders=crops("device"))
    first = next(iter(raw))["image"]
    assert isinstance(first, EncodedBatch) and first.keys == [f"image[{i}]" for i in range(5)]
