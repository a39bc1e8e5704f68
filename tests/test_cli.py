"""The command line: a real run end to end, and bad input as one line + exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def titanlite(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "titanlite", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def flags(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", str(v))]


def test_train_then_export_to_hugging_face(data_dir, tmp_path):
    r = titanlite(
        "train",
        "--config",
        "configs/debug.toml",
        *flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 5})),
    )
    assert r.returncode == 0, r.stderr
    assert "done: 5 steps" in r.stdout and "MFU" in r.stdout
    assert "Failed to load" not in r.stdout + r.stderr  # torchao's CPU noise stays hidden
    run_dir = tmp_path / "runs" / "t"
    r = titanlite("export-hf", str(run_dir), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    from transformers import LlamaForCausalLM

    assert LlamaForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 512


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stesp", "5"], "unknown config key 'training.stesp'"),
        (["--training.steps", "many"], "training.steps must be an integer"),
        (["--training.steps", "0"], "training.steps must be positive"),
        (["--training.batch_size", "-1"], "training.batch_size must be between 1 and 1048576"),
        (["--training.seq_len", "4096"], "exceeds the model's maximum"),
        (["--model.vocab_size", "64"], "but the model's vocab_size is 64"),
        (["--data.dataset", "file", "--data.path", "missing.txt"], "missing.txt"),
        (["--training.device", "mps" if sys.platform != "darwin" else "cuda"], "requested"),
        (["--config", "nope.toml"], "config file 'nope.toml' does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(data_dir, tmp_path, args, message):
    base = flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 2}))
    r = titanlite("train", *base, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error:"), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr


def test_export_of_a_missing_run_is_one_line(tmp_path):
    r = titanlite("export-hf", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is missing" in r.stderr


WORKER_PROBE = """
import json, runpy, sys
from pathlib import Path
import titanlite.distributed.env as env

report, args = Path(sys.argv[1]), sys.argv[2:]
real_exit = env.exit_worker

def exit_and_report(code=0):
    # Which modules were loaded from train.py, at the moment the worker leaves.
    train_py = str(Path(env.__file__).resolve().parents[1] / "train.py")
    copies = sorted(name for name, m in list(sys.modules.items())
                    if getattr(m, "__file__", None) and str(Path(m.__file__).resolve()) == train_py)
    report.write_text(json.dumps({"copies": copies, "code": code,
                                  "main": sys.modules["__main__"].__spec__.name}))
    real_exit(code)

