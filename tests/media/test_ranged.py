"""formats.ranged.RangedFile: any read at any position gives the object's bytes, through whole
blocks, sequential runs in growing requests, a seek elsewhere starting small again."""

from __future__ import annotations

import io
import random

import pytest

from streamdata.formats.ranged import RangedFile


def test_reads_anywhere_are_the_objects_bytes():
    data = random.Random(0).randbytes(1_000_003)
    asked: list[tuple[int, int]] = []

    def read_range(start: int, end: int) -> bytes:
        asked.append((start, end))
        return data[start:end]

    f = io.BufferedReader(RangedFile(read_range, len(data), block=4096, keep=4), 1024)
    rng = random.Random(1)
    for _ in range(300):
        at, n = rng.randrange(len(data) + 10), rng.randrange(20_000)
        f.seek(at)
        assert f.read(n) == data[at:at + n]
    f.seek(0)
    assert f.read() == data
    assert all(0 <= s < e <= len(data) and s % 4096 == 0 for s, e in asked)


def test_a_sequential_run_grows_its_requests_and_a_seek_starts_small():
    data = bytes(range(256)) * 4096  # 1 MiB
    asked: list[int] = []
    f = RangedFile(lambda s, e: (asked.append(e - s), data[s:e])[1], len(data), block=1024)
    assert f.read(10 * 1024) == data[:10 * 1024]
    assert asked == [1024, 2048, 4096, 8192]  # 1, 2, 4, 8 blocks: the run reads ahead
    f.seek(500_000)
    f.read(10)
    assert asked[-1] == 1024 and f.requests == len(asked) and f.bytes_read == sum(asked)


def test_an_object_shorter_than_its_size_is_a_format_error():
    import streamdata as sd

    f = RangedFile(lambda s, e: b"x" * max(0, min(e, 100) - s), 1000, block=64)
    with pytest.raises(sd.FormatError, match="ended at"):
        f.read(500)
