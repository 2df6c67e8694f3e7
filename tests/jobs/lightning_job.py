"""A Lightning ``Trainer(strategy="ddp")`` job over sd.loader, run by ``torchrun`` from
tests/test_frameworks.py: docs/frameworks.md's recipe (the block between the markers below, kept
identical to the page by the test), trained for two epochs; a first run stops at a seeded step
(an exception on every rank), the second resumes from Lightning's ``last.ckpt``.

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/lightning_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec``, ``storage_options``, ``ckpt_dir`` and ``stop`` (the global step at
which the first run fails; none: run to the end, resuming from ``ckpt_dir/last.ckpt``). Each rank
writes ``OUT_DIR/{tag}-rank{R}.json``: per epoch, the keys its training_step trained, its steps, and
the loader's ``held_ahead`` (what it found Lightning's fetcher holds) and, per epoch, Lightning's
``num_training_batches`` (its progress bar's total; None where the loader has no ``len()``).
"""

from __future__ import annotations

import json
import sys

# --- recipe: docs/frameworks.md, Lightning ---
import lightning as L
import torch

import streamdata as sd


class Data(L.LightningDataModule):
    def __init__(self, spec, storage_options=None):
        super().__init__()
        self.spec, self.storage_options = spec, storage_options

    def train_dataloader(self):  # called once torch.distributed is up: rank 0 alone lists
        ds = sd.TarDataset(self.spec, storage_options=self.storage_options, shuffle=True, seed=0)
        # with the sample index the loader has a len(): Lightning's progress bar shows the total and
        # its fetcher takes no batch ahead; without, the batch it takes ahead of training_step is
        # found and left out of the state Lightning saves (loader.held_ahead: 1)
        self.loader = sd.loader(ds, batch_size=8, num_workers=2)
        return self.loader


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def on_train_epoch_start(self):  # the data's epoch follows Lightning's
        self.trainer.datamodule.loader.set_epoch(self.current_epoch)

    def training_step(self, batch, batch_idx):
        return self.net(batch["npy"].float()).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(model, data, ckpt_dir, every_n_train_steps=100):
    last = L.pytorch.callbacks.ModelCheckpoint(ckpt_dir, every_n_train_steps=every_n_train_steps,
                                               save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, callbacks=[last],
                        default_root_dir=ckpt_dir)
    trainer.fit(model, datamodule=data, ckpt_path="last")  # ckpt_dir/last.ckpt, if there is one
# --- end of recipe ---


class Stop(Exception):
    """The seeded failure."""


class Recorded(Model):
    def __init__(self, stop: int | None):
        super().__init__()
        self.stop, self.trained, self.steps, self.totals, self.epoch_steps = stop, {}, 0, {}, {}

    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        total = self.trainer.num_training_batches
        self.totals[str(self.current_epoch)] = None if total == float("inf") else int(total)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.stop:  # after the checkpoint of the step before
            raise Stop(self.global_step)

    def training_step(self, batch, batch_idx):
        self.trained.setdefault(str(self.current_epoch), []).extend(batch["__key__"])
        self.steps += 1
        self.epoch_steps[str(self.current_epoch)] = self.epoch_steps.get(str(self.current_epoch), 0) + 1
        return super().training_step(batch, batch_idx)


def main(out_dir: str, config_json: str) -> None:
    import torch.distributed as dist

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    model, data = Recorded(cfg.get("stop")), Data(cfg["spec"], cfg["storage_options"])
    try:
        fit(model, data, cfg["ckpt_dir"], every_n_train_steps=1)
    except Stop:
        pass
    data.loader.close()
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"trained": model.trained, "steps": model.steps, "held_ahead": data.loader.held_ahead,
                   "totals": model.totals, "epoch_steps": model.epoch_steps}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
