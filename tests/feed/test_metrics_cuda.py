"""loader.metrics() with ``device="cuda"``: the stall fraction against a stopwatch in a loop
that uses each batch on the GPU, and the feed's own host times (``feed.pin_s``, ``feed.copy_s``)
present and within the loop's wall. Skipped without CUDA (tests/conftest.py); the CPU half is
tests/feed/test_metrics.py, whose helpers these reuse."""

from __future__ import annotations

import json
import time

import pytest

import streamdata as sd
from tests.feed.test_metrics import _check_readers, _local

pytestmark = pytest.mark.cuda


def _train_on_gpu(loader, step_s: float) -> dict:
    """As test_metrics._train, but each step reads its batch on the device (a sum, synchronised),
    so a batch counts as delivered only once it is usable there."""
    it, waits, steps = iter(loader), 0.0, 0
    start = time.perf_counter()
    batch = next(it)
    first = time.perf_counter()
    while True:
        assert batch["npy"].is_cuda
        batch["npy"].sum().item()
        time.sleep(step_s)
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            waits += time.perf_counter() - asked
            break
        waits += time.perf_counter() - asked
        steps += 1
    end = time.perf_counter()
    return {"first": first - start, "wait": waits, "wall": end - first, "steps": steps + 1,
            "fraction": waits / (end - first)}


def test_a_well_fed_gpu_loop_reports_no_stall_and_the_feeds_host_times(tmp_path):
    ds = sd.TarDataset(_local(tmp_path, [32] * 4, floats=4096), index=None)
    with sd.loader(ds, batch_size=16, num_workers=2, device="cuda") as loader:
        seen = _train_on_gpu(loader, 0.2)
        m = loader.metrics()
    assert m["steps"] == seen["steps"] == 8
    assert m["stall_fraction"] <= 0.05 and m["verdict"] is None, m
    assert abs(m["data_wait_s"] - seen["wait"]) < 0.02 + 0.05 * seen["wait"], (m, seen)
    assert abs(m["wall_s"] - seen["wall"]) < 0.05 * seen["wall"], (m, seen)
    # every batch was pinned and copied: each took host time, and together far less than the loop
    assert 0 < m["feed.pin_s"] < seen["wall"] and 0 < m["feed.copy_s"] < seen["wall"], m
    json.dumps(m)
    _check_readers(ds)


def test_a_starved_gpu_loop_reports_the_stopwatchs_stall(tmp_path):
    def slow(sample):
        time.sleep(0.004)
        return sample

    ds = sd.TarDataset(_local(tmp_path, [40] * 6), index=None, map=slow)
    with sd.loader(ds, batch_size=8, num_workers=2, device="cuda") as loader:
        seen = _train_on_gpu(loader, 0.002)
        m = loader.metrics()
    assert seen["fraction"] > 0.5
    assert abs(m["stall_fraction"] - seen["fraction"]) <= 0.05, (m, seen)
    assert m["verdict"].startswith("CPU-bound: workers are"), m
    assert m["feed.pin_s"] > 0 and m["feed.copy_s"] > 0, m
