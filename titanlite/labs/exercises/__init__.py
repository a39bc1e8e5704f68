"""The checks behind the notebooks' exercises: `check(name, student_fn)` runs exercise `name`'s
check on fresh random inputs against the package's real implementation, prints one line
when it passes and raises one `ExerciseError` line saying what is wrong when it does not.

One module per group of notebooks (basics: 01-06, parallel: 07-11, resilience: 12-13,
cpu_and_search: 14-15, capstone: 16); each
check is registered with `@exercise(name, title)` under the name the notebook's check cell uses
(the notebook number first: "02_global_token_loss").
"""
from __future__ import annotations

from ...errors import closest, install_notebook_handler
from ...exercises import ExerciseError

EXERCISES: dict[str, tuple[str, object]] = {}  # name → (title, check function)


def exercise(name: str, title: str):
    def register(fn):
        EXERCISES[name] = (title, fn)
        return fn
    return register


def check(name: str, student_fn) -> str:
    """Check the student's function for exercise `name`; returns the line it printed.
    In IPython it first installs titanlite's one-line error display (what notebook_setup()
    does; idempotent), so a failed check reads as one line even in a notebook without it."""
    install_notebook_handler()
    if name not in EXERCISES:
        raise ExerciseError(f"no exercise named '{name}'{closest(name, EXERCISES)}; "
                            f"the exercises are: {', '.join(sorted(EXERCISES))}")
    return EXERCISES[name][1](student_fn)


def exercises_of(notebook: str) -> list[str]:
    """The exercise names of notebook 'NN' (or 'NN_title'), in order."""
    return sorted(n for n in EXERCISES if n[:2] == notebook[:2])


from . import basics, capstone, cpu_and_search, parallel, resilience  # noqa: E402,F401  (they register their checks)

__all__ = ["EXERCISES", "ExerciseError", "check", "exercise", "exercises_of"]
