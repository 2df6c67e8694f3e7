"""Compressed tar shards (gzip, zstd): read like the plain shard, locally and over S3; chosen by
magic bytes; corrupt or truncated data is a FormatError (or a counted skip), never a hang."""

from __future__ import annotations

import gzip
import io
import random
import tarfile

import fsspec
import numpy as np
import pytest
import zstandard

import streamdata as sd
from streamdata.formats.compress import OUT_CHUNK, TAR_SUFFIXES, decompressed
from streamdata.formats.tar import samples_from_chunks
from tests.formats.test_fuzz import time_limit
from tests.helpers import read_keys


def _png(n: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((6, 8, 3), n % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def sample_tar(first: int, count: int) -> bytes:
    """Like WebDataset's ``testdata/sample.tgz`` (written with tarfile): ``png``, ``cls`` and
    ``json`` members per sample."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for n in range(first, first + count):
            for ext, data in (("cls", str(n % 10).encode()), ("json", b'{"n": %d}' % n), ("png", _png(n))):
                info = tarfile.TarInfo(f"sample/{n:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzip_members(data: bytes, pieces: int = 3) -> bytes:
    """``data`` as a multi-member gzip stream (as ``cat a.gz b.gz`` or pigz make)."""
    cut = [len(data) * i // pieces for i in range(pieces + 1)]
    return b"".join(gzip.compress(data[a:b]) for a, b in zip(cut, cut[1:], strict=False))


def zstd_frames(data: bytes, pieces: int = 3) -> bytes:
    cut = [len(data) * i // pieces for i in range(pieces + 1)]
    c = zstandard.ZstdCompressor(write_checksum=True)
    frames = [c.compress(data[a:b]) for a, b in zip(cut, cut[1:], strict=False)]
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    return frames[0] + skippable + b"".join(frames[1:])


def sample_tgz(first: int, count: int) -> bytes:
    """``tarfile`` mode ``w:gz``, the way WebDataset's sample.tgz was made."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        gz.write(sample_tar(first, count))
    return buf.getvalue()


SHARDS = [(0, 30), (30, 30), (60, 30)]  # 90 samples, as in sample.tgz

FORMATS = {
    ".tar": lambda a, n: sample_tar(a, n),
    ".tgz": sample_tgz,
    ".tar.gz": lambda a, n: gzip_members(sample_tar(a, n)),
    ".tar.zst": lambda a, n: zstd_frames(sample_tar(a, n)),
    ".tar.zstd": lambda a, n: zstandard.ZstdCompressor().compress(sample_tar(a, n)),
}


def write_all(fs, prefix: str) -> None:
    for suffix, make in FORMATS.items():
        for i, (a, n) in enumerate(SHARDS):
            fs.pipe_file(f"{prefix}/{suffix.strip('.').replace('.', '_')}-{i}{suffix}", make(a, n))
    fs.pipe_file(f"{prefix}/meta.json", b"{}")  # not a shard: listings leave it out


def samples(ds) -> dict[str, dict]:
    import torch

    out = {}
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                                         timeout=60)
    for s in loader:
        key = s.pop("__key__")
        s.pop("__url__")
        assert key not in out, key
        out[key] = s
    return out


def _check_formats(root: str, options: dict | None = None) -> None:
    want = samples(sd.TarDataset(f"{root}/tar-*.tar", decode=False, storage_options=options))
    assert len(want) == 90 and set(want["sample/0007"]) == {"cls", "json", "png"}
    for suffix in FORMATS:
        name = suffix.strip(".").replace(".", "_")
        got = samples(sd.TarDataset(f"{root}/{name}-*{suffix}", decode=False, storage_options=options))
        assert got == want, suffix


def test_compressed_shards_read_like_the_plain_shard_local(tmp_path):
    write_all(fsspec.filesystem("file"), str(tmp_path))
    _check_formats(str(tmp_path))
    # decoded, too: the png of sample n is n's gray level
    ds = sd.TarDataset(str(tmp_path / "tgz-0.tgz"))
    first = next(iter(ds))
    assert first["__key__"] == "sample/0000" and first["cls"] == 0 and first["png"].shape == (3, 6, 8)


def test_compressed_shards_read_like_the_plain_shard_s3(s3_bucket):
    server, bucket = s3_bucket
    fs = fsspec.filesystem("s3", **server.storage_options)
    write_all(fs, bucket)
    _check_formats(f"s3://{bucket}", server.storage_options)
    # a prefix lists every tar suffix (and not the .json): each sample once per format
    shards = sd.expand_spec(f"s3://{bucket}/", server.storage_options, suffixes=TAR_SUFFIXES)
    assert len(shards) == len(FORMATS) * len(SHARDS)
    assert not [s for s in shards if s.url.endswith(".json")]
    ds = sd.TarDataset(f"s3://{bucket}/", storage_options=server.storage_options, decode=False)
    keys = read_keys(ds, num_workers=2)
    assert sorted(keys) == sorted(f"sample/{n:04d}" for n in range(90) for _ in FORMATS)


def test_webdataset_reads_the_same_gzip_shard(tmp_path):
    wds = pytest.importorskip("webdataset")
    path = tmp_path / "sample.tgz"
    path.write_bytes(sample_tgz(0, 90))
    theirs = [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)]
    ours = [s["__key__"] for s in sd.TarDataset(str(path), decode=False)]
    assert ours == theirs and len(ours) == 90


