"""docs/frameworks.md's recipes under the real frameworks (2 CPU processes, gloo, the S3 test
server, 13 uneven tar shards with a sample index): every sample exactly once per epoch, the same
steps on every rank, and a run stopped at a seeded step resumed through the framework's own
checkpointing exactly (no sample twice, none lost). Each recipe is the marked block of its job in
tests/jobs/, kept identical to the page here."""

from __future__ import annotations

import collections
import random
import re
from pathlib import Path

import pytest

from tests.helpers import torchrun, write_shards

DOC = Path(__file__).resolve().parent.parent / "docs" / "frameworks.md"
JOBS = Path(__file__).parent / "jobs"
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17, 6]  # 119 samples
TIME_LIMIT_S = 240


def _recipe(job: str) -> str:
    text = (JOBS / job).read_text()
    start = text.index("\n", text.index("# --- recipe:")) + 1
    return text[start:text.index("# --- end of recipe ---")].strip()


def _doc_block(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    stop = text.find("\n## ", start + 1)
    section = text[start:stop if stop >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0].strip()


@pytest.mark.parametrize("heading,job", [("Lightning", "lightning_job.py")])
def test_the_pages_recipes_are_the_jobs(heading, job):
    assert _doc_block(heading) == _recipe(job)


@pytest.fixture(scope="module")
def shards(s3_server):
    import uuid

    import s3fs

    import streamdata as sd

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    keys = write_shards(fs, f"{bucket}/train", counts=COUNTS)
    sd.build_index(f"s3://{bucket}/train/", storage_options=s3_server.storage_options, progress=False)
    try:
        yield {"spec": f"s3://{bucket}/train/", "storage_options": s3_server.storage_options}, keys
    finally:
        s3_server.delete_bucket(bucket)


def _check(runs: list[list[dict]], everything: list[str], epochs: int = 2) -> None:
    """Each run's ranks trained the same number of steps; over the runs, every epoch trained every
    sample exactly once."""
    for run in runs:
        steps = [rank["steps"] for rank in run]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
    for epoch in range(epochs):
        got = collections.Counter(k for run in runs for rank in run
                                  for k in rank["trained"].get(str(epoch), []))
        assert max(got.values()) == 1, f"epoch {epoch}: twice {sorted(k for k, n in got.items() if n > 1)}"
        assert sorted(got) == sorted(everything), f"epoch {epoch}: lost {sorted(set(everything) - set(got))}"


@pytest.mark.slow
def test_lightning_trainer_ddp_resumes_from_its_checkpoint_exactly(shards, tmp_path):
    """Lightning's set-up probes the loader with iter() before loading its state, and its fetcher
    holds one batch ahead when it saves: the resumed run trains exactly the rest."""
    case, everything = shards
    stop = random.Random(7).randint(2, 13)  # of about 15 steps over two epochs
    cfg = {**case, "ckpt_dir": str(tmp_path / "ckpts")}
    first = torchrun(JOBS / "lightning_job.py", tmp_path, 2, {**cfg, "tag": "first", "stop": stop},
                     TIME_LIMIT_S)
    assert (tmp_path / "ckpts" / "last.ckpt").exists()
    assert sum(len(v) for v in first[0]["trained"].values()) > 0
    after = torchrun(JOBS / "lightning_job.py", tmp_path, 2, {**cfg, "tag": "after"}, TIME_LIMIT_S)
    _check([first, after], everything)
