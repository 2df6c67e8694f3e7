"""Stage timings (``metrics.StageClock``, ``ErrorPolicy.each``): every record's pull less the
waits for bytes is parsing, its ``prepare`` decoding, its ``map`` mapping; each flush takes the
nested times apart and fits the stages into what was measured.

The clock here is a counter the records themselves move (``time.perf_counter_ns`` replaced for
the test): what each record costs is known exactly, so the sums can be checked to the
nanosecond, with no timing of the machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import fsspec
import pytest
import torch

import streamdata as sd
from streamdata.errors import DecodeError
from streamdata.metrics import StageClock
from streamdata.policy import ErrorPolicy
from tests.helpers import write_shards


class _Table:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add_many(self, row: dict) -> None:
        self.rows.append(row)


class _Clock:
    """A clock the test moves; counts its reads."""

    def __init__(self) -> None:
        self.now = 10**9
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(time, "perf_counter_ns", fake)
    return fake


def _records(clock: _Clock, acc: list[int], n: int, parse_ns: int, wait_ns: int = 0):
    """``n`` records, each costing ``parse_ns`` to pull and ``wait_ns`` of waiting for bytes
    (the prefetcher's share: it adds its waits to the clock's ``WAIT`` itself)."""
    for i in range(n):
        clock.now += parse_ns + wait_ns
        acc[StageClock.WAIT] += wait_ns
        yield i


def _prepare(clock: _Clock, decode_ns: int):
    def prepare(i: int) -> int:
        clock.now += decode_ns
        return i * 10
    return prepare


@pytest.mark.parametrize("n", [0, 1, 9, 83])
def test_every_record_is_timed_exactly(clock, n):
    sc = StageClock(_Table())
    policy = ErrorPolicy(clock=sc)
    recs = _records(clock, sc.acc, n, parse_ns=5_000, wait_ns=3_000)
    out = list(policy.each(recs, _prepare(clock, 2_000), pull=StageClock.PARSE, run=StageClock.DECODE))
    assert out == [i * 10 for i in range(n)]
    acc = sc.acc
    assert acc[StageClock.WAIT] == n * 3_000  # the prefetcher's, never counted as parsing
    assert acc[StageClock.PARSE] == n * 5_000 and acc[StageClock.DECODE] == n * 2_000
    assert clock.reads == 1 + 3 * n + 2  # the clock's start, three a record, the end's pull


def test_a_long_wait_for_bytes_does_not_count_as_parsing(clock):
    sc = StageClock(_Table())
    policy = ErrorPolicy(clock=sc)
    recs = _records(clock, sc.acc, 16, parse_ns=1_000, wait_ns=10_000_000)
    list(policy.each(recs, _prepare(clock, 1_000), pull=StageClock.PARSE, run=StageClock.DECODE))
    assert sc.acc[StageClock.PARSE] == 16 * 1_000 and sc.acc[StageClock.WAIT] == 16 * 10_000_000


def test_a_map_stage_times_only_its_run_and_skips_keep_the_sums(clock):
    sc = StageClock(_Table())
    policy = ErrorPolicy("skip", clock=sc)

    def mapped(i: int) -> int:
        clock.now += 4_000
        if i % 5 == 0:
            raise DecodeError(f"bad {i}")
        return i

    recs = _records(clock, sc.acc, 40, parse_ns=1_000)
    out = list(policy.each(recs, mapped, run=StageClock.MAP))
    assert out == [i for i in range(40) if i % 5] and policy.skipped == 8
    assert sc.acc[StageClock.MAP] == 40 * 4_000 and sc.acc[StageClock.PARSE] == 0


def test_a_flush_fits_the_estimates_into_what_was_measured(clock):
    table = _Table()
    sc = StageClock(table)
    start = clock.now
    # samples put out one by one: each next() is busy time, the stages inside it
    sc.acc[:] = [1_000, 2_000, 3_000, 4_000, 12_000, 16, 0, 1_000, 0, 500]
    clock.now = start + 100_000
    sc.flush()
    row = table.rows[-1]
    assert row["busy_ns"] == 12_000 and row["collate_ns"] == 2_000 and row["wall_ns"] == 100_000
    # decode's parts per modality, as measured
    assert (row["decode_image_ns"], row["decode_video_ns"], row["decode_audio_ns"]) == (1_000, 0, 500)
    # batches: estimates over a batch's measured busy time are scaled into it, waits kept whole
    sc.acc[:] = [1_000, 4_000, 4_000, 0, 5_000, 32, 2, 2_000, 2_000, 0]
    clock.now += 100_000
    sc.flush()
    row = table.rows[-1]
    assert row["wait_bytes_ns"] == 1_000 and row["parse_ns"] == 2_000 and row["decode_ns"] == 2_000
    assert row["busy_ns"] == 5_000 and row["collate_ns"] == 0
    # decode's parts scaled with it
    assert (row["decode_image_ns"], row["decode_video_ns"], row["decode_audio_ns"]) == (1_000, 1_000, 0)
    # parts over their decode time (each on its own clock) are fitted into it
    sc.acc[:] = [0, 0, 1_000, 0, 10_000, 1, 0, 0, 1_500, 500]
    clock.now += 100_000
    sc.flush()
    row = table.rows[-1]
    assert row["decode_ns"] == 1_000 and (row["decode_video_ns"], row["decode_audio_ns"]) == (750, 250)
    # estimates under it: the rest is collating
    sc.acc[:] = [1_000, 1_000, 1_000, 1_000, 9_000, 32, 2, 0, 0, 0]
    clock.now += 100_000
    sc.flush()
    assert table.rows[-1]["collate_ns"] == 5_000


def test_samples_decoded_on_a_pool_keep_their_busy_time(tmp_path: Path):
    """With ``decode_threads`` the records are decoded and mapped on a pool that no stage
    times: a reader that puts out samples (a plain DataLoader batches them) times each
    ``next()``, so its busy time holds the pool's work (the verdict can say CPU-bound)."""
    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[12, 12], floats=8)

    def slow(sample):
        time.sleep(0.003)
        return sample

    ds = sd.TarDataset(f"file://{tmp_path}/shard-{{000..001}}.tar", index=None, map=slow, decode_threads=2)
    loader = sd.timed(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0))
    assert sum(len(batch["__key__"]) for batch in loader) == 24
    m = loader.metrics()
    assert m["samples"] == 24 and m["readers.busy_s"] >= 24 * 0.003 / 2  # two threads at most
    assert m["readers.busy_s"] <= m["readers.wall_s"] * 1.001
