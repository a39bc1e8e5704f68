"""Course labs: a student edition from the instructor's notebooks, and a lab's progress table.

The notebooks in notebooks/ are the instructor edition: each exercise's solution sits between
nbgrader's `### BEGIN SOLUTION` / `### END SOLUTION` markers in a cell whose nbgrader metadata
says `"solution": true`, and its check cell says `"grade": true` (nbgrader can generate and
autograde them as they are). `student_edition` writes the same notebooks with every solution
replaced by `# YOUR CODE HERE` + `raise NotImplementedError()` (`make student`): with nbgrader's
own `ClearSolutions` preprocessor when nbgrader is installed, else with the small stripper here,
which writes the same stub, so a course without nbgrader gets the same student copy.

`progress` runs a folder of notebooks (smoke scale, errors allowed) - or reads the outputs a
student saved - and reports, per exercise, pass / fail / not attempted from what each check
cell printed.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import TitanliteError
from .exercises import NOT_ATTEMPTED, PASSED

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
CHECK_NAME = re.compile(r"""check\(\s*["']([0-9A-Za-z_]+)["']""")


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def is_solution_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and bool(_nbgrader(cell).get("solution"))


def is_check_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and bool(_nbgrader(cell).get("grade"))


def strip_solution(source: str) -> str:
    """`source` with each BEGIN..END SOLUTION region (markers included) replaced by the stub,
    indented like the BEGIN marker. An unclosed region is an authoring error: say where."""
    out, inside, indent = [], False, ""
    for number, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise TitanliteError(f"line {number}: {BEGIN} inside another solution region: "
                                     f"close the first with {END}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in STUB]
        elif marker == END:
            if not inside:
                raise TitanliteError(f"line {number}: {END} without a {BEGIN} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise TitanliteError(f"a {BEGIN} is never closed: add {END} after the solution")
    return "\n".join(out)


def _without_outputs(nb):
    """A copy of `nb` with no outputs, after checking every solution region is marked as one
    (nbgrader would silently mark an unmarked cell a solution; here it is an authoring error)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if BEGIN in cell.get("source", "") and not is_solution_cell(cell):
            raise TitanliteError(f"cell {cell.get('id', '?')} holds {BEGIN} but no nbgrader "
                                 f"solution metadata: mark it as a solution cell")
    return nb


def student_notebook(nb):
    """A copy of notebook `nb` (an nbformat node) with the solutions stripped and no outputs,
    by the small stripper here (no nbgrader needed)."""
    nb = _without_outputs(nb)
    for cell in nb.cells:
        if is_solution_cell(cell):
            cell.source = strip_solution(cell.source)
    return nb


def stripper(use_nbgrader: bool | None = None) -> str:
    """Which tool strips the solutions: "nbgrader" when asked for, or (None) when it is
    importable; else "titanlite". Asking for nbgrader without it installed is an error."""
    installed = importlib.util.find_spec("nbgrader") is not None
    if use_nbgrader and not installed:
        raise TitanliteError("nbgrader is not installed: `pip install nbgrader`, or leave "
                             "use_nbgrader=None to use titanlite's own stripper")
    return "nbgrader" if (installed if use_nbgrader is None else use_nbgrader) else "titanlite"


def strip_solutions(nb, use_nbgrader: bool | None = None):
    """The student copy of notebook `nb`: no outputs, each solution replaced by the stub - by
    nbgrader's ClearSolutions preprocessor (what `nbgrader generate_assignment` runs) where
    `stripper` picks it, so the copy is exactly nbgrader's; else by `student_notebook`."""
    if stripper(use_nbgrader) == "titanlite":
        return student_notebook(nb)
    from nbgrader.preprocessors import ClearSolutions
    nb = _without_outputs(nb)
    try:
        nb, _ = ClearSolutions().preprocess(nb, {})
    except Exception as e:  # e.g. an unclosed region: one line, naming who said it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TitanliteError(f"nbgrader's ClearSolutions refused the notebook: {first}") from None
    return nb


def has_exercises(nb) -> bool:
    return any(is_check_cell(c) for c in nb.cells)


def student_edition(source: str | Path = "notebooks", out: str | Path = "student",
                    use_nbgrader: bool | None = None) -> list[Path]:
    """Write the student edition of every notebook in `source` into `out` (replaced whole),
    stripped as `strip_solutions` picks; the notebooks without exercises are copied without
    their outputs, so the edition is complete."""
    import nbformat
    source, out = Path(source), Path(out)
    notebooks = sorted(source.glob("*.ipynb"))
    if not notebooks:
        raise TitanliteError(f"no notebooks in '{source}': point at the instructor's notebooks/ folder")
    if out.resolve() == source.resolve():
        raise TitanliteError("the student edition would overwrite the instructor's notebooks: "
                             "choose another output folder")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    written = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        nbformat.write(strip_solutions(nb, use_nbgrader), out / path.name)
        written.append(out / path.name)
    return written


@dataclass
class Result:
    notebook: str
    exercise: str
    status: str   # pass | fail | not attempted | not run
    detail: str


def _text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "".join(parts)


def read_results(nb, notebook: str) -> list[Result]:
    """Pass / fail / not attempted per check cell, from the outputs `nb` carries."""
    results = []
    for cell in nb.cells:
        if not is_check_cell(cell):
            continue
        found = CHECK_NAME.search(cell.source)
        name = found.group(1) if found else _nbgrader(cell).get("grade_id", "?")
        text = _text(cell).strip()
        last = text.splitlines()[-1] if text else ""
        if f"{name}: {PASSED}" in text:
            status = "pass"
        elif NOT_ATTEMPTED in text:
            status = "not attempted"
        elif not cell.get("outputs") and cell.get("execution_count") is None:
            status, last = "not run", ""
        else:
            status = "fail"
        results.append(Result(notebook, name, status, last))
    return results


def run_for_progress(path: Path, timeout_s: float = 600) -> list[Result]:
    """Execute notebook `path` up to its last check cell (a copy, in a scratch folder beside
    nothing of the student's), errors allowed, and read its check cells."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    last = max((i for i, c in enumerate(nb.cells) if is_check_cell(c)), default=-1)
    if last < 0:
        return []
    nb.cells = nb.cells[: last + 1]
    with tempfile.TemporaryDirectory(prefix="titanlite-progress-") as scratch:
        # A copy of the folder: the run's outputs and runs/ never land in the student's folder.
        work = Path(scratch) / "notebooks"
        shutil.copytree(path.parent, work, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(work)}})
        client.execute()
    return read_results(nb, path.stem)


def progress(folder: str | Path = "notebooks", *, run: bool = True, smoke: bool = True,
             only: str | None = None) -> list[Result]:
    """Every exercise of the notebooks in `folder`: executed (smoke scale) when `run`, else as
    the saved outputs say. `only`: a notebook number or name prefix ("07")."""
    import nbformat
    folder = Path(folder)
    notebooks = sorted(folder.glob("*.ipynb")) if folder.is_dir() else [folder]
    if not notebooks or not all(p.is_file() for p in notebooks):
        raise TitanliteError(f"no notebooks at '{folder}': give the notebooks/ or student/ folder")
    if only:
        notebooks = [p for p in notebooks if p.name.startswith(only)]
    if smoke:
        os.environ["TITANLITE_SMOKE"] = "1"  # the kernels inherit it
    results = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        if not has_exercises(nb):
            continue
        results += run_for_progress(path) if run else read_results(nb, path.stem)
    return results


def format_table(results: list[Result]) -> str:
    if not results:
        return "no exercises found"
    width = max(len(r.notebook) for r in results), max(len(r.exercise) for r in results)
    lines = [f"{'notebook':<{width[0]}}  {'exercise':<{width[1]}}  status"]
    for r in results:
        detail = f"  {r.detail[:100]}" if r.status == "fail" else ""
        lines.append(f"{r.notebook:<{width[0]}}  {r.exercise:<{width[1]}}  {r.status}{detail}")
    done = sum(r.status == "pass" for r in results)
    lines.append(f"{done} of {len(results)} exercises pass")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m titanlite.course [notebooks] [student]  (make student)
    import sys
    args = sys.argv[1:] + ["notebooks", "student"][len(sys.argv[1:]):]
    try:  # nbgrader's ClearSolutions when it is installed, titanlite's stripper otherwise
        paths = student_edition(args[0], args[1])
    except TitanliteError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print(f"wrote the student edition of {len(paths)} notebooks to {args[1]}/ "
          f"(solutions stripped by {stripper()})")
