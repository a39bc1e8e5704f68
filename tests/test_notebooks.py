"""Every notebook runs top to bottom in smoke scale, and is committed without outputs.

Each notebook asserts its own claims on the numbers it measures, so executing it is the test.
"""

import json
import shutil
import time
from pathlib import Path

import pytest

from titanlite.tools.course.editions import kernel_on_unix_sockets

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Run whole in tests/test_browser.py (Run All in a fresh kernel, in JupyterLab), which fails on any
# error or unrun cell: executed here as well, CI would pay for them twice. Here only without a browser.
RUN_ALL_IN_THE_BROWSER = {"15_hyperparameter_search", "16_capstone"}
# A notebook whose extra has no wheel on some platforms (torchft: Linux x86-64 only, where `make
# test` installs it, so on Linux it runs): elsewhere it stops in its first cells, in one line.
NEEDS = {"22_training_that_does_not_stop": "torchft"}


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert "00_hardware_and_roofline.ipynb" in names and "01_baseline_training.ipynb" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_scale(path, tmp_path, monkeypatch):
    import nbformat
    from jupyter_browser import browser_missing
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    if path.stem in RUN_ALL_IN_THE_BROWSER and not browser_missing():
        pytest.skip("run top to bottom by tests/test_browser.py, in JupyterLab")
    if path.stem in NEEDS:
        pytest.importorskip(
            NEEDS[path.stem], reason="no wheel on this platform (Linux x86-64 only)"
        )

    # Run a copy, so outputs and runs/ never land in the repository.
    work = tmp_path / "notebooks"
    shutil.copytree(
        ROOT / "notebooks", work, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints")
    )
    monkeypatch.setenv("TITANLITE_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(work / path.name, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(work)}},
        **kernel_on_unix_sockets(tmp_path),
    )
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed in smoke scale:\n{str(e)[-3000:]}")
    print(f"{path.name}: {time.perf_counter() - start:.1f} s in smoke scale")
    stderr = [
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("name") == "stderr"
    ]
    noise = [s for s in stderr if "Failed to load" in s or "Traceback" in s]
    assert not noise, f"{path.name} printed noise a learner should not see: {noise[:2]}"
