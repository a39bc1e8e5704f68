"""Multi-node training, with two "machines" on one: configs/multinode/node.sh and train.sbatch.

Each "machine" is its own torchrun agent (`--nnodes 2 --nproc-per-node 1`); the two meet at a
c10d rendezvous on 127.0.0.1, exactly as two real machines would meet at MASTER_ADDR. SLURM is
faked by an `scontrol` and an `srun` on PATH (srun starts the task once per "node", with its
SLURM_NODEID), so the real sbatch script runs unchanged.

Both jobs are 2-rank DDP runs of 4 sequences per rank. The reference is one process with 8
sequences per step: the same global batch (the sampler gives rank r rows [4r, 4r + 4) of the
single process's 8), so every step's loss must agree. The only difference is the order of a
float32 sum (gloo's all-reduce of the two ranks' gradients vs one backward over 8 rows), which
moves the losses by ~1e-6; a wrong batch split or a missing gradient sync moves them by > 1e-3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

from titanlite.config import load_config
from titanlite.train import Trainer

REPO = Path(__file__).resolve().parents[1]
NODE_SH = REPO / "configs" / "multinode" / "node.sh"
SBATCH = REPO / "configs" / "multinode" / "train.sbatch"
BASH = shutil.which("bash")
STEPS, PER_RANK, RANKS = 4, 4, 2
TOLERANCE = 1e-5  # float32 summation order only (see the module docstring)
NODE_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")


def _overrides(data_dir: Path, log_dir: Path, **extra) -> dict:
    # device cpu: two agents on one machine would otherwise both take cuda:0 on a GPU box
    return tiny_overrides(
        data_dir,
        log_dir,
        **{
            "training.steps": STEPS,
            "training.batch_size": PER_RANK,
            "eval.every": 0,
            "training.device": "cpu",
            **extra,
        },
    )


def _cli(overrides: dict) -> list[str]:
    args = ["--config", str(REPO / "configs" / "debug.toml")]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    return args


def _env(**extra) -> dict:
    """This environment, minus anything that would make the scripts think they are already
    inside a job (a CI that itself runs under SLURM or torchrun), with the venv's torchrun."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k not in (*NODE_VARS, "RANK", "LOCAL_RANK", "WORLD_SIZE", "RDZV_ID", "TORCHRUN")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(commands: list[tuple[list[str], dict]], timeout: float = 150) -> list[tuple[int, str]]:
    """Start every command at once (as on separate machines); (returncode, output) of each.
    A job still running after `timeout` is killed with its children, then the test fails."""
    procs = [
        subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd, env in commands
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # workers die with their agent (PDEATHSIG)
            p.communicate()
        pytest.fail(f"the two-node job did not finish within {timeout:.0f} s")
    return results


def _losses(path: Path) -> list[float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["world_size"] == RANKS for r in records if r["kind"] == "train")
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def single_process_losses(data_dir, tmp_path_factory) -> list[float]:
    """One process, 8 sequences per step: the same global batch as 2 ranks x 4. Run first, it
    also builds the shared data cache, so the agents below only read it."""
    log_dir = tmp_path_factory.mktemp("single")
    cfg = load_config(
        REPO / "configs" / "debug.toml",
        _overrides(data_dir, log_dir, **{"training.batch_size": RANKS * PER_RANK}),
    )
    trainer = Trainer(cfg)
    losses = trainer.fit().losses
    assert trainer.dist.world_size == 1 and len(losses) == STEPS
    return losses


def _assert_same_training(run_dir: Path, reference: list[float], outputs: list[str]) -> None:
    shown = "\n".join(outputs)[-3000:]
    rank0, rank1 = run_dir / "metrics.jsonl", run_dir / "metrics.rank1.jsonl"
    assert rank0.is_file() and rank1.is_file(), f"a rank wrote no metrics:\n{shown}"
    info = json.loads((run_dir / "run.json").read_text())
    assert (info["world_size"], info["parallel"], info["global_batch"]) == (
        RANKS,
        "ddp",
        RANKS * PER_RANK,
    )
    for path in (rank0, rank1):
        losses = _losses(path)
        assert len(losses) == STEPS
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        assert worst < TOLERANCE, f"{path.name}: {losses} vs one process {reference}"


def test_two_agents_via_node_sh_train_like_one_process(data_dir, tmp_path, single_process_losses):
    port = _free_port()
    args = _cli(
        _overrides(
            data_dir,
            tmp_path,
            **{
                "metrics.run_name": "two-nodes",
                "parallel.dp_replicate": RANKS,
                "parallel.dp_shard": 1,
            },
        )
    )
    common = dict(
        NNODES="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NPROC_PER_NODE="1",
        RDZV_ID="test-node-sh",
    )
    # Machine 1 starts first: it must wait for machine 0's rendezvous store, not fail.
    results = _run_all(
        [([BASH, str(NODE_SH), *args], _env(NODE_RANK=str(rank), **common)) for rank in (1, 0)]
    )
    outputs = [out for _, out in results]
    assert [rc for rc, _ in results] == [0, 0], "\n".join(outputs)[-3000:]
    # world_size 2 with one process per agent (checked below): the two agents did meet
    for rank, out in zip((1, 0), outputs):
        assert f"node.sh: machine {rank} of 2" in out
    _assert_same_training(tmp_path / "runs" / "two-nodes", single_process_losses, outputs)


FAKE_SCONTROL = """#!/usr/bin/env bash
# fake `scontrol show hostnames LIST`: every "node" of the allocation is this machine
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
printf '127.0.0.1\\nlocalhost\\n'
"""

FAKE_SRUN = """#!/usr/bin/env bash
# fake srun: run the command once per "node" of the allocation, all at once, each with the
# per-task variables SLURM sets; like --kill-on-bad-exit, one failure stops the others.
set -uo pipefail
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done  # options (--ntasks-per-node=1, ...)
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for _ in "${pids[@]}"; do
    wait -n || { status=$?; kill "${pids[@]}" 2>/dev/null; }
done
exit $status
"""


def test_sbatch_script_trains_on_two_fake_slurm_nodes(data_dir, tmp_path, single_process_losses):
    fake_bin = tmp_path / "fake-slurm"
    fake_bin.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    args = _cli(
        _overrides(
            data_dir,
            tmp_path,
            **{
                "metrics.run_name": "sbatch",
                "parallel.dp_replicate": RANKS,
                "parallel.dp_shard": 1,
            },
        )
    )
    env = _env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_CPUS_PER_TASK="1",
        MASTER_PORT=str(_free_port()),
    )
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    [(rc, out)] = _run_all([([BASH, str(SBATCH), *args], env)])
    assert rc == 0, out[-3000:]
    assert "2 machines (node[0-1]) x 1 processes, rendezvous at 127.0.0.1:" in out
    assert "node.sh: machine 0 of 2" in out and "node.sh: machine 1 of 2" in out
    assert "(job 4242)" in out  # the SLURM job id names the rendezvous
    _assert_same_training(tmp_path / "runs" / "sbatch", single_process_losses, [out])


