"""Real ``torchrun`` jobs over ``sd.TokenDataset`` (gloo on CPU, the S3 test server), for flat
.bin, Megatron .bin + .idx (also with packing="fit"), Parquet list columns and tar shards of
.npy fields: a whole epoch on 2 ranks x 2 workers (every token of the stream in exactly one
sequence, equal steps), and, for flat .bin and tar, on 1 and 3 ranks x 0 and 2 workers; the
same job stopped at a seeded step, its state restarted on 2 x 2, 3 x 1 and 1 x 0: before +
after = the epoch's sequences exactly."""

from __future__ import annotations

import collections
import io
import random
import tarfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from streamdata.formats.tokens import idx_bytes
from tests.helpers import torchrun

JOB = Path(__file__).parent / "jobs" / "tokens_job.py"
TIME_LIMIT_S = 300
WORLDS = (("same", 2, 2), ("three", 3, 1), ("one", 1, 0))  # tag, ranks, workers
LENGTHS = [[30, 0, 75, 12], [160], [9, 14, 3, 40, 21], [55, 66]]  # documents per file: 485 tokens
WHOLE = [(name, tag, workers) for name in ("bin", "tar") for tag in ("one", "three") for workers in (0, 2)]


def _tar(docs: list) -> bytes:
    """A tar shard of one sample per document, its tokens a .npy field."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for k, doc in enumerate(docs):
            npy = io.BytesIO()
            np.save(npy, doc.astype(np.uint16))
            info = tarfile.TarInfo(f"doc{k:04d}.npy")
            info.size = len(npy.getvalue())
            tar.addfile(info, io.BytesIO(npy.getvalue()))
    return out.getvalue()


def _write(fs, bucket: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    at = 0
    for i, lengths in enumerate(LENGTHS):
        docs = [np.arange(at + sum(lengths[:k]), at + sum(lengths[:k + 1])) for k in range(len(lengths))]
        at += sum(lengths)
        flat = np.concatenate(docs).astype(np.uint16)
        fs.pipe_file(f"{bucket}/bin/part-{i}.bin", flat.tobytes())
        fs.pipe_file(f"{bucket}/idx/part-{i}.bin", flat.tobytes())
        fs.pipe_file(f"{bucket}/idx/part-{i}.idx", idx_bytes(lengths, np.uint16))
        fs.pipe_file(f"{bucket}/tar/part-{i}.tar", _tar(docs))
        with fs.open(f"{bucket}/parquet/part-{i}.parquet", "wb") as f:
            pq.write_table(pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))}),
                           f, row_group_size=2)
    common = {"seq_len": 16, "batch_size": 3, "shuffle": True, "seed": 5}
    return {"bin": {"spec": f"s3://{bucket}/bin/", "options": {**common, "dtype": "uint16"}},
            "idx": {"spec": f"s3://{bucket}/idx/", "options": {**common, "eos_id": 60000, "partial": "pad",
                                                             "targets": True}},
            "idx-fit": {"spec": f"s3://{bucket}/idx/",
                        "options": {**common, "eos_id": 60000, "packing": "fit", "documents": True}},
            "parquet": {"spec": f"s3://{bucket}/parquet/",
                        "options": {**common, "column": "tokens", "bos_id": 60001}},
            "tar": {"spec": f"s3://{bucket}/tar/",
                    "options": {**common, "field": "npy", "bos_id": 60001, "eos_id": 60000}}}


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    import s3fs

    import streamdata as sd

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    tmp_path = tmp_path_factory.mktemp("tokens-ddp")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
        cases = _write(fs, bucket)
        for case in cases.values():
            case["options"]["storage_options"] = s3_server.storage_options
        everything = {}
        for name, case in cases.items():  # the epoch's sequences, read by one reader here
            ds = sd.TokenDataset(case["spec"], **case["options"])
            ds.set_epoch(1)
            everything[name] = [tuple(s) for b in ds for s in b["input_ids"].tolist()]
        stops = {name: random.Random(7 + i).randint(2, 8) for i, name in enumerate(cases)}
        first = torchrun(JOB, tmp_path, 2, {"workers": 2, "tag": "first", "cases": {
            **{f"{name}-whole": case for name, case in cases.items()},
            **{name: {**case, "stop": stops[name], "save": str(tmp_path / f"{name}.json")}
               for name, case in cases.items()}}}, TIME_LIMIT_S)
        after = {tag: torchrun(JOB, tmp_path, nproc, {"workers": workers, "tag": tag, "cases": {
            **{name: {**case, "load": str(tmp_path / f"{name}.json")} for name, case in cases.items()},
            **{f"{name}-whole-{w}": {**cases[name], "workers": w} for name, t, w in WHOLE if t == tag}}},
            TIME_LIMIT_S) for tag, nproc, workers in WORLDS}
        yield everything, stops, first, after
    finally:
        s3_server.delete_bucket(bucket)


def _seqs(ranks: list[dict], name: str) -> list[tuple]:
    return [tuple(s) for r in ranks for s in r[name]["seqs"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bin", "idx", "idx-fit", "parquet", "tar"])
def test_torchrun_every_token_once_and_exact_resume(runs, name):
    everything, stops, first, after = runs
    whole = [r[f"{name}-whole"] for r in first]
    assert whole[0]["all_steps"] == [whole[0]["steps"]] * 2, "unequal steps"
    assert collections.Counter(_seqs(first, f"{name}-whole")) == collections.Counter(everything[name])
    assert [r[name]["steps"] for r in first] == [stops[name]] * 2
    before = _seqs(first, name)
    for tag, _, _ in WORLDS:
        run = after[tag]
        assert len(set(run[0][name]["all_steps"])) == 1, (tag, run[0][name]["all_steps"])
        got = collections.Counter(before + _seqs(run, name))
        assert got == collections.Counter(everything[name]), f"{tag}: a sequence lost or twice"



@pytest.mark.slow
@pytest.mark.parametrize("name,tag,workers", WHOLE)
def test_torchrun_whole_epoch_on_one_and_three_ranks(runs, name, tag, workers):
    everything, _, _, after = runs
    ranks = [r[f"{name}-whole-{workers}"] for r in after[tag]]
    assert ranks[0]["all_steps"] == [ranks[0]["steps"]] * len(ranks), "unequal steps"
    got = collections.Counter(_seqs(after[tag], f"{name}-whole-{workers}"))
    assert got == collections.Counter(everything[name]), "a sequence lost or twice"
