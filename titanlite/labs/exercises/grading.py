"""Exercises for course labs: the student writes a small piece of a technique, a check compares
it with the package's real implementation on fresh random inputs.

This module holds what every check shares: `ExerciseError` (a TitanliteError, so the notebook
handler of `notebook_setup()` shows it as one friendly line, never a traceback) and `Check`,
one run of one exercise's check: its seed (a new one each run, printed in every failure, and
given back to `check(name, fn, seed=N)` to repeat it), the way a student's function is called
(`call`: "not attempted yet" for the NotImplementedError the student edition starts with, one
line naming the student's own line for anything else it raises), and the comparisons that say
*what* is wrong (which item, which element, with enough digits to see the difference).
The checks themselves live beside this module, one file per group of notebooks.
"""

from __future__ import annotations

import linecache
import math
import os
import random
import sys
import sysconfig
from pathlib import Path

import torch

from ...errors import TitanliteError
from ...tools.course.editions import NOT_ATTEMPTED, PASSED  # the words `titanlite progress` reads


class ExerciseError(TitanliteError):
    """A student's answer disagrees with the real implementation; the message says how."""


def fresh_seed() -> int:
    """A new seed per check, so a hard-coded answer cannot pass; it goes into the message of a
    failure, so the student can repeat it."""
    return random.SystemRandom().randrange(2**31)


# Frames in these folders are not the student's: the line a crash names is the student's own.
_NOT_STUDENT = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {str(Path(__file__).resolve().parents[2])}
)


def _student_frame(tb):
    """The innermost frame of `tb` in the student's code (a notebook cell, a test file), or None."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        real = filename if filename.startswith("<") else str(Path(filename).resolve())
        if not real.startswith(_NOT_STUDENT):
            found = tb
        tb = tb.tb_next
    return found


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plain(x):
    """A one-element tensor or a numpy scalar as the Python number (or bool) it holds."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    return x


