"""The sample index: tar offsets, the v1 format, writing, lookup and staleness, building.

S3 through the ``s3_server`` fixture (moto in a subprocess); request counts through
``benchmarks.faults.FaultProxy`` in front of it.
"""

from __future__ import annotations

import io
import json
import random
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import streamdata as sd
from streamdata.catalog import index as sdx
from streamdata.catalog.specs import Sightings
from streamdata.formats.tar import member_offsets, samples_from_chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds benchmarks/
from benchmarks.faults import Fault, FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

# ---------------------------------------------------------------------------- tar offsets


def _member(tar: tarfile.TarFile, name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE,
            pax: dict | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    if pax:
        info.pax_headers = pax
    if kind == tarfile.SYMTYPE:
        info.linkname = "elsewhere/" + "l" * 150  # long: a GNU K header, or a pax linkpath
    info.size = len(data) if data is not None and kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if data is not None and kind == tarfile.REGTYPE else None)


LONG = "deep/" + "d" * 120 + "/"


def _tricky_tar(fmt: int) -> tuple[bytes, list[str], list[str]]:
    """A tar written by Python's tarfile with long names, pax records, metadata members,
    directories, a link and names without an extension. Returns the bytes, the names of the
    members each sample starts with (in order), and the sample keys."""
    plan = [  # (name, data or None, kind, starts a sample)
        ("__meta__", b"top-level metadata", tarfile.REGTYPE, False),
        ("deep/", None, tarfile.DIRTYPE, False),
        (LONG + "a.jpg", b"A" * 700, tarfile.REGTYPE, True),  # long name: an extension header
        (LONG + "a.json", b"{}", tarfile.REGTYPE, False),
        ("README", b"no extension: ignored", tarfile.REGTYPE, False),
        ("__info__/x.json", b"metadata dir", tarfile.REGTYPE, False),
        ("b\u00e9.cls", b"1", tarfile.REGTYPE, True),  # non-ASCII: a pax path record (PAX)
        ("b\u00e9.txt", b"b" * 513, tarfile.REGTYPE, False),
        ("link.txt", None, tarfile.SYMTYPE, False),
        ("c.cls", b"2", tarfile.REGTYPE, True),
        (LONG, None, tarfile.DIRTYPE, False),  # a long directory name between samples
        (LONG + "e" * 90 + ".cls", b"3", tarfile.REGTYPE, True),
        ("f.npy", b"\0" * 1024, tarfile.REGTYPE, True),
        ("trailing", b"ignored, after the last sample", tarfile.REGTYPE, False),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data, kind, _ in plan:
            pax = {"comment": "x" * 300} if name == "c.cls" and fmt == tarfile.PAX_FORMAT else None
            _member(tar, name, data, kind, pax)
    starts = [name for name, _, _, first in plan if first]
    keys = [name.rsplit(".", 1)[0] for name in starts]
    return buf.getvalue(), starts, keys


def _split(data: bytes, rng: random.Random, mean: int = 300) -> list[bytes]:
    """``data`` in random pieces (the parser must not care where chunks end)."""
    out, pos = [], 0
    while pos < len(data):
        step = rng.randint(1, 2 * mean)
        out.append(data[pos:pos + step])
        pos += step
    return out


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_offsets_match_tarfile_and_ranges_parse_to_exactly_those_samples(fmt):
    data, starts, keys = _tricky_tar(fmt)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        infos = tar.getmembers()
    by_name = {i.name: i for i in infos}
    last = infos[-1]
    marker = last.offset_data + (last.size + 511) // 512 * 512
    want = [by_name[name].offset for name in starts] + [marker]  # tarfile's offset: first ext header
    if fmt == tarfile.GNU_FORMAT:  # the long names really have extension headers
        assert by_name[LONG + "a.jpg"].offset < by_name[LONG + "a.jpg"].offset_data - 512
    got = sdx.tar_sample_offsets(_split(data, random.Random(1)), "mem://t.tar", total=len(data))
    assert got.dtype == np.uint64 and got.tolist() == want
    # every member's offset, as tarfile sees it (regular files only)
    regular = [(i.name, i.offset) for i in infos if i.isreg()]
    walk = member_offsets([data], "mem://t.tar")
    assert list(walk) == regular
    full = list(samples_from_chunks([data], "mem://t.tar"))
    assert [s["__key__"] for s in full] == keys
    rng = random.Random(2)
    for a in range(len(keys) + 1):
        for b in range(a, len(keys) + 1):
            piece = data[want[a]:want[b]]
            got_samples = list(samples_from_chunks(_split(piece, rng, 200), "mem://t.tar",
                                                   accept_unterminated=True))
            assert got_samples == full[a:b], (a, b)


def test_offsets_of_webdataset_shards_and_empty_ones():
    [samples] = make_samples([40])
    data = tar_bytes(samples)
    off = sdx.tar_sample_offsets([data], "mem://w.tar")
    assert len(off) == 41 and off[0] == 0 and (np.diff(off.astype(np.int64)) > 0).all()
    assert data[int(off[-1]):].count(0) == len(data) - int(off[-1])  # only the marker follows
    for i in (0, 17, 39):
        one = list(samples_from_chunks([data[int(off[i]):int(off[i + 1])]], "mem://w.tar",
                                       accept_unterminated=True))
        assert [s["__key__"] for s in one] == [samples[i]["__key__"]]
    assert sdx.tar_sample_offsets([tar_bytes([])], "mem://e.tar").tolist() == [0]


def test_offsets_refuse_what_reading_refuses():
    data = tar_bytes(make_samples([3])[0])
    with pytest.raises(sd.FormatError, match="unterminated"):
        sdx.tar_sample_offsets([data[:int(sdx.tar_sample_offsets([data], "mem://u.tar")[2])]], "mem://u.tar")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("k.txt", "k.txt"):
            _member(tar, name, b"x")
    with pytest.raises(sd.FormatError, match="duplicate member"):
        sdx.tar_sample_offsets([buf.getvalue()], "mem://d.tar")


# ---------------------------------------------------------------------------- format


def _entries(counts: list[int], floats: int = 64, prefix: str = "shard-") -> tuple[list, list[bytes]]:
    entries, blobs = [], []
    for i, shard in enumerate(make_samples(counts, floats)):
        data = tar_bytes(shard)
        off = sdx.tar_sample_offsets([data], f"mem://{i}")
        entries.append(sdx.ShardEntry(f"{prefix}{i:05d}.tar", len(data), f"etag{i}", len(shard), off))
        blobs.append(data)
    return entries, blobs


def test_format_round_trip_and_size_per_sample():
    counts = [1000] * 20 + [0, 3]  # a realistic dataset: 20 shards of 1000 samples, an empty and a tiny one
    rng = np.random.default_rng(0)  # a tar's offsets: 512-byte blocks, a sample of 1 to 40 blocks
    entries = []
    for i, n in enumerate(counts):
        offsets = np.concatenate([[0], np.cumsum(512 * rng.integers(1, 41, n))]).astype(np.uint64)
        entries.append(sdx.ShardEntry(f"shard-{i:05d}.tar", int(offsets[-1]) + 1024, f"etag{i}", n, offsets))
    data = sdx.encode_index(entries)
    assert data[:6] == b"SDIDX\x00" and int.from_bytes(data[6:8], "little") == 1
    back = sdx.decode_index(data, "s3://bkt/_streamdata.sdx")
    assert back == entries
    assert [e.offsets.tolist() for e in back] == [e.offsets.tolist() for e in entries]
    per_sample = len(data) / sum(counts)
    assert per_sample <= 16, per_sample
    assert per_sample < 8.2  # 8 bytes of offset per sample, the header is small


@pytest.mark.parametrize("damage", ["payload", "offset", "header", "etag", "version", "truncated", "magic",
                                    "json"])
def test_corrupt_index_is_a_format_error_naming_the_url(damage):
    entries, _ = _entries([5, 7], floats=8)
    data = bytearray(sdx.encode_index(entries))
    header_at = 16
    if damage == "payload":
        data[-5] ^= 0x01
    elif damage == "offset":  # an inner offset one byte off: still increasing, only the CRC sees it
        data[-16] ^= 0x01
    elif damage == "etag":
        at = bytes(data).index(b"etag1")
        data[at] = ord("E")
    elif damage == "header":  # a size digit: still valid JSON, caught by the checksum
        at = bytes(data).index(b'"size":') + 7
        data[at] = ord("1") if data[at] != ord("1") else ord("2")
    elif damage == "version":
        data[6] = 2
    elif damage == "truncated":
        del data[-8:]
    elif damage == "magic":
        data[0] = ord("X")
    else:
        data[header_at] = ord("[")
    with pytest.raises(sd.FormatError) as info:
        sdx.decode_index(bytes(data), "s3://bkt/dir/_streamdata.sdx")
    assert "s3://bkt/dir/_streamdata.sdx" in str(info.value)
    if damage == "version":
        assert "version 2" in str(info.value)


def test_default_location_and_entry_names():
    urls = ["s3://bkt/a/train/x-0.tar", "s3://bkt/a/train/x-1.tar"]
    assert sdx.default_index_url(urls) == "s3://bkt/a/train/_streamdata.sdx"
    assert sdx.default_index_url([*urls, "s3://bkt/a/val/y.tar"]) == "s3://bkt/a/_streamdata.sdx"
    assert sdx.default_index_url(["/data/t/a.tar", "/data/u/b.tar"]) == "/data/_streamdata.sdx"
    with pytest.raises(sd.SpecError, match="share no directory"):
        sdx.default_index_url(["s3://one/a.tar", "s3://two/b.tar"])
    assert sdx.entry_name("s3://bkt/a/_streamdata.sdx", "s3://bkt/a/val/y.tar") == "val/y.tar"
    assert sdx.entry_name("s3://bkt/a/_streamdata.sdx", "s3://other/y.tar") == "s3://other/y.tar"


# ---------------------------------------------------------------------------- S3: write, lookup


def _upload(fs, bucket: str, counts: list[int], floats: int = 8, prefix: str = "ds") -> list:
    for i, shard in enumerate(make_samples(counts, floats)):
        fs.pipe_file(f"{bucket}/{prefix}/shard-{i:03d}.tar", tar_bytes(shard))
    return sd.expand_spec(f"s3://{bucket}/{prefix}/", _options(fs), suffixes=(".tar",))


def _options(fs) -> dict:
    return fs._sd_options


@pytest.fixture
def s3(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    fs._sd_options = server.storage_options
    return server, bucket, fs


def _entries_of(fs, shards, index_url: str) -> list:
    out = []
    for s in shards:
        data = fs.cat_file(s.url)
        out.append(sdx.ShardEntry(s.url, s.size, s.etag, 0, None))
        off = sdx.tar_sample_offsets([data], s.url)
        out[-1] = sdx.ShardEntry(s.url, s.size, s.etag, len(off) - 1, off)
    return out


def test_shards_carry_the_listing_etag(s3):
    server, bucket, fs = s3
    shards = _upload(fs, bucket, [2, 3])
    assert all(s.etag and '"' not in s.etag for s in shards)
    assert shards[0].etag == fs.info(shards[0].url)["ETag"].strip('"')
    [one] = sd.expand_spec(shards[1].url, server.storage_options)  # a single object: a HEAD
    assert one == shards[1]


def test_write_merge_and_lookup_on_s3(s3):
    server, bucket, fs = s3
    counts = [5, 1, 9, 3, 0, 7, 2]
    shards = _upload(fs, bucket, counts)
    url = sdx.default_index_url([s.url for s in shards])
    assert url == f"s3://{bucket}/ds/_streamdata.sdx"
    entries = _entries_of(fs, shards, url)
    sdx.write_index(url, entries[:4], server.storage_options)
    sdx.write_index(url, entries[3:], server.storage_options)  # merged: 3 replaced, the rest added
    assert [p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ds")].count("_streamdata.sdx") == 1
    assert not [p for p in fs.ls(f"{bucket}/ds") if ".tmp-" in p]  # the temporary key is gone
    stored = sdx.read_index(url, server.storage_options)
    assert [e.name for e in stored] == [f"shard-{i:03d}.tar" for i in range(7)]  # relative names
    found = sdx.lookup(shards, "auto", server.storage_options)
    assert found.url == url and found.counts.tolist() == counts and found.counts.dtype == np.int64
    for s, off in zip(shards, found.offsets, strict=True):
        assert off.tolist() == sdx.tar_sample_offsets([fs.cat_file(s.url)], s.url).tolist()
    assert sdx.lookup(shards, None, server.storage_options) is None
    explicit = sdx.lookup(shards, url, server.storage_options)
    assert explicit.counts.tolist() == counts
    assert sdx.index_status(shards, server.storage_options) == f"index: {url}: 7/7 shards, 27 samples"
    sdx.write_index(url, entries[:2], server.storage_options, merge=False)
    with pytest.warns(UserWarning, match=r"no entry for 5 of 7 shards.*streamdata index SPEC"):
        assert sdx.lookup(shards, "auto", server.storage_options) is None
    with pytest.raises(sd.SpecError, match="no entry for 5 of 7 shards"):
        sdx.lookup(shards, url, server.storage_options)
    assert "5 missing" in sdx.index_status(shards, server.storage_options)


def test_auto_without_an_index_makes_one_request_and_no_noise(s3):
    """Told by the listing (LISTED-NAMES) that neither name exists: one GET; without a listing's
    word, the old name is asked for after the new one's 404 (the datasets send both ahead)."""
    server, bucket, fs = s3
    shards = _upload(fs, bucket, [2, 2])
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        listed = Sightings(sdx.INDEX_NAMES)
        listing = sd.expand_spec(f"s3://{bucket}/ds/", options, suffixes=(".tar",), sightings=listed)
        assert [s.url for s in listing] == [s.url for s in shards]
        assert listed.tells(f"s3://{bucket}/ds") and not listed.found
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sdx.lookup(shards, "auto", options, sightings=listed) is None
        assert proxy.requests == {"list": 1, "get": 1}, proxy.requests
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sdx.lookup(shards, "auto", options) is None
        assert proxy.requests == {"list": 1, "get": 3}, proxy.requests
        # without s3:ListBucket, S3 answers a missing key with 403: a warning, no index, no failure
        denied = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        proxy.add(Fault("status", status=403, match="get", times=1, body=denied))
        with pytest.warns(UserWarning, match=r"could not read the sample index at .*access denied"):
            assert sdx.lookup(shards, "auto", options) is None
        proxy.add(Fault("status", status=403, match="get", times=1, body=denied))
        with pytest.raises(sd.AccessDeniedError):
            sdx.lookup(shards, f"s3://{bucket}/ds/_streamdata.sdx", options)
    with pytest.raises(sd.SpecError, match="no sample index at"):
        sdx.lookup(shards, f"s3://{bucket}/ds/other.sdx", server.storage_options)


@pytest.mark.parametrize("change", ["size", "etag"])
def test_stale_index_refused(s3, change):
    server, bucket, fs = s3
    shards = _upload(fs, bucket, [3, 4])
    url = sdx.default_index_url([s.url for s in shards])
    sdx.write_index(url, _entries_of(fs, shards, url), server.storage_options)
    old = fs.cat_file(shards[1].url)
    if change == "size":
        new = tar_bytes(make_samples([3, 5])[1])  # other samples: another size
    else:
        new = old.replace(b"s000003", b"s000099")  # same size, other bytes: another ETag
        assert len(new) == len(old) and new != old
    fs.pipe_file(shards[1].url, new)
    fresh = sd.expand_spec(f"s3://{bucket}/ds/", server.storage_options, suffixes=(".tar",))
    assert (fresh[1].size != shards[1].size) == (change == "size") and fresh[1].etag != shards[1].etag
    for index in ("auto", url):
        with pytest.raises(sd.StaleIndexError) as info:
            sdx.lookup(fresh, index, server.storage_options)
        text = str(info.value)
        assert "shard-001.tar" in text and url in text and "run `streamdata index SPEC` again" in text
        assert ("size" if change == "size" else "ETag") in text
        assert isinstance(info.value, sd.SpecError)
    assert "1 stale" in sdx.index_status(fresh, server.storage_options)


def test_wids_shard_list_gives_counts(s3):
    server, bucket, fs = s3
    shards = _upload(fs, bucket, [5, 0, 2])
    listing = {"__kind__": "wids-shard-index-v1", "name": "ds", "shardlist": [
        {"url": "shard-000.tar", "nsamples": 5},
        {"url": f"s3://{bucket}/ds/shard-001.tar", "nsamples": 0},  # an absolute URL too
        {"url": "shard-002.tar", "nsamples": 2, "filesize": shards[2].size}]}
    fs.pipe_file(f"{bucket}/ds/wids.json", json.dumps(listing).encode())
    found = sdx.lookup(shards, f"s3://{bucket}/ds/wids.json", server.storage_options)
    assert found.counts.tolist() == [5, 0, 2] and found.offsets == [None, None, None]
    listing["shardlist"][2]["filesize"] = shards[2].size + 1
    fs.pipe_file(f"{bucket}/ds/wids.json", json.dumps(listing).encode())
    with pytest.raises(sd.StaleIndexError):
        sdx.lookup(shards, f"s3://{bucket}/ds/wids.json", server.storage_options)
    fs.pipe_file(f"{bucket}/ds/wids.json", b'{"shardlist": [{"url": "a.tar"}]}')
    with pytest.raises(sd.FormatError, match="wids.json"):
        sdx.lookup(shards, f"s3://{bucket}/ds/wids.json", server.storage_options)


def test_corrupt_index_object_is_a_format_error(s3):
    server, bucket, fs = s3
    shards = _upload(fs, bucket, [2, 3])
    url = sdx.default_index_url([s.url for s in shards])
    sdx.write_index(url, _entries_of(fs, shards, url), server.storage_options)
    data = bytearray(fs.cat_file(url))
    data[-3] ^= 0xFF
    fs.pipe_file(url, bytes(data))
    with pytest.raises(sd.FormatError, match=f"corrupt sample index {url}: checksum"):
        sdx.lookup(shards, "auto", server.storage_options)


def test_local_write_and_lookup(tmp_path):
    for i, shard in enumerate(make_samples([4, 6])):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    shards = sd.expand_spec(str(tmp_path / "s-{0..1}.tar"))
    url = sdx.default_index_url([s.url for s in shards])
    assert url == str(tmp_path / "_streamdata.sdx")
    entries = [sdx.ShardEntry(s.url, s.size, None, 0, None) for s in shards]
    entries = [sdx.ShardEntry(e.name, e.size, None, len(off) - 1, off) for e, off in
               zip(entries, [sdx.tar_sample_offsets([Path(s.url).read_bytes()], s.url) for s in shards],
                   strict=True)]
    sdx.write_index(url, entries)
    assert sdx.lookup(shards, "auto").counts.tolist() == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_streamdata.sdx", "s-0.tar", "s-1.tar"]


# ---------------------------------------------------------------------------- building


def _gets(proxy: FaultProxy) -> list[str]:
    """The object each GET of the proxy's history asked for (its last path segment)."""
    return sorted(target.split("?", 1)[0].rsplit("/", 1)[-1] for kind, _, target, _ in proxy.history
                  if kind == "get")


def _expected(fs, shards) -> list[list[int]]:
    return [sdx.tar_sample_offsets([fs.cat_file(s.url)], s.url).tolist() for s in shards]


def test_build_skips_compressed_and_resumes_after_a_failed_shard(s3):
    server, bucket, fs = s3
    counts = [5, 1, 9, 3, 0, 7, 2, 4]
    shards = _upload(fs, bucket, counts)
    fs.pipe_file(f"{bucket}/ds/extra.tar.gz", b"\x1f\x8b not indexed")
    url = f"s3://{bucket}/ds/_streamdata.sdx"
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        proxy.add(Fault("status", status=404, times=None,
                        match=lambda method, path, query: method == "GET" and "shard-005" in path))
        compressed = r"1 compressed shard\(s\) get no sample index.*extra\.tar\.gz"
        failed = r"1 of 8 shards could not be indexed.*streamdata index SPEC"
        with pytest.warns(UserWarning, match=compressed), pytest.raises(sd.ShardNotFoundError, match=failed):
            sdx.build_index(f"s3://{bucket}/ds/", options, progress=False)
        partial = sdx.read_index(url, server.storage_options)
        assert [e.name for e in partial] == [f"shard-{i:03d}.tar" for i in range(8) if i != 5]
        proxy.clear()
        proxy.reset_counters()
        with pytest.warns(UserWarning, match="compressed"):
            assert sdx.build_index(f"s3://{bucket}/ds/", options, progress=False) == url
        assert _gets(proxy) == ["_streamdata.sdx", "shard-005.tar"]  # the index, and the one shard left
    found = sdx.lookup(shards, "auto", server.storage_options)
    assert found.counts.tolist() == counts
    assert [o.tolist() for o in found.offsets] == _expected(fs, shards)
    assert [e.size for e in sdx.read_index(url, server.storage_options)] == [s.size for s in shards]


def test_interrupted_build_resumes_and_stale_shards_are_read_again(s3, monkeypatch):
    server, bucket, fs = s3
    counts = [3, 4, 5, 6, 7, 8, 9, 10]
    shards = _upload(fs, bucket, counts)
    url = f"s3://{bucket}/ds/_streamdata.sdx"
    monkeypatch.setattr(sdx, "SAVE_EVERY_S", 0.0)  # save after every shard
    monkeypatch.setattr(sdx, "SAVE_COST_RATIO", 0)
    seen = []

    class Stop(Exception):
        pass

    def stop_after_three(entry):
        seen.append(entry.name)
        if len(seen) == 2:  # the partial index is saved while the build runs
            assert [e.name for e in sdx.read_index(url, server.storage_options)] == seen[:1]
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):
        sdx.build_index(f"s3://{bucket}/ds/shard-{{000..007}}.tar", server.storage_options,
                        progress=stop_after_three, window=2)
    assert [e.name for e in sdx.read_index(url, server.storage_options)] == seen  # saved when stopped
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        sdx.build_index(f"s3://{bucket}/ds/shard-{{000..007}}.tar", options, progress=False)
        assert _gets(proxy) == ["_streamdata.sdx"] + [f"shard-{i:03d}.tar" for i in range(3, 8)]
        fs.pipe_file(shards[6].url, tar_bytes(make_samples([1])[0]))  # shard 6 changes: stale
        proxy.reset_counters()
        sdx.build_index(f"s3://{bucket}/ds/", options, progress=False)
        assert _gets(proxy) == ["_streamdata.sdx", "shard-006.tar"]
    fresh = sd.expand_spec(f"s3://{bucket}/ds/", server.storage_options, suffixes=(".tar",))
    assert sdx.lookup(fresh, "auto", server.storage_options).counts.tolist() == counts[:6] + [1] + counts[7:]


def test_build_local_equals_the_entries_made_by_hand(tmp_path, capsys):
    made = []
    for i, shard in enumerate(make_samples([4, 0, 6])):
        data = tar_bytes(shard)
        (tmp_path / f"s-{i}.tar").write_bytes(data)
        off = sdx.tar_sample_offsets([data], "x")
        made.append(sdx.ShardEntry(f"s-{i}.tar", len(data), None, len(off) - 1, off))
    (tmp_path / "other.sdx").write_bytes(sdx.encode_index(made[:1]))
    out = sdx.build_index(str(tmp_path / "s-{0..2}.tar"), progress=True)
    assert out == str(tmp_path / "_streamdata.sdx")
    assert sdx.read_index(out) == made
    assert "indexing 3 shards" in capsys.readouterr().err  # the bar, drawn when asked for
    with pytest.raises(sd.SpecError, match="unknown option 'windw'"):
        sdx.build_index(str(tmp_path / "s-0.tar"), windw=3)


def test_old_signed_header_checksums_still_read():
    import struct

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tar:
        _member(tar, "caf\u00e9.txt", b"x")  # 0xe9 in the name: signed and unsigned sums differ
    data = bytearray(buf.getvalue())
    signed = sum(struct.unpack_from("148b8x356b", bytes(data[:512]))) + 8 * 32
    data[148:156] = b"%06o\0 " % signed
    assert [s["__key__"] for s in samples_from_chunks([bytes(data)], "mem://s.tar")] == ["caf\udce9"]
    assert sdx.tar_sample_offsets([bytes(data)], "mem://s.tar").tolist() == [0, 1024]
    data[148:156] = b"%06o\0 " % (signed + 1)
    with pytest.raises(sd.FormatError, match="checksum"):
        sdx.tar_sample_offsets([bytes(data)], "mem://s.tar")


def test_gcs_etag_build_and_stale(gcs_bucket):
    import gcsfs

    server, bucket = gcs_bucket
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options)
    for i, shard in enumerate(make_samples([3, 4])):
        fs.pipe_file(f"{bucket}/ds/shard-{i}.tar", tar_bytes(shard))
    shards = sd.expand_spec(f"gs://{bucket}/ds/", server.storage_options, suffixes=(".tar",))
    assert shards[0].etag and shards[0].etag == fs.info(shards[0].url)["md5Hash"]
    url = sdx.build_index(f"gs://{bucket}/ds/", server.storage_options, progress=False)
    assert url == f"gs://{bucket}/ds/_streamdata.sdx"
    assert sdx.lookup(shards, "auto", server.storage_options).counts.tolist() == [3, 4]
    old = fs.cat_file(shards[1].url)
    fs.pipe_file(shards[1].url, old.replace(b"s000004", b"s000099"))  # same size, other content
    fresh = sd.expand_spec(f"gs://{bucket}/ds/", server.storage_options, suffixes=(".tar",))
    with pytest.raises(sd.StaleIndexError, match="ETag"):
        sdx.lookup(fresh, "auto", server.storage_options)


def test_http_auto_lookup_and_build(tmp_path, http_server):
    for i, shard in enumerate(make_samples([2, 5])):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    server = http_server(tmp_path)
    urls = [server.url(f"s-{i}.tar") for i in range(2)]
    shards = sd.expand_spec(urls)
    assert all(s.size is None and s.etag is None for s in shards)  # HTTP is not listed
    before = len(server.requests)
    assert sdx.lookup(shards, "auto") is None  # a 404 at the default location: no index
    # HTTP is not listed: the old name is asked for after the new one's 404
    assert [r[1] for r in server.requests[before:]] == ["/_streamdata.sdx", "/streamdata.sdx"]
    built = sdx.build_index(str(tmp_path / "s-{0..1}.tar"))  # local build, served over HTTP
    assert built == str(tmp_path / "_streamdata.sdx")
    found = sdx.lookup(shards, "auto")
    assert found.url == server.url("_streamdata.sdx") and found.counts.tolist() == [2, 5]
    signed = [sd.Shard(u + "?X-Amz-Signature=abc") for u in urls]
    before = len(server.requests)
    assert sdx.lookup(signed, "auto") is None and len(server.requests) == before  # no default location


def test_writing_the_new_name_keeps_the_old_name_entries(tmp_path):
    """A writer adding shards to a folder indexed under the old name (``streamdata.sdx``) writes
    ``_streamdata.sdx`` with the old entries and its own, so the whole folder stays indexed;
    ``build_index`` resumes from the old index without reading its shards again."""
    for i, shard in enumerate(make_samples([3, 2, 4])):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    shards = sd.expand_spec(str(tmp_path / "s-{0..2}.tar"))
    entries = [sdx.ShardEntry(s.url, s.size, None, len(o) - 1, o) for s, o in
               zip(shards, [sdx.tar_sample_offsets([Path(s.url).read_bytes()], s.url) for s in shards],
                   strict=True)]
    old = str(tmp_path / sdx.LEGACY_INDEX_NAME)
    sdx.write_index(old, entries[:2])
    new = sdx.default_index_url([s.url for s in shards])
    assert new == str(tmp_path / "_streamdata.sdx")
    assert sdx.lookup(shards[:2], "auto").url == old  # only the old name: read
    sdx.write_index(new, entries[2:])
    assert [e.name for e in sdx.read_index(new)] == ["s-0.tar", "s-1.tar", "s-2.tar"]
    assert sdx.lookup(shards, "auto").counts.tolist() == [3, 2, 4]
    (tmp_path / "_streamdata.sdx").unlink()
    read: list[str] = []
    assert sdx.build_index(str(tmp_path / "s-{0..2}.tar"), progress=read.append) == new
    assert [e.name for e in read] == ["s-2.tar"]  # s-0 and s-1 taken from the old index
    assert sdx.lookup(shards, "auto").url == new
