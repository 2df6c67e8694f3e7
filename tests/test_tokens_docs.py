"""docs/tokens.md and the README's token recipe run as written, against the loopback S3 server:
a tiny GPT trains on a token corpus in a bucket (every token once, the loss falls); documents'
cu_seqlens flatten for a variable-length kernel; a chat corpus with loss masks trains on labels."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from streamdata.formats.tokens import idx_bytes
from tests.helpers import doc_blocks, s3_environment, tar_bytes

ROOT = Path(__file__).resolve().parent.parent
FILES, TOKENS = 4, 2_600  # tokens per flat .bin: 160 sequences of 65, 20 steps of 8


_blocks = doc_blocks


@pytest.fixture(scope="module")
def corpus(s3_server):
    import s3fs

    s3_server.create_bucket("corpus")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    rng = np.random.default_rng(0)
    for i in range(FILES):  # learnable: runs counting up modulo 97 from random starts
        starts = rng.integers(0, 97, TOKENS // 50)
        tokens = (starts[:, None] + np.arange(50)[None, :]).ravel() % 97 + 3  # (TOKENS: a multiple of 50)
        fs.pipe_file(f"corpus/tokens/part-{i}.bin", tokens.astype(np.uint16).tobytes())
    for i in range(2):
        lengths = rng.integers(1, 40, 30)
        ids = rng.integers(200, 500, lengths.sum()).astype(np.uint16)  # (apart from the flat corpus: 3..99)
        fs.pipe_file(f"corpus/megatron/part-{i}.bin", ids.tobytes())
        fs.pipe_file(f"corpus/megatron/part-{i}.idx", idx_bytes(lengths, np.uint16))
    for i in range(3):  # tar shards of .npy fields: 20 documents each, ids 600..699
        samples = [(f"d{i}-{k:02d}", rng.integers(600, 700, rng.integers(5, 60))) for k in range(20)]
        fs.pipe_file(f"corpus/npy/part-{i}.tar", tar_bytes(
            [{"__key__": key, "npy": _npy(ids.astype(np.uint32)), "txt": b"x"} for key, ids in samples]))
        fs.pipe_file(f"corpus/flat/part-{i}.bin", rng.integers(700, 800, 1000).astype(np.uint16).tobytes())
    fs.pipe_file("corpus/flat/tokens.json", json.dumps({"dtype": "uint16"}).encode())
    for i in range(3):  # conversations: a prompt (ids 10..199, mask 0), a reply (200..499, mask 1)
        prompts, replies = rng.integers(3, 20, 25), rng.integers(3, 30, 25)
        ids = np.concatenate([np.concatenate([rng.integers(10, 200, p), rng.integers(200, 500, r)])
                              for p, r in zip(prompts, replies, strict=True)])
        mask = np.concatenate([[0] * p + [1] * r for p, r in zip(prompts, replies, strict=True)])
        fs.pipe_file(f"corpus/chat/part-{i}.bin", ids.astype(np.uint16).tobytes())
        fs.pipe_file(f"corpus/chat/part-{i}.idx", idx_bytes(prompts + replies, np.uint16))
        fs.pipe_file(f"corpus/chat/part-{i}.mask.bin", mask.astype(np.uint8).tobytes())
    return s3_server


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.fixture
def aws(corpus, monkeypatch):
    opts = corpus.storage_options
    s3_environment(monkeypatch, opts)


def _run(code: str) -> dict:
    import streamdata as sd

    ns: dict = {"__name__": "__docs__"}
    exec(compile(code, "tokens recipe", "exec"), ns)
    for value in ns.values():
        if isinstance(value, sd.Loader):
            value.close()
    return ns


def _check_training(ns: dict) -> None:
    ds, losses = ns["ds"], ns["losses"]
    width = 65
    whole = FILES * TOKENS // width
    halves = (whole + 1) // 2, whole // 2  # two workers' spans, each batched by 8
    assert len(losses) == sum(-(-n // 8) for n in halves)  # one epoch: every whole sequence once
    assert ds.counts["tokens.dropped"] == FILES * TOKENS - whole * width
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, "the tiny GPT did not learn"
    assert ns["checkpoint"]["data"]["stages"], "a mid-epoch position"


@pytest.mark.slow  # (the README's loop, below, is the same loop in the default suite)
def test_the_docs_training_loop_runs(aws):
    gpt = _blocks(ROOT / "docs" / "tokens.md")[0]
    _check_training(_run(gpt))


def test_the_docs_recipes_run(aws):
    varlen, mix = _blocks(ROOT / "docs" / "tokens.md", "## Packing")[0], _blocks(ROOT / "docs" / "tokens.md",
                                                                                "## Mixing corpora")[0]
    ns = _run(varlen)
    assert int(ns["cu"][-1]) == 4 * 32 and len(ns["cu"]) > 5  # documents in the sequences
    batches = _run(mix)["batches"]
    assert len(batches) == 125 and all(tuple(b["input_ids"].shape) == (4, 32) for b in batches)
    web = sum(int(r[0]) < 100 for b in batches for r in b["input_ids"])  # the web corpus: ids 3..99
    assert 0.7 < web / 500 < 0.9


def test_the_docs_fine_tuning_recipe_runs(aws):
    (code,) = _blocks(ROOT / "docs" / "tokens.md", "## Fine-tuning data: loss masks and packing")
    ns = _run(code)
    ds, losses = ns["ds"], ns["losses"]
    assert ds.counts["tokens.truncated"] == 0 and ds.counts["tokens.padded"] > 0
    assert len(losses) >= ds.num_sequences // 4 and all(np.isfinite(losses))
    batch = next(iter(ds))
    ids, labels = batch["input_ids"], batch["labels"]
    learnt = labels != -100
    assert (labels[learnt] == ids[learnt]).all() and learnt.any()
    assert not ((ids < 200) & (ids != 2) & learnt).any()  # a prompt's tokens (and padding) never labels
    assert ((ids >= 200) & ~learnt).sum() <= (batch["position_ids"] == 0).sum()  # but at a document start

def test_the_docs_shuffle_recipe_runs(aws):
    (code,) = _blocks(ROOT / "docs" / "tokens.md", "## Shuffle")
    ns = _run(code)
    ds = ns["ds"]
    assert ds.block_sequences == 1024 // (32 * 2) and ds.block_window() == 4 * 16
    assert len(ns["first"]) == 8 and ds.num_sequences == FILES * TOKENS // 32


def test_the_readme_recipe_runs(aws):
    (code,) = _blocks(ROOT / "README.md", "### Token streams for language models")
    _check_training(_run(code))


@pytest.mark.slow
def test_the_tokens_benchmark_runs(tmp_path, capsys):
    from benchmarks import tokens

    tokens.main(["--quick", "--out", str(tmp_path / "tokens.json")])
    report = json.loads((tmp_path / "tokens.json").read_text())
    assert [r["delay_ms"] for r in report["results"]] == [0, 100]
    assert all(r["vs_whole-file_median"] > 0 for r in report["results"])
    assert len(report["rss_after_epoch"]) == 2


def test_the_docs_tar_recipe_runs(aws):
    (code,) = _blocks(ROOT / "docs" / "tokens.md", "### Tar shards of `.npy` tokens")
    ns = _run(code)
    ds, batches = ns["ds"], ns["batches"]
    rows = [r for b in batches for r in b["input_ids"].tolist()]
    assert len(rows) == ds.num_sequences == ds.num_tokens // 32 and all(len(r) == 32 for r in rows)
    ids = [t for r in rows for t in r]
    assert set(ids) - {0} <= set(range(600, 700)) and ids.count(0) >= 60 - 2  # a document's eos each
    flat = ns["flat"]
    assert flat.layout == "bin" and flat.num_tokens == 3000
