"""The suite stays within its clock (25 minutes on 2 cores) by sharing one fast path for processes.

A torchrun start-up costs a 2-core machine 7-15 s before step 1, most of it importing torch again;
the launcher's warm path (titanlite/tools/forkserver.py: `launch`, `launch_function`,
`launch_script`, and conftest's `run_torchrun`) forks ranks that start in about a second. This
file counts, per test file, the places that start a process some other way, and fails when a
file starts more than it is allowed here or a new file starts any: a count, not a timing, so
noise cannot flip it. Raise a count only with the reason beside it."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A process started outside the fast path: subprocess, torchrun itself, a fork or a spawn.
LAUNCH = re.compile(
    r"subprocess\.(run|Popen|check_output|check_call|call)\(|torch\.distributed\.run|"
    r"os\.fork\(|mp\.spawn|multiprocessing\.|get_context\(|torchrun=True"
)

# file -> (launch sites allowed, why they cannot take the fast path)
ALLOWED = {
    "conftest.py": (3, "run_torchrun(torchrun=True): torchrun itself, for its own entry's tests"),
    "jupyter_browser.py": (1, "JupyterLab's server, which Chromium drives"),
    "test_accelerators.py": (
        1,
        "jax in a fresh interpreter: its 8 host devices are fixed when it starts",
    ),
    "test_bad_input.py": (1, "the CLI as a real process: the process boundary is the point"),
    "test_browser.py": (
        4,
        "git (a fresh clone, then its status) and make lab's own course command",
    ),
    "test_bench.py": (1, "the benchmarks are scripts, run as users run them"),
    "test_checkpoint_io.py": (3, "DCP's writer process; a process that never imports titanlite"),
    "test_cli.py": (4, "`titanlite` and `torchrun -m titanlite` as a shell runs them"),
    "test_comm_and_scratch_ddp.py": (1, "the file's own worker entry (it runs on the fast path)"),
    "test_core_size.py": (1, "`import titanlite.train` in a fresh interpreter, to list what loads"),
    "test_course.py": (
        5,
        "`make student` and the course CLI, as an instructor runs them; a moved module's import "
        "in a fresh interpreter, as a kept workbook notebook runs it",
    ),
    "test_hostile_machine.py": (2, "mount and umount a small tmpfs (no Python)"),
    "test_imports.py": (3, "fresh interpreters: what importing titanlite changes"),
    "test_layering.py": (1, "an old module name imported in a fresh interpreter: its one line"),
    "test_launcher.py": (4, "a kernel to interrupt or kill; torchrun's restart; a fresh import"),
    "test_multinode.py": (4, "two torchrun agents meeting over a rendezvous, as two machines"),
    "test_nbgrader.py": (1, "nbgrader's own command line"),
    "test_readme.py": (6, "the README's commands as shown: torchrun's restarts, bash, hf, jupyter"),
    "test_ui.py": (1, "a run whose output goes to a file, as under nohup"),
}


def launch_sites(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if LAUNCH.search(line))


def test_no_test_file_starts_more_processes_outside_the_fast_path_than_allowed():
    found = {
        p.name: launch_sites(p) for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name
    }
    over = {
        name: f"{n} launch sites, {ALLOWED.get(name, (0,))[0]} allowed"
        for name, n in found.items()
        if n > ALLOWED.get(name, (0,))[0]
    }
    assert not over, (
        f"{over}: start ranks with titanlite.tools.jobs.launcher (launch, launch_function, "
        f"launch_script) or conftest.run_torchrun, which fork them warm; or, if a test needs its "
        f"own process, allow it in ALLOWED with the reason"
    )


def test_the_count_can_fail(tmp_path):
    """A planted file that runs torchrun itself is counted."""
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import subprocess, sys\n"
        "def test_x():\n"
        "    subprocess.run([sys.executable, '-m', 'torch.distributed.run', 'w.py'])\n"
    )
    assert launch_sites(planted) == 1 and "test_planted.py" not in ALLOWED
