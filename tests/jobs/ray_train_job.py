"""A Ray Train ``TorchTrainer`` job over sd.loader (2 CPU workers, a local Ray), run as a plain
script from tests/test_frameworks.py: docs/frameworks.md's recipe (the block between the markers
below, kept identical to the page by the test), trained for two epochs with a checkpoint
reported at every step. Rank 1 leaves with ``os._exit`` at a seeded step of the first attempt
only (a marker file remembers it), and ``FailureConfig(max_failures=1)`` restarts the workers
from the last reported checkpoint.

    python tests/jobs/ray_train_job.py OUT_DIR CONFIG

CONFIG: ``spec``, ``storage_options``, ``storage_path`` (Ray's storage, absolute), ``stop``
(the global step at which rank 1 dies on the first attempt), ``move_to_device`` (Ray's
wrapper, over the loader as the recipe builds it) and ``held_ahead`` (given to ``sd.loader``
if there; left out, the loader finds the wrapper's batch ahead). Each worker
appends one JSON line per trained step to ``OUT_DIR/ray-rank{R}.jsonl``: the checkpoint step its
attempt started from (``from``), the epoch, the global step, the keys trained and the loader's
``held_ahead``.
"""

from __future__ import annotations

# --- recipe: docs/frameworks.md, Ray Train ---
import os
import tempfile

import ray.train
import ray.train.torch
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import streamdata as sd


def train_step(model, optimizer, batch, epoch, step):  # your step (epoch, step: for your logs)
    loss = model(batch["npy"].float()).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def train_loop_per_worker(config):
    # TorchTrainer has set torch.distributed up: rank 0 alone lists the bucket
    ds = sd.TarDataset(config["spec"], storage_options=config["storage_options"], shuffle=True, seed=0)
    loader = sd.loader(ds, batch_size=8, num_workers=2)
    batches = ray.train.torch.prepare_data_loader(loader, move_to_device=False)  # the loader itself
    model = ray.train.torch.prepare_model(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch = step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:  # a restarted attempt: the last reported checkpoint
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # the epoch, and the position in it
        epoch, step = saved["loader"]["epoch"], saved["step"]
    while epoch < config["epochs"]:
        for batch in batches:
            step += 1
            train_step(model, optimizer, batch, epoch, step)
            state = loader.state_dict()  # every rank's position: a collective, on every rank
            with tempfile.TemporaryDirectory() as d:
                reported = None
                if ray.train.get_context().get_world_rank() == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "loader": state, "step": step}, os.path.join(d, "state.pt"))
                    reported = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"epoch": epoch, "step": step}, checkpoint=reported)
        epoch += 1
        loader.set_epoch(epoch)
    loader.close()


def fit(config, storage_path):
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="train", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=1),  # restart from the last checkpoint
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    return trainer.fit()
# --- end of recipe ---


_STARTED: list[int] = []  # this worker process's attempt: the checkpoint step it started from


def _started_from() -> int:
    if not _STARTED:
        checkpoint = ray.train.get_checkpoint()
        step = 0
        if checkpoint:
            with checkpoint.as_directory() as d:
                step = torch.load(os.path.join(d, "state.pt"))["step"]
        _STARTED.append(step)
    return _STARTED[0]


_recipe_step = train_step


def train_step(model, optimizer, batch, epoch, step):  # noqa: F811 - the recipe's, recorded
    rank = ray.train.get_context().get_world_rank()
    started = _started_from()
    marker = os.path.join(_CONFIG["out_dir"], "killed")
    if rank == 1 and step == _CONFIG["stop"] and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # a worker lost mid-epoch, on the first attempt only
    _recipe_step(model, optimizer, batch, epoch, step)
    import json

    with open(os.path.join(_CONFIG["out_dir"], f"ray-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"from": started, "epoch": epoch, "step": step, "keys": list(batch["__key__"]),
                            "held_ahead": _LOADERS[-1].held_ahead}) + "\n")


_recipe_loop = train_loop_per_worker
_sd_loader = sd.loader
_prepare = ray.train.torch.prepare_data_loader
_LOADERS: list = []  # the sd.loader this worker process built, its held_ahead recorded


def train_loop_per_worker(config):  # noqa: F811 - the recipe's, or its variant for Ray's wrapper
    """With ``move_to_device`` in the config: the recipe with Ray's default
    ``prepare_data_loader(loader)`` (``move_to_device=True``, a wrapper that takes one batch
    ahead, which the loader finds); with ``held_ahead``, the loader built with it."""
    given = {"held_ahead": config["held_ahead"]} if "held_ahead" in config else {}

    def built(*args, **kwargs):
        _LOADERS.append(_sd_loader(*args, **{**kwargs, **given}))
        return _LOADERS[-1]

    sd.loader = built
    if config.get("move_to_device"):
        ray.train.torch.prepare_data_loader = lambda loader, **kw: _prepare(loader, **{
            **kw, "move_to_device": True})
    _recipe_loop(config)


_CONFIG: dict = {}


def main(out_dir: str, config_json: str) -> None:
    import json

    import ray

    cfg = json.loads(config_json)
    _CONFIG.update(cfg, out_dir=out_dir)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        extra = {k: cfg[k] for k in ("move_to_device", "held_ahead") if k in cfg}
        result = fit({"spec": cfg["spec"], "storage_options": cfg["storage_options"], "epochs": 2, **extra},
                     cfg["storage_path"])
        with open(os.path.join(out_dir, "ray-result.json"), "w") as f:
            json.dump({"error": repr(result.error) if result.error else None,
                       "metrics": result.metrics}, f)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:3])
