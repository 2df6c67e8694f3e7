"""Hugging Face image columns in Parquet and Arrow decoded by their type (``decode=``): files
written by ``datasets`` itself (tests/data/README.md) read from the loopback S3 server; the
row-key seeding (IMAGE-SEED) against the tar path's, across worlds and a resume; ``decoders=``
winning; corrupt and path-only cells as DecodeErrors naming column, row, unit and URL, or
dropped rows counted under ``on_error="skip"``; the docs recipe."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import streamdata as sd
from streamdata.batch.tables import DROPPED, TensorOptions, to_rows, to_tensors
from streamdata.formats.image_columns import RowKeys, image_columns, with_row_keys
from streamdata.formats.images import sample_key
from tests.helpers import doc_blocks, rank_batches, s3_environment, tar_bytes

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
CELL = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
HF_META = {b"huggingface": json.dumps({"info": {"features": {
    "image": {"_type": "Image"}, "label": {"dtype": "int64", "_type": "Value"}}}}).encode()}


def _png(i: int, size: tuple[int, int] = (40, 30)) -> bytes:
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, (37 * i) % 256)], axis=2).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "PNG")
    return out.getvalue()


def _hf_table(images: list[bytes]) -> pa.Table:
    cells = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)], CELL)
    table = pa.table({"image": cells, "label": pa.array(range(len(images)), pa.int64())})
    return table.replace_schema_metadata(HF_META)


@pytest.fixture
def bucket(s3_bucket):
    import s3fs

    server, name = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    for f in ("hf_images.parquet", "hf_images.arrow"):
        fs.put_file(str(DATA / f), f"{name}/hub/{f}")
    return server, name, fs


def _write(fs, path: str, table: pa.Table, row_group_size: int) -> None:
    with fs.open(path, "wb") as f:
        pq.write_table(table, f, row_group_size=row_group_size)


def _cells(table: pa.Table) -> list[bytes]:
    return [c["bytes"] for c in table.column("image").to_pylist()]


# ---- the files datasets writes ------------------------------------------------------------


@pytest.mark.parametrize("name, unit", [("hf_images.parquet", "row group {g}"),
                                        ("hf_images.arrow", "stream")])
def test_datasets_files_decode_by_type(bucket, name, unit, caplog):
    """The real files: the column found by type, uint8 [n, 3, 32, 32] under its own name, each
    crop the one the row's key gives (the same image twice: two crops), labels in order."""
    server, b, _ = bucket
    cls = sd.ParquetDataset if name.endswith(".parquet") else sd.ArrowDataset
    t = sd.images.RandomResizedCrop(32)
    ds = cls(f"s3://{b}/hub/{name}", storage_options=server.storage_options, decode=t, batch_size=3, seed=4)
    batches = list(ds)
    assert [sorted(x) for x in batches] == [["image", "label"]] * 3
    got = torch.cat([x["image"] for x in batches])
    assert got.shape == (8, 3, 32, 32) and got.dtype == torch.uint8
    assert torch.cat([x["label"] for x in batches]).tolist() == list(range(8))
    source = pq.read_table(DATA / "hf_images.parquet")
    assert image_columns(source.schema) == ["image"]
    cells, bound = _cells(source), t.for_pass(4, 0)
    for i in range(8):
        g, r = (i // 4, i % 4) if unit != "stream" else (0, i)
        key = sample_key({"__key__": f"{unit.format(g=g)}\x00{r}", "__url__": name})
        assert torch.equal(got[i], bound.image(cells[i], key=key)), i
    assert cells[0] == cells[6] and not torch.equal(got[0], got[6])
    rows = list(cls(f"s3://{b}/hub/{name}", storage_options=server.storage_options, decode=t, seed=4))
    assert all(torch.equal(row["image"], got[i]) for i, row in enumerate(rows))  # batch_size=None: the same
    with caplog.at_level("INFO", logger="streamdata"):
        ds = cls(f"s3://{b}/hub/{name}", storage_options=server.storage_options, batch_size=8)
    plain, = list(ds)
    assert sorted(plain) == ["image.bytes", "image.path", "label"] and plain["image.bytes"] == cells
    if unit == "stream":  # an IPC stream's schema is known only once read
        assert ds.image_columns is None
    else:  # found in the footer: the constructor says how to decode them
        assert ds.image_columns == ["image"] and "decode=sd.images.RandomResizedCrop" in caplog.text


def test_decoders_win_and_other_image_shapes(bucket):
    """``decoders=`` over ``decode=`` for its column; field order swapped, large types, a plain
    binary column the metadata marks; a struct that only looks alike stays flattened."""
    server, b, fs = bucket
    images = [_png(i) for i in range(6)]
    swapped = pa.struct([("path", pa.large_string()), ("bytes", pa.large_binary())])
    table = pa.table({
        "image": pa.array([{"bytes": x, "path": None} for x in images], CELL),
        "thumb": pa.array([{"path": "p", "bytes": x} for x in images], swapped),
        "raw": pa.array(images, pa.binary()),
        "other": pa.array([{"bytes": x, "size": 1} for x in images],
                          pa.struct([("bytes", pa.binary()), ("size", pa.int64())])),
    }).replace_schema_metadata({b"huggingface": json.dumps(
        {"info": {"features": {"raw": {"_type": "Image"}, "image": {"_type": "Image"}}}}).encode()})
    _write(fs, f"{b}/mixed/m.parquet", table, 3)
    assert image_columns(table.schema) == ["image", "thumb", "raw"]
    ds = sd.ParquetDataset(f"s3://{b}/mixed/m.parquet", storage_options=server.storage_options, batch_size=6,
                           decode=sd.images.RandomResizedCrop(16),
                           decoders={"image": sd.images.CenterCrop(8)})
    batch, = list(ds)
    assert batch["image"].shape == (6, 3, 8, 8)  # decoders= wins
    assert batch["thumb"].shape == batch["raw"].shape == (6, 3, 16, 16)
    assert batch["other.bytes"] == images and batch["other.size"].tolist() == [1] * 6
    # a row's image columns share its key, as a tar sample's image fields do: an image and its
    # mask keep the same crop
    assert torch.equal(batch["thumb"], batch["raw"])
    # a decode= function gets the encoded bytes; decoders= still takes any column
    ds = sd.ParquetDataset(f"s3://{b}/mixed/m.parquet", storage_options=server.storage_options, batch_size=6,
                           columns=["raw", "other"], decode=len, decoders={"other": lambda c: c["size"] * 2})
    batch, = list(ds)
    assert batch["raw"] == [len(x) for x in images] and batch["other"] == [2] * 6
    for bad in (True, "pil", 3):
        with pytest.raises(sd.SpecError, match="decode="):
            sd.ParquetDataset(f"s3://{b}/mixed/m.parquet", storage_options=server.storage_options, decode=bad)


# ---- seeding (IMAGE-SEED) ------------------------------------------------------------------


def _coordinates(size: int = 128) -> bytes:
    """A PNG whose red is x and green is y: a crop's place and flip can be read off its pixels."""
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), np.zeros_like(x)], axis=2).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "PNG")
    return out.getvalue()