env.exit_worker = exit_and_report
sys.argv = ["titanlite", *args]
runpy.run_module("titanlite", run_name="__main__", alter_sys=True)  # what `-m titanlite` does
"""


def test_a_torchrun_worker_imports_the_trainer_once(data_dir, tmp_path):
    """`torchrun -m titanlite train`: train.py is loaded once, as titanlite.train (the old
    `-m titanlite.train` loaded it twice: as __main__ and as titanlite.train, two Trainers)."""
    from conftest import run_torchrun

    probe = tmp_path / "probe.py"
    probe.write_text(WORKER_PROBE)
    report = tmp_path / "report.json"
    run_torchrun(
        probe,
        report,
        "train",
        "--config",
        ROOT / "configs/debug.toml",
        *flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 2, "eval.every": 0})),
        nproc=1,
        timeout=300,
        torchrun=True,  # this is about torchrun's own `-m titanlite` entry
    )
    seen = json.loads(report.read_text())
    assert seen == {"copies": ["titanlite.train"], "code": 0, "main": "titanlite.__main__"}
    assert (tmp_path / "runs" / "t" / "model.safetensors").is_file()  # the run itself finished


def test_train_help_lists_every_section_and_key_with_its_default_and_comment():
    import dataclasses

    from titanlite.config import Config

    r = titanlite("train", "--help")
    assert r.returncode == 0, r.stderr
    for section in dataclasses.fields(Config):
        assert f"[{section.name}]" in r.stdout
        for f in dataclasses.fields(getattr(Config(), section.name)):
            assert f"--{section.name}.{f.name} " in r.stdout, f"{section.name}.{f.name} missing"
    assert "--training.steps 200" in r.stdout and "optimizer steps" in r.stdout  # trailing comment
    assert (
        "--training.dtype float32" in r.stdout
        and "parameter (and optimizer state) dtype" in r.stdout
    )  # comment above
    assert "--scheduler.decay cosine" in r.stdout and "one of cosine, linear, constant" in r.stdout
    assert "--eval.prompt 'The '" in r.stdout  # a default with a space shows it


def test_every_listed_default_is_accepted_back_as_an_override():
    """The help shows defaults as one would type them: feeding them all back changes nothing."""
    import re

    from titanlite.config import Config, load_config
    from titanlite.tools.cli.config_help import overrides_help

    pairs = re.findall(r"^    (--\S+) ('[^']*'|\S+)", overrides_help(), re.M)
    args = [
        a
        for flag, value in pairs
        for a in (flag, value.strip("'") if value.startswith("'") else value)
    ]
    assert len(pairs) > 80 and load_config(None, args) == Config()


@pytest.mark.parametrize(
    "typo, line",
    [
        ("trian", "titanlite: error: unknown command 'trian': did you mean 'train'?"),
        (
            "export-ckeckpoint",
            "titanlite: error: unknown command 'export-ckeckpoint': did you mean 'export-checkpoint'?",
        ),
        ("zzz", "titanlite: error: unknown command 'zzz': use one of train, peaks"),
    ],
)
def test_an_unknown_command_is_one_line_with_the_nearest_one(typo, line):
    r = titanlite(typo, "--config", "configs/debug.toml")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(line), r.stderr


def test_export_checkpoint_help_is_a_full_sentence():
    r = titanlite("--help")
    line = " ".join(r.stdout.rsplit("export-checkpoint", 1)[-1].split())
    assert line.startswith("write a distributed checkpoint") and "torch.save file" in line
    r = titanlite("export-checkpoint", "--help")
    assert "Write a distributed checkpoint" in r.stdout and "step-N folder" in r.stdout


@pytest.mark.parametrize(
    "launcher",
    [[], ["-m", "torch.distributed.run", "--nproc-per-node", "1"]],
    ids=["python", "torchrun"],
)
def test_the_trainer_module_is_not_a_program(launcher, tmp_path):
    """`python -m titanlite.train` (torchtitan's spelling, and this project's before) used to
    exit 0 having trained nothing; it, and torchrun's `-m titanlite.train`, now fail with one
    line naming the entry."""
    cmd = [sys.executable, *launcher, "-m", "titanlite.train", "--config", "configs/debug.toml"]
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
        env={**__import__("os").environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "e.json")},
    )
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "python -m titanlite train" in ln]
    assert lines and lines[0].startswith("titanlite.train is a module, not a program"), r.stderr[
        -2000:
    ]
    if not launcher:
        assert r.stderr.strip().splitlines() == lines[:1]  # the one line, nothing else


def _tree(folder: Path) -> dict:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_second_run_under_the_same_name_is_refused_and_the_first_is_left_byte_for_byte(
    data_dir, tmp_path
):
    """Issue 25: training twice under one run name replaced the first run's weights and run.json and
    appended its records to the first run's metrics (steps 1-3, then 1-5). Now the second start is
    refused in one line naming the fix, the first run's files untouched; asking to overwrite works."""
    base = flags(
        tiny_overrides(
            data_dir, tmp_path, **{"training.steps": 3, "eval.every": 0, "metrics.run_name": "exp"}
        )
    )
    r = titanlite("train", *base)
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / "runs" / "exp"
    first = _tree(run_dir)
    assert {"run.json", "metrics.jsonl", "model.safetensors"} <= set(first)
    for extra, why in (
        (
            ["--training.steps", "5", "--optimizer.lr", "0.01"],
            "different optimizer.lr 0.003 → 0.01",
        ),
        (["--training.steps", "5"], "no committed checkpoint to resume"),
    ):
        r = titanlite("train", *base, *extra)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith(
            f"titanlite: error: run folder '{run_dir}' holds another run ({why}"
        )
        assert "choose another --metrics.run_name, or add --metrics.overwrite true" in lines[0]
        assert _tree(run_dir) == first  # byte for byte: nothing replaced, nothing appended
    r = titanlite("train", *base, "--training.steps", "5", "--metrics.overwrite", "true")
    assert r.returncode == 0, r.stderr
    assert f"titanlite: metrics.overwrite: deleting the run in {run_dir}" in r.stdout
    steps = [
        json.loads(ln)["step"]
        for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(ln).get("kind") == "train"
    ]
    assert steps == [1, 2, 3, 4, 5]  # one run's records, not two runs mixed


