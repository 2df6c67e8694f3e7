"""``sd.Mix``: weighted sampling from several sharded datasets, exact per source, resumable.

Each reader (rank x worker) reads its own share of every source's epoch (the sources' plans,
EXACTLY-ONCE / EQUAL-STEPS) and interleaves them by a seeded sequence of choices that is the same
on every rank (MIX-CHOICES in ``epoch.mix``). The epoch ends by ``stop``:

- ``"first"``: when a source runs out on the reader: with sample counts known, at the reader's
  quota of it, the fewest any rank's reader of that worker index holds, so every rank stops at
  the same step; what the other sources did not deliver is counted (``mix.undelivered.K``);
- ``"all"``: a source that runs out starts its next epoch (counted, ``mix.cycled.K``) until every
  source has delivered its share once (with counts: as many as the rank with most);
- ``samples=N``: N samples per epoch over the whole job, cycling sources as needed.

``weights`` may be a :class:`~streamdata.epoch.mix.Schedule`: weights that follow the epoch's
progress over the whole job (MIX-CHOICES).

The state (``epoch.mix``) is every source's position plus the number of choices taken, per reader,
in the dataset state format, so torchdata's ``StatefulDataLoader`` and ``sd.loader`` save and
restore it as they do a dataset's; a restart on another world shape re-divides what each source
has left (RESUME-ELASTIC) and starts a new choice sequence for the new stage. See docs/mix.md.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch.utils.data

from streamdata._compat import dataloader_asking
from streamdata.batch.batches import batches
from streamdata.datasets.passes import EpochIterator, stages_before
from streamdata.datasets.sharded import ShardedDataset, refuse_resplitting
from streamdata.epoch.blocks import with_mode
from streamdata.epoch.mix import (
    CYCLE_STRIDE,
    Probs,
    Schedule,
    Scheduled,
    choices,
    counts_before,
    entry_of,
    mix_fingerprint,
    parse_entry,
    quotas,
    source_stages,
    split_budget,
    start_entry,
    taken_in_stage,
)
from streamdata.epoch.resume import Stage
from streamdata.epoch.state import STATE_FORMAT, Loaded, check_header, stages_json, start_state
from streamdata.epoch.world import World
from streamdata.errors import SpecError, StreamDataError
from streamdata.metrics import Consumed, Counters
from streamdata.ranks import DataParallel, data_parallel

__all__ = ["Mix"]

_OWN: Any = object()  # ``steps``: the mix's own batch size
_EMPTY_CYCLES = 3  # a source that yields nothing this many cycles in a row: an error, not a hang


class Mix(torch.utils.data.IterableDataset):
    """Samples drawn from ``sources`` (streamdata sharded datasets) with probabilities ``weights``:
    one number per source, or an ``sd.Schedule`` (or a function of the epoch's fraction done) of
    weights that change over the epoch.

    ``seed`` seeds the choices (per epoch, stage and worker index; never per rank). ``stop``:
    ``"first"`` (default) or ``"all"``; ``samples=N`` instead: N samples per epoch over the job.
    ``batch_size`` / ``drop_last`` / ``collate_fn`` batch the mixed samples in the reader (the
    sources must not batch). ``set_epoch``, ``state_dict`` / ``load_state_dict`` as the datasets.
    """

    state_format = STATE_FORMAT  # sd.loader's Loader gathers these states (``checkpoint``)

    def __init__(self, sources: Sequence[ShardedDataset],
                 weights: Sequence[float] | Schedule | Callable[[float], Sequence[float]] | None = None, *,
                 seed: int = 0, stop: str | None = None, samples: int | None = None,
                 batch_size: int | None = None, drop_last: bool = False,
                 collate_fn: Callable[[list], Any] | None = None, dp_rank: int | None = None,
                 dp_size: int | None = None, mesh: Any = None, group: Any = None) -> None:
        super().__init__()
        self.sources = list(sources)
        _check_sources(self.sources)
        places = {s.data_parallel for s in self.sources}
        if len(places) > 1:
            raise SpecError(f"the sources were built for different data-parallel places: {places}")
        self.data_parallel: DataParallel | None = places.pop()
        self.set_data_parallel(data_parallel(dp_rank, dp_size, mesh=mesh, group=group))
        if callable(weights) and not isinstance(weights, Schedule):
            weights = Schedule(weights)
        self.schedule: Schedule | None = weights if isinstance(weights, Schedule) else None
        if self.schedule is None:
            weights = [1.0] * len(self.sources) if weights is None else list(weights)  # type: ignore[arg-type]
            if len(weights) != len(self.sources):
                raise SpecError(f"{len(weights)} weights for {len(self.sources)} sources: one weight per "
                                "source")
            if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights):
                raise SpecError(f"weights must be finite numbers > 0, got {weights}")
        if samples is not None and stop is not None:
            raise SpecError("give either stop= ('first' or 'all') or samples=N, not both")
        if samples is not None and (not isinstance(samples, int) or samples < 1):
            raise SpecError(f"samples must be an int >= 1, got {samples!r}")
        stop = "first" if stop is None and samples is None else stop
        if stop not in ("first", "all", None):
            raise SpecError(f"stop must be 'first' or 'all', got {stop!r}")
        if batch_size is not None and batch_size < 1:
            raise SpecError(f"batch_size must be >= 1 or None, got {batch_size}")
        if not isinstance(seed, int) or seed < 0:
            raise SpecError(f"seed must be an int >= 0, got {seed!r}")
        self.seed, self.stop, self.samples = seed, stop, samples
        self.weights: list[float] | Schedule
        self._horizon: int | None = None
        if self.schedule is not None:
            self.weights, self.probs = self.schedule, None
            self._horizon = self._check_schedule(self.schedule)
        else:
            self.weights = [float(w) for w in weights]  # type: ignore[union-attr]
            self.probs = np.asarray(self.weights) / sum(self.weights)
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        k = range(len(self.sources))
        self._counters = Counters([*(f"mix.taken.{i}" for i in k), *(f"mix.cycled.{i}" for i in k),
                                   *(f"mix.undelivered.{i}" for i in k), "mix.left_out"])
        self._consumed: Consumed | None = None  # (``consumed_counts``)
        self._epoch, self._passes = 0, 0
        self._resume: Loaded | None = None
        self._live: _Run | None = None
        if stop != "first":
            empty = [i for i, s in enumerate(self.sources) if _total(s) == 0]
            if empty:
                raise SpecError(f"sources {empty} have no samples: they cannot be cycled (stop='all' or "
                                "samples=N); remove them from the mix")

    def _check_schedule(self, schedule: Schedule) -> int | None:
        """The schedule's horizon (``by="fraction"``: the epoch's length over the job), checked."""
        n = len(schedule(0.0))
        if n != len(self.sources):
            raise SpecError(f"the Schedule gives {n} weights for {len(self.sources)} sources: one weight per "
                            "source")
        horizon = None
        if schedule.by == "fraction":
            totals = [_total(s) for s in self.sources]
            if self.samples is None and None in totals:
                unknown = [i for i, t in enumerate(totals) if t is None]
                raise SpecError(f"a Schedule by fraction needs the epoch's length, but the samples of "
                                f"sources {unknown} are unknown until read (tar without an index: "
                                "`streamdata index SPEC`): give samples=N, index the sources, or "
                                "Schedule(..., by='samples')")
            horizon = self.samples if self.samples is not None else sum(t or 0 for t in totals)
        if self.stop == "all":
            final = schedule.final()
            if final is None or not all(w > 0 for w in final):
                raise SpecError(f"with stop='all' every source needs a weight > 0 at the Schedule's end (got "
                                f"{final if final is not None else 'a function of samples, with no end'}): a "
                                "source left at 0 would never deliver its share; give each a weight there, "
                                "or use stop='first' or samples=N")
        return horizon

    def _probs(self, before: Sequence[Stage[dict]], world: World) -> Probs:
        """The choice probabilities of a stage of ``world``'s shape after ``before``: the weights,
        or the schedule from the samples the earlier stages took (MIX-CHOICES)."""
        if self.schedule is None:
            assert self.probs is not None
            return self.probs
        start = sum(int(e["t"]) for stage in before for e in stage.known())
        return Scheduled(self.schedule, start, world.slots, self._horizon)

    # ---- epochs and counts ------------------------------------------------------------

    def world(self) -> World:
        """This reader's place, among the data-parallel replicas where they were given."""
        return World.current(self.data_parallel)

    def set_data_parallel(self, place: DataParallel | None) -> None:
        """Read as replica ``place.rank`` of ``place.size``, the sources alike."""
        if place is None:
            return
        if self.data_parallel is not None and place != self.data_parallel:
            raise SpecError(f"the mix was built for data-parallel place {self.data_parallel}, the loader "
                            f"gives {place}: give it once")
        self.data_parallel = place
        for source in self.sources:
            source.set_data_parallel(place)

    def set_epoch(self, epoch: int) -> None:
        """The epoch to read next; in a worker it also advances by one per pass (as the datasets)."""
        refuse_resplitting(sys._getframe(1))  # SELF-SPLIT
        self._epoch, self._passes, self._live = int(epoch), 0, None

    @property
    def epoch(self) -> int:
        return self._epoch + self._passes

    @property
    def counts(self) -> dict[str, int]:
        """The mix's counters (``mix.taken.K``, ``mix.cycled.K``, ``mix.undelivered.K``,
        ``mix.left_out``) and every source counter summed over the sources, over every worker.
        Read through ``sd.loader``, the mix's own follow the batches the loop received, as its
        state does (``consumed_counts``)."""
        out = self._consumed.snapshot() if self._consumed is not None else self._counters.snapshot()
        for source in self.sources:
            for name, n in source.counts.items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def consumed_counts(self) -> Consumed:
        """The mix's counters as of the batches the loop received (CONSUMED-POSITION): what
        ``sd.loader`` keeps, so that the counts agree with the state it saves. Readers prefetch
        ahead of the loop; a reader whose pass ended in a DataLoader worker has counted what it
        left (``mix.undelivered``), but the state taken before its last batches reach the loop
        resumes them, and re-divides what that reader left."""
        if self._consumed is None:
            self._consumed = Consumed(self._counters)
        return self._consumed

    def reader_stats(self) -> list[dict[str, int]]:
        """Each reader's ``metrics.READER_STATS``, its sources' rows summed (``loader.metrics()``);
        its wall is its longest source pass's (the sources' passes run side by side in it). The
        mix's own work between them (choosing, batching) is in no stage."""
        return Counters.merged_rows([source._stats for source in self.sources], most=("wall_ns",))

    @property
    def skipped(self) -> dict[str, int]:
        """The sources' skips under ``on_error``, per reason, summed."""
        return _summed(s.skipped for s in self.sources)

    @property
    def retried(self) -> dict[str, int]:
        """The sources' retried requests, per reason, summed."""
        return _summed(s.retried for s in self.sources)

    @property
    def resigned(self) -> dict[str, int]:
        """The sources' presigned URLs signed again, per reason, summed."""
        return _summed(s.resigned for s in self.sources)

    def __len__(self) -> int:
        """What this rank yields this epoch (:meth:`steps`): batches with a ``batch_size``, else
        samples; a DataLoader asking counts with its ``num_workers``."""
        asking = dataloader_asking(sys._getframe(1))
        return self.steps(num_workers=asking.num_workers if asking is not None else 0)

    def steps(self, batch_size: int | None | Any = _OWN, drop_last: bool | None = None, *,
              num_workers: int = 0) -> int:
        """The batches (``batch_size`` None: samples) this rank yields this epoch with
        ``num_workers`` readers, from the choices and the sources' counts (``samples=N``, or every
        source's sample counts known); an epoch resumed on another world shape as the datasets'
        ``steps``. TypeError where a source's counts are unknown (its end is met when read)."""
        if batch_size is _OWN:
            batch_size = self.batch_size
        drop_last = self.drop_last if drop_last is None else bool(drop_last)

        def steps(samples: int) -> int:
            if batch_size is None:
                return samples
            return samples // batch_size if drop_last else -(-samples // batch_size)

        def stage_samples(before: list[Stage[dict]], w: World) -> int:
            limits = _limits(self, w, self.epoch, before)
            if limits.budget is not None:
                return limits.budget
            if limits.quotas is None:
                unknown = [i for i, s in enumerate(self.sources) if s.sample_counts() is None]
                raise TypeError(f"this Mix has no length: the samples of its sources {unknown} are unknown "
                                "until they are read (tar without an index: `streamdata index SPEC`); give "
                                "samples=N, or the trainer the steps to run (max_steps=...)")
            assert self.stop is not None
            return taken_in_stage(self._probs(before, w), self.seed, self.epoch, len(before), w.worker,
                                  limits.quotas, self.stop)

        world = self.world()
        nw = max(int(num_workers), 1)

        def rank_steps(before: list[Stage[dict]], world_size: int, workers: int, rank: int) -> int:
            return sum(steps(stage_samples(before, World(rank, world_size, w, workers)))
                       for w in range(workers))

        whole = rank_steps([], world.world_size, nw, world.rank)
        earlier: list[Stage[dict]] = stages_before(self._live, self._resume, self.epoch,
                                                   World(world.rank, world.world_size, 0, nw))
        if not earlier:
            return whole
        done = sum(max(sum(steps(int(e["t"])) for e in stage.known()[r * stage.num_workers:
                                                                  (r + 1) * stage.num_workers])
                       for r in range(stage.world_size)) for stage in earlier)
        return max(whole, done + rank_steps(earlier, world.world_size, nw, world.rank))

    # ---- the state -------------------------------------------------------------------

    def describe(self) -> dict:
        """What a state must match: each source's fingerprint and split, weights (or schedule), seed,
        stop, samples."""
        keys = [s.state_key() for s in self.sources]
        weights = self.schedule.describe() if self.schedule is not None else self.weights
        return {"sources": [k[0] for k in keys], "splits": [k[1] for k in keys], "weights": weights,
                "seed": self.seed, "stop": self.stop, "samples": self.samples}

    def _head(self, epoch: int, stages: list) -> dict:
        describe = self.describe()
        return {**start_state(mix_fingerprint(describe), epoch, "mix"), "mix": describe,
                "batching": [self.batch_size, bool(self.drop_last and self.batch_size is not None)],
                "stages": stages}

    def state_dict(self) -> dict:
        """Where this reader stands (in a worker: what it yielded); else the state loaded, or the
        epoch's start. Every source's position and the choices taken (docs/mix.md)."""
        if self._live is not None:
            run = self._live
            return self._head(run.epoch, stages_json([*run.before, Stage.own(run.world, run.entry())]))
        if self._resume is not None and self._resume.epoch == self.epoch:
            return self._head(self._resume.epoch, stages_json(self._resume.stages))
        return self._head(self.epoch, [])

    def load_state_dict(self, state: dict) -> None:
        """The next pass resumes the saved epoch where it stood; a state of another mix or of a
        plain dataset is refused (SpecError naming what differs). Call it before iterating."""
        check_header(state)
        if state.get("split") != "mix":
            raise SpecError(f"this is the state of a single dataset (split {state.get('split')!r}), not of a "
                            "Mix: load it into that dataset, or give this Mix a state its state_dict() made")
        mine, saved = self.describe(), state.get("mix") or {}
        if state.get("fingerprint") != mix_fingerprint(mine) or saved != mine:
            raise SpecError("this state belongs to another Mix: " + _differences(saved, mine, self.sources))
        splits = mine["splits"]
        try:
            stages = [Stage(int(s["world"][0]), int(s["world"][1]),
                            [parse_entry(e, splits) for e in s["delivered"]]) for s in state["stages"]]
            self._resume = Loaded(int(state["epoch"]), stages)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecError(f"a malformed Mix state: {type(exc).__name__}: {exc}") from exc
        self._epoch, self._passes, self._live = self._resume.epoch, 0, None

    # ---- the pass ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self.iter_batches(self.batch_size, drop_last=self.drop_last, collate_fn=self.collate_fn)

    def iter_batches(self, batch_size: int | None, *, drop_last: bool = False,
                     collate_fn: Callable[[list], Any] | None = None,
                     in_flight: int | None = None) -> EpochIterator:
        """This reader's pass of the mix, batched by ``batch_size`` (None: samples); ``sd.loader``
        calls it to batch in the worker."""
        run = self._begin()
        samples: Iterator[Any] = self._mixed(run)
        if batch_size is not None:
            samples = batches(_tail_counted(samples, batch_size, drop_last, self._counters), batch_size,
                              collate_fn=collate_fn, drop_last=drop_last, in_flight=in_flight)
        return EpochIterator(samples, run.close)

    def _begin(self) -> _Run:
        world, epoch = self.world(), self.epoch
        resume, self._resume = self._resume, None
        stages: list[Stage[dict]] = resume.stages if resume is not None and resume.epoch == epoch else []
        go_on = bool(stages) and stages[-1].same_shape(world)
        before = stages[:-1] if go_on else stages
        saved = stages[-1].delivered[world.slot] if go_on else None
        if go_on and saved is None:
            raise SpecError(f"the saved Mix state has no entry for {world.describe()}")
        splits = [s.state_key()[1] for s in self.sources]
        entry = saved if saved is not None else start_entry(splits)
        for stage in before:
            if any(e is None for e in stage.delivered):
                missing = [i for i, e in enumerate(stage.delivered) if e is None][:8]
                raise SpecError(f"the saved Mix state lacks readers {missing} of its {stage.world_size} "
                                f"ranks x {stage.num_workers} workers: it resumes only on that world shape; "
                                "save every reader's position (sd.loader's Loader.state_dict()) to resume "
                                "on another")
        run = _Run(self, world, epoch, before, entry)
        try:
            for k in range(len(self.sources) if not run.ended else 0):  # (an ended reader reads nothing)
                cycle, position = entry["sources"][k]
                run.open(k, cycle, source_stages(stages, k, splits[k]) if cycle == 0 else
                         [Stage.own(world, position)])
        except BaseException:
            run.close()
            raise
        self._live = run
        if torch.utils.data.get_worker_info() is not None:
            self._passes += 1  # a persistent worker's copy cannot see set_epoch: count passes
        return run

    def _mixed(self, run: _Run) -> Iterator[Any]:
        """The reader's samples: choose, take (cycling as ``stop`` says), until the epoch ends. The
        end is known before the last sample goes (the next choice is drawn first), so the state
        taken after the last batch says it (``end``: a restart on another world then hands that
        reader's leftovers to no one), and the counters with it have counted them as undelivered
        (a reader that ends at its first choice too: it yields nothing, what it holds is left)."""
        chosen = choices(run.probs, self.seed, run.epoch, len(run.before), run.world.worker, run.t)
        k = next(chosen)
        if not run.ended and run.over(k):  # (a saved entry that had ended was counted where it ended)
            run.end()
        try:
            while not run.ended:
                sample = run.take(k)
                if sample is _END:
                    run.end()
                    break
                run.t += 1
                run.chosen[k] += 1
                self._counters.add(f"mix.taken.{k}")
                if run.cycles[k]:
                    self._counters.add(f"mix.cycled.{k}")
                k = next(chosen)
                if run.over(k):
                    run.end()  # before the last sample goes: its state says end, its counts the rest
                yield sample
        finally:
            run.close()

    def __repr__(self) -> str:
        ends = f"samples={self.samples}" if self.samples is not None else f"stop={self.stop!r}"
        return (f"Mix({[type(s).__name__ for s in self.sources]}, weights={self.weights}, seed={self.seed}, "
                f"{ends}, batch_size={self.batch_size})")


