"""WORKER-MEMORY and INHERITED-HEAP (streamdata/_alloc.py), and where the fork hooks act.

A worker allocates and frees 96 MiB in 1 MiB blocks, twice, and counts the page faults of
the second round: with glibc's defaults the freed memory went back to the OS (at most 64 MiB
of free heap is kept even at its most generous) and is faulted in again; with
``reuse_worker_memory`` (the default) the second round reuses it.

``import streamdata`` registers no fork hook; once a dataset has iterated, a DataLoader
worker's fork freezes the inherited heap, and any other child the process forks keeps its
collector as Python has it (checked in fresh interpreters).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import IterableDataset

import streamdata as sd
from streamdata import _alloc, _fork

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


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_reuse_freed_memory_by_default(context):
    if not _glibc():
        pytest.skip("not glibc malloc on ordinary pages")
    with sd.loader(FaultProbe(), num_workers=1, pin_memory=False, multiprocessing_context=context) as feed:
        [batch] = list(feed)
    assert int(batch["faults"][0]) < PAGES // 10, int(batch["faults"][0])


@pytest.mark.slow
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

    _fork.install()  # as a streamdata dataset's first iteration does (the probe is not one)
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


# ---- which forks the hooks act on, in fresh interpreters --------------------------------

REPO = Path(__file__).resolve().parents[1]

_FORKS = r"""
import gc, json, multiprocessing, os, sys
import numpy as np
import streamdata as sd
from streamdata import _fork
from streamdata.store import loop
from torch.utils.data import DataLoader, IterableDataset

def collector():
    return {"frozen": gc.get_freeze_count(), "collecting": gc.isenabled(),
            "loops_inherited": [lt.inherited for lt in loops]}

def plain_fork():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, json.dumps(collector()).encode())
        os._exit(0)
    os.close(write)
    got = json.loads(os.read(read, 1 << 16))
    os.waitpid(pid, 0)
    return got

def pool_child():
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(collector)

class Probe(IterableDataset):
    def __iter__(self):
        yield collector()

def worker():
    [got] = list(DataLoader(Probe(), batch_size=None, num_workers=1, multiprocessing_context="fork"))
    return got

held = [[i] for i in range(50_000)]  # tracked objects every child inherits
loops = []
out = {"import": {"installed": _fork.installed(), "plain": plain_fork(), "pool": pool_child()}}
with sd.ShardWriter(os.path.join(sys.argv[1], "s-%06d.tar"), maxcount=8, progress=False) as w:
    for i in range(16):
        w.write({"__key__": f"{i:04d}", "x.npy": np.arange(4) + i})
it = iter(sd.TarDataset(os.path.join(sys.argv[1], "s-{000000..000001}.tar")))
next(it)  # a pass is open: its loop thread is alive while the children are forked
loops = list(loop._live)
out["iterated"] = {"installed": _fork.installed(), "plain": plain_fork(), "pool": pool_child(),
                   "worker": worker(), "parent": collector()}
print(json.dumps(out))
"""


def _forks_seen(tmp_path: Path, **env: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _FORKS, str(tmp_path)], capture_output=True, text=True,
                         timeout=240, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_installs_nothing_and_only_dataloader_workers_are_frozen(tmp_path):
    """After ``import streamdata`` no hook is registered; after a dataset iterated, a plain
    ``os.fork()`` child and a ``multiprocessing`` pool child see an untouched collector (and
    FORK-RESET still marks the loop they inherited), while a DataLoader worker's is frozen."""
    seen = _forks_seen(tmp_path)
    before, after = seen["import"], seen["iterated"]
    assert before["installed"] is False
    for child in (before["plain"], before["pool"]):
        assert child["frozen"] == 0 and child["collecting"], child
    assert after["installed"] is True
    for child in (after["plain"], after["pool"]):
        assert child["frozen"] == 0 and child["collecting"], child
    assert after["plain"]["loops_inherited"] and all(after["plain"]["loops_inherited"]), after["plain"]
    assert after["worker"]["frozen"] >= 50_000 and after["worker"]["collecting"], after["worker"]
    assert all(after["worker"]["loops_inherited"]), after["worker"]
    assert after["parent"]["frozen"] == 0 and after["parent"]["collecting"], after["parent"]
    assert after["parent"]["loops_inherited"] == [False] * len(after["parent"]["loops_inherited"])


@pytest.mark.slow
def test_with_freezing_off_a_worker_is_not_frozen_either(tmp_path):
    seen = _forks_seen(tmp_path, STREAMDATA_FREEZE_AT_FORK="0")["iterated"]
    assert seen["worker"]["frozen"] < 50_000 and seen["worker"]["collecting"], seen["worker"]
    assert seen["plain"]["frozen"] == 0, seen["plain"]
