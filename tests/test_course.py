"""The course tooling: `make student` never deletes or overwrites a student's work and refuses,
in one line, a folder that is not a student edition; `titanlite progress` streams each notebook's
results with a progress bar, grades a folder from its exercise cells alone (`--checks`), shows
whole messages and no kernel noise."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from titanlite.errors import TitanliteError
from titanlite.tools.course.editions import (
    STAMP,
    checks_only,
    format_table,
    is_check_cell,
    is_solution_cell,
    progress,
    read_results,
    student_edition,
    work_hash,
)

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _source(tmp_path, *names) -> Path:
    src = tmp_path / "course" / "notebooks"
    src.mkdir(parents=True)
    for name in names:
        shutil.copy(ROOT / "notebooks" / name, src)
    return src


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _answer(nb, name: str, code: str):
    """Put `code` in place of exercise `name`'s stub, as a student does."""
    for i, cell in enumerate(nb.cells):
        if is_check_cell(cell) and f'check("{name}"' in cell.source:
            nb.cells[i - 1].source = code
            return nb
    raise AssertionError(name)


NB02, NB13, NB16 = "02_gradient_accumulation.ipynb", "13_fault_tolerance.ipynb", "16_capstone.ipynb"


def test_student_edition_replaces_only_what_the_student_did_not_change(tmp_path):
    src = _source(tmp_path, NB02, NB13, NB16)
    out = tmp_path / "course" / "student"
    first = student_edition(src, out)
    assert sorted(first.written) == [NB02, NB13, NB16] and not first.kept
    nb = nbformat.read(out / NB02, 4)
    assert nb.metadata[STAMP]["edition"] == "student" and nb.metadata[STAMP]["sha256"] == work_hash(
        nb
    )
    assert "### BEGIN SOLUTION" not in json.dumps(nb)

    again = student_edition(src, out)  # nothing changed anywhere: nothing rewritten
    assert sorted(again.unchanged) == [NB02, NB13, NB16] and not (again.written or again.refreshed)

    # The student answers in 02 and only runs 13 (outputs, no edit); 16 is deleted by accident.
    mine = _answer(
        nbformat.read(out / NB02, 4),
        "02_accum_steps",
        "def accum_steps(global_batch, micro_batch, dp):\n    return global_batch // (micro_batch * dp)",
    )
    nbformat.write(mine, out / NB02)
    ran = nbformat.read(out / NB13, 4)
    ran.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    nbformat.write(ran, out / NB13)
    (out / NB16).unlink()
    (out / "runs").mkdir()  # what running the notebooks leaves beside them
    (out / "runs" / "metrics.jsonl").write_text("{}\n")
    # a student's own notebook
    (out / "scratch.ipynb").write_text(json.dumps(nbformat.v4.new_notebook()))
    before = (out / NB02).read_bytes()

    # The instructor changes every notebook's first cell (a new release, pulled).
    for name in (NB02, NB13, NB16):
        nb = nbformat.read(src / name, 4)
        nb.cells[0].source += "\n\nA new sentence."
        nbformat.write(nb, src / name)
    report = student_edition(src, out)
    assert report.kept == [NB02] and report.refreshed == [NB13] and report.written == [NB16]
    assert (out / NB02).read_bytes() == before, "the student's answer is untouched"
    assert nbformat.read(out / NB13, 4).cells[0].source.endswith("A new sentence.")
    assert (out / "runs" / "metrics.jsonl").exists() and (out / "scratch.ipynb").exists()
    summary = report.summary()
    assert f"kept 1 notebook(s) you changed, untouched: {NB02}" in summary
    assert (
        f"mv {out / NB02} {out / '02_gradient_accumulation.mine.ipynb'}" in summary
        and "make student" in summary
    )