_END = object()


class _Run:
    """One reader's pass of a mix: its sources' iterators, cycles, quotas and position."""

    def __init__(self, mix: Mix, world: World, epoch: int, before: list[Stage[dict]], entry: dict) -> None:
        self.mix, self.world, self.epoch, self.before = mix, world, epoch, before
        n = len(mix.sources)
        self.t, self.ended, self.saved = entry["t"], bool(entry.get("end")), entry
        self.cycles = [c for c, _ in entry["sources"]]
        self.iters: list[Any] = [None] * n
        self.empty = [0] * n
        self.probs = mix._probs(before, world)
        self.chosen = counts_before(self.probs, mix.seed, epoch, len(before), world.worker, self.t)
        self.budget, lost, self.quotas, self.own = _limits(mix, world, epoch, before)
        if lost and world.slot == 0 and self.t == 0:
            mix._counters.add("mix.left_out", lost)

    def over(self, k: int) -> bool:
        """Whether the epoch ends before taking the choice ``k`` (with a budget, or quotas)."""
        if self.budget is not None:
            return self.t >= self.budget
        if self.quotas is None:
            return False
        if self.mix.stop == "all":
            return all(c >= q for c, q in zip(self.chosen, self.quotas, strict=True))
        return self.chosen[k] >= self.quotas[k]

    def open(self, k: int, cycle: int, stages: list[Stage]) -> None:
        """Source ``k``'s pass of its epoch in cycle ``cycle``, resumed at ``stages``' position."""
        source = self.mix.sources[k]
        epoch = self.epoch + cycle * CYCLE_STRIDE
        if stages:
            fp, split = source.state_key()
            state = {**start_state(fp, epoch, split), "stages": stages_json(stages),
                     "batching": [None, False]}
            source.load_state_dict(with_mode(state, source.block_window()))  # BLOCK-SHUFFLE's tag
        else:
            source.set_epoch(epoch)
        old, self.iters[k] = self.iters[k], source.iter_batches(None)
        if old is not None:
            old.close()

    def take(self, k: int) -> Any:
        """The next sample of source ``k``; ``_END`` when the epoch ends there (``stop``)."""
        while True:
            try:
                sample = next(self.iters[k])
                self.empty[k] = 0
                return sample
            except StopIteration:
                pass
            if self.mix.stop == "first":
                return _END
            if self.quotas is None and self.mix.samples is None and all(
                    c or i == k for i, c in enumerate(self.cycles)):
                return _END  # stop="all" without counts: the last source to run out ends the epoch
            self.empty[k] += 1
            if self.empty[k] > _EMPTY_CYCLES:
                raise StreamDataError(f"source {k} of the mix ({type(self.mix.sources[k]).__name__}) gave "
                                      f"{self.world.describe()} no sample in {_EMPTY_CYCLES} epochs in a "
                                      "row; give it more samples than readers, or leave it out")
            self.cycles[k] += 1
            self.open(k, self.cycles[k], [])

    def entry(self) -> dict:
        """This reader's entry in the state: choices taken, and each source's cycle and position."""
        if self.iters[0] is None:  # it ended before this pass: nothing was opened
            return self.saved
        positions = [s.state_dict()["stages"][-1]["delivered"][self.world.slot] for s in self.mix.sources]
        return entry_of(self.t, self.cycles, positions, self.ended)

    def end(self) -> None:
        """The pass ends: count what ``stop="first"`` left undelivered of this reader's share of
        each source (once per reader and stage: a state that says ``end`` has counted it)."""
        self.ended = True
        if self.mix.stop != "first" or self.own is None:
            return
        for k, (own, chosen) in enumerate(zip(self.own, self.chosen, strict=True)):
            if own > chosen:
                self.mix._counters.add(f"mix.undelivered.{k}", own - chosen)

    def close(self) -> None:
        for it in self.iters:
            if it is not None:
                it.close()


