"""The fast image path (streamdata/formats/images.py): shape and dtype, the crop distribution,
the PSNR bound against a full decode then resize, IMAGE-SEED (crops reproduce across runs, worlds
and resumes), PNG / WebP / grayscale / CMYK, a Hugging Face image column in Parquet by ``decoders=``, decode
threads, and corrupt images as DecodeErrors naming key and URL (or counted skips)."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

import streamdata as sd
from streamdata.formats import images as I
from tests.helpers import check_one_corrupt, doc_blocks, s3_environment, tar_bytes


def _picture(seed: int, size: tuple[int, int] = (160, 120)) -> np.ndarray:
    """A smooth synthetic picture (gradients and discs), ``H x W x 3``."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], axis=2)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(5, min(w, h) / 2)
        out[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    return out.clip(0, 255).astype(np.uint8)


def _encode(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **kw) -> bytes:
    image = Image.fromarray(array)
    if mode is not None:
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}) | kw)
    return out.getvalue()


def _psnr(a: torch.Tensor, b: np.ndarray) -> float:
    mse = float(((a.numpy().astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 10 * math.log10(255 ** 2 / max(mse, 1e-10))


def _reference(data: bytes, t: I.ImageTransform, key: str) -> np.ndarray:
    """Full decode, then Pillow's antialiased bilinear resize of the same crop, then the flip."""
    rng = I.sample_rng(t._seed, t._epoch, key)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    x, y, w, h = t.box(full.width, full.height, rng)
    oh, ow = t.out_size((x, y, w, h))
    flip = t.flip and rng.random() < 0.5
    out = full.resize((ow, oh), Image.BILINEAR, box=(x, y, x + w, y + h))
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out).transpose(2, 0, 1)


@pytest.fixture(params=["simplejpeg", "pillow"])
def jpeg_path(request, monkeypatch):
    """Both JPEG paths: libjpeg-turbo's scaled decode, and Pillow's draft."""
    if request.param == "simplejpeg":
        pytest.importorskip("simplejpeg")
    else:
        monkeypatch.setattr(I, "_simplejpeg", lambda: None)
    return request.param


@pytest.mark.parametrize("transform, shape", [
    (I.RandomResizedCrop(64), (3, 64, 64)), (I.RandomResizedCrop((48, 80)), (3, 48, 80)),
    (I.CenterCrop(64, resize=72), (3, 64, 64)), (I.CenterCrop(50), (3, 50, 50)),
    (I.Resize(60), (3, 60, 80)), (I.Resize((30, 40)), (3, 30, 40))])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_shape_and_dtype(transform, shape, fmt, jpeg_path):
    data = _encode(_picture(1), fmt)
    out = transform.for_pass(0, 0).image(data, key="k")
    assert out.dtype == torch.uint8 and tuple(out.shape) == shape and out.is_contiguous()


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGBA", "P"])
def test_other_colour_modes_come_out_rgb(mode, jpeg_path):
    fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
    data = _encode(_picture(2), fmt, mode)
    t = I.RandomResizedCrop(32, flip=False)
    out = t.image(data, key="k")
    assert tuple(out.shape) == (3, 32, 32) and out.dtype == torch.uint8
    assert _psnr(out, _reference(data, t, "k")) >= 30


def test_the_crop_is_torchvisions():
    """Area within ``scale`` and aspect within ``ratio`` on the tries; the clamped centre crop after
    ten failed tries (an image far wider than ``ratio`` allows)."""
    rng = random.Random(0)
    areas, aspects = [], []
    for _ in range(2000):
        x, y, w, h = I.random_resized_box(500, 375, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= x and x + w <= 500 and 0 <= y and y + h <= 375
        areas.append(w * h / (500 * 375))
        aspects.append(w / h)
    assert min(areas) >= 0.075 and max(areas) <= 1.0 and 0.38 < float(np.mean(areas)) < 0.5
    assert min(aspects) >= 0.74 and max(aspects) <= 1.35
    assert I.random_resized_box(1000, 10, (0.5, 1.0), (3 / 4, 4 / 3), random.Random(1)) == (493, 0, 13, 10)
    assert I.random_resized_box(10, 1000, (0.5, 1.0), (3 / 4, 4 / 3), random.Random(1)) == (0, 493, 10, 13)


def test_psnr_against_a_full_decode_then_resize(jpeg_path):
    """Real photographs (scikit-image's), ImageNet-sized and three times larger (where the DCT
    scaled decode is used): at least 30 dB against Pillow's full decode and resize."""
    skdata = pytest.importorskip("skimage.data")
    photos = [skdata.astronaut(), skdata.chelsea(), skdata.coffee(), skdata.rocket()]
    worst = math.inf
    scaled = 0
    for i, photo in enumerate(photos):
        for size in ((500, 375), (375, 500), (1500, 1125)):
            data = _encode(np.asarray(Image.fromarray(photo).resize(size, Image.BILINEAR)))
            for epoch in range(3):
                t = I.RandomResizedCrop(224).for_pass(7, epoch)
                box = t.box(*size, I.sample_rng(7, epoch, f"{i}"))
                scaled += I._dct_factor(box, 224, 224) > 1
                worst = min(worst, _psnr(t.image(data, key=f"{i}"), _reference(data, t, f"{i}")))
    assert scaled > 0  # the scaled decode was measured too
    assert worst >= 30, worst


def test_seeded_by_seed_epoch_and_key():
    data = _encode(_picture(3, (300, 200)))
    t = I.RandomResizedCrop(48)
    a = t.for_pass(1, 0).image(data, key="a")
    assert torch.equal(a, t.for_pass(1, 0).image(data, key="a"))
    assert not torch.equal(a, t.for_pass(1, 1).image(data, key="a"))
    assert not torch.equal(a, t.for_pass(2, 0).image(data, key="a"))
    assert not torch.equal(a, t.for_pass(1, 0).image(data, key="b"))
    own = I.RandomResizedCrop(48, seed=1)  # its own seed wins over the dataset's
    assert torch.equal(own.for_pass(99, 0).image(data, key="a"), a)
    # the key is the shard's name and __key__: the same from another endpoint, bytes or text
    assert I.sample_key({"__key__": b"k", "__url__": b"s3://bkt/a/train-1.tar"}) == \
        I.sample_key({"__key__": "k", "__url__": "http://127.0.0.1:9000/bkt/a/train-1.tar"})
    assert I.sample_key({"__key__": "k", "__url__": "s3://bkt/train-1.tar"}) != \
        I.sample_key({"__key__": "k", "__url__": "s3://bkt/train-2.tar"})
    # a bare value (a Parquet cell) is keyed by its bytes
    assert torch.equal(t.image({"bytes": data, "path": "x.jpg"}), t.image(data))


def test_an_already_decoded_image_takes_the_same_crop():
    """``map=`` after ``decode=True``: the ``[3, H, W]`` tensor is cropped the same way (resampled
    from the full image: equal to the bytes path up to rounding)."""
    data = _encode(_picture(4, (200, 150)))
    t = I.RandomResizedCrop(40).for_pass(0, 3)
    decoded = sd.TarDataset.__mro__[0]  # (the class only; decode=True's value is built below)
    assert decoded is sd.TarDataset
    full = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1).copy())
    sample = {"__key__": "k", "__url__": "s3://b/shard-0.tar", "jpg": full, "cls": 1}
    from_array = t(sample)["jpg"]
    from_bytes = t({**sample, "jpg": data})["jpg"]
    assert from_array.shape == from_bytes.shape == (3, 40, 40)
    assert _psnr(from_array, from_bytes.numpy()) >= 30


def test_corrupt_and_truncated_images_are_decode_errors():
    good = _encode(_picture(5))
    t = I.RandomResizedCrop(32)
    for bad in (good[: len(good) // 2], b"\xff\xd8\xff" + b"\x00" * 100, b"not an image", b""):
        sample = {"__key__": "s7", "__url__": "s3://bkt/train-3.tar", "jpg": bad}
        with pytest.raises(sd.DecodeError) as info:
            t(sample)
        assert info.value.key == "s7" and info.value.url == "s3://bkt/train-3.tar"
        assert "s7" in str(info.value) and "train-3.tar" in str(info.value)


def test_bad_arguments_are_spec_errors():
    for make in (lambda: I.RandomResizedCrop(0), lambda: I.RandomResizedCrop(32, scale=(0.9, 0.1)),
                 lambda: I.CenterCrop(32, resize=0), lambda: I.Resize(-1)):
        with pytest.raises(sd.SpecError):
            make()


# ---- through the datasets (the loopback S3 server) ------------------------------------------------

def _image_shards(fs, prefix: str, counts: list[int], corrupt: set[str] = frozenset()) -> list[str]:
    keys, n = [], 0
    for s, count in enumerate(counts):
        samples = []
        for _ in range(count):
            key = f"img{n:05d}"
            data = _encode(_picture(n, (96 + 8 * (n % 5), 72 + 4 * (n % 3))))
            samples.append({"__key__": key, "jpg": data[: len(data) // 3] if key in corrupt else data,
                            "cls": str(n % 10).encode()})
            keys.append(key)
            n += 1
        fs.pipe_file(f"{prefix}/shard-{s:03d}.tar", tar_bytes(samples))
    return keys


@pytest.fixture
def image_bucket(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    return server, bucket, fs


def _by_key(loader) -> dict[str, torch.Tensor]:
    out = {}
    for batch in loader:
        for key, image in zip(batch["__key__"], batch["jpg"], strict=True):
            assert key not in out, key
            out[key] = image.clone()
    return out


def test_tar_dataset_every_image_once_seeded_across_runs_and_threads(image_bucket):
    server, bucket, fs = image_bucket
    keys = _image_shards(fs, f"{bucket}/img", [7, 5, 9, 3])
    spec = f"s3://{bucket}/img/shard-{{000..003}}.tar"

    def run(workers: int, threads: int = 1, **kw) -> dict[str, torch.Tensor]:
        ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=4, shuffle=True, seed=5,
                           decode=sd.images.RandomResizedCrop(32), decode_threads=threads, **kw)
        with sd.loader(ds, num_workers=workers) as loader:
            got = _by_key(loader)
        assert sorted(got) == keys  # every image exactly once
        assert all(v.shape == (3, 32, 32) and v.dtype == torch.uint8 for v in got.values())
        return got

    first = run(2)
    for other in (run(2), run(0), run(1, threads=2)):  # another run, world, thread count: the same crops
        assert all(torch.equal(first[k], other[k]) for k in keys)
    # map= over raw bytes gives the same crops as decode=
    ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=4, seed=5, decode=False,
                       map=sd.images.RandomResizedCrop(32))
    with sd.loader(ds, num_workers=0) as loader:
        mapped = _by_key(loader)
    assert all(torch.equal(first[k], mapped[k]) for k in keys)


def test_seeded_crops_after_a_resume(image_bucket):
    """sd.loader's state mid-epoch, loaded by a fresh loader: the rest of the epoch, each image
    once, with the crops the uninterrupted epoch gave them; the next epoch's crops differ."""
    server, bucket, fs = image_bucket
    keys = _image_shards(fs, f"{bucket}/img", [6, 6, 6, 6])
    spec = f"s3://{bucket}/img/shard-{{000..003}}.tar"
    sd.build_index(spec, server.storage_options, progress=False)  # an exact epoch: an exact resume

    def loader():
        ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=3, shuffle=True, seed=2,
                           decode=sd.images.RandomResizedCrop(24))
        return sd.loader(ds, num_workers=2)

    with loader() as whole:
        whole.set_epoch(1)
        full = _by_key(whole)
        whole.set_epoch(2)
        nxt = _by_key(whole)
    assert sorted(full) == keys and sum(not torch.equal(full[k], nxt[k]) for k in keys) > len(keys) // 2
    with loader() as first:
        first.set_epoch(1)
        seen: dict[str, torch.Tensor] = {}
        for step, batch in enumerate(first, 1):
            seen.update({k: v.clone() for k, v in zip(batch["__key__"], batch["jpg"], strict=True)})
            if step == 3:
                state = first.state_dict()
                break
    with loader() as second:
        second.load_state_dict(state)
        rest = _by_key(second)
    assert sorted([*seen, *rest]) == keys and not set(seen) & set(rest)
    assert all(torch.equal(full[k], v) for k, v in {**seen, **rest}.items())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_corrupt_image_in_a_shard(image_bucket, policy, threads):
    server, bucket, fs = image_bucket
    keys = _image_shards(fs, f"{bucket}/img", [4, 4], corrupt={"img00005"})
    ds = sd.TarDataset(f"s3://{bucket}/img/shard-{{000..001}}.tar", storage_options=server.storage_options,
                       batch_size=2, decode=sd.images.RandomResizedCrop(16), on_error=policy,
                       decode_threads=threads)
    check_one_corrupt(ds, policy, keys, "img00005", sd.DecodeError, "shard-001.tar", "decode")


def test_hugging_face_image_column_in_parquet(image_bucket):
    """A ``struct<bytes: binary, path: string>`` column as Hugging Face datasets write it, decoded
    through the same path by a ``decoders=`` entry: a uint8 batch, seeded by the row's key (the
    object's name, row group and row; tests/datasets/test_hf_image_columns.py has ``decode=``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    server, bucket, fs = image_bucket
    images = [_encode(_picture(i, (80, 60)), "PNG" if i % 3 == 0 else "JPEG") for i in range(10)]
    column = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)],
                      type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": column, "label": pa.array(range(10), pa.int64())})
    with fs.open(f"{bucket}/hf/train-0.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=5)
    t = sd.images.RandomResizedCrop(24)
    ds = sd.ParquetDataset(f"s3://{bucket}/hf/train-0.parquet", storage_options=server.storage_options,
                           batch_size=5, decoders={"image": t})
    batches = list(ds)
    got = torch.cat([b["image"] for b in batches])
    assert got.shape == (10, 3, 24, 24) and got.dtype == torch.uint8
    assert torch.cat([b["label"] for b in batches]).tolist() == list(range(10))
    bound = t.for_pass(0, 0)
    keys = [f"train-0.parquet\x00row group {i // 5}\x00{i % 5}" for i in range(10)]
    assert all(torch.equal(got[i], bound.image(images[i], key=keys[i])) for i in range(10))
    with pytest.raises(sd.SpecError):
        sd.ParquetDataset(f"s3://{bucket}/hf/train-0.parquet", storage_options=server.storage_options,
                          decode_threads=2)


def test_the_docs_recipe_runs(image_bucket, monkeypatch):
    """docs/images.md's recipe as written (its bucket pointed at the test server's): two epochs,
    as many images as the shards hold in each, uint8 [n, 3, 224, 224] batches with int64 labels."""

    server, bucket, fs = image_bucket
    keys = _image_shards(fs, f"{bucket}/imagenet", [5, 5, 5, 5])
    for i in range(4):
        fs.mv(f"{bucket}/imagenet/shard-{i:03d}.tar", f"{bucket}/imagenet/train-{i:06d}.tar")
    code = doc_blocks("docs/images.md", "## Recipe")[0].replace("s3://bkt/", f"s3://{bucket}/")
    opts = server.storage_options
    s3_environment(monkeypatch, opts)
    seen: list[tuple] = []
    namespace = {"train_step": lambda images, labels: seen.append((images.clone(), labels.clone()))}
    exec(compile(code, "docs/images.md", "exec"), namespace)  # noqa: S102 - the page's recipe, run
    assert sum(len(labels) for _, labels in seen) == 2 * len(keys)
    assert all(images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, 224, 224) for images, _ in seen)
    assert all(labels.dtype == torch.int64 for _, labels in seen)
