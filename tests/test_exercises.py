"""Course-lab exercises: every check passes the instructor's solution, fails a wrong answer with
its one-line message, and fails the student edition's stub; the student edition is generated
from the same notebooks and really fails at its first check; `titanlite progress` reads it."""
import json
import math
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from titanlite.course import (BEGIN, END, format_table, is_check_cell, is_solution_cell,
                              progress, read_results, strip_solution, strip_solutions, stripper,
                              student_edition, student_notebook)
from titanlite.errors import TitanliteError
from titanlite.exercises import ExerciseError
from titanlite.labs.exercises import EXERCISES, check

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WITH_EXERCISES = [p for p in NOTEBOOKS if any(is_check_cell(c) for c in nbformat.read(p, 4).cells)]


def _solutions() -> dict[str, tuple[str, str, Path]]:
    """exercise → (solution cell source, the function name its check passes, notebook)."""
    found = {}
    for path in WITH_EXERCISES:
        cells = nbformat.read(path, 4).cells
        for i, cell in enumerate(cells):
            if is_check_cell(cell):
                name, fn = cell.source.split('check("')[1].split('", ')
                found[name] = (cells[i - 1].source, fn.rstrip(")"), path)
    return found


SOLUTIONS = _solutions()


def _define(source: str, fn: str):
    ns = {}
    exec(compile(source, "<solution cell>", "exec"), ns)
    return ns[fn]