class _Limits(NamedTuple):
    """Where a reader's pass of a stage ends: ``budget`` samples (``samples=N``; ``lost``: what the
    division left out), or the ``quotas`` of each source (counts known: every rank's the same) and
    the reader's ``own`` share of each; neither: where the sources run out."""

    budget: int | None
    lost: int
    quotas: list[int] | None
    own: list[int] | None


def _limits(mix: Mix, world: World, epoch: int, before: list[Stage[dict]]) -> _Limits:
    shape = (world.world_size, world.num_workers)
    if mix.samples is not None:
        left = mix.samples  # each earlier stage gave out what its ranks could share equally
        for stage in before:
            left -= split_budget(left, (stage.world_size, 1), 0)[1] + sum(e["t"] for e in stage.known())
        budget, lost = split_budget(left, shape, world.worker)
        return _Limits(budget, lost, None, None)
    counts = [c for c in (s.sample_counts() for s in mix.sources) if c is not None]
    if len(counts) < len(mix.sources):
        return _Limits(None, 0, None, None)
    per_rank = [quotas(c, source_stages(before, k, "samples"), shape, world.worker, seed=s.seed,
                       epoch=epoch, shuffle=s.shuffle)
                for k, (s, c) in enumerate(zip(mix.sources, counts, strict=True))]
    agg = min if mix.stop == "first" else max
    return _Limits(None, 0, [agg(q) for q in per_rank], [q[world.rank] for q in per_rank])