def show_pair(got, want) -> tuple[str, str]:
    """Two numbers printed with just enough digits to tell them apart (ints whole)."""
    if isinstance(got, int) and isinstance(want, int):
        return f"{got:,}", f"{want:,}"
    for digits in range(6, 18):
        a, b = f"{got:.{digits}g}", f"{want:.{digits}g}"
        if a != b:
            return a, b
    return repr(got), repr(want)


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Check:
    """One run of exercise `name`'s check, with its seed: `rng` (Python) and `gen` (torch) are
    seeded from it, so the same seed draws the same inputs."""

    def __init__(self, name: str, seed: int | None = None):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ExerciseError(
                f"{name}: seed must be a whole number >= 0 (the one a failure "
                f"printed), got {seed!r}"
            )
        self.name = name
        self.seed = fresh_seed() if seed is None else seed
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    def fail(self, what: str):
        raise ExerciseError(f"{self.name}: {what} [seed {self.seed}]")

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), with whatever it raises turned into one line: its type, its
        message's first line, the line of the student's code it came from, and the seed."""
        if not callable(fn):
            self.fail(
                f"expected a function, got {type(fn).__name__}: pass the function itself "
                f"(no parentheses)"
            )
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            raise ExerciseError(
                f"{self.name}: {NOT_ATTEMPTED} - replace `raise NotImplementedError()` "
                f"in the cell above with your code, run it, then run this check"
            ) from None
        except ExerciseError:
            raise
        except Exception as e:  # the student's bug: one line, no traceback wall
            lines = str(e).strip().splitlines()
            first = lines[0].strip() if lines else ""
            first = first if len(first) <= 200 else first[:197] + "..."
            where = ""
            frame = _student_frame(e.__traceback__)
            if frame is not None:
                code = frame.tb_frame.f_code
                text = linecache.getline(
                    code.co_filename, frame.tb_lineno, frame.tb_frame.f_globals
                ).strip()
                text = text if len(text) <= 80 else text[:77] + "..."
                where = f" (line {frame.tb_lineno} of {code.co_name}{': ' + text if text else ''})"
            self.fail(
                f"your function raised {type(e).__name__}{': ' + first if first else ''}{where}"
            )

    def same_tensor(
        self,
        got,
        want: torch.Tensor,
        what: str,
        *,
        rtol: float = 1e-5,
        atol: float = 1e-6,
        exact: bool = False,
    ) -> None:
        """Fail with one line naming the first difference: type, shape, dtype, then values.
        `exact`: the same dtype and the same bits (NaN equal to NaN)."""
        if not isinstance(got, torch.Tensor):
            self.fail(f"{what} should be a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(want.shape):
            self.fail(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype != want.dtype and (
            exact or not (got.is_floating_point() and want.is_floating_point())
        ):
            self.fail(f"{what} has dtype {got.dtype}, expected {want.dtype}")
        got64, want64 = got.detach().cpu().double(), want.detach().cpu().double()
        if not torch.isfinite(got64).all() and torch.isfinite(want64).all():
            index = tuple(int(i) for i in (~torch.isfinite(got64)).nonzero()[0])
            self.fail(
                f"{what} holds {got64[index].item()} at index {index}; the real one is finite"
            )
        if exact:
            bad = (got64 != want64) & ~(got64.isnan() & want64.isnan())
        else:
            bad = ~torch.isclose(got64, want64, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            a, b = show_pair(got64[index].item(), want64[index].item())
            at = f" at index {index}" if index else ""
            self.fail(
                f"{what} is {a}{at}, expected {b} ({int(bad.sum())} of {bad.numel()} values differ"
                f"{', compared bit for bit' if exact else ''})"
            )

    def same_value(self, got, want, what: str, *, rel: float = 1e-9, at: str = "") -> None:
        """Numbers (floats within `rel`, ints exactly), bools, and dicts, lists and tuples of them
        item by item, naming the first item that differs; anything else by ==. `at`: where the
        part compared sits in the whole answer `what` describes ("[2]['lr']"), named after the
        description and set apart from it ("... of a sequence of 20, item [5] is 7, expected
        12"), never glued to its last word ("20[5]")."""
        whole, what = what, f"{what}, item {at}" if at else what
        got = _plain(got)
        if isinstance(want, dict):
            if not isinstance(got, dict):
                self.fail(f"{what} should be a dict, got {type(got).__name__}: {_short(got)}")
            missing = [k for k in want if k not in got]
            if missing:
                self.fail(
                    f"{what} has no key {missing[0]!r} (expected keys: {', '.join(map(repr, want))})"
                )
            extra = [k for k in got if k not in want]
            if extra:
                self.fail(
                    f"{what} has a key {extra[0]!r} that should not be there (expected keys: "
                    f"{', '.join(map(repr, want))})"
                )
            for key in want:
                self.same_value(got[key], want[key], whole, rel=rel, at=f"{at}[{key!r}]")
            return
        if isinstance(want, (list, tuple)):
            if not isinstance(got, (list, tuple)):
                self.fail(
                    f"{what} should be a {type(want).__name__} of {len(want)}, got "
                    f"{type(got).__name__}: {_short(got)}"
                )
            if len(got) != len(want):
                self.fail(
                    f"{what} has {len(got)} item{'s' * (len(got) != 1)}, expected {len(want)}: "
                    f"{_short(got)} vs {_short(want)}"
                )
            for i, (g, w) in enumerate(zip(got, want)):
                self.same_value(g, w, whole, rel=rel, at=f"{at}[{i}]")
            return
        if isinstance(want, bool):
            if not isinstance(got, bool):
                self.fail(
                    f"{what} should be True or False, got {type(got).__name__}: {_short(got)}"
                )
            if got != want:
                self.fail(f"{what} is {got}, expected {want}")
            return
        if _number(want):
            if not _number(got):
                self.fail(f"{what} should be a number, got {type(got).__name__}: {_short(got)}")
            if isinstance(want, int) and isinstance(got, float) and got != math.floor(got):
                a, b = show_pair(got, want)
                self.fail(f"{what} is {a}, expected the whole number {b}")
            if isinstance(want, int) and isinstance(got, int):
                if got != want:
                    self.fail(f"{what} is {got:,}, expected {want:,}")
                return
            if not math.isfinite(got) or abs(got - want) > rel * max(1.0, abs(want)):
                a, b = show_pair(float(got), float(want))
                self.fail(f"{what} is {a}, expected {b}")
            return
        if got != want:
            self.fail(f"{what} is {_short(got)}, expected {_short(want)}")

    def separating(self, draw, right, mistakes: dict, tries: int = 500):
        """Draw inputs until every classic mistake answers differently from the right answer on
        at least one of them: a check whose inputs cannot tell a mistake apart from the answer
        would pass it. `draw(rng)` gives a list of argument tuples; `right` and each mistake
        are functions of those arguments. A draw that cannot separate them is a bug in the check."""

        def answer(fn, args):
            try:
                return fn(*args)
            except Exception as e:  # a crash is an answer that differs
                return ("raised", type(e).__name__)

        for _ in range(tries):
            cases = draw(self.rng)
            want = [answer(right, args) for args in cases]
            if all(
                any(answer(m, args) != w for args, w in zip(cases, want)) for m in mistakes.values()
            ):
                return cases
        left = [
            n for n, m in mistakes.items() if all(answer(m, a) == w for a, w in zip(cases, want))
        ]
        raise RuntimeError(
            f"{self.name}: the check's inputs never separate {left} from the answer "
            f"(seed {self.seed}): a bug in the check"
        )

    def passed(self, detail: str) -> None:
        """Print the line a passing check shows (once: check() returns nothing to echo)."""
        print(f"✓ {self.name}: {PASSED} - {detail}")
        sys.stdout.flush()


# The exercises, registered by the modules beside this one under the name a notebook's check
# cell uses (`@exercise("02_global_token_loss", title)`); `check` in __init__.py runs them.
EXERCISES: dict[str, tuple[str, object]] = {}  # name → (title, check function)


def exercise(name: str, title: str):
    def register(fn):
        EXERCISES[name] = (title, fn)
        return fn

    return register
