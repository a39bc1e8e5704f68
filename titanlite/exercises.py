"""Exercises for course labs: the student writes a small piece of a technique, a check compares
it with the package's real implementation on fresh random inputs.

This module holds what every check shares: `ExerciseError` (a TitanliteError, so the notebook
handler of `titanlite.notebook_setup()` shows it as one friendly line, never a traceback), the
way a student's function is called (`call`: "not attempted yet" for the NotImplementedError the
student edition starts with, one line for anything else it raises) and the comparisons that
say *what* is wrong (shape, dtype, which element, by how much). The checks themselves live
with the notebooks' labs, in `titanlite/labs/exercises/` (`check(name, fn)` is the entry point).
"""
from __future__ import annotations

import random

import torch

from .errors import TitanliteError

PASSED = "passed"              # the word a passing check prints: `titanlite progress` reads it
NOT_ATTEMPTED = "not attempted yet"


class ExerciseError(TitanliteError):
    """A student's answer disagrees with the real implementation; the message says how."""


def fresh_seed() -> int:
    """A new seed per check, so a hard-coded answer cannot pass; it goes into the message of a
    failure, so the student can reproduce it."""
    return random.SystemRandom().randrange(2**31)


def call(name: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), with whatever it raises turned into one line about exercise `name`."""
    if not callable(fn):
        raise ExerciseError(f"{name}: expected a function, got {type(fn).__name__}: pass the "
                            f"function itself (no parentheses)")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseError(f"{name}: {NOT_ATTEMPTED} - replace `raise NotImplementedError()` in "
                            f"the cell above with your code, run it, then run this check") from None
    except ExerciseError:
        raise
    except Exception as e:  # the student's bug: name it in one line, no traceback wall
        where = ""
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" (line {tb.tb_lineno} of {tb.tb_frame.f_code.co_name})"
        raise ExerciseError(f"{name}: your function raised {type(e).__name__}: {e}{where}") from None


def fail(name: str, what: str, seed: int | None = None) -> None:
    tail = f" [seed {seed}]" if seed is not None else ""
    raise ExerciseError(f"{name}: {what}{tail}")


def same_tensor(name: str, got, want: torch.Tensor, what: str, *, seed: int | None = None,
                rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Fail with one line naming the first difference: type, shape, dtype, then values."""
    if not isinstance(got, torch.Tensor):
        fail(name, f"{what} should be a torch.Tensor, got {type(got).__name__}", seed)
    if tuple(got.shape) != tuple(want.shape):
        fail(name, f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}", seed)
    if got.dtype != want.dtype and not (got.is_floating_point() and want.is_floating_point()):
        fail(name, f"{what} has dtype {got.dtype}, expected {want.dtype}", seed)
    got64, want64 = got.detach().double(), want.detach().double()
    if not torch.isfinite(got64).all() and torch.isfinite(want64).all():
        fail(name, f"{what} contains inf or nan; the real one is finite", seed)
    bad = ~torch.isclose(got64, want64, rtol=rtol, atol=atol, equal_nan=True)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        at = f" at index {index}" if index else ""
        fail(name, f"{what} is {got64[index].item():.6g}{at}, expected {want64[index].item():.6g} "
                   f"({int(bad.sum())} of {bad.numel()} values differ)", seed)


def same_value(name: str, got, want, what: str, *, seed: int | None = None,
               rel: float = 1e-9) -> None:
    """Numbers (within `rel`), or anything else by ==."""
    if isinstance(want, bool) or not isinstance(want, (int, float)):
        if got != want:
            fail(name, f"{what} is {got!r}, expected {want!r}", seed)
        return
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        fail(name, f"{what} should be a number, got {type(got).__name__}", seed)
    if abs(got - want) > rel * max(1.0, abs(want)):
        fail(name, f"{what} is {got:.6g}, expected {want:.6g}", seed)


def passed(name: str, detail: str) -> str:
    """The line a passing check prints (and returns)."""
    line = f"✓ {name}: {PASSED} - {detail}"
    print(line)
    return line
