"""Checks for notebook 16: the overrides each ablation row runs under, and reading a speed-up
against the drift between the two baseline rows."""
from __future__ import annotations

import random

from ...exercises import call, fail, fresh_seed, passed, same_value
from . import exercise

_ABSENT = object()
_KEYS = ("training.mixed_precision", "compile.enable", "float8.enable", "float8.recipe",
         "activation_checkpoint.mode", "parallel.dp_shard", "checkpoint.every")


def _random_rungs(rng: random.Random):
    """A ladder of 3-8 rungs over a few shared keys (so later rungs override earlier ones),
    some of them measured instead of the row before (carry=False)."""
    from ..nb16_capstone import Rung
    rungs = []
    for i in range(rng.randint(3, 8)):
        keys = rng.sample(_KEYS, rng.randint(0, 3))
        rungs.append(Rung(f"rung {i}", {k: rng.randint(0, 99) for k in keys}, carry=rng.random() < 0.7))
    return rungs


@exercise("16_row_overrides", "the overrides each row of the ladder runs under")
def row_overrides(fn):
    from ..nb16_capstone import ladder, row_overrides as real
    name, seed = "16_row_overrides", fresh_seed()
    rng = random.Random(seed)
    ladders = [ladder(rng.choice([2, 4, 8]), rng.randint(1, 10))] + [_random_rungs(rng) for _ in range(20)]
    for rungs in ladders:
        got, want = call(name, fn, rungs), real(rungs)
        if not isinstance(got, list) or len(got) != len(want):
            fail(name, f"return a list of (rung, overrides), one per rung ({len(want)}), got "
                       f"{len(got) if isinstance(got, list) else type(got).__name__}", seed)
        for i, ((rung, want_over), item) in enumerate(zip(want, got)):
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] is rung):
                fail(name, f"item {i} should be the pair (rungs[{i}], its overrides)", seed)
            got_over = item[1]
            if not isinstance(got_over, dict):
                fail(name, f"the overrides of {rung.name!r} should be a dict, got "
                           f"{type(got_over).__name__}", seed)
            if got_over != want_over:  # name the first key that differs, not two whole dicts
                key = next(k for k in [*want_over, *got_over]
                           if got_over.get(k, _ABSENT) != want_over.get(k, _ABSENT))
                carried = ", ".join(f"{r.name}{'' if r.carry else ' (not carried)'}" for r in rungs[:i])
                show = lambda v: "absent" if v is _ABSENT else repr(v)  # noqa: E731
                fail(name, f"the overrides of {rung.name!r} after [{carried}]: {key!r} is "
                           f"{show(got_over.get(key, _ABSENT))}, expected "
                           f"{show(want_over.get(key, _ABSENT))}", seed)
    return passed(name, f"equals titanlite.labs.nb16_capstone.row_overrides on {len(ladders)} ladders")


@exercise("16_speed_verdict", "a speed-up, read against the baselines' drift")
def speed_verdict(fn):
    from ..nb16_capstone import drift, verdict
    name, seed = "16_speed_verdict", fresh_seed()
    rng = random.Random(seed)
    spans = ((-2.5, -1.05), (-0.95, 0.95), (1.05, 2.5))  # slower, within, faster: all three
    for i in range(30):
        first = rng.uniform(50, 50_000)
        last = first * (1 + rng.choice((-1, 1)) * rng.uniform(0.005, 0.2))
        band = drift([{"tokens_per_sec": first}, {"tokens_per_sec": last}])
        ratio = 1 + rng.uniform(*spans[i % 3]) * band  # never on the edge: understanding decides
        row = first * ratio
        same_value(name, call(name, fn, first, last, row), verdict(row / first, band),
                   f"the verdict for baselines {first:,.1f} and {last:,.1f} tokens/s and a row at "
                   f"{row:,.1f} ({ratio:.3f}× the first, drift {band:.1%})", seed=seed)
    return passed(name, "equals nb16_capstone.verdict(ratio, drift(rows)) on 30 rows: "
                        "faster, slower and within drift")
