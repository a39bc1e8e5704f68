"""Checks for notebook 16: the overrides each ablation row runs under, and reading a speed-up
against the drift between the two baseline rows."""

from __future__ import annotations

import random

from .grading import exercise

_ABSENT = object()
_KEYS = (
    "training.mixed_precision",
    "compile.enable",
    "float8.enable",
    "float8.recipe",
    "activation_checkpoint.mode",
    "parallel.dp_shard",
    "checkpoint.every",
)


def _random_rungs(rng: random.Random):
    """A ladder of 3-8 rungs over a few shared keys (so later rungs override earlier ones),
    some of them measured instead of the row before (carry=False)."""
    from ..nb16_capstone import Rung

    rungs = []
    for i in range(rng.randint(3, 8)):
        keys = rng.sample(_KEYS, rng.randint(0, 3))
        rungs.append(
            Rung(f"rung {i}", {k: rng.randint(0, 99) for k in keys}, carry=rng.random() < 0.7)
        )
    return rungs


@exercise("16_row_overrides", "the overrides each row of the ladder runs under")
def row_overrides(c, fn):
    from ..nb16_capstone import ladder
    from ..nb16_capstone import row_overrides as real

    rng = c.rng
    ladders = [ladder(rng.choice([2, 4, 8]), rng.randint(1, 10))] + [
        _random_rungs(rng) for _ in range(20)
    ]
    for rungs in ladders:
        got, want = c.call(fn, rungs), real(rungs)
        if not isinstance(got, list) or len(got) != len(want):
            c.fail(
                f"return a list of (rung, overrides), one per rung ({len(want)}), got "
                f"{len(got) if isinstance(got, list) else type(got).__name__}"
            )
        for i, ((rung, want_over), item) in enumerate(zip(want, got)):
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] is rung):
                c.fail(f"item {i} should be the pair (rungs[{i}], its overrides)")
            got_over = item[1]
            if not isinstance(got_over, dict):
                c.fail(
                    f"the overrides of {rung.name!r} should be a dict, got {type(got_over).__name__}"
                )
            if got_over is rung.overrides or any(got_over is other[1] for other in got[:i]):
                c.fail(
                    f"the overrides of {rung.name!r} should be a new dict, not "
                    f"{'the rung' if got_over is rung.overrides else 'an earlier row'}'s own "
                    f"(a later change would change both)"
                )
            if got_over != want_over:  # name the first key that differs, not two whole dicts
                key = next(
                    k
                    for k in [*want_over, *got_over]
                    if got_over.get(k, _ABSENT) != want_over.get(k, _ABSENT)
                )
                carried = ", ".join(
                    f"{r.name}{'' if r.carry else ' (not carried)'}" for r in rungs[:i]
                )
                show = lambda v: "absent" if v is _ABSENT else repr(v)  # noqa: E731
                c.fail(
                    f"the overrides of {rung.name!r} after [{carried}]: {key!r} is "
                    f"{show(got_over.get(key, _ABSENT))}, expected {show(want_over.get(key, _ABSENT))}"
                )
    c.passed(f"equals titanlite.labs.nb16_capstone.row_overrides on {len(ladders)} ladders")


def _verdict_by(ratio, band):
    return (
        "faster (beyond drift)"
        if ratio > 1 + band
        else "slower (beyond drift)"
        if ratio < 1 - band
        else "within drift"
    )


VERDICT_MISTAKES = {  # (first, last, row) -> verdict
    "no drift band": lambda a, b, r: _verdict_by(r / a, 0.0),
    "against the baselines' mean": lambda a, b, r: _verdict_by(
        r / ((a + b) / 2), abs(a - b) / ((a + b) / 2)
    ),
    "against the last baseline": lambda a, b, r: _verdict_by(r / b, abs(a - b) / ((a + b) / 2)),
    "the gap over the first baseline": lambda a, b, r: _verdict_by(r / a, abs(a - b) / a),
    "the gap over the last baseline": lambda a, b, r: _verdict_by(r / a, abs(a - b) / b),
    "the signed gap": lambda a, b, r: _verdict_by(r / a, (a - b) / ((a + b) / 2)),
    "the signed gap, last minus first": lambda a, b, r: _verdict_by(r / a, (b - a) / ((a + b) / 2)),
}


def _draw_rows(rng: random.Random):
    from ..nb16_capstone import drift

    spans = ((-2.5, -1.02), (-0.98, 0.98), (1.02, 2.5))  # slower, within, faster: all three
    cases = []
    for i in range(30):
        first = rng.uniform(50, 50_000)
        # Each of the three verdicts with the machine drifting up and drifting down, five times
        # each: a gap taken with its sign is wrong one way or the other, at every seed.
        direction = 1 if (i // 3) % 2 else -1
        last = first * (1 + direction * rng.uniform(0.02, 0.2))
        band = drift([{"tokens_per_sec": first}, {"tokens_per_sec": last}])
        # never within 2% of the edge: no rounding decides
        ratio = 1 + rng.uniform(*spans[i % 3]) * band
        cases.append((first, last, first * ratio))
    return cases


@exercise("16_speed_verdict", "a speed-up, read against the baselines' drift")
def speed_verdict(c, fn):
    from ..nb16_capstone import drift, verdict

    def real(first, last, row):
        return verdict(row / first, drift([{"tokens_per_sec": first}, {"tokens_per_sec": last}]))

    cases = c.separating(_draw_rows, real, VERDICT_MISTAKES)
    for first, last, row in cases:
        band = drift([{"tokens_per_sec": first}, {"tokens_per_sec": last}])
        c.same_value(
            c.call(fn, first, last, row),
            real(first, last, row),
            f"the verdict for baselines {first:,.3f} and {last:,.3f} tokens/s and a row at "
            f"{row:,.3f} ({row / first:.4f}× the first, drift {band:.3%})",
        )
    c.passed(
        f"equals nb16_capstone.verdict(ratio, drift(rows)) on {len(cases)} rows: "
        "faster, slower and within drift"
    )