def _node_sh(env_vars: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, str(NODE_SH), "--training.steps", "1"],
        env=_env(**env_vars),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


VALID = dict(
    NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", NPROC_PER_NODE="1"
)


@pytest.mark.parametrize("missing", NODE_VARS)
def test_node_sh_names_a_missing_variable_in_one_line(missing):
    result = _node_sh({k: v for k, v in VALID.items() if k != missing})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"node.sh: {missing} is not set: export {missing}="
    )


@pytest.mark.parametrize(
    "bad, named",
    [
        (dict(NODE_RANK="2"), "NODE_RANK=2 is not in 0..1"),
        (dict(NNODES="two"), "NNODES=two is not a positive integer"),
        (dict(MASTER_PORT="70000"), "MASTER_PORT=70000 is not a TCP port"),
        (dict(NPROC_PER_NODE="0"), "NPROC_PER_NODE=0 is not a positive integer"),
        (dict(TORCHRUN="no-such-torchrun"), "'no-such-torchrun' not found"),
    ],
)
def test_node_sh_refuses_bad_values_in_one_line(bad, named):
    result = _node_sh({**VALID, **bad})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"node.sh: {named}")


def test_sbatch_outside_slurm_says_so():
    result = subprocess.run(
        [BASH, str(SBATCH)], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"train.sbatch: SLURM_JOB_ID is not set: this script runs inside a SLURM allocation; "
        f"submit it with sbatch {SBATCH} ..."
    ]


@pytest.mark.parametrize("script", [NODE_SH, SBATCH])
def test_scripts_are_executable_strict_bash(script):
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    assert subprocess.run([BASH, "-n", str(script)]).returncode == 0  # parses
