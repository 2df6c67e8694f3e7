"""A Hugging Face ``Trainer`` job over sd.loader (``streamdata.integrations.hf``), run by
``torchrun`` from tests/test_hf_trainer.py: docs/frameworks.md's recipes (the blocks between the
markers below, kept identical to the page by the test) on a tiny GPT-2 built here (no download).

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/hf_trainer_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec``, ``storage_options``, ``output_dir``, ``trainer`` ("trainer": the
Trainer recipe, two epochs, a checkpoint at every step; "sft": the TRL recipe, one epoch),
``resume`` and ``stop`` (the batch whose forward fails on every rank, after the checkpoint of the
step before; "epoch_end": the first batch of the second epoch; none: run to the end). Without a
loader length the job counts an epoch's batches first and gives ``max_steps``. Each rank writes
``OUT_DIR/{tag}-rank{R}.json``: per epoch, the keys of the samples the model's embedding received
(the token ids are the sample's number), its steps, and whether the loader had a length.
"""

from __future__ import annotations

import json
import sys

# --- recipe: docs/frameworks.md, Hugging Face Trainer ---
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import streamdata as sd
from streamdata.integrations.hf import StreamdataTrainer


def tokens(sample):  # your tokenisation, run in the loader's workers: here the shards hold token ids
    ids = torch.as_tensor(sample["npy"]).long()
    return {"input_ids": ids, "labels": ids}


def model():  # your model
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=128, n_positions=8))


def fit(spec, storage_options, output_dir, resume=False, epochs=2, max_steps=-1, save_steps=100):
    args = TrainingArguments(output_dir, num_train_epochs=epochs, max_steps=max_steps, save_steps=save_steps,
                             per_device_train_batch_size=8, use_cpu=True, report_to="none")
    # TrainingArguments has set torch.distributed up (torchrun): rank 0 alone lists the bucket
    ds = sd.TarDataset(spec, storage_options=storage_options, shuffle=True, seed=0, map=tokens)
    loader = sd.loader(ds, batch_size=8, num_workers=2)
    trainer = StreamdataTrainer(model=model(), args=args, train_dataset=loader)
    # True: the newest checkpoint-N of output_dir, the loader's position in it too
    trainer.train(resume_from_checkpoint=resume)
    loader.close()
    return trainer
# --- end of recipe ---


# --- recipe: docs/frameworks.md, TRL ---
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from streamdata.integrations.hf import streamdata_trainer


def token_ids(sample):  # SFT's collator takes lists of ids: it pads them and makes the labels
    return {"input_ids": sample["npy"].astype("int64").tolist()}


def fit_sft(spec, storage_options, output_dir, tokenizer, max_steps=-1):
    args = SFTConfig(output_dir, num_train_epochs=1, max_steps=max_steps, per_device_train_batch_size=8,
                     use_cpu=True, report_to="none")
    ds = sd.TarDataset(spec, storage_options=storage_options, shuffle=True, seed=0, map=token_ids)
    collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    loader = sd.loader(ds, batch_size=8, num_workers=2, collate_fn=collate)
    trainer = streamdata_trainer(SFTTrainer)(model=model(), args=args, train_dataset=loader,
                                             processing_class=tokenizer)
    trainer.train()
    loader.close()
    return trainer
# --- end of recipe ---


class Stop(Exception):
    """The seeded failure."""


RUN: dict = {"trained": {}, "steps": 0, "batches": 0, "stop": None, "loader": None}
_recipe_model = model


def _received(module, inputs) -> None:
    """The embedding's input: what the model trains on (token ids: the samples' numbers)."""
    RUN["batches"] += 1
    if RUN["batches"] == RUN["stop"]:
        raise Stop(RUN["batches"])
    epoch = str(RUN["loader"].dataset.epoch)
    RUN["trained"].setdefault(epoch, []).extend(f"s{n:06d}" for n in inputs[0][:, 0].tolist())
    RUN["steps"] += 1


def model():  # noqa: F811 - the recipe's, its input recorded
    m = _recipe_model()
    m.get_input_embeddings().register_forward_pre_hook(_received)
    return m


def _kept(cls):
    """``cls``, its loader kept for the records (the epoch being read)."""
    class Kept(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            RUN["loader"] = self.loader

    return Kept


StreamdataTrainer = _kept(StreamdataTrainer)  # the recipe's, recorded
_recipe_streamdata_trainer = streamdata_trainer


def streamdata_trainer(base):  # noqa: F811 - the recipe's, recorded
    return _kept(_recipe_streamdata_trainer(base))


def _tokenizer():
    """A word-level tokenizer built here (SFTTrainer wants one; no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 127, **{f"t{i}": i for i in range(127)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")),
                                   pad_token="[PAD]", eos_token="[PAD]")


def _epoch_batches(cfg: dict) -> tuple[int, bool]:
    """An epoch's batches on this rank, and whether the loader said so (len) or they were counted."""
    ds = sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"], shuffle=True, seed=0)
    with sd.loader(ds, batch_size=8, num_workers=2) as probe:
        try:
            return len(probe), True
        except TypeError:
            return sum(1 for _ in probe), False


def main(out_dir: str, config_json: str) -> None:
    import torch.distributed as dist

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    batches, has_len = _epoch_batches(cfg)  # before the Trainer sets torch.distributed up: each rank its own
    epochs = 2 if cfg["trainer"] == "trainer" else 1
    RUN["stop"] = batches + 1 if cfg.get("stop") == "epoch_end" else cfg.get("stop")
    max_steps = -1 if has_len else epochs * batches
    try:
        if cfg["trainer"] == "sft":
            fit_sft(cfg["spec"], cfg["storage_options"], cfg["output_dir"], _tokenizer(), max_steps=max_steps)
        else:
            fit(cfg["spec"], cfg["storage_options"], cfg["output_dir"], resume=cfg.get("resume", False),
                epochs=epochs, max_steps=max_steps, save_steps=1)
    except Stop:
        RUN["loader"].close()
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"trained": RUN["trained"], "steps": RUN["steps"], "has_len": has_len,
                   "epoch_batches": batches}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
