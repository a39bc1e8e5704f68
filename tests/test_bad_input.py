"""Nothing lost, no traceback: every bad input is refused in one line, and nothing on disk changes.

Each case builds a small world in its own folder (config files, data files, a copy of a trained
run's checkpoints, a log folder), hashes every file in it, runs the bad input, and checks:
exit status != 0 (or a TitanliteError from the Python API), exactly one non-blank line on
stderr, no "Traceback", and the same hashes afterwards. Most cases call `titanlite.tools.cli.commands.main`
in this process (the CLI's code path, without a second torch import); a few run the real
`python -m titanlite.tools.cli.commands` to prove the process boundary too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

from titanlite import TitanliteError

ROOT = Path(__file__).resolve().parents[1]


def flags(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", str(v))]


def snapshot(root: Path) -> dict:
    """Every file and folder under `root`: content hashes (folders as None)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        )
    return out


# ----- one trained run with checkpoints, shared by the checkpoint cases ------------------------


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A 4-step run saving checkpoints at steps 2 and 4 (tokenizer beside them)."""
    from titanlite.tools.cli.commands import main

    home = tmp_path_factory.mktemp("trained")
    o = tiny_overrides(
        data_dir,
        home,
        **{
            "training.steps": 4,
            "eval.every": 0,
            "checkpoint.enable": True,
            "checkpoint.every": 2,
            "checkpoint.keep_latest_k": 0,
        },
    )
    assert main(["train", *flags(o)]) == 0
    return home / "runs" / "t"


# ----- the cases --------------------------------------------------------------------------------
# Each case: (id, setup(world) -> argv or a callable, kind). kind "cli": argv for cli.main;
# "api": a callable that must raise TitanliteError; "proc": argv for a real subprocess.


def _base(world: Path, data_dir: Path, **extra) -> list[str]:
    return flags(tiny_overrides(data_dir, world, **{"training.steps": 2, "eval.every": 0, **extra}))


def _ckpt_copy(world: Path, trained: Path) -> Path:
    """This case's own copy of the trained run's checkpoint folder (and tokenizer)."""
    dst = world / "ckpts"
    shutil.copytree(trained / "checkpoints", dst)
    return dst


def _damage(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(b"\x00not what was written\xff" * 8)
    elif how == "flip":  # same size, different bytes: only the CRC notices
        b = bytearray(path.read_bytes())
        for i in range(min(len(b), 64)):
            b[len(b) // 2 + i - 32] ^= 0xFF
        path.write_bytes(bytes(b))
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "delete":
        path.unlink()
    elif how == "not json":
        path.write_text("{ this is not json")
    elif how == "wrong json":
        path.write_text(json.dumps({"format": 1, "step": "four", "files": [1, 2]}))


CONFIG_VALUES = [
    ("lr-nan", ["--optimizer.lr", "nan"], "optimizer.lr"),
    ("lr-inf", ["--optimizer.lr", "inf"], "optimizer.lr"),
    ("lr-zero", ["--optimizer.lr", "0"], "optimizer.lr"),
    ("beta1-1.5", ["--optimizer.beta1", "1.5"], "optimizer.beta1"),
    ("beta2-1", ["--optimizer.beta2", "1"], "optimizer.beta2"),
    ("eps-negative", ["--optimizer.eps", "-1"], "optimizer.eps"),
    ("weight-decay-negative", ["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
    ("threads-negative", ["--training.threads", "-1"], "training.threads"),
    ("min-lr-ratio-negative", ["--scheduler.min_lr_ratio", "-1"], "scheduler.min_lr_ratio"),
    ("min-lr-ratio-2", ["--scheduler.min_lr_ratio", "2"], "scheduler.min_lr_ratio"),
    ("grad-clip-nan", ["--training.grad_clip", "nan"], "training.grad_clip"),
    ("steps-zero", ["--training.steps", "0"], "training.steps"),
    ("seed-negative", ["--training.seed", "-3"], "training.seed"),
    ("dp-shard-zero", ["--parallel.dp_shard", "0"], "parallel.dp_shard"),
    ("timeout-negative", ["--parallel.timeout_s", "-5"], "parallel.timeout_s"),
    ("device-gpu", ["--training.device", "gpu"], "training.device"),
    ("dtype-f8", ["--training.dtype", "f8"], "training.dtype"),
    ("decay-cosin", ["--scheduler.decay", "cosin"], "did you mean: cosine"),
    ("run-name-slash", ["--metrics.run_name", "a/b"], "metrics.run_name"),
    ("prompt-empty", ["--eval.prompt="], "eval.prompt"),
    ("vocab-too-small", ["--data.vocab_size", "100"], "data.vocab_size"),
    ("val-fraction-1", ["--data.val_fraction", "1"], "data.val_fraction"),
    ("fault-rank-negative", ["--fault.rank", "-1"], "fault.rank"),
    ("steps-not-a-number", ["--training.steps", "ten"], "must be an integer"),
    ("bool-maybe", ["--training.deterministic", "maybe"], "true or false"),
    ("unknown-key", ["--training.stesp", "5"], "did you mean: training.steps"),
    ("unknown-section", ["--nosuch.key", "1"], "unknown config key"),
    ("missing-value", ["--training.steps"], "needs a value"),
    ("stray-argument", ["stray"], "unexpected argument"),
    # Refused by checks beyond the config (model, device, parallel layout), still before work.
    ("tp-2-alone", ["--parallel.tp", "2"], ""),
    ("pp-2-alone", ["--parallel.pp", "2"], ""),
    ("dp-shard-2-alone", ["--parallel.dp_shard", "2"], ""),
    ("cp-2-alone", ["--parallel.cp", "2"], "cp"),
    ("cp-layout-typo", ["--parallel.cp_layout", "zigzg"], "did you mean: zigzag"),
    ("cp-method-typo", ["--parallel.cp_method", "rings"], "did you mean: ring"),
    ("ep-2-alone", ["--parallel.ep", "2"], "ep"),
    (
        "k-over-experts",
        ["--model.n_experts", "4", "--model.experts_per_token", "5"],
        "experts_per_token",
    ),
    ("one-expert", ["--model.n_experts", "1"], "at least 2"),
    ("moe-balance-typo", ["--model.n_experts", "4", "--model.moe_balance", "aux_fre"], "aux_free"),
    ("moe-every-beyond", ["--model.n_experts", "4", "--model.moe_every", "9"], "moe_every"),
    ("seq-len-beyond-model", ["--training.seq_len", "4096"], "maximum"),
    # the optimizers (issue 48): a misspelt name, and an option of one optimizer given to another
    ("optimizer-typo", ["--optimizer.name", "adafacter"], "did you mean: adafactor"),
    ("muon-key-on-adamw", ["--optimizer.muon_momentum", "0.9"], "is Muon's"),
    (
        "adam-key-on-adafactor",
        ["--optimizer.name", "adafactor", "--optimizer.beta2", "0.99"],
        "optimizer.beta2 is AdamW's",
    ),
    ("muon-ns-steps-100", ["--optimizer.muon_ns_steps", "100"], "optimizer.muon_ns_steps"),
    ("attention-typo", ["--model.attention", "flx"], "did you mean: flex"),
    # torch 2.13 has no FlexAttention backward on the CPU (a later torch that has one trains)
    ("flex-without-a-backward-here", ["--model.attention", "flex"], "FlexAttention backward"),
    ("heads-not-dividing", ["--model.n_heads", "5"], ""),
    # Fault tolerance (torchft): what a replica group cannot be, refused before the lighthouse.
    (
        "ft-replica-id-outside",
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
        + ["--fault_tolerance.replica_id", "2"],
        "fault_tolerance.replica_id=2 is outside the 2 replica group(s)",
    ),
    ("ft-diloco-h-zero", ["--fault_tolerance.sync_steps", "0"], "fault_tolerance.sync_steps"),
    (
        "ft-layout-moe-aux-free",  # a router bias each group would move by its own tokens
        ["--fault_tolerance.enable", "--model.n_experts", "4"],
        "cannot replicate a mixture of experts balanced aux_free",
    ),
]


def config_file_case(world: Path, kind: str) -> list[str]:
    f = world / "c.toml"
    if kind == "bad-toml":
        f.write_text("[training\nsteps = 1\n")
    elif kind == "missing":
        f = world / "nope.toml"
    elif kind == "not-a-table":
        f.write_text("training = 3\n")
    elif kind == "non-utf8":
        f.write_bytes(b"[training]\nsteps = 1 # \xff\xfe\n")
    elif kind == "bad-value":
        f.write_text("[optimizer]\nbeta1 = 1.5\n")
    elif kind == "wrong-type":
        f.write_text('[training]\nsteps = "many"\n')
    elif kind == "unknown-key":
        f.write_text("[training]\nstesp = 3\n")
    elif kind == "a-folder":
        f = world / "folder.toml"
        f.mkdir()
    return ["--config", str(f)]


CONFIG_FILES = [
    "bad-toml",
    "missing",
    "not-a-table",
    "non-utf8",
    "bad-value",
    "wrong-type",
    "unknown-key",
    "a-folder",
]


def data_file_case(world: Path, kind: str) -> list[str]:
    f = world / "corpus.txt"
    if kind == "empty":
        f.write_text("")
    elif kind == "whitespace":
        f.write_text("  \n\n\t \n")
    elif kind == "binary":
        f.write_bytes(bytes(range(256)) * 64)
    elif kind == "non-utf8":
        f.write_bytes(("Some text, then a Latin-1 byte: caf\xe9. " * 200).encode("latin-1"))
    elif kind == "tiny":
        f.write_text("hello world\n")
    elif kind == "missing":
        f = world / "nope.txt"
    elif kind == "empty-folder":
        f = world / "corpus"
        f.mkdir()
    # A data cache of this case's own, so a write into it shows up in the snapshot.
    return ["--data.dataset", f"file:{f}", "--data.data_dir", str(world / "cache")]


DATA_FILES = ["empty", "whitespace", "binary", "non-utf8", "tiny", "missing", "empty-folder"]


def path_case(world: Path, kind: str) -> list[str]:
    blocker = world / "a-file"
    blocker.write_text("precious\n")
    if kind == "log-dir-under-file":
        return ["--metrics.log_dir", str(blocker / "runs")]
    if kind == "log-dir-is-file":
        return ["--metrics.log_dir", str(blocker)]
    if kind == "checkpoint-folder-under-file":
        return ["--checkpoint.enable", "--checkpoint.folder", str(blocker / "ckpt")]
    if kind == "load-missing":
        return ["--checkpoint.load", str(world / "no-such-step")]
    raise AssertionError(kind)


PATHS = ["log-dir-under-file", "log-dir-is-file", "checkpoint-folder-under-file", "load-missing"]

# (case, file in the step folder, damage, verify mode)
DAMAGE = [
    ("record-not-json", "titanlite.json", "not json", "crc"),
    ("record-wrong-json", "titanlite.json", "wrong json", "crc"),
    ("metadata-garbage", ".metadata", "garbage", "crc"),
    ("metadata-garbage-size-only", ".metadata", "garbage", "size"),
    ("metadata-flipped-size-only", ".metadata", "flip", "size"),
    ("metadata-missing", ".metadata", "delete", "crc"),
    ("shard-truncated", "__0_0.distcp", "truncate", "crc"),
    ("shard-missing", "__0_0.distcp", "delete", "crc"),
    ("shard-flipped", "__0_0.distcp", "flip", "crc"),
]
# Not a case: flipped bytes inside a shard's tensor data with --checkpoint.verify size. Nothing
# but the CRC can see those (the values are just different numbers), which is why crc is the
# default; "size" trades that check for speed.
OTHER_MODEL = [
    ("other-dim", ["--model.dim", "32"]),
    ("other-layers", ["--model.n_layers", "3"]),
    ("other-vocab", ["--data.vocab_size", "600"]),
]


def run_cli(argv: list[str], capfd) -> tuple[int, str]:
    from titanlite.tools.cli.commands import main

    capfd.readouterr()
    code = main(argv)
    return code, capfd.readouterr().err


def check(code, err: str, message: str = "") -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("titanlite: error:"), err
    assert message in lines[0], (message, lines[0])


@pytest.fixture
def world(tmp_path):
    w = tmp_path / "world"
    w.mkdir()
    return w


@pytest.mark.parametrize(
    "argv, message", [c[1:] for c in CONFIG_VALUES], ids=[c[0] for c in CONFIG_VALUES]
)
def test_bad_config_values_on_the_command_line(world, data_dir, capfd, argv, message):
    base = _base(world, data_dir)
    before = snapshot(world)
    code, err = run_cli(["train", *base, *argv], capfd)
    check(code, err, message)
    assert snapshot(world) == before


@pytest.mark.parametrize("kind", CONFIG_FILES)
def test_bad_config_files(world, data_dir, capfd, kind):
    argv = config_file_case(world, kind)
    before = snapshot(world)
    code, err = run_cli(["train", *argv, *_base(world, data_dir)], capfd)
    check(code, err)
    assert snapshot(world) == before


@pytest.mark.parametrize("kind", DATA_FILES)
def test_bad_data_files(world, data_dir, capfd, kind):
    argv = data_file_case(world, kind)
    before = snapshot(world)
    code, err = run_cli(["train", *_base(world, data_dir), *argv], capfd)
    check(code, err)
    after = snapshot(world)
    # The tokenizer trained on the file may be cached (keyed by the file's content) before the
    # corpus proves too small: a new cache entry, never a change to what was there.
    assert {k: after.get(k) for k in before} == before
    assert all(k.startswith("cache") for k in set(after) - set(before)), set(after) - set(before)


_path_outcomes: dict = {}


def _path_outcome(kind, tmp_path_factory, data_dir, capfd):
    if kind not in _path_outcomes:
        world = tmp_path_factory.mktemp(f"path-{kind}")
        argv = path_case(world, kind)
        before = snapshot(world)
        code, err = run_cli(["train", *_base(world, data_dir), *argv], capfd)
        _path_outcomes[kind] = (code, err, before, snapshot(world))
    return _path_outcomes[kind]


@pytest.mark.parametrize("kind", PATHS)
def test_bad_output_paths(kind, tmp_path_factory, data_dir, capfd):
    code, err, _, _ = _path_outcome(kind, tmp_path_factory, data_dir, capfd)
    check(code, err)


@pytest.mark.parametrize("kind", PATHS)
def test_bad_output_paths_leave_the_disk_unchanged(kind, tmp_path_factory, data_dir, capfd):
    _, _, before, after = _path_outcome(kind, tmp_path_factory, data_dir, capfd)
    assert after == before


# ----- damaged checkpoints: one line each; the "disk unchanged" half in a test of its own -----
_outcomes: dict = {}


def _damaged_outcome(case, trained, data_dir, tmp_path_factory, capfd):
    """Run a damaged-checkpoint case once; its result feeds both tests below."""
    if case in _outcomes:
        return _outcomes[case]
    name, file, how, verify = next(d for d in DAMAGE if d[0] == case)
    world = tmp_path_factory.mktemp(f"damaged-{case}")
    ckpts = _ckpt_copy(world, trained)
    _damage(ckpts / "step-00000004" / file, how)
    # Resume in a run of its own, whose checkpoint folder is the damaged copy: the newest
    # checkpoint (step 4) is damaged; refusing beats silently training from step 2.
    argv = [
        "train",
        *_base(world, data_dir, **{"training.steps": 6}),
        "--checkpoint.enable",
        "--checkpoint.folder",
        str(ckpts),
        "--checkpoint.verify",
        verify,
    ]
    before = snapshot(world)
    code, err = run_cli(argv, capfd)
    _outcomes[case] = (code, err, before, snapshot(world))
    return _outcomes[case]


@pytest.mark.parametrize("case", [d[0] for d in DAMAGE])
def test_damaged_checkpoints_are_refused_in_one_line(
    case, trained, data_dir, tmp_path_factory, capfd
):
    code, err, _, _ = _damaged_outcome(case, trained, data_dir, tmp_path_factory, capfd)
    check(code, err, "damaged")
    assert "delete that step folder" in err


@pytest.mark.parametrize("case", [d[0] for d in DAMAGE])
def test_damaged_checkpoints_leave_the_disk_unchanged(
    case, trained, data_dir, tmp_path_factory, capfd
):
    _, _, before, after = _damaged_outcome(case, trained, data_dir, tmp_path_factory, capfd)
    assert after == before


@pytest.mark.parametrize("case, argv", OTHER_MODEL, ids=[c[0] for c in OTHER_MODEL])
def test_checkpoint_of_another_model_is_refused(case, argv, trained, world, data_dir, capfd):
    ckpt = _ckpt_copy(world, trained) / "step-00000004"
    code, err = run_cli(
        ["train", *_base(world, data_dir), *argv, "--checkpoint.load", str(ckpt)], capfd
    )
    check(code, err, "")
    assert "different model" in err or "does not fit" in err


@pytest.mark.parametrize(
    "name, patch, message",
    [
        # a device torchao's quantized states do not run on (here the CPU, declared one of them)
        ("adamw8bit", ("QUANTIZED_DEVICES", ("cuda",)), "run on cuda only, not on cpu"),
        # a model part with no 2-D hidden matrix for Muon to take
        ("muon", ("hidden_matrices", lambda parts: []), "this model part has none"),
    ],
)
def test_an_optimizer_that_cannot_build_here_is_refused(
    name, patch, message, world, data_dir, capfd, monkeypatch
):
    import titanlite.optimizer

    monkeypatch.setattr(titanlite.optimizer, *patch)
    before = snapshot(world)
    code, err = run_cli(["train", *_base(world, data_dir), "--optimizer.name", name], capfd)
    check(code, err, message)
    assert code == 2 and snapshot(world) == before


def test_checkpoint_of_another_optimizer_is_refused(trained, world, data_dir, capfd):
    ckpt = _ckpt_copy(world, trained) / "step-00000004"
    before = snapshot(world)
    argv = ["--optimizer.name", "muon", "--checkpoint.load", str(ckpt)]
    code, err = run_cli(["train", *_base(world, data_dir), *argv], capfd)
    check(code, err, "holds adamw's optimizer state, and this run asks for --optimizer.name muon")
    assert snapshot(world) == before


@pytest.mark.parametrize(
    "case", ["record-not-json", "metadata-garbage", "shard-truncated", "shard-flipped"]
)
def test_export_of_a_damaged_checkpoint(case, trained, world, capfd):
    _, file, how, _ = next(d for d in DAMAGE if d[0] == case)
    step = _ckpt_copy(world, trained) / "step-00000004"
    _damage(step / file, how)
    before = snapshot(world)
    code, err = run_cli(
        ["export-checkpoint", str(step), str(world / "out.pt"), "--format", "torch"], capfd
    )
    check(code, err, "damaged")
    assert snapshot(world) == before


@pytest.mark.parametrize(
    "kind", ["target-is-folder", "target-under-file", "hf-under-file", "hf-run-under-file"]
)
def test_bad_export_targets(kind, trained, world, capfd):
    step = _ckpt_copy(world, trained) / "step-00000004"
    blocker = world / "a-file"
    blocker.write_text("precious\n")
    (world / "existing").mkdir()
    argv = {
        "target-is-folder": [
            "export-checkpoint",
            str(step),
            str(world / "existing"),
            "--format",
            "torch",
        ],
        "target-under-file": [
            "export-checkpoint",
            str(step),
            str(blocker / "m.pt"),
            "--format",
            "torch",
        ],
        "hf-under-file": ["export-checkpoint", str(step), str(blocker / "hf")],
        "hf-run-under-file": ["export-hf", str(trained), str(blocker / "hf")],
    }[kind]
    before = snapshot(world)
    code, err = run_cli(argv, capfd)
    check(code, err, str(world))
    assert snapshot(world) == before


# ----- the Python API: the same refusals as TitanliteError, nothing printed --------------------


def _api_cases():
    from titanlite.config import Config, load_config

    def cfg_with(section, key, value):
        def go():
            c = Config()
            setattr(getattr(c, section), key, value)
            c.validate()

        return go

    def trainer_with(**o):
        def go(world, data_dir):
            from titanlite.train import Trainer

            Trainer(load_config(None, tiny_overrides(data_dir, world, **o)))

        return go

    return {
        "config-lr-nan": cfg_with("optimizer", "lr", float("nan")),
        "config-steps-str": cfg_with("training", "steps", "5"),
        "config-betas-1": cfg_with("optimizer", "beta2", 1.0),
        "config-threads-0": cfg_with("training", "threads", 0),
        "config-bool-int": cfg_with("compile", "enable", 1),
        "load-config-dict": lambda: load_config(None, {"scheduler.min_lr_ratio": -1}),
        "load-config-unknown": lambda: load_config(None, {"optimizer.learning_rate": 1}),
        "trainer-tp-alone": trainer_with(**{"parallel.tp": 2}),
        "trainer-missing-data": trainer_with(**{"data.dataset": "file:/no/such/file.txt"}),
    }


API_CASES = [
    "config-lr-nan",
    "config-steps-str",
    "config-betas-1",
    "config-threads-0",
    "config-bool-int",
    "load-config-dict",
    "load-config-unknown",
    "trainer-tp-alone",
    "trainer-missing-data",
]


@pytest.mark.parametrize("case", API_CASES)
def test_python_api_refuses_in_one_line(case, world, data_dir, capfd):
    go = _api_cases()[case]
    before = snapshot(world)
    capfd.readouterr()
    with pytest.raises(TitanliteError) as e:
        go(world, data_dir) if case.startswith("trainer") else go()
    assert "\n" not in str(e.value)
    assert not [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert snapshot(world) == before


@pytest.mark.parametrize("lighthouse", ["unset", "unreachable"])
def test_fault_tolerance_without_a_reachable_lighthouse(
    lighthouse, world, data_dir, capfd, monkeypatch
):
    """torchft's lighthouse (TORCHFT_LIGHTHOUSE) not set, or nothing answering there: one line
    naming the address after a bounded wait (TORCHFT_CONNECT_TIMEOUT_SEC), exit 2, nothing written."""
    pytest.importorskip("torchft")
    import socket

    with socket.socket() as s:  # a port that was free: closed again, nothing listens there
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    if lighthouse == "unset":
        monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    else:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "1")
    base = _base(world, data_dir, **{"fault_tolerance.enable": "true"})
    before = snapshot(world)
    code, err = run_cli(["train", *base], capfd)
    check(code, err, "TORCHFT_LIGHTHOUSE is not set" if lighthouse == "unset" else address)
    assert code == 2 and snapshot(world) == before


# ----- the notebook launcher: pre-flight checks refuse before any process starts --------------

LAUNCH_CASES = [
    ("nproc-zero", 0, {}),
    ("nproc-str", "2", {}),
    ("dp-shard-3-of-2", 2, {"parallel.dp_shard": 3}),
    ("tp-3-of-2", 2, {"parallel.tp": 3, "parallel.dp_shard": 1}),
    ("pp-4-of-2-layers", 4, {"parallel.pp": 4, "parallel.dp_shard": 1}),
    ("replicate-2-shard-2-of-2", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
    ("cp-3-of-2", 2, {"parallel.cp": 3}),
    ("cp-not-cutting-the-sequence", 2, {"parallel.cp": 2, "training.seq_len": 30}),
    ("document-mask-on-the-ring", 2, {"parallel.cp": 2, "data.document_mask": True}),
    ("ep-without-experts", 2, {"parallel.ep": 2}),
    ("experts-not-dividing-ep", 2, {"model.n_experts": 3, "parallel.ep": 2}),
    ("experts-with-pp", 2, {"model.n_experts": 4, "parallel.pp": 2, "parallel.dp_shard": 1}),
    ("experts-with-tp-and-ep", 4, {"model.n_experts": 4, "parallel.tp": 2, "parallel.ep": 2}),
    (
        "expert-width-not-dividing-tp",
        2,
        {"model.n_experts": 4, "model.expert_hidden_dim": 33, "parallel.tp": 2},
    ),
    ("fault-rank-beyond", 2, {"fault.kind": "exception", "fault.rank": 5}),
    ("bad-value", 2, {"optimizer.beta1": 1.5}),
    ("log-dir-under-file", 2, {"metrics.log_dir": "a-file/runs"}),
]


@pytest.mark.parametrize(
    "nproc, overrides", [c[1:] for c in LAUNCH_CASES], ids=[c[0] for c in LAUNCH_CASES]
)
def test_launcher_refuses_before_starting_processes(nproc, overrides, world, data_dir, capfd):
    from titanlite.config import load_config
    from titanlite.tools.jobs import launcher

    (world / "a-file").write_text("precious\n")
    o = tiny_overrides(data_dir, world)
    o.update({k: (str(world / v) if k == "metrics.log_dir" else v) for k, v in overrides.items()})
    before = snapshot(world)
    capfd.readouterr()
    with pytest.raises(TitanliteError) as e:
        launcher.launch(
            load_config(None, {k: v for k, v in o.items() if k not in overrides}),
            nproc=nproc,
            overrides={k: o[k] for k in overrides},
        )
    assert "\n" not in str(e.value)
    assert not [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert snapshot(world) == before


# ----- the real process boundary: a few cases as `python -m titanlite.tools.cli.commands` ---------------------


def titanlite(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "titanlite.tools.cli.commands", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_document_mask_over_a_tokenizer_without_an_end_of_document_token(world, data_dir, capfd):
    """A document mask needs the token documents end with: a tokenizer folder that names none
    (a bare tokenizer.json gets titanlite's <|eos|>) is refused in one line (data/tokenizer.py's
    load_tokenizer, before anything is written)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (world / "no-eos").mkdir()
    tok.save(str(world / "no-eos" / "tokenizer.json"))
    argv = ["--data.tokenizer", str(world / "no-eos"), "--data.document_mask", "true"]
    before = snapshot(world)
    code, err = run_cli(["train", *_base(world, data_dir), *argv], capfd)
    check(code, err, "no eos token")
    assert code == 2 and snapshot(world) == before