def _tail_counted(samples: Iterator[Any], batch_size: int, drop_last: bool,
                  counters: Counters) -> Iterator[Any]:
    """``samples``; with ``drop_last``, the short last batch's samples are counted as left out."""
    n = 0
    for sample in samples:
        n += 1
        yield sample
    if drop_last and n % batch_size:
        counters.add("mix.left_out", n % batch_size)


def _total(source: ShardedDataset) -> int | None:
    counts = source.sample_counts()
    return None if counts is None else int(np.sum(counts))


def _summed(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for name, n in d.items():
            out[name] = out.get(name, 0) + n
    return out


def _check_sources(sources: list) -> None:
    if not sources:
        raise SpecError("a Mix needs at least one source")
    for i, source in enumerate(sources):
        if not isinstance(source, ShardedDataset):
            raise SpecError(f"source {i} is a {type(source).__name__}: a Mix mixes streamdata's sharded "
                            "datasets (TarDataset, ParquetDataset, ArrowDataset)")
        if source.batch_size is not None:
            raise SpecError(f"source {i} ({type(source).__name__}) batches itself (batch_size="
                            f"{source.batch_size}): a Mix mixes samples; leave the sources' batch_size unset "
                            "and give it to the Mix (sd.Mix(..., batch_size=N)) or to sd.loader")
        if any(source is other for other in sources[:i]):
            raise SpecError(f"source {i} is the same dataset object as an earlier one: build one dataset "
                            "per source (weights say how often each is chosen)")


def _differences(saved: dict, mine: dict, sources: Sequence[ShardedDataset]) -> str:
    if not saved:
        return "the state has no mix description (saved by another streamdata?)"
    out = []
    if len(saved.get("sources", [])) != len(mine["sources"]):
        out.append(f"{len(saved.get('sources', []))} sources saved, {len(mine['sources'])} here")
    else:
        for i, (a, b) in enumerate(zip(saved["sources"], mine["sources"], strict=True)):
            if a != b:
                out.append(f"source {i} ({type(sources[i]).__name__}) differs (its shards, sizes, sample "
                           "counts, seed or shuffle)")
    for key in ("splits", "weights", "seed", "stop", "samples"):
        if key != "splits" and saved.get(key) != mine[key]:
            out.append(f"{key} {saved.get(key)!r} saved, {mine[key]!r} here")
    if saved.get("splits") != mine["splits"] and not out:
        out.append(f"splits {saved.get('splits')} saved, {mine['splits']} here (an index added or removed?)")
    return "; ".join(out or ["its fingerprint differs"]) + ": load it into the Mix it was saved from"
