"""Every code block README.md shows works as shown: they are what a newcomer copies first.

Each block is matched to the test that runs it (a block no test claims fails
`test_every_readme_code_block_is_tested`): the Python blocks run in a fresh interpreter as
written; the shell commands run with only their length shortened (steps, sequence length, where
they log); commands that need the network (downloads) or another machine's accounts are checked
for options that exist and for valid shell."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m[1], m[2]) for m in re.finditer(r"```(\w*)\n(.*?)```", README, re.S)]

# Which test claims a block: a phrase the block contains.
CLAIMS = {
    "make lab ": "test_packaging.py::test_readme_gives_two_commands_and_ci_runs_the_test_one",
    "history = Trainer(cfg, peaks=MatmulPeaks()).fit": "test_the_python_api_and_launch_blocks_run_as_shown",
    "from titanlite.tools.jobs.launcher import launch": "test_the_python_api_and_launch_blocks_run_as_shown",
    "# FSDP2": "test_the_torchrun_commands_train",
    "--max-restarts 3": "test_the_restart_drill_restarts_and_reports_goodput",
    "hf download": "test_the_download_block_uses_options_the_hf_cli_has",
    "ExerciseError:": "test_the_exercise_messages_shown_are_what_the_checks_print",
    "nbgrader generate_assignment": "test_nbgrader.py (the same commands, end to end)",
    "for i in 0 1 2 3": "test_every_shell_block_is_valid_shell",
    "--fault_tolerance.enable true": "test_the_fault_tolerance_block_uses_options_that_exist",
}


def _short(data_dir: Path, log_dir: Path) -> list[str]:
    """The options that shorten a README command to seconds (what it trains, not how)."""
    o = tiny_overrides(data_dir, log_dir, **{"training.steps": 4, "eval.every": 0})
    o.pop("metrics.run_name")
    return [a for k, v in o.items() for a in (f"--{k}", str(v))]


def _commands(block: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_every_readme_code_block_is_tested():
    unclaimed = [text[:80] for _, text in BLOCKS if not any(k in text for k in CLAIMS)]
    assert not unclaimed, f"README code blocks no test runs: {unclaimed}"


def test_every_shell_block_is_valid_shell():
    for lang, text in BLOCKS:
        if lang in ("bash", "sh"):
            r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
            assert r.returncode == 0, (text, r.stderr)
    (gpu_lab,) = [t for _, t in BLOCKS if "for i in 0 1 2 3" in t]
    help_text = subprocess.run(
        [sys.executable, "-m", "jupyterlab", "--help-all"], capture_output=True, text=True
    ).stdout
    for option in ("--no-browser", "--port"):
        assert option in gpu_lab and option in help_text, option


def test_the_python_api_and_launch_blocks_run_as_shown(data_dir, tmp_path):
    """The Python API block (a 100-step run with a live plot) and the launch block after it, in
    one fresh interpreter, as a newcomer pastes them into one notebook."""
    api, launch = (t for lang, t in BLOCKS if lang == "python")
    assert "from titanlite.tools.jobs.launcher import launch" in launch
    script = tmp_path / "readme.py"
    checks = textwrap.dedent("""
        assert len(history.losses) == 100 and history.losses[-1] < history.losses[0]
        assert all(0 < r["mfu"] for r in history.train)  # the peak finder was handed in
        assert len(result.losses) == 100 and result.warm is not None
        print("README blocks ran")
    """)
    script.write_text(api + "\n" + launch + "\n" + checks)
    env = {**os.environ, "TITANLITE_DATA_DIR": str(data_dir), "MPLBACKEND": "Agg"}
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "README blocks ran" in r.stdout, r.stderr[-3000:]


def test_the_torchrun_commands_train(data_dir, tmp_path):
    """`torchrun --nproc-per-node N -m titanlite train ...` as shown (FSDP2, DDP), shortened, on the
    launcher's path: the same module, arguments and ranks."""
    from titanlite.tools.jobs.launcher import launch_script

    (block,) = [t for _, t in BLOCKS if "# FSDP2" in t]
    commands = _commands(block)
    assert len(commands) == 2
    for i, argv in enumerate(commands):
        assert argv[0] == ".venv/bin/torchrun" and argv[1] == "--nproc-per-node", argv
        nproc, module = int(argv[2]), argv[3:]
        assert module[:3] == ["-m", "titanlite", "train"], argv
        module = [str(ROOT / a) if a.startswith("configs/") else a for a in module]
        run_dir = tmp_path / f"job{i}"
        launch_script([*module, *_short(data_dir, run_dir)], nproc, run_dir=run_dir, timeout_s=300)
        assert list(run_dir.glob("runs/*/model.safetensors")), "the run finished"


