"""The streaming tar parser and WebDataset grouping, on bytes split at arbitrary points."""

import io
import random
import tarfile

import numpy as np
import pytest
import webdataset as wds

import streamdata as sd
from streamdata.formats.tar import group_samples, iter_members, samples_from_chunks, split_key
from tests.helpers import make_samples, tar_bytes


def _split(data: bytes, rng: random.Random, most: int):
    pos = 0
    while pos < len(data):
        step = rng.randint(1, most)
        yield data[pos:pos + step]
        pos += step


def test_parse_from_any_chunking_equals_whole_parse():
    data = tar_bytes(make_samples([40], floats=300)[0])
    whole = list(samples_from_chunks([data], "u"))
    assert len(whole) == 40
    rng = random.Random(0)
    for most in (1, 3, 511, 512, 513, 4096, 100000):
        assert list(samples_from_chunks(_split(data, rng, most), "u")) == whole


def test_members_match_tarfile():
    data = tar_bytes(make_samples([5])[0])
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers() if m.isfile()]
    assert list(iter_members([data])) == want


def test_long_names_pax_and_gnu():
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        name = "d/" + "x" * 150 + ".txt"
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            info = tarfile.TarInfo(name)
            info.size = 3
            tf.addfile(info, io.BytesIO(b"abc"))
            d = tarfile.TarInfo("dir")
            d.type = tarfile.DIRTYPE
            tf.addfile(d)
        assert list(iter_members([buf.getvalue()])) == [(name, b"abc")]


def test_truncated_and_corrupt_tar_raise_format_error():
    data = tar_bytes(make_samples([3], floats=200)[0])
    with pytest.raises(sd.FormatError, match="truncated tar u"):
        list(iter_members([data[:1500]], "u"))
    with pytest.raises(sd.FormatError, match="bad header checksum"):
        list(iter_members([b"not a tar" * 100], "u"))


def test_grouping_follows_webdataset_keys():
    assert split_key("a/b/c.seg.PNG") == ("a/b/c", "seg.PNG")
    assert split_key("noext") is None
    members = [("k1.jpg", b"1"), ("k1.CLS", b"2"), ("k2.jpg", b"3"), ("__meta__", b"x"), ("readme", b"y")]
    got = list(group_samples(members, "u"))
    assert got == [{"__key__": "k1", "__url__": "u", "jpg": b"1", "cls": b"2"},
                   {"__key__": "k2", "__url__": "u", "jpg": b"3"}]
    with pytest.raises(sd.FormatError, match="duplicate"):
        list(group_samples([("k.a", b""), ("k.a", b"")], "u"))


def test_decoding_defaults_and_images(tmp_path):
    from PIL import Image

    img = np.zeros((4, 6, 3), dtype=np.uint8)
    img[..., 0] = 200
    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    sample = {"__key__": "k", "npy": np.arange(3.0), "cls": 7, "json": {"a": 1}, "txt": "hi",
              "png": png.getvalue()}
    (tmp_path / "a.tar").write_bytes(tar_bytes([sample]))
    [got] = list(sd.TarDataset(str(tmp_path / "a.tar")))
    assert got["cls"] == 7 and got["json"] == {"a": 1} and got["txt"] == "hi"
    np.testing.assert_array_equal(got["npy"], np.arange(3.0))
    assert got["png"].dtype.is_floating_point is False and tuple(got["png"].shape) == (3, 4, 6)
    assert int(got["png"][0, 0, 0]) == 200 and int(got["png"][1, 0, 0]) == 0
    [raw] = list(sd.TarDataset(str(tmp_path / "a.tar"), decode=False))
    assert raw["cls"] == b"7"
    [flt] = list(sd.TarDataset(str(tmp_path / "a.tar"), decode="torchrgb"))
    assert flt["png"].dtype.is_floating_point


def test_decode_error_names_url_and_key(tmp_path):
    (tmp_path / "bad.tar").write_bytes(tar_bytes([{"__key__": "k0", "npy": b"not npy"}]))
    with pytest.raises(sd.DecodeError) as info:
        list(sd.TarDataset(str(tmp_path / "bad.tar")))
    assert "bad.tar" in str(info.value) and "'k0'" in str(info.value)


def test_skip_policy_counts_and_continues(tmp_path):
    good = make_samples([2])[0]
    (tmp_path / "a.tar").write_bytes(tar_bytes([good[0], {"__key__": "bad", "npy": b"zz"}, good[1]]))
    (tmp_path / "b.tar").write_bytes(b"garbage" * 200)
    seen = []
    ds = sd.TarDataset(str(tmp_path), on_error=lambda exc: seen.append(exc) or True)
    keys = [s["__key__"] for s in ds]
    assert keys == [good[0]["__key__"], good[1]["__key__"]]
    assert [type(e) for e in seen] == [sd.DecodeError, sd.FormatError]


def test_webdataset_reads_our_layout_and_we_read_theirs(tmp_path):
    samples = make_samples([6])[0]
    with wds.ShardWriter(str(tmp_path / "w-%03d.tar"), maxcount=4) as sink:
        for s in samples:
            sink.write(s)
    ours = list(sd.TarDataset(str(tmp_path / "w-{000..001}.tar")))
    theirs = list(wds.WebDataset(str(tmp_path / "w-{000..001}.tar"), shardshuffle=False).decode())
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs] == [s["__key__"] for s in samples]
    for a, b in zip(ours, theirs, strict=True):
        assert a["cls"] == b["cls"] and a["json"] == b["json"]
        np.testing.assert_array_equal(a["npy"], b["npy"])


def test_batches_are_collated_tensors(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([10])[0]))
    batches = list(sd.TarDataset(str(tmp_path / "a.tar"), batch_size=4))
    assert [len(b["__key__"]) for b in batches] == [4, 4, 2]
    assert tuple(batches[0]["npy"].shape) == (4, 8) and batches[0]["cls"].tolist() == [0, 1, 2, 3]
    dropped = list(sd.TarDataset(str(tmp_path / "a.tar"), batch_size=4, drop_last=True))
    assert [len(b["__key__"]) for b in dropped] == [4, 4]