@pytest.mark.parametrize(
    "kind", ["bad-value", "bad-toml", "damaged-checkpoint", "export-to-folder", "bad-layout-on-2"]
)
def test_as_a_real_process(kind, world, data_dir, trained):
    base = _base(world, data_dir)
    if kind == "bad-value":
        argv = ["train", *base, "--optimizer.lr", "nan"]
    elif kind == "bad-layout-on-2":  # issue 47: torchrun added its ChildFailedError report, exit 1
        argv = ["train", "--nproc-per-node", "2", *base, "--parallel.cp", "2"]
        argv += ["--training.seq_len", "130"]
    elif kind == "bad-toml":
        argv = ["train", *config_file_case(world, "bad-toml"), *base]
    elif kind == "damaged-checkpoint":
        step = _ckpt_copy(world, trained) / "step-00000004"
        _damage(step / ".metadata", "garbage")
        argv = ["export-checkpoint", str(step), str(world / "out"), "--format", "torch"]
    else:
        step = _ckpt_copy(world, trained) / "step-00000004"
        (world / "out").mkdir()
        argv = ["export-checkpoint", str(step), str(world / "out"), "--format", "torch"]
    before = snapshot(world)
    r = titanlite(*argv)
    assert r.returncode == 2, r.stderr
    check(r.returncode, r.stderr)
    assert snapshot(world) == before


