"""Mid-epoch resume plans (resume.py): what one world delivered plus what the next one reads is the
epoch exactly (or the drop_last rule), no sample twice, equal steps on the new ranks.

Exhaustive over small cases, like test_plan.py: count vectors, old and new worlds, batch sizes,
drop_last, positions at seeded random batch boundaries (anywhere without a batch size)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest

from streamdata.epoch.plan import batch_sizes, reader_span
from streamdata.epoch.resume import Stage, resume_span
from streamdata.epoch.world import World
from streamdata.errors import SpecError

COUNT_VECTORS = [[], [1], [5], [0, 0, 3], [5, 1, 9, 3, 0, 7, 2], [2, 2, 2, 2], [64] * 9,
                 [10, 200, 37, 150, 11, 99, 120, 13], [1] * 11]
WORLDS = [(1, 1), (2, 1), (2, 2), (3, 1), (1, 3), (4, 2)]


def _samples(span):
    return [(s.unit, i) for s in span.segments for i in range(s.start, s.stop)]


def _spans(counts, stages, shape, **kw):
    ranks, workers = shape
    return {slot: resume_span(counts, stages, World(slot // workers, ranks, slot % workers, workers), **kw)
            for slot in range(ranks * workers)}


def _stop(spans, rng, batch):
    """A position per reader (at a batch boundary) and the samples delivered before it."""
    delivered, before = [], []
    for slot in sorted(spans):
        span = spans[slot]
        if batch is None:
            d = rng.randint(0, span.samples)
        else:
            sizes = batch_sizes(span, batch)
            d = sum(sizes[:rng.randint(0, len(sizes))])
        delivered.append(d)
        before += _samples(span)[:d]
    return delivered, before


def _steps(spans, shape):
    steps = Counter()
    for slot, span in spans.items():
        steps[slot // shape[1]] += span.batches
    return steps


CASES = list(itertools.product(range(len(COUNT_VECTORS)), WORLDS, WORLDS, [None, 1, 3, 4], [False, True]))


@pytest.mark.parametrize("case", range(0, len(CASES), 1 + len(CASES) // 500))
def test_resume_property(case):
    _check(case)


@pytest.mark.slow
def test_resume_property_every_case():
    for case in range(len(CASES)):
        _check(case)


def _check(case):
    vector, old, new, batch, drop_last = CASES[case]
    counts = COUNT_VECTORS[vector]
    everything = Counter((u, i) for u, n in enumerate(counts) for i in range(n))
    rng = random.Random(case)
    for epoch, shuffle in ((0, False), (3, True)):
        kw = dict(seed=7, epoch=epoch, shuffle=shuffle, batch_size=batch, drop_last=drop_last)
        first = _spans(counts, [], old, **kw)
        for slot, span in first.items():  # no stage: the epoch's own plan
            ref = reader_span(counts, World(slot // old[1], old[0], slot % old[1], old[1]), **kw)
            assert _samples(span) == _samples(ref) and span.batches == ref.batches
        delivered, before = _stop(first, rng, batch)
        stages = [Stage(*old, delivered)]
        after_spans = _spans(counts, stages, new, **kw)
        after = [s for span in after_spans.values() for s in _samples(span)]
        _check_union(everything, before, after, first, after_spans, batch, drop_last)
        if old == new:  # RESUME-CONTINUES: each reader the rest of its own span
            for slot, span in after_spans.items():
                assert _samples(span) == _samples(first[slot])[delivered[slot]:]
                if batch is not None:
                    rest = batch_sizes(first[slot], batch)
                    assert sum(rest) - delivered[slot] == sum(batch_sizes(span, batch))
        elif batch is not None:  # RESUME-ELASTIC: what is left, re-divided into equal spans
            assert len(set(_steps(after_spans, new).values())) == 1  # EQUAL-STEPS on the new ranks
            if not drop_last:
                own = [span.samples - span.pad for span in after_spans.values()]
                assert max(own) - min(own) <= 1
        # a second resume on a third world
        d2, mid = _stop(after_spans, rng, batch)
        third = (1, 2) if new != (1, 2) else (3, 1)
        last = _spans(counts, [*stages, Stage(*new, d2)] if old != new else [Stage(*old, [
            a + b for a, b in zip(delivered, d2, strict=True)])], third, **kw)
        rest = [s for span in last.values() for s in _samples(span)]
        _check_union(everything, before + mid, rest, first, last, batch, drop_last, after_spans)
        if batch is not None:
            assert len(set(_steps(last, third).values())) == 1


def _check_union(everything, before, after, first, spans, batch, drop_last, middle=None):
    got = Counter(before) + Counter(after)
    pads = sum(s.pad for s in spans.values()) + sum(s.pad for s in first.values())
    pads += sum(s.pad for s in (middle or {}).values())
    if drop_last and batch:
        assert max(got.values(), default=1) == 1 and got <= everything
        assert all(set(batch_sizes(s, batch)) <= {batch} for s in spans.values())
    else:
        extra = got - everything
        assert got - extra == everything, "a sample lost"
        assert sum(extra.values()) <= pads, "a sample twice (beyond the plan's pads)"


def test_the_same_world_continues_where_each_reader_stopped():
    counts = [5, 1, 9, 3, 0, 7, 2]
    world = World(1, 2, 1, 2)
    span = reader_span(counts, world, batch_size=2)
    resumed = resume_span(counts, [Stage(2, 2, [None, None, None, 4])], world, batch_size=2)
    assert _samples(resumed) == _samples(span)[4:]
    assert batch_sizes(resumed, 2) == batch_sizes(span, 2)[2:]


def test_a_partial_position_resumes_only_on_its_own_world():
    with pytest.raises(SpecError, match="same world shape"):
        resume_span([4, 4], [Stage(2, 1, [None, 2])], World(0, 1, 0, 1), batch_size=2)


def test_elastic_resume_plans_a_million_units_quickly_enough_to_be_pure():
    counts = np.random.default_rng(0).integers(50, 150, 100_000)
    delivered = [int(x) for x in np.random.default_rng(1).integers(0, 100, 64 * 4)]
    span = resume_span(counts, [Stage(64, 4, delivered)], World(5, 24, 1, 3), seed=1, shuffle=True,
                       batch_size=32)
    left = counts.sum() - sum(delivered)
    assert abs(span.samples - left / 72) <= 1


def test_a_state_in_the_saved_format_loads_and_saves_unchanged():
    """Positions are typed in memory (an int, a ``UnitPosition``) and plain JSON in a state: a
    state saved before the types loads, and a pass saves it back in the same form."""
    import json

    from streamdata.epoch.resume import UnitPosition
    from streamdata.epoch.state import Position, parse_state, stages_json

    fp = "f" * 24
    units = {"format": "streamdata-state", "version": 1, "fingerprint": fp, "epoch": 2, "split": "units",
             "stages": [{"world": [2, 1], "delivered": [[1, 3], [0, 0]]},
                        {"world": [1, 2], "delivered": [[2, 1], None]}]}
    epoch, stages = parse_state(units, fp, "units")
    assert epoch == 2 and stages[0].delivered == [UnitPosition(1, 3), UnitPosition(0, 0)]
    assert stages_json(stages) == units["stages"]  # lists again, the unknown reader kept
    pos = Position.of_pass(World(0, 1, 0, 2), epoch, "units", stages, [None, False])
    assert pos.base == UnitPosition(2, 1) and pos.samples_before == 0
    state = pos.state(fp)
    assert json.loads(json.dumps(state)) == state and state["stages"] == units["stages"]

    samples = {**units, "split": "samples", "stages": [{"world": [1, 2], "delivered": [7, None]}]}
    epoch, stages = parse_state(samples, fp, "samples")
    pos = Position.of_pass(World(0, 1, 0, 2), epoch, "samples", stages, [4, False])
    assert pos.base == 7 and pos.samples_before == 7
    assert list(pos.count(range(3))) == [0, 1, 2] and pos.mine() == 10
    assert pos.state(fp)["stages"] == [{"world": [1, 2], "delivered": [10, None]}]


def test_a_stage_without_every_reader_names_the_missing_ones():
    stage = Stage(2, 2, [3, None, 4, None])
    with pytest.raises(SpecError, match=r"lacks readers \[1, 3\] of its 2 ranks x 2 workers"):
        stage.known()
    assert Stage(1, 2, [3, 0]).known() == [3, 0]
    own = Stage.own(World(1, 2, 0, 2), 5)
    assert own.delivered == [None, None, 5, None]
