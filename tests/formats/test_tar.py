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


# ---- malformed input: FormatError naming the URL and the byte offset, never a hang ------------


def _header_offsets(data: bytes) -> list[tuple[int, bytes, str]]:
    """``(offset, type, name)`` of each header of a valid tar, pax headers included."""
    out, at = [], 0
    while data[at:at + 512].count(0) != 512:
        size = int(data[at + 124:at + 135], 8)
        out.append((at, data[at + 156:at + 157], data[at:at + 100].split(b"\0")[0].decode()))
        at += 512 + (size + 511) // 512 * 512
    return out


def _with_checksum(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _pax_block(records: bytes) -> bytes:
    header = bytearray(512)
    header[0:14] = b"././@PaxHeader"
    header[124:136] = b"%011o\0" % len(records)
    header[156:157] = b"x"
    header[257:263] = b"ustar\0"
    return _with_checksum(header) + records + bytes(-len(records) % 512)


def test_webdataset_tarwriter_writes_a_pax_header_per_member():
    kinds = [kind for _, kind, _ in _header_offsets(tar_bytes(make_samples([2])[0]))]
    assert kinds == [b"x", b"0"] * 6  # so the pax parser runs on every read


@pytest.mark.timeout(30)  # the bug was a loop that never ended
@pytest.mark.parametrize("records", [b"00 path=x\n", b"0 path=x\n", b"ab path=x\n", b"9 pathabc\n",
                                     b"99999 path=x\n", b"12 path=abc", b"10 size=-1\n",
                                     b"12 size=0x10\n"])
def test_bad_pax_records_are_format_errors_naming_the_offset(records):
    """A record length of 00 used to leave the parser at the same position for ever."""
    data = tar_bytes(make_samples([2])[0])
    pax_at, kind, _ = _header_offsets(data)[2]
    assert kind == b"x"
    bad = data[:pax_at] + _pax_block(records) + data[pax_at + 1024:]
    with pytest.raises(sd.FormatError, match=rf"corrupt tar u: .* at byte {pax_at + 512}\b|"
                                             rf"corrupt tar u: a pax size .* at byte {pax_at}\b"):
        list(iter_members([bad], "u"))


def test_sizes_octal_base256_and_negative():
    data = tar_bytes([{"__key__": "k", "txt": b"hello"}])
    at, kind, name = _header_offsets(data)[1]
    assert (kind, name) == (b"0", "k.txt")

    def with_size(field: bytes) -> bytes:
        header = bytearray(data[at:at + 512])
        header[124:136] = field
        return data[:at] + _with_checksum(header) + data[at + 512:]

    assert list(iter_members([with_size(b"\x80" + bytes(10) + b"\x05")])) == [("k.txt", b"hello")]
    for field, match in [(b"\xff" * 12, "of -1 bytes"), (b"\x80" + b"\x01" + bytes(10), r"in an object of"),
                         (b"0x5\0" + bytes(8), "bad size"), (b"+5\0" + bytes(9), "bad size")]:
        with pytest.raises(sd.FormatError, match=rf"corrupt tar u: .*{match}.* at byte {at}\b"):
            list(iter_members([with_size(field)], "u", total=len(data)))


def test_gnu_long_name_records_bounded():
    data = tar_bytes(make_samples([1])[0])
    header = bytearray(512)
    header[0:13] = b"././@LongLink"
    header[124:136] = b"%011o\0" % ((1 << 33) - 1)
    header[156:157] = b"L"
    bad = _with_checksum(header) + data
    with pytest.raises(sd.FormatError, match="extended header of 8589934591 bytes at byte 0"):
        list(iter_members([bad], "u"))


def test_non_utf8_names_decode_like_webdataset(tmp_path):
    """latin-1 names from other tools: surrogateescape, as tarfile (and so webdataset) reads them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        for name, body in [("caf\xe9.txt", b"a"), ("caf\xe9.cls", b"1")]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    (tmp_path / "l.tar").write_bytes(buf.getvalue())
    [ours] = list(sd.TarDataset(str(tmp_path / "l.tar"), decode=False))
    [theirs] = list(wds.WebDataset(str(tmp_path / "l.tar"), shardshuffle=False))
    assert ours["__key__"] == theirs["__key__"] == "caf\udce9"
    assert ours["__key__"].encode("utf-8", "surrogateescape") == b"caf\xe9"
    assert (ours["txt"], ours["cls"]) == (theirs["txt"], theirs["cls"]) == (b"a", b"1")


def _cut_between_samples(data: bytes, sample: int, members: int = 3) -> int:
    """The offset where sample ``sample`` starts (its first pax header)."""
    return _header_offsets(data)[2 * members * sample][0]


def test_unterminated_and_zero_byte_tars_are_format_errors_unless_accepted(tmp_path):
    data = tar_bytes(make_samples([10])[0])
    cut = _cut_between_samples(data, 5)
    (tmp_path / "half.tar").write_bytes(data[:cut])
    (tmp_path / "empty.tar").write_bytes(b"")
    (tmp_path / "onezero.tar").write_bytes(data[:cut] + bytes(512))
    for name, at in [("half.tar", cut), ("empty.tar", 0), ("onezero.tar", cut)]:
        url = str(tmp_path / name)
        with pytest.raises(sd.FormatError, match=rf"unterminated tar {url}: it ends at byte {at}\b"):
            list(sd.TarDataset(url))
    ds = sd.TarDataset(str(tmp_path / "half.tar"), accept_unterminated=True)
    assert [s["__key__"] for s in ds] == [f"s{i:06d}" for i in range(5)]
    assert ds.counts["accepted.unterminated"] == 1
    ds = sd.TarDataset(str(tmp_path / "empty.tar"), accept_unterminated=True)
    assert list(ds) == [] and ds.counts["accepted.unterminated"] == 1
    (tmp_path / "half.tar").write_bytes(data)  # complete now: not counted
    mixed = sd.TarDataset(str(tmp_path), accept_unterminated=True)
    assert len(list(mixed)) == 15 and mixed.counts["accepted.unterminated"] == 2
    with pytest.raises(sd.FormatError, match="truncated tar u: it ends inside a header"):
        list(iter_members([data[:cut + 100]], "u", accept_unterminated=True))


def test_a_zero_block_followed_by_data_is_not_an_end(tmp_path):
    data = tar_bytes(make_samples([4])[0])
    cut = _cut_between_samples(data, 2)
    with pytest.raises(sd.FormatError, match=rf"corrupt tar u: a zero block .* at byte {cut}\b"):
        list(iter_members([data[:cut] + bytes(512) + data[cut:]], "u"))


def test_truncated_shard_through_s3_is_a_format_error_or_accepted_and_counted(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    data = tar_bytes(make_samples([50])[0])
    fs.pipe_file(f"{bucket}/half.tar", data[:_cut_between_samples(data, 25)])
    url = f"s3://{bucket}/half.tar"
    seen = []
    with pytest.raises(sd.FormatError, match=rf"unterminated tar {url}: it ends at byte \d+") as info:
        for sample in sd.TarDataset(url, storage_options=server.storage_options):
            seen.append(sample["__key__"])
    # the 25th sample is held until its end is known, and the error comes first
    assert seen == [f"s{i:06d}" for i in range(24)] and info.value.url == url
    ds = sd.TarDataset(url, storage_options=server.storage_options, accept_unterminated=True)
    assert [s["__key__"] for s in ds] == [f"s{i:06d}" for i in range(25)]
    assert ds.counts["accepted.unterminated"] == 1 and ds.skipped["format"] == 0


def test_the_header_byte_sum_is_exact_at_its_extremes():
    """``_byte_sum`` (Adler-32 over two halves) equals ``sum`` for any 512 bytes, 0xff-filled
    halves included (65280 each: the most a half can sum to, still below Adler's modulus)."""
    import random

    from streamdata.formats.tar import _byte_sum

    rng = random.Random(7)
    blocks = [bytes(512), b"\xff" * 512, b"\xff" * 256 + bytes(256), bytes(256) + b"\xff" * 256]
    blocks += [bytes(rng.choice((0, 1, 254, 255)) for _ in range(512)) for _ in range(200)]
    blocks += [rng.randbytes(512) for _ in range(200)]
    assert [_byte_sum(b) for b in blocks] == [sum(b) for b in blocks]