# ----- several ranks, one line per distinct error ---------------------------------------------


def test_launcher_shows_each_distinct_rank_error_once(tmp_path, capfd):
    """Both ranks refuse the same bad input (only the first prints it) and rank 1 also hits an
    error of its own: the launcher raises the first and prints the other, one line each."""
    from titanlite.tools.jobs.launcher import _failure

    blocks = [
        f"[{i}]:\n  time      : 2026-11-22_07:32:01\n  rank      : {r} (local_rank: {r})\n"
        f"  exitcode  : 2 (pid: 1)\n  error_file: <N/A>\n"
        for i, r in enumerate((1, 0))
    ]
    (tmp_path / "launcher.log").write_text(
        f"Failures:\n{blocks[1]}----\nRoot Cause (first observed failure):\n{blocks[0]}====\n"
    )
    for attempt, lines in (
        (0, {0: ["old attempt"], 1: []}),
        (
            1,
            {
                0: ["data file x.txt is empty: add text"],
                1: ["data file x.txt is empty: add text", "rank 1 only"],
            },
        ),
    ):
        for rank, errors in lines.items():
            log = tmp_path / "logs" / "job" / f"attempt_{attempt}" / str(rank) / "stderr.log"
            log.parent.mkdir(parents=True)
            log.write_text("".join(f"noise\ntitanlite: error: {e}\n" for e in errors))
    capfd.readouterr()
    error = _failure(tmp_path, 1, "")
    assert str(error) == "data file x.txt is empty: add text"
    assert capfd.readouterr().err == "titanlite: error: rank 1 only\n"


