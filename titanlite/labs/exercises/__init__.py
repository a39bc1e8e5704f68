"""The checks behind the notebooks' exercises: `check(name, student_fn)` runs exercise `name`'s
check on fresh random inputs against the package's real implementation, prints one line
when it passes and raises one `ExerciseError` line saying what is wrong when it does not.
A failure names its seed: `check(name, student_fn, seed=N)` draws the same inputs again.

One module per group of notebooks (basics: 01-06, parallel: 07-11, resilience: 12-13,
cpu_and_search: 14-15, capstone: 16, long_context: 17 and 21, experts: 18, accelerators: 19,
optimizers: 20, replicas: 22); each check is a function
of a `Check` (the run: name, seed, random generators, the comparisons) and the student's
function, registered with
`@exercise(name, title)` under the name the notebook's check cell uses (the notebook number
first: "02_global_token_loss"). Every check draws its inputs so that the cases which tell the
classic mistakes apart from the answer are there at every seed (tests/test_exercises.py
sweeps seeds with more mistakes than the checks name).
"""

from __future__ import annotations

import warnings

from ...errors import closest
from ...tools.display.notebook import install_notebook_handler, quiet_third_party
from .grading import EXERCISES, Check, ExerciseError, exercise


def check(name: str, student_fn, *, seed: int | None = None) -> None:
    """Check the student's function for exercise `name`: prints one line when it passes, raises
    one ExerciseError line when it does not. `seed`: repeat the inputs of a failure's [seed N].
    In IPython it first installs titanlite's one-line error display and quiets third-party
    import noise (what notebook_setup() does; idempotent), so a failed check reads as one line
    even in a notebook without it, and a check that first imports torchao prints nothing on
    stderr. Warnings raised while checking are not shown: the check's own output is its one line
    (and nbgrader counts anything on stderr in a check cell as a failure)."""
    install_notebook_handler()
    quiet_third_party()
    if name not in EXERCISES:
        raise ExerciseError(
            f"no exercise named '{name}'{closest(name, EXERCISES)}; "
            f"the exercises are: {', '.join(sorted(EXERCISES))}"
        )
    run = Check(name, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        EXERCISES[name][1](run, student_fn)


def exercises_of(notebook: str) -> list[str]:
    """The exercise names of notebook 'NN' (or 'NN_title'), in order."""
    return sorted(n for n in EXERCISES if n[:2] == notebook[:2])


from . import (  # noqa: E402,F401  (they register their checks)
    accelerators,
    basics,
    capstone,
    cpu_and_search,
    experts,
    long_context,
    optimizers,
    parallel,
    replicas,
    resilience,
)

__all__ = ["EXERCISES", "Check", "ExerciseError", "check", "exercise", "exercises_of"]