def test_the_workbook_edition_keeps_the_solutions_and_the_learners_edits(tmp_path, capsys):
    """make lab's working copy: every notebook as the instructor wrote it, without outputs; an
    edited one kept on the next make lab, the others refreshed; a student edition is refused."""
    from titanlite.tools.course.editions import _main

    src = _source(tmp_path, NB02, NB13)
    out = tmp_path / "workbook"
    first = student_edition(src, out, solutions=True)
    assert sorted(first.written) == [NB02, NB13] and first.name == "workbook"
    nb = nbformat.read(out / NB02, 4)
    assert nb.metadata[STAMP]["edition"] == "workbook"
    assert [c.source for c in nb.cells] == [c.source for c in nbformat.read(src / NB02, 4).cells]
    nb.cells[1].source += "\n# my note"
    nbformat.write(nb, out / NB02)
    for name in (NB02, NB13):  # a new release of the course
        new = nbformat.read(src / name, 4)
        new.cells[0].source += "\n\nA new sentence."
        nbformat.write(new, src / name)
    assert _main(["--workbook", str(src), str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"workbook edition in {out}/: 1 updated") and "stripped" not in said
    assert nbformat.read(out / NB02, 4).cells[1].source.endswith("# my note")
    assert nbformat.read(out / NB13, 4).cells[0].source.endswith("A new sentence.")
    student = tmp_path / "student"
    student_edition(src, student)
    with pytest.raises(TitanliteError, match="not a workbook edition"):
        student_edition(src, student, solutions=True)


def test_a_kept_workbook_notebook_that_imports_a_moved_module_is_told_the_new_name(
    tmp_path, capsys
):
    """tools/ was regrouped (2026-11): a learner's edited copy may still import an old name.
    `make lab` keeps it and lists each old name with the new one; running the old import fails
    in one line that names the new module, never a bare ImportError."""
    from titanlite.tools.course.editions import _main

    src = _source(tmp_path, NB02)
    out = tmp_path / "workbook"
    student_edition(src, out, solutions=True)
    nb = nbformat.read(out / NB02, 4)
    old = "from titanlite.tools.live_plot import LivePlot\nfrom titanlite.tools import datasheet"
    nb.cells[1].source = old + "\n" + nb.cells[1].source
    nbformat.write(nb, out / NB02)
    assert _main(["--workbook", str(src), str(out)]) == 0
    said = capsys.readouterr().out
    assert (
        f"{out / NB02} imports modules that moved: "
        "titanlite.tools.datasheet is now titanlite.tools.probe.datasheet; "
        "titanlite.tools.live_plot is now titanlite.tools.display.live_plot"
    ) in said
    assert nbformat.read(out / NB02, 4).cells[1].source.startswith(old)  # kept as it was
    ran = subprocess.run([PYTHON, "-c", old], capture_output=True, text=True)
    assert ran.returncode == 1 and ran.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: titanlite.tools.live_plot moved to titanlite.tools.display."
        "live_plot: import it from there (titanlite's tools are grouped by purpose; "
        "titanlite/tools/__init__.py lists them)"
    )
    # an untouched copy of the course's notebooks imports no old name
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        from titanlite.tools.course.editions import old_imports

        assert old_imports(nbformat.read(path, 4)) == [], path.name


def test_an_edition_written_before_hashes_is_stamped_not_replaced(tmp_path):
    src = _source(tmp_path, NB02, NB13)
    out = tmp_path / "course" / "student"
    student_edition(src, out)
    for name in (NB02, NB13):  # as the old `make student` wrote them: no stamp
        nb = json.loads((out / name).read_text())
        del nb["metadata"][STAMP]
        (out / name).write_text(json.dumps(nb, indent=1))
    edited = _answer(
        nbformat.read(out / NB13, 4),
        "13_young",
        "def young_interval_by_hand(c, m):\n    return 1.0",
    )
    nbformat.write(edited, out / NB13)
    edited_bytes = (out / NB13).read_bytes()
    report = student_edition(src, out)
    assert report.unchanged == [NB02] and report.kept == [NB13]
    assert nbformat.read(out / NB02, 4).metadata[STAMP]["sha256"], "stamped in place"
    assert (out / NB13).read_bytes() == edited_bytes


