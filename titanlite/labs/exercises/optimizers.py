"""Checks for notebook 20: the bytes one parameter's optimizer state holds, and one quintic
Newton-Schulz iteration of Muon."""

from __future__ import annotations

import math

import torch

from ..nb20_optimizers_and_memory import newton_schulz_step, state_bytes
from .grading import exercise

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")

# Shapes every draw holds: each tells one rule apart from a near miss. 4096 values (the threshold
# itself) in whole blocks, 2048 (whole blocks, under it), 4160 (over it, not whole blocks of 256),
# 4224 (whole blocks of 128, not of 256), a matrix, a 3-D stack and a vector for Adafactor.
FIXED = [
    ((4096,), "adamw8bit"),
    ((2048,), "adamw8bit"),
    ((64, 65), "adamw8bit"),
    ((33, 128), "adamw4bit"),
    ((33, 128), "adamw8bit"),
    ((192, 64), "adamw4bit"),
    ((192, 64), "adamw8bit"),
    ((30, 50), "adafactor"),
    ((3, 16, 40), "adafactor"),
    ((100,), "adafactor"),
    ((64, 64), "adamw"),
]


def _quantized(shape, name, *, block=None, table=None, scales=True, moments=2, code=None):
    """A quantized state with one of its parts counted wrong (for the mistakes the check must tell)."""
    numel = math.prod(shape)
    block = block or {"adamw8bit": 256, "adamw4bit": 128}[name]
    if numel < 4096 or numel % block:
        return 8 * numel
    per_value = code if code is not None else (1 if name == "adamw8bit" else 0.5)
    tables = {"adamw8bit": 256, "adamw4bit": 16}[name] if table is None else table
    one = per_value * numel + (4 * numel // block if scales else 0) + 4 * tables
    return int(moments * one)


def _adafactor(shape, *, lead=True, full=False):
    if len(shape) < 2:
        return 4 * math.prod(shape)
    *leading, rows, cols = shape
    return 4 * (math.prod(leading) if lead else 1) * (rows * cols if full else rows + cols)


def _mistake(**changes):
    """state_bytes with one rule broken; the others as they are."""

    def fn(shape, name):
        if name in ("adamw8bit", "adamw4bit") and any(
            k in changes for k in ("block", "table", "scales", "moments", "code")
        ):
            return _quantized(shape, name, **changes)
        if name == "adafactor" and any(k in changes for k in ("lead", "full")):
            return _adafactor(shape, **changes)
        if name in ("adamw8bit", "adamw4bit") and "threshold" in changes:
            numel = math.prod(shape)
            if numel <= changes["threshold"]:
                return 8 * numel
        return state_bytes(shape, name)

    return fn


STATE_MISTAKES = {
    "no block scales": _mistake(scales=False),
    "no lookup table": _mistake(table=0),
    "one moment": _mistake(moments=1),
    "4-bit as a byte a value": _mistake(code=1),
    "4-bit in blocks of 256": _mistake(block=256),
    "quantized from more than 4096 values": _mistake(threshold=4096),
    "Adafactor keeps rows × cols": _mistake(full=True),
    "Adafactor's leading dims forgotten": _mistake(lead=False),
}


def _draw_state(rng):
    cases = list(FIXED)
    for _ in range(4):
        name = rng.choice(OPTIMIZERS)
        dims = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.choice([8, 16, 32, 48, 64, 96, 128, 192, 256]) for _ in range(dims))
        cases.append((shape, name))
    rng.shuffle(cases)
    return cases


@exercise("20_state_bytes", "the bytes one parameter's optimizer state holds")
def state_bytes_check(c, fn):
    cases = c.separating(_draw_state, state_bytes, STATE_MISTAKES)
    for shape, name in cases:
        got = c.call(fn, shape, name)
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        c.same_value(got, state_bytes(shape, name), f"state_bytes({shape}, {name!r})")
    c.passed(f"the bytes titanlite's formula counts, for {len(cases)} shapes and optimizers")


def _coefficients(rng):
    """Coefficients unlike Keller Jordan's, all different: a hard-coded (3.4445, -4.775, 2.0315) or
    two of them swapped gives another answer."""
    a = rng.uniform(1.5, 3.5)
    b = -rng.uniform(1.0, 4.0)
    c = rng.uniform(0.5, 2.5)
    return a, b, c


def _draw_ns(rng):
    cases = []
    for rows, cols in [(4, 4), (3, 7), (5, 12), (6, 6)]:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        x = x / torch.linalg.matrix_norm(x, ord=2)  # spectral norm 1, as Muon scales it (below)
        cases.append((x, *_coefficients(rng)))
    return cases


NS_MISTAKES = {
    "x·(bA + cA²) on the right": lambda x, a, b, c: (
        a * x + x @ (b * (x @ x.T) + c * (x @ x.T) @ (x @ x.T))
    ),
    "A = xᵀx": lambda x, a, b, c: a * x + (b * (x.T @ x) + c * (x.T @ x) @ (x.T @ x)) @ x,
    "c·A, not c·A²": lambda x, a, b, c: a * x + (b * (x @ x.T) + c * (x @ x.T)) @ x,
    "A² elementwise": lambda x, a, b, c: a * x + (b * (x @ x.T) + c * (x @ x.T) ** 2) @ x,
    "b and c swapped": lambda x, a, b, c: a * x + (c * (x @ x.T) + b * (x @ x.T) @ (x @ x.T)) @ x,
    "Keller Jordan's coefficients": lambda x, a, b, c: newton_schulz_step(
        x, 3.4445, -4.7750, 2.0315
    ),
    "no a·x": lambda x, a, b, c: (b * (x @ x.T) + c * (x @ x.T) @ (x @ x.T)) @ x,
}


def _listed(step):
    """An iteration's answer as nested lists rounded to 1e-9: answers `separating` can compare."""
    return lambda *args: (step(*args) * 1e9).round().tolist()


@exercise("20_newton_schulz_step", "one quintic Newton-Schulz iteration")
def newton_schulz_check(c, fn):
    mistakes = {name: _listed(m) for name, m in NS_MISTAKES.items()}
    cases = c.separating(_draw_ns, _listed(newton_schulz_step), mistakes)
    for x, a, b, coef in cases:
        got = c.call(fn, x.clone(), a, b, coef)
        want = newton_schulz_step(x, a, b, coef)
        what = f"one iteration on a {tuple(x.shape)} matrix with (a, b, c) = ({a:.3f}, {b:.3f}, {coef:.3f})"
        # float64 in and out: a sum of a few products of values <= 1 in size, rounded a few times
        c.same_tensor(got, want, what, rtol=1e-9, atol=1e-12)
    c.passed(
        f"equals x ← a·x + (b·A + c·A²)·x, A = x·xᵀ, in float64 on {len(cases)} random matrices"
    )
