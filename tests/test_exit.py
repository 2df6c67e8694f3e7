"""CLOSE-AT-EXIT (streamdata/store/loop.py): a process that ends with an iterator still open
exits cleanly, on every path.

Each case is a fresh interpreter that opens a pass over a few shards, keeps it open (a peeked
batch, a ``break``, an exception still held with its traceback), and ends: through direct
iteration, a plain ``DataLoader`` with 0 or 2 workers, and ``sd.loader``; over tar and
Parquet; from local files and from the S3 test server. The exit must be code 0, without an
abort (``terminate called``: a thread stopped in native code at finalisation), asyncio's
"Task was destroyed but it is pending!", an ignored exception or a traceback on stderr. Timing
decides some of these, so the default tests run each path once, the formats taking turns, and
the slow tests repeat every pair of path and format.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import streamdata as sd

pytestmark = pytest.mark.slow  # exit paths in fresh interpreters, seconds each: `make test-slow`, and CI

REPO = Path(__file__).resolve().parents[1]
HOWS = ("peek", "break", "raise", "dataloader0", "dataloader2", "loader")
FORMATS = ("tar", "parquet")
REPEATS = 12  # of each case, in the slow test
_UNCLEAN = re.compile(r"Task was destroyed|terminate called|Exception ignored|Traceback")
_EXIT_LIMIT_S = 120  # the case's whole run: imports, listing, one batch, exit
_SLOW_LIMIT_S = 1800  # 144 runs, two at a time, of some 3-8 s each on a loaded 2-core machine

_CASE = r"""
import json, os, sys
import streamdata as sd
from torch.utils.data import DataLoader

how, fmt, root = sys.argv[1:4]
options = json.loads(os.environ.get("SD_EXIT_OPTIONS") or "null")
if fmt == "tar":
    ds = sd.TarDataset(root + "/s-{000000..000003}.tar", storage_options=options, batch_size=4)
else:
    ds = sd.ParquetDataset(root + "/p-{000000..000003}.parquet", storage_options=options, batch_size=4)

def train():
    for batch in ds:
        raise RuntimeError("the training step failed")

if how == "peek":
    it = iter(ds)
    first = next(it)
elif how == "break":
    for first in ds:
        break
elif how == "raise":
    try:
        train()
    except RuntimeError as exc:
        held = exc  # its traceback keeps the pass's frames, and so the pass, open
elif how.startswith("dataloader"):
    it = iter(DataLoader(ds, batch_size=None, num_workers=int(how[len("dataloader"):])))
    first = next(it)
elif how == "loader":
    feed = sd.loader(ds, batch_size=None, num_workers=2)
    it = iter(feed)
    first = next(it)
print("took a batch")
"""


def _write(root: Path) -> None:
    with sd.ShardWriter(str(root / "s-%06d.tar"), maxcount=16, progress=False) as writer:
        for i in range(64):
            writer.write({"__key__": f"{i:05d}", "x.npy": np.arange(32, dtype=np.float32) + i,
                          "cls": str(i)})
    sd.write_parquet({"x": list(range(256)), "y": [float(i) for i in range(256)]},
                     str(root / "p-{shard:06d}.parquet"), rows_per_shard=64, row_group_size=16)


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("exit")
    _write(root)
    return str(root)


@pytest.fixture(scope="module")
def s3_root(s3_server, tmp_path_factory: pytest.TempPathFactory):
    import s3fs

    root = tmp_path_factory.mktemp("exit-s3")
    _write(root)
    bucket = "sd-exit-test"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    for path in sorted(root.iterdir()):
        fs.put_file(str(path), f"{bucket}/{path.name}")
    yield f"s3://{bucket}", s3_server.storage_options
    s3_server.delete_bucket(bucket)


def _run_case(how: str, fmt: str, root: str, options: dict | None = None) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SD_EXIT_OPTIONS": json.dumps(options)}
    run = subprocess.run([sys.executable, "-c", _CASE, how, fmt, root], capture_output=True, text=True,
                         timeout=_EXIT_LIMIT_S, cwd=REPO, env=env)
    return run.returncode, run.stdout, run.stderr


def _check_cases(cases: list[tuple[str, str]], root: str, options: dict | None = None,
                 repeats: int = 1) -> None:
    """Run every case ``repeats`` times (two at a time: exits overlap other processes' work,
    as they do in a job) and report every unclean exit at once."""
    runs = [case for case in cases for _ in range(repeats)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: (case, *_run_case(*case, root, options)), runs))
    unclean = [f"{how}/{fmt}: exit {code}; stderr: {err.strip()[-1500:]}"
               for (how, fmt), code, out, err in results
               if code != 0 or "took a batch" not in out or _UNCLEAN.search(err)]
    assert not unclean, f"{len(unclean)} of {len(runs)} exits unclean:\n" + "\n".join(unclean)


def _each_path_once(hows: tuple[str, ...], first: int) -> list[tuple[str, str]]:
    """Each of ``hows`` once, the formats taking turns (the slow tests run every pair, many times)."""
    return [(how, FORMATS[(first + i) % len(FORMATS)]) for i, how in enumerate(hows)]


def test_every_path_exits_cleanly_from_local_files(local_root):
    """Half the paths here, the other half from S3: each path once in the default suite."""
    _check_cases(_each_path_once(HOWS[0::2], 0), local_root)


def test_every_path_exits_cleanly_from_s3(s3_root):
    root, options = s3_root
    _check_cases(_each_path_once(HOWS[1::2], 1), root, options)


@pytest.mark.timeout(_SLOW_LIMIT_S)
def test_every_path_exits_cleanly_every_time_from_local_files(local_root):
    _check_cases([(how, fmt) for how in HOWS for fmt in FORMATS], local_root, repeats=REPEATS)


@pytest.mark.timeout(_SLOW_LIMIT_S)
def test_every_path_exits_cleanly_every_time_from_s3(s3_root):
    root, options = s3_root
    _check_cases([(how, fmt) for how in HOWS for fmt in FORMATS], root, options, repeats=REPEATS)
