"""Hugging Face ``Trainer`` (and TRL's trainers, its subclasses) over an ``sd.loader``.

``StreamdataTrainer(model=..., args=TrainingArguments(...), train_dataset=sd.loader(ds, ...))``
is a ``transformers.Trainer`` that trains from the loader as it is:

- ``get_train_dataloader`` returns the loader, never a ``DataLoader`` that ``accelerator.prepare``
  wraps (which would split each rank's share again: SELF-SPLIT, ``datasets/sharded.py``);
- the Trainer's ``set_epoch`` reaches the loader, its epoch numbered from the one the loader
  stands at (loaded on a resume);
- every checkpoint the Trainer saves gets the loader's state beside its own files,
  ``checkpoint-N/streamdata_loader.json`` (every rank calls ``state_dict()``, a collective; the
  ranks that write the Trainer's files write it);
- ``train(resume_from_checkpoint=...)`` loads that state before the first batch, and the Trainer
  skips no batch itself (``get_resumed_dataloader`` returns the loader, which already stands
  after the batches trained; transformers without that hook get ``ignore_data_skip=True``):
  no batch trained twice, none skipped twice. ``resume_from_checkpoint=True``: the newest
  ``checkpoint-N`` of ``output_dir`` that holds the loader's state.

The Trainer counts its steps from ``len(loader)`` where the loader has a length, else from
``TrainingArguments(max_steps=...)``. A streamdata dataset given as ``train_dataset`` is put in
an ``sd.loader`` with the arguments' ``per_device_train_batch_size``, ``dataloader_num_workers``
(streamdata's default where 0) and ``data_collator`` (as ``collate_fn``).

``streamdata_trainer(trl.SFTTrainer)`` makes the same of a TRL trainer. TRL's trainers take 🤗
datasets only and read a row of theirs as they are built: they are given a one-row placeholder
(``{"input_ids": [0]}``) for that, and train from the loader; tokenise in the dataset's ``map``
and collate with the trainer's collator (``sd.loader(..., collate_fn=DataCollatorForLanguageModeling(
pad_token_id))``).

transformers is imported only here, and this module only when used (``pip install streamdata[hf]``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any, TypeVar

from transformers import Trainer, TrainerCallback

from streamdata.epoch.state import STATE_FORMAT
from streamdata.errors import SpecError
from streamdata.feed.loader import Loader
from streamdata.feed.loader import loader as make_loader

__all__ = ["STATE_NAME", "StreamdataTrainer", "last_checkpoint", "streamdata_trainer"]

STATE_NAME = "streamdata_loader.json"  # in each checkpoint-N folder, beside the Trainer's files
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR

T = TypeVar("T", bound=type)


class _Epochs:
    """The loader as the Trainer iterates it. The Trainer numbers its epochs from the steps it
    has trained (without a length: from 0 on every run); the loader's epoch at the first
    ``set_epoch`` of a ``train()`` is the Trainer's epoch then, later epochs follow by one. A state
    saved at an epoch's last batch resumes to an empty pass: that pass goes on with the next epoch."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.offset: int | None = None  # the loader's epoch less the Trainer's
        self.resumed = False  # a state was loaded and its pass not read yet

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)  # TypeError where the loader has no length: the Trainer needs max_steps

    def set_epoch(self, epoch: int) -> None:
        if self.offset is None:
            self.offset = _epoch(self.loader) - epoch
        self.loader.set_epoch(epoch + self.offset)

    def __iter__(self) -> Iterator[Any]:
        resumed, self.resumed = self.resumed, False
        delivered = False
        for batch in self.loader:
            delivered = True
            yield batch
        if resumed and not delivered:  # the state of an epoch's last batch: the next epoch, now
            self.offset = (self.offset or 0) + 1
            self.loader.set_epoch(_epoch(self.loader) + 1)
            yield from self.loader


def _epoch(loader: Loader) -> int:
    return int(getattr(loader.dataset, "epoch", 0))


class _SaveLoaderState(TrainerCallback):
    """After each checkpoint the Trainer saved: the loader's state in it (``STATE_NAME``)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = self.loader.state_dict()  # every rank's position: a collective, on every rank
        if not args.should_save:  # the ranks that write the Trainer's files write this one
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_NAME)
        with open(path + ".tmp", "w") as f:
            json.dump(saved, f)
        os.replace(path + ".tmp", path)  # whole or absent


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that holds the loader's state (one the
    run stopped in before writing it is passed over), or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := _CHECKPOINT.match(name))), reverse=True)
    for _, name in steps:
        if os.path.isfile(os.path.join(output_dir, name, STATE_NAME)):
            return os.path.join(output_dir, name)
    return None


def _placeholder() -> Any:
    """The one-row 🤗 dataset a TRL trainer is built with (it checks the type and reads a row; a
    map-style one, which has a length: the Trainer asks for one unless ``max_steps`` is given)."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [[0]]})