# One plausible mistake per exercise, and a fragment of the line its check must say.
def _wrong(name):
    import torch.nn.functional as F
    from torch.utils.checkpoint import CheckpointPolicy
    return {
        "01_cross_entropy": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten().clamp(min=0),
                                                           reduction="sum"), "expected"),
        "01_lr_schedule": (lambda s, w, t, f: s / w if s < w else 1.0, "lr_factor(0"),
        "02_global_token_loss": (lambda xs, ts: [F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="sum")
                                                 / (t != -100).sum() / len(xs) for x, t in zip(xs, ts)],
                                 "real tokens)"),
        "02_accum_steps": (lambda g, m, dp: g // m, "accum_steps("),
        "03_scaler_step": (lambda grads, s, tr, gi: (False, s, tr), "step "),
        "03_autocast_policy": (lambda d, c: "bf16" if d == "cuda" else "fp32", "SM (6, 0)"),
        "04_sac_policy": (lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE, "the policy for"),
        "04_selective_blocks": (lambda n, mode, every: list(range(n)), "blocks_to_checkpoint("),
        "05_no_graph_break": (_scaled_sin_with_item, "graph"),
        "06_tensorwise_fp8": (lambda x: x.to(torch.float8_e4m3fn).float(), "round trip"),
        "06_fp8_dtype": (lambda role: torch.float8_e4m3fn, "'grad_output'"),
        "07_buckets": (lambda ps, cap: [list(ps)], "buckets"),
        "07_bucketed_allreduce": (lambda g, cap: ([t for t in g[0]], 1), "averaged over"),
        "08_zero_bytes": (lambda n, w, s: {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n // w},
                          "bytes for"),
        "08_fsdp_shard": (lambda shape, w, r: math.prod(shape) // w, "rank "),
        "09_tp_mlp": (lambda g, u, d, tp, r: (g.chunk(tp, 1)[r], u.chunk(tp, 1)[r], d.chunk(tp, 0)[r]),
                      "rank 0's gate shard"),
        "09_block_comm": (lambda b, s, d, sp: {"all_reduce": 2 * b * s * d * 4}, "sequence_parallel=True"),
        "14_state_bytes": (lambda n, b, s, v: 16 * n, "bytes for"),
        "15_best_lr_per_accum": (lambda st: {t.params["grad_accum_steps"]: (t.value, t.params["lr"])  # swapped
                                             for t in st.trials if t.value is not None}, "the best (lr, loss)"),
        "15_compute_saved": (lambda st: sum(t.user_attrs["token_budget"] for t in st.trials), "tokens saved"),
        "10_one_f_one_b": (lambda r, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
                           "rank 1 of p=2, m=2: op 1"),
        "10_bubble": (lambda p, m: p / m, "the bubble for p=2, m=4"),
        "11_rank_grid": (lambda r, shape: {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": r},
                         "the coordinates of rank"),
        "11_groups": (lambda shape, dim: [[0]], "groups of shape"),
        "12_atomic_commit": (_commit_after_rename, "was not in the folder when it was renamed"),
        "12_latest_committed": (lambda folder: max(Path(folder).iterdir(), default=None),
                                "the latest committed checkpoint"),
        "13_young": (lambda d, m: math.sqrt(d * m), "the interval for"),
        "13_cluster_mtbf": (lambda n, rate: 1 / (n * rate), "the MTBF in seconds"),
        "16_row_overrides": (_carry_every_rung, "the overrides of"),
        "16_speed_verdict": (lambda first, last, row: "faster (beyond drift)" if row > first  # no band
                             else "slower (beyond drift)", "the verdict for baselines"),
    }[name]


def _carry_every_rung(rungs):
    """The classic bug: carry FP8 rowwise (carry=False) on to the rows after it too."""
    kept, out = {}, []
    for rung in rungs:
        kept.update(rung.overrides)
        out.append((rung, dict(kept)))
    return out


def _scaled_sin_with_item(x):
    y = torch.sin(x)
    return y * y.abs().max().item()  # right values, but .item() breaks the graph


def _commit_after_rename(tmp, final, step):
    """The classic bug: move the folder first, write the record after."""
    import os
    import zlib
    os.rename(tmp, final)
    files = {f.name: [f.stat().st_size, zlib.crc32(f.read_bytes())] for f in final.iterdir()}
    (final / "titanlite.json").write_text(json.dumps({"format": 1, "step": step, "files": files}))


def test_every_exercise_has_a_notebook_cell_and_a_check():
    assert set(SOLUTIONS) == set(EXERCISES), set(SOLUTIONS) ^ set(EXERCISES)
    assert len(EXERCISES) >= 20


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_check_passes_the_solution_and_fails_a_wrong_one(name, capsys):
    source, fn, _ = SOLUTIONS[name]
    line = check(name, _define(source, fn))
    assert line.startswith(f"✓ {name}: passed") and line in capsys.readouterr().out
    wrong, says = _wrong(name)
    with pytest.raises(ExerciseError) as e:
        check(name, wrong)
    message = str(e.value)
    assert message.startswith(f"{name}: ") and says in message and "\n" not in message, message
    with pytest.raises(ExerciseError, match=f"^{name}: not attempted yet"):
        check(name, _define(strip_solution(source), fn))


def test_a_crashing_answer_is_named_in_one_line():
    def broken(step, warmup, total, floor):
        return 1 / 0
    with pytest.raises(ExerciseError, match=r"^01_lr_schedule: your function raised ZeroDivisionError: "
                                            r"division by zero \(line \d+ of broken\)$"):
        check("01_lr_schedule", broken)
    with pytest.raises(ExerciseError, match="did you mean: 13_young"):
        check("13_yung", broken)
    assert issubclass(ExerciseError, TitanliteError)  # the notebook handler shows it as one line


def test_strip_solution_is_nbgraders_stub():
    source = f"def f(x):\n    '''doc'''\n    {BEGIN}\n    y = x + 1\n    return y\n    {END}\n\nprint(1)"
    assert strip_solution(source) == ("def f(x):\n    '''doc'''\n    # YOUR CODE HERE\n"
                                      "    raise NotImplementedError()\n\nprint(1)")
    for bad, says in ((f"{BEGIN}\nx = 1", "never closed"), (f"x = 1\n{END}", "without"),
                      (f"{BEGIN}\n{BEGIN}\n{END}", "inside another")):
        with pytest.raises(TitanliteError, match=says):
            strip_solution(bad)


FAKE_NBGRADER = '''
CALLS = []

class ClearSolutions:
    """Stands in for nbgrader's preprocessor: records each call, stubs the solution cells."""
    def preprocess(self, nb, resources):
        CALLS.append((nb, resources))
        if any("FAIL" in c.source for c in nb.cells):
            raise RuntimeError("unclosed solution region\\nsecond line")
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("solution"):
                cell.source = "# stripped by nbgrader"
        return nb, resources
'''


@pytest.fixture
def no_nbgrader(monkeypatch):
    """Hide any nbgrader (real or fake) from this test and put sys.modules back after it."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "nbgrader"}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nbgrader", None)  # find_spec says None: not installed
    yield monkeypatch
    for k in [k for k in sys.modules if k.split(".")[0] == "nbgrader"]:
        del sys.modules[k]
    sys.modules.update(saved)


def _fake_nbgrader(tmp_path, monkeypatch):
    package = tmp_path / "site" / "nbgrader"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "preprocessors.py").write_text(FAKE_NBGRADER)
    monkeypatch.delitem(sys.modules, "nbgrader")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_strip_solutions_without_nbgrader_uses_the_stripper(no_nbgrader):
    nb = nbformat.read(ROOT / "notebooks" / "16_capstone.ipynb", 4)
    assert stripper() == "titanlite" and stripper(False) == "titanlite"
    assert strip_solutions(nb) == student_notebook(nb)
    with pytest.raises(TitanliteError, match="^nbgrader is not installed: `pip install nbgrader`"):
        strip_solutions(nb, use_nbgrader=True)


def test_strip_solutions_with_nbgrader_calls_its_clear_solutions(no_nbgrader, tmp_path):
    _fake_nbgrader(tmp_path, no_nbgrader)
    assert stripper() == "nbgrader" and stripper(True) == "nbgrader" and stripper(False) == "titanlite"
    calls = __import__("nbgrader.preprocessors").preprocessors.CALLS
    nb = nbformat.read(ROOT / "notebooks" / "16_capstone.ipynb", 4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="old output")]
    student = strip_solutions(nb)
    assert len(calls) == 1 and calls[0][1] == {} and calls[0][0] is student   # (nb, {}) as documented
    solutions = [i for i, c in enumerate(nb.cells) if is_solution_cell(c)]
    assert solutions and all(student.cells[i].source == "# stripped by nbgrader" for i in solutions)
    assert not student.cells[2].outputs and nb.cells[2].outputs, "outputs cleared, on a copy"
    assert BEGIN in nb.cells[solutions[0]].source, "the instructor's notebook is untouched"
    assert strip_solutions(nb, use_nbgrader=False) == student_notebook(nb) and len(calls) == 1
    # `make student` (student_edition) goes the same way: one ClearSolutions call per notebook
    source = tmp_path / "nbs"
    source.mkdir()
    shutil.copy(ROOT / "notebooks" / "16_capstone.ipynb", source)
    shutil.copy(ROOT / "notebooks" / "14_cpu_and_apple_silicon.ipynb", source)
    student_edition(source, tmp_path / "student")
    assert len(calls) == 3
    written = nbformat.read(tmp_path / "student" / "16_capstone.ipynb", 4)
    assert written.cells[solutions[0]].source == "# stripped by nbgrader"
    nb.cells[0].source = "FAIL"
    with pytest.raises(TitanliteError, match="^nbgrader's ClearSolutions refused the notebook: unclosed") as e:
        strip_solutions(nb)
    assert "\n" not in str(e.value), "one line, however many nbgrader's message has"


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_instructor_notebook_is_nbgrader_ready(path):
    """Solution cells carry nbgrader's metadata and markers, each is followed by its locked
    check cell, and grade ids are unique (nbgrader refuses duplicates)."""
    cells = nbformat.read(path, 4).cells
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids))
    solutions = [i for i, c in enumerate(cells) if is_solution_cell(c)]
    assert 1 <= len(solutions) <= 3
    for i in solutions:
        meta = cells[i].metadata["nbgrader"]
        assert meta["schema_version"] == 3 and meta["locked"] is False and meta["grade"] is False
        assert BEGIN in cells[i].source and END in cells[i].source
        check_meta = cells[i + 1].metadata["nbgrader"]
        assert check_meta["grade"] and check_meta["locked"] and check_meta["points"] == 1
        assert BEGIN not in student_notebook(nbformat.read(path, 4)).cells[i].source


def _run_until_first_check(path: Path, tmp_path, monkeypatch):
    from nbclient import NotebookClient
    work = tmp_path / "notebooks"
    shutil.copytree(path.parent, work, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    monkeypatch.setenv("TITANLITE_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = student_notebook(nbformat.read(path, 4))
    first = next(i for i, c in enumerate(nb.cells) if is_check_cell(c))
    nb.cells = nb.cells[: first + 1]
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(work)}})
    return nb, client


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_student_edition_fails_at_its_first_check_in_one_line(path, tmp_path, monkeypatch):
    from nbclient.exceptions import CellExecutionError
    nb, client = _run_until_first_check(path, tmp_path, monkeypatch)
    with pytest.raises(CellExecutionError) as e:
        client.execute()
    name = nb.cells[-1].source.split('check("')[1].split('"')[0]
    shown = [o["text"] for o in nb.cells[-1].outputs if o.get("name") == "stderr"]
    assert shown == [f"ExerciseError: {name}: not attempted yet - replace `raise NotImplementedError()` "
                     f"in the cell above with your code, run it, then run this check\n"], \
        f"the first error was not the check's: {str(e.value)[-1500:]}"
    assert "Traceback" not in str(e.value) and f"ExerciseError: {name}: not attempted" in str(e.value)


def _with_outputs(tmp_path, outputs: dict[str, list]) -> Path:
    """A notebook whose check cells carry the given outputs (as a student's saved copy does)."""
    nb = nbformat.v4.new_notebook()
    for name, outs in outputs.items():
        cell = nbformat.v4.new_code_cell(f'check("{name}", f)')
        cell.metadata["nbgrader"] = {"grade": True, "grade_id": f"{name}_check", "locked": True,
                                     "points": 1, "schema_version": 3, "solution": False, "task": False}
        cell.outputs = [nbformat.v4.new_output("stream", name=n, text=t) for n, t in outs]
        cell.execution_count = 1 if outs else None
        nb.cells.append(cell)
    folder = tmp_path / "saved"
    folder.mkdir()
    nbformat.write(nb, folder / "99_lab.ipynb")
    return folder


def test_progress_reads_saved_outputs(tmp_path):
    folder = _with_outputs(tmp_path, {
        "a": [("stdout", "✓ a: passed - equals the real one\n")],
        "b": [("stderr", "ExerciseError: b: the loss is 3, expected 2 [seed 1]\n")],
        "c": [("stderr", "ExerciseError: c: not attempted yet - replace ...\n")],
        "d": []})
    results = progress(folder, run=False)
    assert [(r.exercise, r.status) for r in results] == [("a", "pass"), ("b", "fail"),
                                                         ("c", "not attempted"), ("d", "not run")]
    table = format_table(results)
    assert "the loss is 3, expected 2" in table and table.endswith("1 of 4 exercises pass")
    assert read_results(nbformat.read(folder / "99_lab.ipynb", 4), "x")[0].notebook == "x"
    with pytest.raises(TitanliteError, match="no notebooks"):
        progress(tmp_path / "nowhere", run=False)


@pytest.mark.slow
def test_progress_runs_both_editions(tmp_path, monkeypatch, capsys):
    """`titanlite progress` on notebook 02: the instructor's passes, the student's is not attempted."""
    from titanlite.cli import main
    from titanlite.course import student_edition
    monkeypatch.setenv("MPLBACKEND", "Agg")
    student_edition(ROOT / "notebooks", tmp_path / "student")
    assert main(["progress", str(tmp_path / "student"), "--only", "02"]) == 0
    out = capsys.readouterr().out
    assert "02_accum_steps        not attempted" in out and out.strip().endswith("0 of 2 exercises pass")
    assert [r.status for r in progress(ROOT / "notebooks", only="02")] == ["pass"] * 2


def test_tensorwise_fp8_check_holds_at_a_seed_where_a_float32_scale_lands_one_fp8_step_off(monkeypatch):
    """Seed 1812472548 (a loaded CI run): the (16, 8) tensor has a value on an e4m3 rounding
    boundary, so a scale divided in float32 instead of torchao's float64 casts it a whole FP8
    step away. The instructor's solution divides in float64 and passes; the float32 one fails."""
    from titanlite.labs.exercises import basics
    monkeypatch.setattr(basics, "fresh_seed", lambda: 1812472548)
    source, fn, _ = SOLUTIONS["06_tensorwise_fp8"]
    assert check("06_tensorwise_fp8", _define(source, fn)).startswith("✓")
    float32_scale = _define(source.replace(".double()", ".float()"), fn)
    with pytest.raises(ExerciseError, match="expected 69.148"):
        check("06_tensorwise_fp8", float32_scale)


# Seeds at which a check once let the classic mistake through, or failed it with another message
# (found by running every check over thousands of seeds): 01 drew no padding token; 02 gave every
# micro-batch a third of the tokens, or the first exactly a third, or one no real token at all
# (the mistake's NaN is caught, by another line); 04 drew only "full" models; 12 drew no
# unfinished newest save.
ONCE_WEAK = {"01_cross_entropy": [70000217, 100000307, 209000634],
             "02_global_token_loss": [172770512, 41000130, 48000151, 2059006184],
             "04_selective_blocks": [3000016, 18000061, 53000166],
             "12_latest_committed": [7, 6000025, 16000055]}


@pytest.mark.parametrize("name", sorted(ONCE_WEAK))
def test_checks_catch_the_classic_mistake_at_seeds_that_once_let_it_through(name, monkeypatch, capsys):
    from titanlite.labs.exercises import basics, resilience
    source, fn, _ = SOLUTIONS[name]
    wrong, says = _wrong(name)
    for seed in ONCE_WEAK[name]:
        for module in (basics, resilience):
            monkeypatch.setattr(module, "fresh_seed", lambda seed=seed: seed)
        assert check(name, _define(source, fn)).startswith("✓")
        with pytest.raises(ExerciseError, match=f"{re.escape(says)}.*\\[seed {seed}\\]"):
            check(name, wrong)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_check_separates_solution_and_mistake_at_many_seeds(name, monkeypatch, capsys):
    """A check draws a fresh seed each run; at 30 spread seeds the solution must pass and the
    classic mistake must fail with its message, so a check is not right only most of the time."""
    from titanlite.labs.exercises import basics, capstone, cpu_and_search, parallel, resilience
    source, fn, _ = SOLUTIONS[name]
    solution, (wrong, says) = _define(source, fn), _wrong(name)
    for seed in range(12345, 12345 + 30 * 7_654_321, 7_654_321):
        for module in (basics, capstone, cpu_and_search, parallel, resilience):
            monkeypatch.setattr(module, "fresh_seed", lambda seed=seed: seed)
        assert check(name, solution).startswith("✓")
        with pytest.raises(ExerciseError, match=re.escape(says)):
            check(name, wrong)
