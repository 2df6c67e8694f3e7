"""A real ``torchrun`` job over ``sd.TokenDataset(shuffle="sequences")`` (gloo on CPU, the S3 test
server): one flat ``.bin`` on 2 ranks x 2 workers, a whole epoch (every sequence of the stream
once, equal steps, not in the file's order) and the same job stopped at a seeded step, its state
restarted on 3 ranks x 1 worker: before + after = the epoch's sequences exactly."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import torchrun

JOB = Path(__file__).parent / "jobs" / "tokens_job.py"
TIME_LIMIT_S = 300
TOKENS = 40_003


@pytest.mark.slow
def test_torchrun_sequence_shuffle_every_token_once_and_resume_2x2_to_3x1(s3_bucket, tmp_path):
    import s3fs

    import streamdata as sd

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    fs.pipe_file(f"{bucket}/train.bin", np.arange(TOKENS, dtype=np.uint32).tobytes())
    options = {"seq_len": 15, "targets": True, "batch_size": 3, "dtype": "uint32", "shuffle": "sequences",
               "block_bytes": 12 * 16 * 4, "window_blocks": 3, "seed": 5, "partial": "pad", "pad_id": -1,
               "storage_options": server.storage_options}
    case = {"spec": f"s3://{bucket}/train.bin", "options": options}
    ds = sd.TokenDataset(case["spec"], **options)
    ds.set_epoch(1)  # (the job's epoch)
    everything = [tuple(s) for b in ds for s in b["input_ids"].tolist()]
    assert sorted(t for s in everything for t in s if t != -1) == list(range(TOKENS))
    stop = int(np.random.default_rng(7).integers(3, 60))
    save = str(tmp_path / "state.json")
    first = torchrun(JOB, tmp_path, 2, {"workers": 2, "tag": "first", "cases": {
        "whole": case, "stopped": {**case, "stop": stop, "save": save}}}, TIME_LIMIT_S)
    after = torchrun(JOB, tmp_path, 3, {"workers": 1, "tag": "after", "cases": {
        "resumed": {**case, "load": save}}}, TIME_LIMIT_S)

    whole = [tuple(s) for r in first for s in r["whole"]["seqs"]]
    assert first[0]["whole"]["all_steps"] == [first[0]["whole"]["steps"]] * 2, "unequal steps"
    assert collections.Counter(whole) == collections.Counter(everything)
    starts = [s[0] for s in first[0]["whole"]["seqs"]]
    assert starts != sorted(starts), "rank 0 read its sequences in the file's order"
    assert [r["stopped"]["steps"] for r in first] == [stop] * 2
    before = [tuple(s) for r in first for s in r["stopped"]["seqs"]]
    assert len(set(after[0]["resumed"]["all_steps"])) == 1, after[0]["resumed"]["all_steps"]
    resumed = [tuple(s) for r in after for s in r["resumed"]["seqs"]]
    assert collections.Counter(before + resumed) == collections.Counter(everything), (
        f"stopped at {stop}: a sequence lost or twice")
