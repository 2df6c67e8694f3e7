"""The Hugging Face Trainer and TRL over sd.loader (``streamdata.integrations.hf``): docs/frameworks.md's
recipes under real ``torchrun`` (2 CPU processes, gloo, the S3 test server, 13 uneven tar shards
with a sample index, a one-layer GPT-2 built locally), the samples counted as the model's embedding
received them; and the integration's refusals, in one process."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from tests.helpers import doc_blocks, torchrun, write_shards

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parent.parent / "docs" / "frameworks.md"
JOB = Path(__file__).parent / "jobs" / "hf_trainer_job.py"
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17, 6]  # 119 samples
TIME_LIMIT_S = 240


def _recipe(name: str) -> str:
    text = JOB.read_text()
    start = text.index("\n", text.index(f"# --- recipe: docs/frameworks.md, {name} ---")) + 1
    return text[start:text.index("# --- end of recipe ---", start)].strip()


def test_the_pages_recipes_are_the_jobs():
    trainer, trl = doc_blocks(DOC, "## Hugging Face Trainer and TRL")[:2]
    assert trainer.strip() == _recipe("Hugging Face Trainer")
    assert trl.strip() == _recipe("TRL")


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


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the ranks inherit it: nothing is downloaded


def _run(tmp_path, cfg: dict) -> list[dict]:
    ranks = torchrun(JOB, tmp_path, 2, cfg, TIME_LIMIT_S)
    steps = [rank["steps"] for rank in ranks]
    assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
    return ranks


def _exactly_once(runs: list[list[dict]], epoch: int, everything: list[str]) -> None:
    got = collections.Counter(k for run in runs for rank in run for k in rank["trained"].get(str(epoch), []))
    assert max(got.values()) == 1, f"epoch {epoch}: twice {sorted(k for k, n in got.items() if n > 1)}"
    assert sorted(got) == sorted(everything), f"epoch {epoch}: lost {sorted(set(everything) - set(got))}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid-epoch", "epoch_end"])
def test_trainer_resumes_from_its_checkpoint_exactly(shards, tmp_path, where):
    """StreamdataTrainer, a checkpoint at every step: a run failing at a seeded step of the first
    epoch (or at the first step after the checkpoint of its last batch) resumed with
    ``resume_from_checkpoint=True``: no batch trained twice, none skipped (the Trainer's own skip by
    count is off); the second epoch, trained whole by the resumed run, exactly once alone."""
    case, everything = shards
    stop = random.Random(19).randint(2, 7) if where == "mid-epoch" else "epoch_end"
    cfg = {**case, "trainer": "trainer", "output_dir": str(tmp_path / "out")}
    first = _run(tmp_path, {**cfg, "tag": "first", "stop": stop})
    assert all(rank["has_len"] for rank in first)  # the index: the Trainer counts epochs by len()
    batches = first[0]["epoch_batches"]
    saved = batches if stop == "epoch_end" else stop - 1
    assert isinstance(saved, int) and 1 <= saved <= batches
    assert first[0]["steps"] == saved and list(first[0]["trained"]) == ["0"]
    assert (tmp_path / "out" / f"checkpoint-{saved}" / "streamdata_loader.json").exists()
    after = _run(tmp_path, {**cfg, "tag": "after", "resume": True})
    assert after[0]["steps"] == 2 * batches - saved
    _exactly_once([first, after], 0, everything)
    _exactly_once([after], 1, everything)


@pytest.mark.slow
def test_trl_sft_trainer_trains_an_epoch_exactly_once(shards, tmp_path):
    """streamdata_trainer(SFTTrainer): built with its placeholder row, trained from the loader
    (SFT's collator in the loader's workers), one epoch over 2 ranks: every sample once."""
    case, everything = shards
    ranks = _run(tmp_path, {**case, "trainer": "sft", "tag": "sft", "output_dir": str(tmp_path / "sft")})
    assert ranks[0]["has_len"] and ranks[0]["steps"] == ranks[0]["epoch_batches"]
    _exactly_once([ranks], 0, everything)


# ---- the refusals, in one process ---------------------------------------------------------


@pytest.fixture
def local(tmp_path):
    import fsspec

    import streamdata as sd

    (tmp_path / "data").mkdir()
    write_shards(fsspec.filesystem("file"), str(tmp_path / "data"), counts=[3, 5])
    sd.build_index(f"{tmp_path}/data/", progress=False)
    return f"{tmp_path}/data/"


def _args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    return TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to="none", **kwargs)


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=128, n_positions=8))


def test_misuse_is_refused_with_what_to_do(local, tmp_path):
    import torch
    from transformers import Trainer

    import streamdata as sd
    from streamdata.integrations.hf import StreamdataTrainer, streamdata_trainer

    args = _args(tmp_path, max_steps=2)
    plain = torch.utils.data.TensorDataset(torch.zeros(4, 8))
    with pytest.raises(sd.SpecError, match="transformers.Trainer"):
        StreamdataTrainer(model=_model(), args=args, train_dataset=plain)
    with pytest.raises(sd.SpecError, match="collate_fn"):
        StreamdataTrainer(model=_model(), args=args, data_collator=lambda rows: rows,
                          train_dataset=sd.loader(sd.TarDataset(local), batch_size=2, num_workers=0))
    unindexed = sd.loader(sd.TarDataset(local, index=None), batch_size=2, num_workers=0)  # no len()
    with pytest.raises(sd.SpecError, match="no length.*streamdata index.*max_steps"):
        StreamdataTrainer(model=_model(), args=_args(tmp_path), train_dataset=unindexed)
    loader = sd.loader(sd.TarDataset(local), batch_size=2, num_workers=0)
    assert len(loader) == 4  # 3 + 5 samples in batches of 2, from the index
    with pytest.raises(sd.SpecError, match="Trainer subclass"):
        streamdata_trainer(torch.nn.Module)
    assert streamdata_trainer(Trainer) is StreamdataTrainer
    trainer = StreamdataTrainer(model=_model(), args=args, train_dataset=loader)
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(sd.SpecError, match="holds no loader state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    with pytest.raises(sd.SpecError, match="no checkpoint-N folder"):
        trainer.train(resume_from_checkpoint=True)


def test_a_dataset_is_put_in_a_loader_with_the_arguments(local, tmp_path):
    import streamdata as sd
    from streamdata.feed.loader import Loader
    from streamdata.integrations.hf import StreamdataTrainer

    ds = sd.TarDataset(local)
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=3, dataloader_num_workers=1)
    trainer = StreamdataTrainer(model=_model(), args=args, train_dataset=ds)
    assert isinstance(trainer.loader, Loader) and trainer.loader.dataset is ds
    assert trainer.loader.dataloader.num_workers == 1
    assert trainer.get_train_dataloader().loader is trainer.loader
    trainer.loader.close()


def test_the_last_checkpoint_is_the_newest_holding_the_loaders_state(tmp_path):
    from streamdata.integrations.hf import STATE_NAME, last_checkpoint

    assert last_checkpoint(str(tmp_path / "none")) is None
    for step in (2, 10, 11):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}" / STATE_NAME).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")  # 11: stopped before writing it