def test_every_entry_point_refuses_another_run_and_a_resume_goes_on(data_dir, tmp_path):
    """The Python API (notebooks) and the launcher refuse like the CLI, before writing anything; a
    run with a committed checkpoint and the same settings resumes as before."""
    from titanlite.config import load_config
    from titanlite.errors import TitanliteError
    from titanlite.tools.jobs.launcher import launch
    from titanlite.train import Trainer

    o = tiny_overrides(
        data_dir, tmp_path, **{"training.steps": 2, "eval.every": 0, "checkpoint.enable": True}
    )
    Trainer(load_config(None, o)).fit()
    run_dir = tmp_path / "runs" / "t"
    first = _tree(run_dir)
    history = Trainer(
        load_config(None, {**o, "training.steps": 3})
    ).fit()  # same settings, more steps: resumes
    assert history.resumed_from is not None and [r["step"] for r in history.train] == [3]
    resumed = _tree(run_dir)
    with pytest.raises(TitanliteError, match=r"holds another run \(different optimizer\.lr"):
        Trainer(load_config(None, {**o, "training.steps": 4, "optimizer.lr": 0.01})).fit()
    with pytest.raises(
        TitanliteError, match=r"holds another run \(different data\.vocab_size 512 → 600"
    ):
        launch(
            load_config(None, {**o, "data.vocab_size": 600}), 2, overrides={"parallel.dp_shard": 2}
        )
    # refused twice, nothing written
    assert _tree(run_dir) == resumed and set(first) <= set(resumed)


def test_done_line_gives_the_runs_median_and_notes_settings_without_effect(data_dir, tmp_path):
    """Issue 25: "done:" showed the last step's tokens/s (1,295) where the run's median was 2,634;
    and --checkpoint.every 2 without --checkpoint.enable true saved nothing, silently."""
    o = tiny_overrides(data_dir, tmp_path, **{"training.steps": 4, "eval.every": 0})
    r = titanlite("train", *flags(o), "--checkpoint.every", "2", "--float8.recipe", "rowwise")
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("titanlite: note:")]
    assert notes == [
        "titanlite: note: --checkpoint.every 2 has no effect without --checkpoint.enable true",
        "titanlite: note: --float8.recipe rowwise has no effect without --float8.enable true",
        "titanlite: note: --eval.batches 2 has no effect without --eval.every N",
    ]
    import statistics

    records = [
        json.loads(ln)
        for ln in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [x for x in records if x.get("kind") == "train"]
    done = next(ln for ln in r.stdout.splitlines() if ln.startswith("done:"))
    speed = statistics.median(x["tokens_per_sec"] for x in train)
    mfu = statistics.median(x["mfu"] for x in train)
    assert f"median over 4 logged steps {speed:,.0f} tokens/s, MFU {100 * mfu:.2f}%" in done, done


@pytest.mark.parametrize(
    "args, first",
    [
        (["--steps", "5"], "did you mean: training.steps, profile.steps"),  # the likeliest first
        (["--lr", "0.1"], "did you mean: optimizer.lr"),
        (["--seed", "1"], "did you mean: training.seed"),
        (
            ["--data.path", "x.txt"],
            "--data.path is not used by --data.dataset pydoc: drop it, or add --data.dataset file",
        ),
    ],
)
def test_errors_use_the_command_line_spelling_and_the_closest_key_first(
    data_dir, tmp_path, args, first
):
    r = titanlite(
        "train", *flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 2})), *args
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and first in lines[0], r.stderr
    assert "dataset='file'" not in lines[0]


# ----- titanlite train --nproc-per-node N: the job from a shell, with one process's promises ----


def cli(argv: list[str], capfd) -> tuple[int, str, str]:
    """`titanlite <argv>` in this process (the CLI's own code; the ranks fork from the warm server)."""
    from titanlite.tools.cli.commands import main

    capfd.readouterr()
    code = main(argv)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, message",
    [  # issue 47: each was the line, then torchrun's 40-line ChildFailedError report and exit 1
        (["--parallel.cp", "2", "--training.seq_len", "130"], "training.seq_len=130 does not cut"),
        (["--model.n_experts", "3", "--parallel.ep", "2"], "model.n_experts=3 does not divide"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive whole number"),
        (["--nproc-per-node", "two"], "--nproc-per-node must be a positive whole number"),
    ],
)
def test_nproc_per_node_refuses_bad_input_in_one_line_before_any_rank_starts(
    data_dir, tmp_path, capfd, monkeypatch, args, message
):
    from titanlite.tools.jobs import launcher

    started = []
    monkeypatch.setattr(launcher, "_run", lambda *a, **k: started.append(a))
    nproc = [] if "--nproc-per-node" in args else ["--nproc-per-node", "2"]
    o = tiny_overrides(data_dir, tmp_path, **{"training.steps": 2})
    code, out, err = cli(["train", *nproc, *flags(o), *args], capfd)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("titanlite: error:"), err
    assert message in lines[0] and not out.strip()
    assert not started and not (tmp_path / "runs").exists()  # no rank, no run folder