@pytest.mark.parametrize(
    "where, says",
    [
        ("notebooks", "it is the instructor's notebooks folder"),
        (".", "it is a folder that holds"),
        ("notebooks/student", "inside the instructor's"),
        ("repo", "holds .git: it looks like a repository"),
        ("other", "holds files that are not a student edition (e.g. 'notes.txt')"),
        ("afile", "is a file, not a folder"),
    ],
)
def test_student_edition_refuses_a_folder_that_is_not_an_edition_in_one_line(tmp_path, where, says):
    src = _source(tmp_path, NB02)
    course = src.parent
    (course / "repo" / ".git").mkdir(parents=True)
    (course / "other").mkdir()
    (course / "other" / "notes.txt").write_text("mine")
    (course / "afile").write_text("mine")
    before = _tree(course)
    with pytest.raises(TitanliteError) as e:
        student_edition(src, course / where)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert _tree(course) == before, "nothing written, nothing deleted"


def _clone(tmp_path) -> Path:
    """A stand-in for a clone of the course: its notebooks, a .git folder and a pyproject.toml."""
    clone = tmp_path / "clone"
    (clone / "notebooks").mkdir(parents=True)
    for name in (NB02, NB13):
        shutil.copy(ROOT / "notebooks" / name, clone / "notebooks")
    (clone / ".git").mkdir()
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    shutil.copy(ROOT / "pyproject.toml", clone)
    return clone