class StreamdataTrainer(Trainer):
    """A ``transformers.Trainer`` training from an ``sd.loader`` (or a streamdata dataset, put in
    one): exact epochs on every rank, the loader's state in every checkpoint, resumed exactly by
    ``train(resume_from_checkpoint=...)``; see the module docstring. The loader: ``trainer.loader``."""

    streamdata_placeholder = False  # True for a TRL trainer (``streamdata_trainer``)

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, *more: Any, **kwargs: Any) -> None:
        self.loader: Loader = _as_loader(train_dataset, args, data_collator)
        self._feed = _Epochs(self.loader)
        if args is not None and getattr(args, "max_steps", -1) <= 0:
            try:
                len(self.loader)
            except TypeError as exc:
                raise SpecError(
                    f"the Trainer needs the steps of an epoch, and this loader has no length ({exc}): give "
                    "TrainingArguments(max_steps=...), the optimizer steps of the whole run") from None
        given = _placeholder() if self.streamdata_placeholder else self.loader
        super().__init__(model, args, data_collator, given, *more, **kwargs)
        self.train_dataset = self.loader
        if not hasattr(Trainer, "get_resumed_dataloader"):  # older transformers: no skip by count
            self.args.ignore_data_skip = True
        self.add_callback(_SaveLoaderState(self.loader))

    def get_train_dataloader(self) -> Any:
        return self._feed  # the loader itself: no accelerator.prepare, no second split

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        return dataloader  # the loaded state stands after the batches trained: skipping would skip twice

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, the loader's state loaded first from the checkpoint resumed."""
        if resume_from_checkpoint is True:
            output_dir = str(self.args.output_dir)
            resume_from_checkpoint = last_checkpoint(output_dir)
            if resume_from_checkpoint is None:
                raise SpecError(f"resume_from_checkpoint=True: no checkpoint-N folder of {output_dir} holds "
                                f"the loader's state ({STATE_NAME})")
        self._feed.offset, self._feed.resumed = None, False
        if resume_from_checkpoint:
            path = os.path.join(str(resume_from_checkpoint), STATE_NAME)
            if not os.path.isfile(path):
                raise SpecError(f"{resume_from_checkpoint} holds no loader state ({STATE_NAME}): resume from "
                                "a checkpoint a StreamdataTrainer saved (every rank must read it: a shared "
                                "folder, or save_on_each_node=True)")
            with open(path) as f:
                self.loader.load_state_dict(json.load(f))
            self._feed.resumed = True
        return super().train(resume_from_checkpoint or None, *args, **kwargs)


def streamdata_trainer(base: T) -> T:
    """``base`` (a ``Trainer`` subclass: TRL's ``SFTTrainer``...) training from an ``sd.loader`` as
    :class:`StreamdataTrainer` does; a subclass other than ``Trainer`` itself is built with a
    one-row placeholder dataset (TRL's trainers take 🤗 datasets only)."""
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise SpecError(f"streamdata_trainer takes a transformers.Trainer subclass, got {base!r}")
    if issubclass(base, StreamdataTrainer):
        return base
    if base is Trainer:
        return StreamdataTrainer  # type: ignore[return-value]
    return type(f"Streamdata{base.__name__}", (StreamdataTrainer, base),  # type: ignore[return-value]
                {"streamdata_placeholder": True, "__module__": __name__})


def _as_loader(train_dataset: Any, args: Any, data_collator: Any) -> Loader:
    """The sd.loader to train from: the one given, or one over the streamdata dataset given."""
    if isinstance(train_dataset, Loader):
        if data_collator is not None:
            raise SpecError("with an sd.loader as train_dataset, give the collator to the loader: "
                            "sd.loader(ds, collate_fn=data_collator, ...) (its workers batch)")
        if getattr(train_dataset.dataset, "state_format", None) != STATE_FORMAT:
            raise SpecError(f"the loader's dataset ({type(train_dataset.dataset).__name__}) has no state to "
                            "save and resume: StreamdataTrainer takes an sd.loader over a streamdata dataset")
        return train_dataset
    if getattr(train_dataset, "state_format", None) == STATE_FORMAT:
        if args is None:
            raise SpecError("StreamdataTrainer(train_dataset=<a streamdata dataset>) needs args: the batch "
                            "size and workers of the sd.loader it builds")
        options: dict[str, Any] = {"num_workers": args.dataloader_num_workers or None,
                                   "collate_fn": data_collator}
        if getattr(train_dataset, "batch_size", None) is None:  # else the dataset batches itself
            options["batch_size"] = args.per_device_train_batch_size
        return make_loader(train_dataset, **options)
    raise SpecError(
        f"StreamdataTrainer trains from an sd.loader or a streamdata dataset (TarDataset, ParquetDataset, "
        f"TokenDataset, Mix ...), got {type(train_dataset).__name__}: for another dataset use "
        "transformers.Trainer itself")