def test_ranks_of_one_torchrun_job_print_a_shared_error_once(tmp_path, monkeypatch, capfd):
    """cli._report under torchrun: the first rank to report a message prints it (one write,
    newline included); the same message from another rank of the same job is not repeated,
    a different one is, and another job (or attempt) prints its own."""
    from titanlite.tools.cli import commands as cli

    monkeypatch.setenv("TITANLITE_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id
    for rank, message in ((0, "bad value"), (1, "bad value"), (1, "rank 1's own")):
        monkeypatch.setenv("RANK", str(rank))
        assert cli._report(message, 2) == 2
    assert capfd.readouterr().err == "titanlite: error: bad value\ntitanlite: error: rank 1's own\n"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the next attempt reports again
    cli._report("bad value", 2)
    assert capfd.readouterr().err == "titanlite: error: bad value\n"


@pytest.mark.slow
def test_launcher_job_whose_ranks_refuse_the_same_data_file(world, data_dir, capfd):
    """Both ranks of a real job refuse an empty data file (not checked before start-up: only a
    rank reads the corpus). The notebook sees one line, and the stderr stays empty."""
    from titanlite.config import load_config
    from titanlite.tools.jobs import launcher

    empty = world / "empty.txt"
    empty.write_text("")
    cfg = load_config(None, tiny_overrides(data_dir, world, **{"data.dataset": f"file:{empty}"}))
    capfd.readouterr()
    with pytest.raises(TitanliteError) as e:
        launcher.launch(cfg, nproc=2, timeout_s=120)
    assert "\n" not in str(e.value) and "file-empty-txt" in str(e.value), str(e.value)
    assert not [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    errors = launcher._reported_errors(world / "runs" / "t")
    assert len(errors) == 1, errors  # printed once, by the first rank to get there
