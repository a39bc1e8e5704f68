"""The command line: a real run end to end, and bad input as one line + exit status 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def titanlite(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "titanlite", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def flags(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", str(v))]


def test_train_then_export_to_hugging_face(data_dir, tmp_path):
    r = titanlite("train", "--config", "configs/debug.toml",
                  *flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 5})))
    assert r.returncode == 0, r.stderr
    assert "done: 5 steps" in r.stdout and "MFU" in r.stdout
    assert "Failed to load" not in r.stdout + r.stderr  # torchao's CPU noise stays hidden
    run_dir = tmp_path / "runs" / "t"
    r = titanlite("export-hf", str(run_dir), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    from transformers import LlamaForCausalLM
    assert LlamaForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 512


@pytest.mark.parametrize("args, message", [
    (["--training.stesp", "5"], "unknown config key 'training.stesp'"),
    (["--training.steps", "many"], "training.steps must be an integer"),
    (["--training.steps", "0"], "training.steps must be positive"),
    (["--training.batch_size", "-1"], "training.batch_size must be positive"),
    (["--training.seq_len", "4096"], "exceeds the model's maximum"),
    (["--model.vocab_size", "64"], "but the model's vocab_size is 64"),
    (["--data.dataset", "file", "--data.path", "missing.txt"], "missing.txt"),
    (["--training.device", "mps" if sys.platform != "darwin" else "cuda"], "requested"),
    (["--config", "nope.toml"], "config file 'nope.toml' does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(data_dir, tmp_path, args, message):
    base = flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 2}))
    r = titanlite("train", *base, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
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
    run_torchrun(probe, report, "train", "--config", ROOT / "configs/debug.toml",
                 *flags(tiny_overrides(data_dir, tmp_path, **{"training.steps": 2, "eval.every": 0})),
                 nproc=1, timeout=300)
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
    assert "--training.dtype float32" in r.stdout and "parameter (and optimizer state) dtype" in r.stdout  # comment above
    assert "--scheduler.decay cosine" in r.stdout and "one of cosine, linear, constant" in r.stdout
    assert "--eval.prompt 'The '" in r.stdout  # a default with a space shows it


def test_every_listed_default_is_accepted_back_as_an_override():
    """The help shows defaults as one would type them: feeding them all back changes nothing."""
    import re

    from titanlite.config import Config, load_config
    from titanlite._config_help import overrides_help
    pairs = re.findall(r"^    (--\S+) ('[^']*'|\S+)", overrides_help(), re.M)
    args = [a for flag, value in pairs for a in (flag, value.strip("'") if value.startswith("'") else value)]
    assert len(pairs) > 80 and load_config(None, args) == Config()


@pytest.mark.parametrize("typo, line", [
    ("trian", "titanlite: error: unknown command 'trian': did you mean 'train'?"),
    ("export-ckeckpoint", "titanlite: error: unknown command 'export-ckeckpoint': did you mean 'export-checkpoint'?"),
    ("zzz", "titanlite: error: unknown command 'zzz': use one of train, peaks"),
])
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