def _boxes(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each crop's area (a fraction of the image) and whether it was flipped."""
    red, green = images[:, 0].double() / 255, images[:, 1].double() / 255
    width = (red[:, :, -1] - red[:, :, 0]).mean(1).abs()
    height = (green[:, -1, :] - green[:, 0, :]).mean(1)
    flipped = (red[:, :, -1] < red[:, :, 0]).double().mean(1) > 0.5
    return (width * height).numpy(), flipped.numpy()


def test_crop_distribution_matches_the_tar_path(bucket):
    """The same image 160 times, through a tar shard and through a Parquet file, the same
    transform and seed: crops as varied on both paths (areas and flips alike), none keyed by
    the bytes alone."""
    server, b, fs = bucket
    data, n = _coordinates(), 160
    fs.pipe_file(f"{b}/same/s-0.tar", tar_bytes([{"__key__": f"k{i:04d}", "png": data} for i in range(n)]))
    _write(fs, f"{b}/same/s-0.parquet", _hf_table([data] * n), 40)
    t = sd.images.RandomResizedCrop(24)
    opts = {"decode": t, "batch_size": 40, "storage_options": server.storage_options, "seed": 1}
    tar = torch.cat([x["png"] for x in sd.TarDataset(f"s3://{b}/same/s-0.tar", **opts)])
    hub = torch.cat([x["image"] for x in sd.ParquetDataset(f"s3://{b}/same/s-0.parquet", **opts)])
    assert tar.shape == hub.shape == (n, 3, 24, 24)
    (tar_area, tar_flip), (hub_area, hub_flip) = _boxes(tar), _boxes(hub)
    assert len({x.numpy().tobytes() for x in hub}) == n  # every row its own crop
    assert abs(tar_area.mean() - hub_area.mean()) < 0.06 and 0.3 < hub_area.mean() < 0.7
    assert abs(np.median(tar_area) - np.median(hub_area)) < 0.08
    assert 0.38 < tar_flip.mean() < 0.62 and 0.38 < hub_flip.mean() < 0.62


def test_crops_across_worlds_epochs_and_a_resume(bucket):
    """sd.loader with 0 and 2 workers, shuffled: each row the same crop; the next epoch new
    crops; a state taken after 3 steps, loaded by a fresh loader: the rest, with the same crops."""
    server, b, fs = bucket
    n = 24
    _write(fs, f"{b}/resume/r-0.parquet", _hf_table([_png(i % 5) for i in range(n)]), 4)
    spec = f"s3://{b}/resume/r-0.parquet"

    def loader(workers: int):
        ds = sd.ParquetDataset(spec, storage_options=server.storage_options, batch_size=3, shuffle=True,
                               seed=7, decode=sd.images.RandomResizedCrop(20))
        return sd.loader(ds, num_workers=workers)

    def by_label(batches) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for batch in batches:
            for label, image in zip(batch["label"].tolist(), batch["image"], strict=True):
                assert label not in out
                out[label] = image.clone()
        return out

    with loader(2) as two:
        two.set_epoch(1)
        full = by_label(two)
        two.set_epoch(2)
        nxt = by_label(two)
    with loader(0) as zero:
        zero.set_epoch(1)
        assert all(torch.equal(full[k], v) for k, v in by_label(zero).items())
    assert sorted(full) == list(range(n)) and sum(not torch.equal(full[k], nxt[k]) for k in full) > n // 2
    with loader(2) as first:
        first.set_epoch(1)
        head: dict[int, torch.Tensor] = {}
        for step, batch in enumerate(first, 1):
            head.update(by_label([batch]))
            if step == 3:
                state = first.state_dict()
                break
    with loader(2) as second:
        second.load_state_dict(state)
        rest = by_label(second)
    assert sorted([*head, *rest]) == list(range(n)) and not set(head) & set(rest)
    assert all(torch.equal(full[k], v) for k, v in {**head, **rest}.items())


# ---- errors --------------------------------------------------------------------------------


def _with_bad_cells(fs, path: str) -> list[bytes]:
    images = [_png(i) for i in range(8)]
    table = _hf_table(images)
    cells = table.column("image").to_pylist()
    cells[6]["bytes"] = images[6][:40]  # truncated: row 2 of row group 1
    table = table.set_column(0, "image", pa.array(cells, CELL))
    _write(fs, path, table, 4)
    return images


@pytest.mark.parametrize("batch_size", [4, None])
def test_a_corrupt_cell_names_its_row_or_costs_only_its_row(bucket, batch_size):
    server, b, fs = bucket
    _with_bad_cells(fs, f"{b}/bad/b-0.parquet")
    url = f"s3://{b}/bad/b-0.parquet"

    def dataset(policy: str):
        return sd.ParquetDataset(url, storage_options=server.storage_options, batch_size=batch_size,
                                 decode=sd.images.RandomResizedCrop(16), on_error=policy)

    with pytest.raises(sd.DecodeError) as info:
        list(dataset("raise"))
    err = info.value
    assert err.key == "row 2 of row group 1" and err.url == url
    assert "column 'image'" in err.message and "row 2 of row group 1 of " + url in err.message
    ds = dataset("skip")
    out = list(ds)
    if batch_size is None:
        labels = [int(row["label"]) for row in out]
    else:
        assert [len(x["label"]) for x in out] == [4, 3]  # the number of batches kept, one row short
        assert all(x["image"].shape == (len(x["label"]), 3, 16, 16) for x in out)
        labels = [v for x in out for v in x["label"].tolist()]
    assert labels == [0, 1, 2, 3, 4, 5, 7]
    assert ds.skipped["decode"] == 1 and sum(ds.skipped.values()) == 1
    # the dropped row counts as read where it was: a state taken before it resumes with the rest
    ds = dataset("skip")
    it = iter(ds)
    head = [next(it) for _ in range(1 if batch_size else 5)]
    state = ds.state_dict()
    it.close()
    again = dataset("skip")
    again.load_state_dict(state)
    rest = list(again)
    if batch_size is None:
        assert [int(r["label"]) for r in head + rest] == [0, 1, 2, 3, 4, 5, 7] and len(head) == 5
    else:
        assert [x["label"].tolist() for x in head + rest] == [[0, 1, 2, 3], [4, 5, 7]]


def test_a_dropped_row_keeps_equal_steps(bucket):
    """Two simulated ranks of an exact epoch, a bad cell skipped: both ranks the same number of
    batches (EQUAL-STEPS), every other row once."""
    server, b, fs = bucket
    _with_bad_cells(fs, f"{b}/bad/b-0.parquet")
    ds = sd.ParquetDataset(f"s3://{b}/bad/b-0.parquet", storage_options=server.storage_options, batch_size=2,
                           shuffle=True, decode=sd.images.RandomResizedCrop(16), on_error="skip")
    per_rank = [rank_batches(ds, r, 2, 0, field="label") for r in range(2)]
    assert [len(batches) for batches in per_rank] == [2, 2]
    assert sorted(v for batches in per_rank for batch in batches for v in batch) == [0, 1, 2, 3, 4, 5, 7]
    assert ds.skipped["decode"] == 1


def test_a_cell_without_bytes_and_a_failing_decoder(bucket):
    server, b, fs = bucket
    table = _hf_table([_png(i) for i in range(4)])
    cells = table.column("image").to_pylist()
    cells[1] = {"bytes": None, "path": "/data/cat.jpg"}
    _write(fs, f"{b}/paths/p.parquet", table.set_column(0, "image", pa.array(cells, CELL)), 4)
    url = f"s3://{b}/paths/p.parquet"
    with pytest.raises(sd.DecodeError, match="no bytes.*cat.jpg") as info:
        list(sd.ParquetDataset(url, storage_options=server.storage_options, batch_size=4,
                               decode=sd.images.Resize((8, 8))))
    assert info.value.key == "row 1 of row group 0"
    # a decoders= function that raises: the same, by row; skipped, only that row goes
    ds = sd.ParquetDataset(url, storage_options=server.storage_options, batch_size=4, on_error="skip",
                           decoders={"label": lambda v: 10 // (v - 2)})
    batch, = list(ds)
    assert batch["label"] == [-5, -10, 10] and batch["image.path"] == ["0.png", "/data/cat.jpg", "3.png"]
    assert ds.skipped["decode"] == 1


def test_to_tensors_and_to_rows_drop_rows_in_place():
    """The conversion alone: a failing row named by its key columns, dropped where ``skip``
    says so, and marked DROPPED in its place by ``to_rows`` (a reader counts it there)."""
    images = [_png(i) for i in range(5)]
    images[3] = b"not an image"
    table = with_row_keys(_hf_table(images), "s3://b/x/part-7.parquet", "row group 2", first=10)
    opts = TensorOptions(images=sd.images.Resize((6, 6)))
    with pytest.raises(sd.DecodeError) as info:
        to_tensors(table, opts)
    assert info.value.key == "row 13 of row group 2" and info.value.url == "s3://b/x/part-7.parquet"
    errors: list[BaseException] = []
    out = to_tensors(table, opts, skip=lambda e: errors.append(e) is None)
    assert out["image"].shape == (4, 3, 6, 6) and out["label"].tolist() == [0, 1, 2, 4]
    assert len(errors) == 1 and sorted(out) == ["image", "label"]
    rows = list(to_rows(table, opts, skip=lambda e: True, dropped=True))
    assert [r if r is DROPPED else int(r["label"]) for r in rows] == [0, 1, 2, DROPPED, 4]
    keys = RowKeys(["s3://b/x/part-7.parquet"], ["row group 2"], [13])
    assert keys.key(0) == "part-7.parquet\x00row group 2\x0013" and keys.place(0) == "row 13 of row group 2"
    # no row keys (a table from elsewhere): seeded by the bytes, named by the row in the batch
    plain = _hf_table(images[:3])
    bound = sd.images.Resize((6, 6))
    assert torch.equal(to_tensors(plain, opts)["image"][2], bound.image(images[2]))


# ---- docs ------------------------------------------------------------------------------------


def test_the_docs_recipe_runs(bucket, monkeypatch):
    """docs/images.md's Hugging Face recipe as written, its bucket the test server's: two epochs
    of the real files' rows, uint8 [n, 3, 224, 224] images and int64 labels."""
    server, b, fs = bucket
    for i in range(2):
        fs.put_file(str(DATA / "hf_images.parquet"), f"{b}/hub/train-{i:05d}.parquet")
    code = doc_blocks("docs/images.md", "## Image columns in Parquet and Arrow (Hugging Face)")[0].replace(
        "s3://bkt/", f"s3://{b}/")
    s3_environment(monkeypatch, server.storage_options)
    seen: list[tuple] = []
    namespace = {"train_step": lambda images, labels: seen.append((images.clone(), labels.clone()))}
    exec(compile(code, "docs/images.md", "exec"), namespace)  # noqa: S102 - the page's recipe, run
    assert sorted(v for _, labels in seen for v in labels.tolist()) == sorted(list(range(8)) * 4)
    assert all(x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, 224, 224) for x, _ in seen)
    assert all(labels.dtype == torch.int64 for _, labels in seen)