def test_nproc_per_node_is_refused_inside_a_torchrun_rank(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    code, _, err = cli(["train", "--nproc-per-node", "2"], capfd)
    assert code == 2 and err.count("\n") == 1 and "drop it under torchrun" in err, err


def test_nproc_per_node_trains_says_the_layout_and_no_rank_warns(data_dir, tmp_path, capfd):
    """Issue 47: the cp run said "on 2 processes (fsdp, gloo)" and every rank printed torch's
    "Slicing a flattened dim from root mesh will be deprecated" (fsdp_mesh indexed the root mesh
    by the flattened dp_shard_cp): now the layout is named and no rank writes a warning."""
    from titanlite.tools.jobs.launcher import rank_output

    o = tiny_overrides(data_dir, tmp_path, **{"training.steps": 3, "eval.every": 0})
    code, out, err = cli(["train", "--nproc-per-node", "2", *flags(o), "--parallel.cp", "2"], capfd)
    assert code == 0, err
    assert "on 2 processes (cp=2; fsdp, gloo)" in out and "done: 3 steps" in out, out
    run_dir = tmp_path / "runs" / "t"
    assert "Warning" not in rank_output(run_dir) + err, rank_output(run_dir)
    assert (run_dir / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "args, code, shown",
    [  # a rank's own failure: its traceback once (not also echoed), one line, exit 1
        (
            ["--fault.kind", "exception", "--fault.rank", "1", "--fault.step", "2"],
            1,
            "rank 1 failed: InjectedFailure",
        ),
        # bad input only a rank can see (it reads the corpus): the ranks' one line, exit 2
        (["--data.dataset", "file:{empty}"], 2, "has only 0 tokens"),
    ],
    ids=["rank-fails", "ranks-refuse"],
)
def test_nproc_per_node_exits_with_the_jobs_status(data_dir, tmp_path, capfd, args, code, shown):
    (tmp_path / "empty.txt").write_text("")
    args = [a.format(empty=tmp_path / "empty.txt") for a in args]
    o = tiny_overrides(data_dir, tmp_path, **{"training.steps": 3, "eval.every": 0})
    got, _, err = cli(["train", "--nproc-per-node", "2", *flags(o), *args], capfd)
    errors = [ln for ln in err.splitlines() if ln.startswith("titanlite: error:")]
    assert got == code and len(errors) == 1 and shown in errors[0], err
    assert err.count("Traceback (most recent call last)") == (code == 1), err


@pytest.mark.filterwarnings("ignore:4 processes on")  # on 2 cores they take turns: fine here
def test_every_fsdp_layout_folds_its_mesh_without_a_warning(tmp_path):
    """fsdp_mesh on 4 ranks, warnings as errors: cp folded into FSDP alone (the flattened mesh kept)
    and beside dp_replicate (HSDP: a 2-D mesh of the same groups, _concatenate), the ranks as
    before, and FSDP takes each mesh for a step."""
    from conftest import run_torchrun

    script = tmp_path / "meshes.py"
    script.write_text(MESH_PROBE)
    run_torchrun(script, tmp_path, nproc=4, timeout=120)
    seen = json.loads((tmp_path / "r0.json").read_text())
    assert seen == {
        "fsdp-cp": [["dp_shard_cp"], [0, 1, 2, 3]],
        "hsdp-cp": [["dp_replicate", "dp_shard_cp"], [[0, 1], [2, 3]]],
        "hsdp": [["dp_replicate", "dp_shard"], [[0, 1], [2, 3]]],
    }
    assert all((tmp_path / f"r{r}.json").read_text() == json.dumps(seen) for r in range(4))


MESH_PROBE = """
import json, sys, warnings
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from titanlite.distributed.mesh import ParallelDims

warnings.simplefilter("error")  # torch's deprecation warning fails the rank
dist.init_process_group("gloo")
seen = {}
for name, (replicate, shard, cp) in {"fsdp-cp": (1, 2, 2), "hsdp-cp": (2, 1, 2), "hsdp": (2, 2, 1)}.items():
    dims = ParallelDims.resolve(replicate, shard, dist.get_world_size(), cp=cp)
    mesh = dims.fsdp_mesh(dims.build_mesh("cpu"))
    seen[name] = [list(mesh.mesh_dim_names), mesh.mesh.tolist()]
    layer = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    layer(torch.ones(2, 4)).sum().backward()
Path(sys.argv[1], f"r{dist.get_rank()}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
"""