def test_the_restart_drill_restarts_and_reports_goodput(data_dir, tmp_path):
    """The drill as shown, with torchrun itself (its agent restarts the job): rank 1 dies at step
    7, the job restarts, resumes from step 4's checkpoint, finishes and prints its goodput."""
    (block,) = [t for _, t in BLOCKS if "--max-restarts 3" in t]
    export, argv = _commands(block)
    assert export == ["export", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    assert argv[0] == ".venv/bin/torchrun"
    port = argv.index("--rdzv-endpoint") + 1
    argv[port] = "127.0.0.1:0"  # 29500 may be taken on a shared machine; 0: the agent binds one
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    argv = [str(ROOT / a) if a.startswith("configs/") else a for a in argv]
    short = _short(data_dir, tmp_path) + ["--training.steps", "10"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [*argv, *short], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "goodput:" in r.stdout and "2 attempt(s)" in r.stdout, r.stdout[-2000:]
    assert (tmp_path / "runs" / "drill" / "goodput.jsonl").is_file()


def test_the_download_block_uses_options_the_hf_cli_has():
    """The downloads need the network; their options must be ones `hf download` takes (one
    pattern per --include), and the training command's options valid config keys."""
    from titanlite.config import load_config

    (block,) = [t for _, t in BLOCKS if "hf download" in t]
    hf = Path(sys.executable).parent / "hf"
    help_text = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0, help_text.stderr
    *downloads, train = _commands(block)
    for argv in downloads:
        assert argv[:2] == [".venv/bin/hf", "download"], argv
        options = [a for a in argv if a.startswith("--")]
        assert all(o in help_text.stdout for o in options), options
        positional = [
            a
            for i, a in enumerate(argv[2:], 2)
            if not a.startswith("--") and not argv[i - 1].startswith("--")
        ]
        assert len(positional) == 1, f"one repo and no stray file names: {argv}"
    assert train[:4] == [".venv/bin/python", "-m", "titanlite", "train"]
    config, overrides = train[train.index("--config") + 1], train[6:]
    load_config(ROOT / config, overrides)  # every key exists and every value is valid


def test_the_fault_tolerance_block_uses_options_that_exist():
    """The lighthouse and two replica groups: running them is tests/test_fault_tolerance.py's job
    (through the launcher); here, that the lighthouse takes the options shown, torchrun parses
    each group's command, and each group's settings pass titanlite's preflight (group 0 and 1)."""
    pytest.importorskip("torchft")
    from torch.distributed import run as torchrun  # its parser only: no process starts
    from torchft._torchft import LighthouseServer

    from titanlite.config import load_config
    from titanlite.preflight import preflight

    (block,) = [t for _, t in BLOCKS if "--fault_tolerance.enable true" in t]
    commands = _commands(block)
    lighthouse = commands[0]
    assert lighthouse[0] == ".venv/bin/torchft_lighthouse"
    signature = LighthouseServer.__text_signature__  # the binary's options are the server's
    for option in (a for a in lighthouse if a.startswith("--")):
        assert option[2:] in signature, (option, signature)
    assert commands[1][0] == "export" and "TORCHFT_LIGHTHOUSE=http://localhost:29510" in commands[1]
    group = next(c for c in commands if c[0] == ".venv/bin/torchrun")
    for g in (0, 1):
        argv = [a.replace("$g", str(g)) for a in group[1:] if a != "&"]
        args = torchrun.get_args_parser().parse_args(argv)
        assert args.max_restarts == 2 and args.module and args.training_script == "titanlite"
        train = args.training_script_args
        config, overrides = train[train.index("--config") + 1], train[3:]
        cfg = load_config(ROOT / config, overrides)
        assert (cfg.fault_tolerance.replica_id, cfg.fault_tolerance.group_size) == (g, 2)
        preflight(cfg, 1, cfg.data.vocab_size)


def test_the_exercise_messages_shown_are_what_the_checks_print(tmp_path, monkeypatch):
    """The two example lines are real: the classic mistake and the crash they show, checked at
    seed 12345, print exactly those lines."""
    from titanlite.labs.exercises import check
    from titanlite.labs.exercises.grading import ExerciseError

    (block,) = [t for _, t in BLOCKS if "ExerciseError:" in t]
    shown = [line for line in block.splitlines() if line.strip()]
    module = tmp_path / "answers.py"
    module.write_text(
        textwrap.dedent("""\
            import torch
            from titanlite.efficiency.accumulation import count_targets, loss_sum


            def each_by_its_own_count(micro_logits, micro_targets):
                return [loss_sum(x, t) / count_targets(t) for x, t in zip(micro_logits, micro_targets)]

            def crash(logits, targets):
                return torch.log_softmax(logits, dim=5).sum()
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import answers

    got = []
    for name, fn in (
        ("02_global_token_loss", answers.each_by_its_own_count),
        ("01_cross_entropy", answers.crash),
    ):
        with pytest.raises(ExerciseError) as e:
            check(name, fn, seed=12345)
        got.append(f"ExerciseError: {e.value}")
    assert got == shown
