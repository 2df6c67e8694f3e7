"""WORKER-MEMORY (streamdata/_alloc.py): sd.loader's workers keep the memory they free.

A worker allocates and frees 96 MiB in 1 MiB blocks, twice, and counts the page faults of
the second round: with glibc's defaults the freed memory went back to the OS (at most 64 MiB
of free heap is kept even at its most generous) and is faulted in again; with
``reuse_worker_memory`` (the default) the second round reuses it.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from pathlib import Path

import pytest
from torch.utils.data import IterableDataset

import streamdata as sd
from streamdata import _alloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

BLOCKS, BLOCK = 96, 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
PAGES = BLOCKS * BLOCK // PAGE


def _one_round() -> None:
    held = [bytearray(BLOCK) for _ in range(BLOCKS)]
    for block in held:
        block[::PAGE] = b"\1" * (BLOCK // PAGE)  # write every page
    del held


class FaultProbe(IterableDataset):
    """One sample: the page faults of the second of two identical allocation rounds."""

    def __iter__(self):
        _one_round()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _one_round()
        yield {"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_reuse_freed_memory_by_default(context):
    if not _glibc():
        pytest.skip("not glibc malloc on ordinary pages")
    with sd.loader(FaultProbe(), num_workers=1, pin_memory=False, multiprocessing_context=context) as feed:
        [batch] = list(feed)
    assert int(batch["faults"][0]) < PAGES // 10, int(batch["faults"][0])


def test_without_it_freed_memory_is_faulted_in_again():
    if not _glibc():
        pytest.skip("not glibc malloc on ordinary pages")
    with sd.loader(FaultProbe(), num_workers=1, pin_memory=False, multiprocessing_context="spawn",
                   reuse_worker_memory=False) as feed:
        [batch] = list(feed)
    assert int(batch["faults"][0]) > PAGES // 3, int(batch["faults"][0])


def _glibc() -> bool:
    """glibc malloc with ordinary pages (huge pages would fault once per 2 MiB)."""
    if _alloc._glibc() is None:
        return False
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        return False
    return "hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")


class FreezeProbe(IterableDataset):
    """One sample: how many objects this process's collector has frozen when iteration starts."""

    def __iter__(self):
        yield {"frozen": gc.get_freeze_count(), "pid": os.getpid(), "collecting": gc.isenabled()}


def _first_sample_of_a_forked_worker() -> dict:
    from torch.utils.data import DataLoader

    loader = DataLoader(FreezeProbe(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    [sample] = list(loader)
    return sample


def test_a_forked_worker_starts_with_everything_it_inherited_frozen():
    """INHERITED-HEAP: a plain DataLoader (no sd.loader, no worker_init_fn of ours) forks a
    worker whose collector already leaves the parent's objects alone; the parent's is untouched."""
    held = [[i] for i in range(50_000)]  # tracked objects the worker inherits
    before = gc.get_freeze_count()
    sample = _first_sample_of_a_forked_worker()
    assert sample["pid"] != os.getpid()
    assert sample["frozen"] >= len(held)
    assert gc.get_freeze_count() == before
    # the collector, off across the fork, is on again on both sides
    assert sample["collecting"] and gc.isenabled()


def test_a_collector_the_job_switched_off_stays_off_on_both_sides_of_the_fork():
    gc.disable()
    try:
        sample = _first_sample_of_a_forked_worker()
        assert not sample["collecting"] and not gc.isenabled()
    finally:
        gc.enable()


def test_freezing_at_fork_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("STREAMDATA_FREEZE_AT_FORK", "0")
    held = [[i] for i in range(50_000)]
    sample = _first_sample_of_a_forked_worker()
    assert sample["frozen"] < len(held)
