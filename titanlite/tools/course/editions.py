"""Course labs: a student edition from the instructor's notebooks, and a lab's progress table.

The notebooks in notebooks/ are the instructor edition: each exercise's solution sits between
nbgrader's `### BEGIN SOLUTION` / `### END SOLUTION` markers in a cell whose nbgrader metadata
says `"solution": true`, and its check cell says `"grade": true` (nbgrader can generate and
autograde them as they are). `student_edition` writes the same notebooks with every solution
replaced by `# YOUR CODE HERE` + `raise NotImplementedError()` (`make student`): with nbgrader's
own `ClearSolutions` preprocessor when nbgrader is installed, else with the small stripper here,
which writes the same stub, so a course without nbgrader gets the same student copy.

`make lab` writes the workbook edition the same way (`solutions=True`): a working copy of every
notebook, solutions in, in workbook/ - git ignores it, so running and editing notebooks never
touches a tracked file, and `git pull` never conflicts with a learner's outputs.

A student's work is never overwritten: each notebook written records a hash of its cells'
sources in its metadata, and writing the edition again (new notebooks pulled, say) replaces only
a notebook whose cells still hash to what was written; one the student edited is left alone and
listed. The output folder must be a new, empty or earlier student-edition folder.

`progress` runs a folder of notebooks (smoke scale, errors allowed) - all of each notebook up to
its last check, or with `checks=True` only the exercise cells and the imports they rely on - or
reads the outputs a student saved, and reports, per exercise, pass / fail / not attempted from
what each check cell printed.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import TitanliteError

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PASSED = "passed"  # the word a passing check prints: `titanlite progress` reads it
NOT_ATTEMPTED = "not attempted yet"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
CHECK_NAME = re.compile(r"""check\(\s*["']([0-9A-Za-z_]+)["']""")
STAMP = "titanlite"  # the notebook-metadata key of what student_edition wrote
REPO_MARKERS = (".git", "pyproject.toml")
EDITION_EXTRAS = {
    "runs",
    ".ipynb_checkpoints",
    "data",
}  # what running the notebooks leaves beside them


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
                raise TitanliteError(
                    f"line {number}: {BEGIN} inside another solution region: "
                    f"close the first with {END}"
                )
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
            raise TitanliteError(
                f"cell {cell.get('id', '?')} holds {BEGIN} but no nbgrader "
                f"solution metadata: mark it as a solution cell"
            )
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
        raise TitanliteError(
            "nbgrader is not installed: `pip install nbgrader`, or leave "
            "use_nbgrader=None to use titanlite's own stripper"
        )
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


# ----- the student edition, written without ever overwriting a student's work -------------------


def work_hash(nb) -> str:
    """What a student changes when they work: the cells' kinds and sources (not outputs, which
    running a notebook changes, nor metadata)."""
    cells = [
        [
            c.get("cell_type"),
            c.get("source", "")
            if isinstance(c.get("source", ""), str)
            else "".join(c.get("source")),
        ]
        for c in nb["cells"]
    ]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def _stamp(nb):
    return nb.get("metadata", {}).get(STAMP, {})


EDITIONS = ("student", "workbook")  # solutions stripped / kept


def _is_ours(nb) -> bool:
    return _stamp(nb).get("edition") in EDITIONS


@dataclass
class Edition:
    """What `student_edition` did, notebook by notebook."""

    out: Path
    name: str = "student"  # the edition: student (solutions stripped) or workbook
    written: list[str] = field(default_factory=list)  # new: there was no such notebook
    refreshed: list[str] = field(default_factory=list)  # replaced: the student had not changed it
    unchanged: list[str] = field(default_factory=list)  # already what would be written
    kept: list[str] = field(default_factory=list)  # changed by the student: left alone
    # a kept notebook's imports of modules that have moved since: {notebook: [(old, new), ...]}
    old_imports: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def summary(self, command: str = "make student", stripped_by: str | None = None) -> str:
        parts = [
            f"{n} {what}"
            for n, what in (
                (len(self.written), "new"),
                (len(self.refreshed), "updated"),
                (len(self.unchanged), "unchanged"),
            )
            if n
        ]
        line = f"{self.name} edition in {self.out}/: {', '.join(parts) or 'nothing to write'}"
        if stripped_by:
            line += f" (solutions stripped by {stripped_by})"
        if self.kept:
            first = self.out / self.kept[0]
            line += (
                f"\nkept {len(self.kept)} notebook(s) you changed, untouched: {', '.join(self.kept)}"
                f"\n  for a fresh copy of one, move yours aside and run `{command}` again, e.g. "
                f"mv {first} {first.with_name(first.stem + '.mine.ipynb')}"
            )
        for name, moves in self.old_imports.items():
            line += f"\n{self.out / name} imports modules that moved: " + "; ".join(
                f"{old} is now {new}" for old, new in moves
            )
        return line


def old_imports(nb) -> list[tuple[str, str]]:
    """(old, new) for each module a notebook's code imports that has moved since (tools.MOVED):
    `titanlite.tools.live_plot` as written, or `from titanlite.tools import live_plot`."""
    from .. import moved_to

    found = {}
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source", ""))
        names = re.findall(r"titanlite\.tools\.[\w.]+", source)
        for listed in re.findall(r"from\s+titanlite\.tools\s+import\s+\(?([\w\s,]+)", source):
            names += [f"titanlite.tools.{n.split()[0]}" for n in listed.split(",") if n.strip()]
        for name in names:
            parts = name.split(".")
            for i in range(len(parts), 2, -1):  # the longest name that is a module, or moved
                prefix = ".".join(parts[:i])
                if _is_module(prefix):
                    break
                if (new := moved_to(prefix)) is not None:
                    found.setdefault(prefix, new)
                    break
    return sorted(found.items())


def _is_module(name: str) -> bool:
    """Whether titanlite has module `name` today (a file, or a package's folder)."""
    path = Path(__file__).resolve().parents[2].joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _within(a: Path, b: Path) -> bool:
    """a is b or inside it."""
    return a == b or b in a.parents


def check_edition_folder(
    source: Path, out: Path, names: set[str], edition: str = "student"
) -> None:
    """Refuse, in one line, an output folder that is not a new, empty or edition folder."""
    src, dst = source.resolve(), out.resolve()
    if _within(src, dst):
        what = (
            "the instructor's notebooks folder" if src == dst else f"a folder that holds {source}"
        )
        raise TitanliteError(
            f"the {edition} edition cannot go into '{out}': it is {what}; choose a "
            f"new folder, e.g. {edition}/"
        )
    if _within(dst, src):
        raise TitanliteError(
            f"the {edition} edition cannot go into '{out}', inside the instructor's "
            f"'{source}': choose a folder outside it, e.g. {edition}/"
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise TitanliteError(
            f"'{out}' is a file, not a folder: choose a new folder for the {edition} edition"
        )
    entries = sorted(p.name for p in out.iterdir())
    marker = next((m for m in REPO_MARKERS if m in entries), None)
    if marker:
        raise TitanliteError(
            f"'{out}' holds {marker}: it looks like a repository, not a {edition} edition; "
            f"choose a new folder, e.g. {edition}/"
        )
    ours, found = False, set()
    for p in out.glob("*.ipynb"):
        try:
            nb = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        ours = ours or _is_ours(nb)
        found.add(_stamp(nb).get("edition"))
    other = next((e for e in EDITIONS if e in found and e != edition), None)
    if other:
        raise TitanliteError(
            f"'{out}' holds the {other} edition, not a {edition} edition: choose another "
            f"folder, e.g. {edition}/"
        )
    stranger = [e for e in entries if e not in names and e not in EDITION_EXTRAS]
    if stranger and not ours:
        raise TitanliteError(
            f"'{out}' holds files that are not a {edition} edition (e.g. '{stranger[0]}'): "
            f"choose a new or empty folder"
        )


def _write(nb, path: Path) -> None:
    """Write a notebook whole or not at all (a temporary file, then a rename)."""
    import nbformat

    tmp = path.with_name(f".{path.name}.writing")
    nbformat.write(nb, tmp)
    os.replace(tmp, path)


def student_edition(
    source: str | Path = "notebooks",
    out: str | Path = "student",
    use_nbgrader: bool | None = None,
    solutions: bool = False,
) -> Edition:
    """Write the student edition of every notebook in `source` into `out`, stripped as
    `strip_solutions` picks (the notebooks without exercises are copied without their outputs,
    so the edition is complete); with `solutions`, the workbook edition: the notebooks as they
    are, without outputs. A notebook already in `out` is replaced only if its cells are still
    what was written there (nothing of the student's is lost); one the student changed, or one
    this function did not write, is kept as it is and listed in the result."""
    import nbformat

    source, out = Path(source), Path(out)
    notebooks = sorted(source.glob("*.ipynb"))
    if not source.is_dir() or not notebooks:
        raise TitanliteError(
            f"no notebooks in '{source}': point at the instructor's notebooks/ folder"
        )
    edition = "workbook" if solutions else "student"
    check_edition_folder(source, out, {p.name for p in notebooks}, edition)
    editions = []
    for path in notebooks:  # every notebook prepared before anything is written
        nb = nbformat.read(path, as_version=4)
        nb = _without_outputs(nb) if solutions else strip_solutions(nb, use_nbgrader)
        nb.metadata[STAMP] = {"edition": edition, "source": path.name, "sha256": work_hash(nb)}
        editions.append((path.name, nb))
    out.mkdir(parents=True, exist_ok=True)
    report = Edition(out, edition)
    for name, nb in editions:
        target = out / name
        if not target.exists():
            _write(nb, target)
            report.written.append(name)
            continue
        try:
            there = json.loads(target.read_text(encoding="utf-8"))
            current = work_hash(there)
        except (OSError, ValueError, KeyError, TypeError):
            report.kept.append(name)  # not a notebook we can read: not ours to replace
            continue
        stamp = _stamp(there)
        if current == nb.metadata[STAMP]["sha256"]:
            if stamp.get("sha256") != current:  # the same cells, written before hashes: stamp it
                there.setdefault("metadata", {})[STAMP] = nb.metadata[STAMP]
                tmp = target.with_name(f".{name}.writing")
                tmp.write_text(
                    json.dumps(there, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
                )
                os.replace(tmp, target)
            report.unchanged.append(name)
        elif stamp.get("edition") == edition and stamp.get("sha256") == current:
            _write(nb, target)
            report.refreshed.append(name)
        else:
            report.kept.append(name)
            if moves := old_imports(there):
                report.old_imports[name] = moves
    return report


# ----- progress: which exercises pass ---------------------------------------------------------


@dataclass
class Result:
    notebook: str
    exercise: str
    status: str  # pass | fail | not attempted | not run
    detail: str


def _text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "".join(parts)


def _error_line(cell) -> str:
    """The first line of the error a cell raised (its outputs hold it), or ''."""
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            evalue = (o.get("evalue") or "").strip().splitlines()
            return f"{o.get('ename')}: {evalue[0] if evalue else ''}".strip()
    return ""


def check_names(nb) -> list[str]:
    names = []
    for cell in nb.cells:
        if is_check_cell(cell):
            found = CHECK_NAME.search(cell.source)
            names.append(found.group(1) if found else _nbgrader(cell).get("grade_id", "?"))
    return names


def read_results(nb, notebook: str) -> list[Result]:
    """Pass / fail / not attempted per check cell, from the outputs `nb` carries."""
    results = []
    cells = nb.cells
    for i, cell in enumerate(cells):
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
            answer = cells[i - 1] if i and is_solution_cell(cells[i - 1]) else None
            broken = _error_line(answer) if answer is not None else ""
            if broken:  # the check only says the name is missing: the answer's own cell failed
                last = f"your answer's cell raised {broken}"
        results.append(Result(notebook, name, status, last))
    return results


def _imports(cells) -> str:
    """The top-level import statements of `cells`, in order: what an exercise may rely on."""
    lines = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        lines += [
            ast.unparse(node)
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
        ]
    return "\n".join(dict.fromkeys(lines))


def checks_only(nb):
    """The notebook reduced to what its exercises need: titanlite's notebook setup and every
    import the notebook makes before its last check (an answer may use them), then each
    exercise's solution and check cells. Nothing else runs: no training, no measurement."""
    import nbformat

    last = max(i for i, c in enumerate(nb.cells) if is_check_cell(c))
    setup = (
        "from titanlite.tools.display.notebook import notebook_setup\nnotebook_setup()\n"
        + _imports(nb.cells[:last])
    )
    small = copy.deepcopy(nb)
    small.cells = [nbformat.v4.new_code_cell(setup)] + [
        copy.deepcopy(c) for c in nb.cells[: last + 1] if is_solution_cell(c) or is_check_cell(c)
    ]
    return small


def kernel_on_unix_sockets(folder: Path) -> dict:
    """NotebookClient keyword arguments that give its kernel Unix sockets in `folder` instead of TCP
    ports. With TCP, jupyter_client finds free ports and the kernel binds them a moment later: on a
    busy machine (torch's stores, other kernels) another process can take one in between, and the
    kernel dies at start ("Kernel died before replying to kernel_info"). Windows, or a folder whose
    socket paths would pass the 107-byte limit, keeps TCP."""
    prefix = Path(folder).resolve() / "kernel"
    # Each socket is "<prefix>-<n>": 90 bytes of prefix leave room for n under the 107-byte limit.
    if os.name != "posix" or len(str(prefix)) > 90:
        return {}
    from traitlets.config import Config

    return {"config": Config({"KernelManager": {"transport": "ipc", "ip": str(prefix)}})}


def run_for_progress(path: Path, timeout_s: float = 600, checks: bool = False) -> list[Result]:
    """Execute notebook `path` (a copy, in a scratch folder beside nothing of the student's),
    errors allowed: up to its last check cell, or with `checks` only what `checks_only` keeps;
    then read its check cells. The kernel's own log (ipykernel's warnings) goes to a file, shown
    only if the kernel dies."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    if not has_exercises(nb):
        return []
    if checks:
        nb = checks_only(nb)
    else:
        last = max(i for i, c in enumerate(nb.cells) if is_check_cell(c))
        nb.cells = nb.cells[: last + 1]
    with tempfile.TemporaryDirectory(prefix="titanlite-progress-") as scratch:
        # A copy of the folder: the run's outputs and runs/ never land in the student's folder.
        work = Path(scratch) / "notebooks"
        shutil.copytree(
            path.parent,
            work,
            ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints", "*.ipynb"),
        )
        log_path = Path(scratch) / "kernel.log"
        client = NotebookClient(
            nb,
            timeout=timeout_s,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": str(work)}},
            **kernel_on_unix_sockets(Path(scratch)),
        )
        with open(log_path, "w") as log:
            try:
                client.execute(stdout=log, stderr=log)
            except Exception as e:  # a dead kernel or a timeout: every check unknown
                lines = [
                    ln
                    for ln in log_path.read_text(errors="replace").splitlines()
                    if ln.strip() and "without encryption" not in ln
                ]
                why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
                tail = f"; the kernel said: {lines[-1][:200]}" if lines else ""
                done = {r.exercise: r for r in read_results(nb, path.stem) if r.status != "not run"}
                return [
                    done.get(name) or Result(path.stem, name, "fail", f"not checked: {why}{tail}")
                    for name in check_names(nb)
                ]
    return read_results(nb, path.stem)


def notebooks_in(folder: str | Path, only: str | None = None) -> list[Path]:
    folder = Path(folder)
    notebooks = (
        sorted(folder.glob("*.ipynb"))
        if folder.is_dir()
        else [folder]
        if folder.suffix == ".ipynb"
        else []
    )
    if not notebooks or not all(p.is_file() for p in notebooks):
        raise TitanliteError(
            f"no notebooks at '{folder}': give the notebooks/ or student/ folder, or one notebook"
        )
    if only:
        notebooks = [p for p in notebooks if p.name.startswith(only)]
        if not notebooks:
            raise TitanliteError(
                f"no notebook in '{folder}' starts with '{only}': give a number like 07"
            )
    return notebooks


def progress(
    folder: str | Path = "notebooks",
    *,
    run: bool = True,
    smoke: bool = True,
    only: str | None = None,
    checks: bool = False,
    on_notebook=None,
) -> list[Result]:
    """Every exercise of the notebooks in `folder`: executed (smoke scale) when `run` - each
    notebook up to its last check, or with `checks` only its exercise cells - else as the saved
    outputs say. `only`: a notebook number or name prefix ("07"). `on_notebook(name, results,
    seconds)` is called as each notebook finishes."""
    import nbformat

    notebooks = notebooks_in(folder, only)
    if smoke:
        os.environ["TITANLITE_SMOKE"] = "1"  # the kernels inherit it
    results = []
    for path in notebooks:
        start = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        if not has_exercises(nb):
            continue
        found = (
            run_for_progress(path, timeout_s=120 if checks else 600, checks=checks)
            if run
            else read_results(nb, path.stem)
        )
        results += found
        if on_notebook is not None:
            on_notebook(path.stem, found, time.perf_counter() - start)
    return results


def _widths(names: list[tuple[str, str]]) -> tuple[int, int]:
    return (
        max([len("notebook")] + [len(n) for n, _ in names]),
        max([len("exercise")] + [len(e) for _, e in names]),
    )


def format_rows(
    results: list[Result], widths: tuple[int, int], width: int | None = None
) -> list[str]:
    """One row per exercise; a failure's whole message, wrapped under the status column."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    lines = []
    for r in results:
        head = f"{r.notebook:<{widths[0]}}  {r.exercise:<{widths[1]}}  "
        if r.status != "fail" or not r.detail:
            lines.append(head + r.status)
            continue
        lines += textwrap.wrap(
            f"fail  {r.detail}",
            width=max(width, len(head) + 40),
            initial_indent=head,
            subsequent_indent=" " * (len(head) + 6),
            break_on_hyphens=False,
        )
    return lines


def format_table(results: list[Result], width: int | None = None) -> str:
    if not results:
        return "no exercises found"
    widths = _widths([(r.notebook, r.exercise) for r in results])
    lines = [f"{'notebook':<{widths[0]}}  {'exercise':<{widths[1]}}  status"]
    lines += format_rows(results, widths, width)
    done = sum(r.status == "pass" for r in results)
    lines.append(f"{done} of {len(results)} exercises pass")
    return "\n".join(lines)


class _Bar:
    """Notebooks done out of all, with elapsed time: redrawn on one line of a terminal's stderr,
    a plain line per notebook elsewhere (a log file)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def line(self, current: str = "") -> str:
        filled = round(20 * self.done / max(1, self.total))
        elapsed = int(time.perf_counter() - self.start)
        now = f" · running {current}" if current else ""
        return (
            f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} notebooks · "
            f"{elapsed // 60:02d}:{elapsed % 60:02d} elapsed{now}"
        )

    def show(self, current: str = "") -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line(current))
        elif not current:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def progress_command(
    folder,
    *,
    saved: bool = False,
    only: str | None = None,
    full: bool = False,
    checks: bool = False,
    out=None,
) -> list[Result]:
    """`titanlite progress`: each notebook's rows printed as it finishes, a progress bar on
    stderr, the total at the end."""
    import nbformat

    out = out or sys.stdout
    notebooks = [
        p for p in notebooks_in(folder, only) if has_exercises(nbformat.read(p, as_version=4))
    ]
    names = [(p.stem, n) for p in notebooks for n in check_names(nbformat.read(p, as_version=4))]
    if not names:
        print("no exercises found", file=out)
        return []
    widths = _widths(names)
    mode = (
        "saved outputs"
        if saved
        else ("exercise cells only" if checks else "each notebook up to its last check")
        + (", full scale" if full else ", smoke scale")
    )
    print(f"{len(names)} exercises in {len(notebooks)} notebooks ({mode})", file=out)
    print(f"{'notebook':<{widths[0]}}  {'exercise':<{widths[1]}}  status", file=out, flush=True)
    bar = _Bar(len(notebooks)) if not saved else None
    queue = list(notebooks)

    def finished(name, results, seconds):
        if bar:
            bar.clear()
        for line in format_rows(results, widths):
            print(line, file=out)
        out.flush()
        if bar:
            bar.done += 1
            queue.pop(0)
            bar.show(queue[0].stem if queue and bar.tty else "")

    if bar:
        bar.show(queue[0].stem if bar.tty else "")
    results = progress(
        folder, run=not saved, smoke=not full, only=only, checks=checks, on_notebook=finished
    )
    if bar:
        bar.clear()
    done = sum(r.status == "pass" for r in results)
    print(f"{done} of {len(results)} exercises pass", file=out, flush=True)
    return results


def _main(argv: list[str]) -> int:
    """python -m titanlite.tools.course.editions [--workbook] [SOURCE [OUT]]: the student edition (make
    student), or with --workbook the working copy, solutions in, that make lab opens."""
    workbook = "--workbook" in argv
    argv = [a for a in argv if a != "--workbook"]
    default = ["notebooks", "workbook" if workbook else "student"]
    args = argv + default[len(argv) :]
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print(
            "usage: python -m titanlite.tools.course.editions [--workbook] [SOURCE [OUT]]  "
            "(default: notebooks student; --workbook: notebooks workbook)",
            file=sys.stderr,
        )
        return 2
    try:  # nbgrader's ClearSolutions when it is installed, titanlite's stripper otherwise
        report = student_edition(args[0], args[1], solutions=workbook)
    except TitanliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    make = "make lab" if workbook else "make student"
    flag = "--workbook " if workbook else ""
    command = (
        f"python -m titanlite.tools.course.editions {flag}{args[0]} {args[1]}"
        if argv and argv != default
        else make
    )
    print(report.summary(command, stripped_by=None if workbook else stripper()))
    return 0


if (
    __name__ == "__main__"
):  # python -m titanlite.tools.course.editions [notebooks] [student]  (make student)
    raise SystemExit(_main(sys.argv[1:]))