def _course(clone: Path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [PYTHON, "-m", "titanlite.tools.course.editions", *args],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_course_command_into_the_clone_itself_deletes_nothing(tmp_path):
    """`python -m titanlite.tools.course.editions notebooks .` once deleted the whole clone."""
    clone = _clone(tmp_path)
    before = _tree(clone)
    for args in (["notebooks", "."], ["notebooks", "notebooks"], ["notebooks", ".git"]):
        done = _course(clone, *args)
        assert done.returncode == 2 and done.stdout == "", done
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and (
            "cannot go into" in errors[0] or "not a student edition" in errors[0]
        ), done.stderr
    assert _tree(clone) == before


def test_the_course_command_twice_keeps_the_students_answer(tmp_path):
    clone = _clone(tmp_path)
    done = _course(clone)
    assert done.returncode == 0 and "student edition in student/: 2 new" in done.stdout, done
    mine = _answer(
        nbformat.read(clone / "student" / NB02, 4),
        "02_accum_steps",
        "def accum_steps(g, m, dp):\n    return g // (m * dp)",
    )
    nbformat.write(mine, clone / "student" / NB02)
    answer = (clone / "student" / NB02).read_bytes()
    done = _course(clone)
    assert done.returncode == 0 and (clone / "student" / NB02).read_bytes() == answer
    assert (
        f"kept 1 notebook(s) you changed, untouched: {NB02}" in done.stdout
        and "make student" in done.stdout
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_student_prints_how_to_open_it_and_keeps_answers(tmp_path):
    clone = _clone(tmp_path)
    shutil.copy(ROOT / "Makefile", clone)
    venv = Path(sys.prefix)
    installed = venv / ".installed"
    args = ["make", "-s", "-C", str(clone), "student", f"VENV={venv}", f"PYTHON={PYTHON}"]
    if installed.exists():
        args += ["-o", str(installed)]  # never reinstall the venv from a test
    else:
        pytest.skip("the venv was not made by `make setup`")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "make lab-student" in done.stdout, done
    mine = _answer(
        nbformat.read(clone / "student" / NB13, 4),
        "13_young",
        "def young_interval_by_hand(c, m):\n    return 2.0",
    )
    nbformat.write(mine, clone / "student" / NB13)
    answer = (clone / "student" / NB13).read_bytes()
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and (clone / "student" / NB13).read_bytes() == answer, done
    assert "kept 1 notebook(s) you changed" in done.stdout
    lab = subprocess.run(
        ["make", "-n", "-C", str(clone), "lab-student", f"VENV={venv}", "-o", str(installed)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        "jupyter lab" in lab.stdout
        and "configs/jupyterlab" in lab.stdout
        and "student/" in lab.stdout
    ), lab


# ----- progress ---------------------------------------------------------------------------------


def _with_outputs(tmp_path, outputs: dict[str, list]) -> Path:
    """A notebook whose check cells carry the given outputs (as a student's saved copy does)."""
    nb = nbformat.v4.new_notebook()
    for name, outs in outputs.items():
        cell = nbformat.v4.new_code_cell(f'check("{name}", f)')
        cell.metadata["nbgrader"] = {
            "grade": True,
            "grade_id": f"{name}_check",
            "locked": True,
            "points": 1,
            "schema_version": 3,
            "solution": False,
            "task": False,
        }
        cell.outputs = [nbformat.v4.new_output("stream", name=n, text=t) for n, t in outs]
        cell.execution_count = 1 if outs else None
        nb.cells.append(cell)
    folder = tmp_path / "saved"
    folder.mkdir()
    nbformat.write(nb, folder / "99_lab.ipynb")
    return folder


def test_progress_reads_saved_outputs_and_wraps_whole_messages(tmp_path):
    long = "the loss is 3.0000001, expected 3.0000002 " + "because " * 30 + "[seed 123456789]"
    folder = _with_outputs(
        tmp_path,
        {
            "a": [("stdout", "✓ a: passed - equals the real one\n")],
            "b": [("stderr", f"ExerciseError: b: {long}\n")],
            "c": [("stderr", "ExerciseError: c: not attempted yet - replace ...\n")],
            "d": [],
        },
    )
    results = progress(folder, run=False)
    assert [(r.exercise, r.status) for r in results] == [
        ("a", "pass"),
        ("b", "fail"),
        ("c", "not attempted"),
        ("d", "not run"),
    ]
    table = format_table(results, width=80)
    assert table.endswith("1 of 4 exercises pass") and all(
        len(line) <= 80 for line in table.splitlines()
    )
    assert " ".join(table.split()).count("[seed 123456789]") == 1, (
        "the whole message, wrapped, never cut"
    )
    assert read_results(nbformat.read(folder / "99_lab.ipynb", 4), "x")[0].notebook == "x"
    with pytest.raises(TitanliteError, match="no notebooks"):
        progress(tmp_path / "nowhere", run=False)


def test_checks_mode_keeps_the_exercise_cells_and_the_imports_only():
    nb = nbformat.read(ROOT / "notebooks" / "05_torch_compile.ipynb", 4)
    small = checks_only(nb)
    setup = small.cells[0].source
    # imports only
    assert "notebook_setup()" in setup and "import torch" in setup and "Trainer" in setup
    kept = small.cells[1:]
    assert all(is_solution_cell(c) or is_check_cell(c) for c in kept) and len(kept) == 4
    assert not any("Trainer(" in c.source or "fit(" in c.source for c in small.cells)


def _student_folder(tmp_path) -> Path:
    """A student's folder: 13 with one right and one wrong answer, 02 with a broken cell."""
    out = tmp_path / "student"
    student_edition(_source(tmp_path, NB02, NB13), out)
    nb = nbformat.read(out / NB13, 4)
    _answer(
        nb,
        "13_cluster_mtbf",
        "def cluster_mtbf_by_hand(n_instances, rate_per_hour):\n"
        "    return 3600.0 / (n_instances * rate_per_hour)",
    )
    _answer(
        nb,
        "13_young",
        "import math\n\ndef young_interval_by_hand(ckpt_cost_s, mtbf_s):\n"
        "    return math.sqrt(ckpt_cost_s * mtbf_s)",
    )
    nbformat.write(nb, out / NB13)
    nb = nbformat.read(out / NB02, 4)
    _answer(nb, "02_accum_steps", "def accum_steps(global_batch, micro_batch, dp)\n    return 1")
    nbformat.write(nb, out / NB02)
    return out


@pytest.mark.slow
def test_progress_checks_grades_a_folder_from_its_exercise_cells(tmp_path, monkeypatch, capfd):
    from titanlite.tools.cli.commands import main

    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The rows wrap to the terminal's width: one width, whoever runs it.
    monkeypatch.setenv("COLUMNS", "100")
    out = _student_folder(tmp_path)
    assert main(["progress", str(out), "--checks"]) == 0
    printed, errors = capfd.readouterr()
    rows = {
        line.split()[1]: line for line in printed.splitlines() if line.startswith(("02_", "13_"))
    }
    assert rows["13_cluster_mtbf"].split()[2] == "pass"
    assert "fail" in rows["13_young"] and "the interval for" in " ".join(printed.split())
    assert "your answer's cell raised SyntaxError" in rows["02_accum_steps"]
    assert rows["02_global_token_loss"].split()[2:4] == ["not", "attempted"]
    assert printed.strip().endswith("1 of 4 exercises pass")
    assert printed.index("02_global_token_loss") < printed.index("13_cluster_mtbf")
    assert "2/2 notebooks" in errors and "without encryption" not in printed + errors, errors


@pytest.mark.slow
def test_progress_runs_both_editions_in_full(tmp_path, monkeypatch, capsys):
    """`titanlite progress` on notebook 02: the instructor's passes, the student's is not attempted."""
    from titanlite.tools.cli.commands import main

    monkeypatch.setenv("MPLBACKEND", "Agg")
    student_edition(ROOT / "notebooks", tmp_path / "student")
    assert main(["progress", str(tmp_path / "student"), "--only", "02"]) == 0
    out = capsys.readouterr().out
    assert "02_accum_steps        not attempted" in out and out.strip().endswith(
        "0 of 2 exercises pass"
    )
    seen = []
    results = progress(
        ROOT / "notebooks", only="02", on_notebook=lambda name, rs, s: seen.append((name, len(rs)))
    )
    assert [r.status for r in results] == ["pass"] * 2 and seen == [("02_gradient_accumulation", 2)]


@pytest.mark.slow
def test_a_dead_kernel_fails_every_check_of_its_notebook_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    out = tmp_path / "student"
    student_edition(_source(tmp_path, NB13), out)
    nb = _answer(nbformat.read(out / NB13, 4), "13_cluster_mtbf", "import os\nos._exit(3)")
    nbformat.write(nb, out / NB13)
    results = progress(out, checks=True)
    assert [r.status for r in results] == ["fail", "fail"], results
    assert all(
        r.detail.startswith("not checked: DeadKernelError") and "\n" not in r.detail
        for r in results
    )


@pytest.mark.skipif(os.name != "posix", reason="Unix sockets: POSIX only (Windows keeps TCP)")
def test_notebook_kernels_listen_on_unix_sockets_in_their_own_folder(tmp_path):
    """A kernel on TCP binds ports jupyter_client found free a moment before: under load another
    process took one and the kernel died at start (CI, 2026-11-28: "Kernel died before replying to
    kernel_info", zmq's bind failing). On Unix sockets in the run's own folder nothing can race."""
    from nbclient import NotebookClient

    from titanlite.tools.course.editions import kernel_on_unix_sockets

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import json\n"
            "from ipykernel.connect import get_connection_info\n"
            "info = json.loads(get_connection_info())\n"
            "print(info['transport'], info['ip'])"
        )
    ]
    NotebookClient(
        nb, timeout=60, kernel_name="python3", **kernel_on_unix_sockets(tmp_path)
    ).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert text.split() == ["ipc", str(tmp_path.resolve() / "kernel")], text
    assert not list(tmp_path.iterdir())  # its sockets are removed with the kernel
    # A folder too deep for a socket path (107 bytes) keeps TCP rather than fail.
    assert kernel_on_unix_sockets(tmp_path / ("d" * 100)) == {}
