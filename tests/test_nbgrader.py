"""nbgrader end to end on a real notebook: a course directory, `nbgrader generate_assignment` on
the instructor edition of notebook 02, a student's submission with one right and one wrong
answer, `nbgrader autograde`, and the scores in the gradebook: 1 of 2 points. The same commands
as README's "Teaching with titanlite"."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip(
    "nbgrader", reason="nbgrader is the `course` extra: pip install -e '.[course]' (make test does)"
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "02_gradient_accumulation"
RIGHT = '''def accum_steps(global_batch, micro_batch, dp):
    """Micro-batches per rank per optimizer step."""
    return global_batch // (micro_batch * dp)'''
WRONG = '''from titanlite.efficiency.accumulation import count_targets, loss_sum

def micro_losses(micro_logits, micro_targets):
    """Each micro-batch by its own count: the classic mistake."""
    return [loss_sum(x, t) / count_targets(t) for x, t in zip(micro_logits, micro_targets)]'''


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    # The venv's bin/ first on PATH, as `source .venv/bin/activate` does: nbgrader runs `alembic`
    # from PATH to set up its gradebook, and fails without it.
    env = {
        **os.environ,
        "TITANLITE_SMOKE": "1",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"nbgrader {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.mark.slow
def test_nbgrader_generates_and_autogrades_a_lab(tmp_path):
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    (course / "source" / "lab02").mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        "c.CourseDirectory.course_id = 'titanlite'\n"
        "c.Execute.timeout = 600  # seconds per cell: a notebook's smoke run fits easily\n"
    )
    shutil.copy(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", course / "source" / "lab02")
    _nbgrader(course, "db", "assignment", "add", "lab02")
    _nbgrader(course, "db", "student", "add", "alice")
    _nbgrader(course, "generate_assignment", "lab02")

    released = course / "release" / "lab02" / f"{NOTEBOOK}.ipynb"
    nb = nbformat.read(released, 4)
    solutions = {
        c.metadata["nbgrader"]["grade_id"]: c
        for c in nb.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("solution")
    }
    assert set(solutions) == {"02_accum_steps_solution", "02_global_token_loss_solution"}
    assert all(
        "raise NotImplementedError()" in c.source and "BEGIN SOLUTION" not in c.source
        for c in solutions.values()
    ), "generate_assignment stripped the solutions"

    solutions["02_accum_steps_solution"].source = RIGHT
    solutions["02_global_token_loss_solution"].source = WRONG
    submitted = course / "submitted" / "alice" / "lab02"
    submitted.mkdir(parents=True)
    nbformat.write(nb, submitted / f"{NOTEBOOK}.ipynb")
    (submitted / "timestamp.txt").write_text("2026-01-05 10:00:00.000000 UTC")
    _nbgrader(course, "autograde", "lab02")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {
            cell: gradebook.find_grade(cell, NOTEBOOK, "lab02", "alice").score
            for cell in ("02_accum_steps_check", "02_global_token_loss_check")
        }
        submission = gradebook.find_submission("lab02", "alice")
        assert scores == {"02_accum_steps_check": 1.0, "02_global_token_loss_check": 0.0}, scores
        assert (submission.score, submission.max_score) == (1.0, 2.0)

    graded = nbformat.read(course / "autograded" / "alice" / "lab02" / f"{NOTEBOOK}.ipynb", 4)
    checks = {
        c.metadata["nbgrader"]["grade_id"]: c
        for c in graded.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade")
    }
    right = "".join(o.get("text", "") for o in checks["02_accum_steps_check"].outputs)
    wrong = [
        o.get("text", "")
        for o in checks["02_global_token_loss_check"].outputs
        if o.get("name") == "stderr"
    ]
    assert right.startswith("✓ 02_accum_steps: passed") and right.count("\n") == 1
    assert (
        len(wrong) == 1
        and wrong[0].startswith("ExerciseError: 02_global_token_loss: micro-batch ")
        and wrong[0].count("\n") == 1
        and "[seed " in wrong[0]
    ), wrong