def test_magic_bytes_win_over_a_misleading_suffix(tmp_path):
    plain = sample_tar(0, 5)
    (tmp_path / "gzip-named.tar").write_bytes(gzip.compress(plain))
    (tmp_path / "zstd-named.tar.gz").write_bytes(zstandard.ZstdCompressor().compress(plain))
    (tmp_path / "plain-named.tgz").write_bytes(plain)
    want = [s["__key__"] for s in samples_from_chunks([plain])]
    for name in ("gzip-named.tar", "zstd-named.tar.gz", "plain-named.tgz"):
        ds = sd.TarDataset(str(tmp_path / name), decode=False)
        assert [s["__key__"] for s in ds] == want, name


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_any_chunking_and_bounded_output(codec):
    data = sample_tar(0, 12)
    packed = gzip_members(data) if codec == "gzip" else zstd_frames(data)
    rng = random.Random(0)
    for most in (1, 3, 7, 4096, len(packed)):
        pieces, pos = [], 0
        while pos < len(packed):
            step = rng.randint(1, most)
            pieces.append(packed[pos:pos + step])
            pos += step
        out, compressed = decompressed(pieces, "u")
        assert compressed and b"".join(out) == data
    # a decompression bomb comes out a bounded piece at a time
    zeros = bytes(64 << 20)
    bomb = gzip.compress(zeros, 9) if codec == "gzip" else zstandard.ZstdCompressor().compress(zeros)
    out, _ = decompressed([bomb], "u")
    sizes = [len(c) for c in out]
    assert sum(sizes) == len(zeros) and max(sizes) <= OUT_CHUNK


@pytest.mark.parametrize("suffix", [".tgz", ".tar.zst"])
def test_corrupt_and_truncated_compressed_shards(tmp_path, suffix):
    good = FORMATS[suffix](0, 20)
    cases = {"truncated": good[:len(good) // 2], "cut-at-70%": good[:len(good) * 7 // 10],
             "flipped": _flip(good, len(good) // 3), "empty-frame": good[:3]}
    for what, data in cases.items():
        path = tmp_path / f"bad-{what}{suffix}"
        path.write_bytes(data)
        with pytest.raises(sd.FormatError) as info:
            list(sd.TarDataset(str(path), decode=False))
        assert str(path) in str(info.value), what
        assert ("gzip" if suffix == ".tgz" else "zstd") in str(info.value), what
    # under on_error="skip": the good shard's samples, the bad ones counted
    (tmp_path / f"good{suffix}").write_bytes(good)
    ds = sd.TarDataset(f"{tmp_path}/*{suffix}", decode=False, on_error="skip")
    keys = read_keys(ds, num_workers=2)
    assert len(keys) >= 20 and set(keys) >= {f"sample/{n:04d}" for n in range(20)}
    assert ds.skipped["format"] == len(cases)


def _flip(data: bytes, at: int) -> bytes:
    mutated = bytearray(data)
    for i in range(at, min(at + 16, len(data))):
        mutated[i] ^= 0x5A
    return bytes(mutated)


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.zst"])
def test_mutated_compressed_shards_never_hang(suffix):
    """Fuzz: bit flips, cuts and splices of compressed shards give samples or our error only."""
    good = FORMATS[suffix](0, 6)
    rng = random.Random(suffix)
    for case in range(150):
        data = bytearray(good)
        kind = case % 3
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del data[rng.randrange(len(data)):]
        else:
            at = rng.randrange(len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        with time_limit(10.0):
            try:
                chunks, _ = decompressed([bytes(data[:100]), bytes(data[100:])], "u")
                list(samples_from_chunks(chunks, "u"))
            except sd.StreamDataError:
                pass
