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
    f = RangedFile(lambda s, e: (asked.append(e - s), data[s:e])[1], len(data), block=1024, read_ahead=0)
    assert f.read(10 * 1024) == data[:10 * 1024]
    assert asked == [1024, 2048, 4096, 8192]  # 1, 2, 4, 8 blocks, one request at a time
    f.seek(500_000)
    f.read(10)
    assert asked[-1] == 1024 and f.requests == len(asked) and f.bytes_read == sum(asked)


def test_a_sequential_run_reads_ahead_by_requests_sent_together():
    """Each round of a run asks for 16 times the blocks of the one before, up to read_ahead
    bytes, in requests of up to 8 blocks sent together (at most in_flight of them)."""
    data = random.Random(2).randbytes(1 << 20)
    rounds: list[list[tuple[int, int]]] = []

    def read_ranges(ranges):
        rounds.append(list(ranges))
        return [data[s:e] for s, e in ranges]

    def read_range(s, e):
        return read_ranges([(s, e)])[0]

    f = RangedFile(read_range, len(data), block=1024, read_ranges=read_ranges, read_ahead=32 * 1024,
                   in_flight=3)
    assert f.read(100 * 1024) == data[:100 * 1024]
    sizes = [[e - s for s, e in r] for r in rounds]
    k = 1024
    # 1 block, 16, then 24 (3 requests in flight)
    assert sizes[:3] == [[k], [8 * k, 8 * k], [8 * k, 8 * k, 8 * k]]
    assert all(sum(r) <= 32 * k and len(r) <= 3 for r in sizes)  # the byte cap, the requests in flight
    # one run, nothing read twice
    assert all(a[-1][1] == b[0][0] for a, b in zip(rounds, rounds[1:], strict=False))
    assert f.requests == sum(map(len, sizes)) and f.bytes_read == sum(map(sum, sizes))
    assert f.bytes_read < 100 * k + 32 * k  # ahead of the reads by at most one round
    f.seek(700_000)
    assert f.read(10) == data[700_000:700_010]
    assert len(rounds) == len(sizes) + 1 and rounds[-1] == [(683 * k, 684 * k)]  # a seek: one block


def test_an_object_shorter_than_its_size_is_a_format_error():
    import streamdata as sd

    f = RangedFile(lambda s, e: b"x" * max(0, min(e, 100) - s), 1000, block=64)
    with pytest.raises(sd.FormatError, match="ended at"):
        f.read(500)
