"""`titanlite` command line.

    titanlite train --config configs/debug.toml --training.steps 50
    titanlite train --nproc-per-node 2 --config configs/debug.toml --parallel.cp 2   # 2 ranks
    titanlite peaks [--device cpu] [--refresh]
    titanlite export-hf runs/<name> out/hf-model
    titanlite export-checkpoint runs/<name>/checkpoints/step-00000100 out/hf-model [--format torch]
    titanlite doctor [--smoke] [--device auto]   # self-check: runs/doctor/report.md

Bad input ends in one line on stderr, never a traceback wall. Exit status:
    0    done
    1    a failure while running (a bug, a dead peer, a full disk): the error, with a traceback
         unless it is a disk/OS error on a known path
    2    bad input: a config value, a data file, a checkpoint, a path (one line: problem + fix)
    130  interrupted (Ctrl-C)
`train --nproc-per-node N` keeps these for a job of N ranks: it checks the input here, before any
rank starts (bad input: one line, exit 2), starts the ranks (tools/jobs/launcher.py), shows their
output, and exits as one process would have. Under torchrun every rank that hits an error reports
it, but an error several ranks of a job hit alike (bad input is the same everywhere) is printed
once, by the first rank to get there; torchrun itself then adds its ChildFailedError report and
exits 1.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import hashlib
import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

from ...errors import DISK_FIX, TitanliteError, disk_error
from .config_help import overrides_help, without_effect


def _train(args, overrides: list[str]) -> None:
    import torch

    from ...config import load_config
    from ...models.llama import Transformer
    from ...train import Trainer
    from ...weights import save_weights
    from ..formats.corpora import fetch_for
    from ..formats.hf_start import HuggingFaceStart
    from ..measure.goodput import Goodput
    from ..measure.profiling import StepProfiler
    from ..measure.stragglers import Stragglers
    from ..probe.datasheet import datasheet_peak
    from ..probe.matmul_peak import MatmulPeaks

    cfg = load_config(args.config, overrides)
    nproc = _processes(args.nproc_per_node)
    if nproc > 1:  # this process only checks, starts the ranks and shows what they print
        from ..jobs.launcher import launch

        fetch_for(cfg)  # once, here, not by each rank
        launch(cfg, nproc, echo=True)  # refuses bad input before any rank starts
        return
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one copy of each note
        for line in without_effect(cfg):
            print(f"titanlite: note: {line}")
    fetch_for(cfg)  # a remote corpus (tinyshakespeare, hf:...) is fetched once, before training
    # The tools a run gets from the command line: the measured matmul peak MFU divides by, vendor
    # peaks for MFU against the datasheet, and the published model --checkpoint.initial_load_path names.
    trainer = Trainer(
        cfg,
        datasheet=datasheet_peak,
        start_from=HuggingFaceStart.from_config(cfg),
        peaks=MatmulPeaks(),
    )
    try:
        say = print if trainer.dist.is_main else (lambda *a, **k: None)
        world = trainer.dist.world_size
        # the layout (e.g. "cp=2"), then what shards or replicates the weights (fsdp, ddp, ...)
        on = (
            f"{world} processes ({trainer.dims.describe()}; {trainer.dims.strategy}, "
            f"{trainer.dist.backend})"
            if world > 1
            else str(trainer.device)
        )
        params = f"{trainer.num_params / 1e6:.2f}M parameters"
        if trainer.model_args.moe is not None:  # FLOPs and MFU count what a token uses
            with torch.device("meta"):  # a weightless copy, to count
                active = Transformer(trainer.model_args).active_params()
            params += f" ({active / 1e6:.2f}M active per token)"
        say(
            f"titanlite: {cfg.model.preset} model, {params}, "
            f"on {on} ({trainer.dtype}); MFU against {trainer.peak.label}"
        )
        # The tools a run from the command line gets: the profiler when [profile] asks, goodput,
        # and straggler detection when there are ranks to compare.
        watchers = (
            ([StepProfiler] if cfg.profile.steps else [])
            + [Goodput]
            + ([Stragglers] if world > 1 else [])
        )
        history = trainer.fit(watchers=watchers)
        save_weights(
            trainer.model_parts,
            trainer.model_args,
            trainer.dtype,
            trainer.tokenizer,
            history.run_dir,
            pp=trainer.dims.pp,
            is_main=trainer.dist.is_main,
        )
        trainer.close()  # save_weights ended every rank's talking before rank 0 began writing
    finally:  # after a failure: leave at once (a peer may be gone, a barrier would hang)
        trainer.close()
    if not trainer.dist.is_main:
        return
    if not history.train:
        print(
            f"nothing to train: {history.resumed_from} is already at step {trainer.step} of "
            f"{cfg.training.steps}; raise --training.steps to go on"
        )
        return
    last = history.train[-1]
    val = f", val loss {history.val[-1]['val_loss']:.3f}" if history.val else ""
    # The run's median step, not the last one: one step is at the mercy of whatever else ran then.
    speed = statistics.median(r["tokens_per_sec"] for r in history.train)
    mfu = statistics.median(r["mfu"] for r in history.train)
    print(
        f"done: {trainer.step} steps, loss {history.train[0]['loss']:.3f} → {last['loss']:.3f}{val}, "
        f"median over {len(history.train)} logged steps {speed:,.0f} tokens/s, MFU {100 * mfu:.2f}%"
    )
    if history.resumed_from is not None or cfg.checkpoint.enable:
        from ..measure.goodput import summarize

        g = summarize(history.run_dir)
        print(
            f"goodput: {100 * g['goodput']:.1f}% of {g['wall_s']:.1f} s wall time over "
            f"{g['attempts']} attempt(s) (lost {g['lost_s']:.1f} s to recomputation, "
            f"{g['checkpoint_s']:.1f} s to checkpoints, {g['restore_s']:.1f} s to restores)"
        )
    print(f"sample: {history.samples[trainer.step]!r}")
    print(f"metrics: {history.run_dir / 'metrics.jsonl'}")


def _processes(value: str | None) -> int:
    """--nproc-per-node as a number of ranks to start (1: none, this process trains)."""
    if value is None:
        return 1
    if "RANK" in os.environ:
        raise TitanliteError(
            "--nproc-per-node starts the ranks itself: drop it under torchrun, whose own "
            "--nproc-per-node already started this one"
        )
    if not value.isdigit() or int(value) < 1:
        raise TitanliteError(
            f"--nproc-per-node must be a positive whole number of processes, got '{value}': "
            f"e.g. --nproc-per-node 2"
        )
    return int(value)


def _peaks(args, _overrides) -> None:
    import torch

    from ... import hardware
    from ..probe import datasheet, matmul_peak

    device = hardware.detect_device(args.device)
    print(f"device: {hardware.device_name(device)}")
    for name in ("float32", "bfloat16", "float16"):
        try:
            dtype = hardware.resolve_dtype(name, device)
        except TitanliteError as e:
            print(f"  {name:9s} unsupported here: {e}")
            continue
        peak = matmul_peak.matmul_peak(device, dtype, refresh=args.refresh)
        sheet = datasheet.datasheet_peak(device, dtype)
        extra = f"   ({sheet.label})" if sheet else ""
        print(f"  {name:9s} {peak.flops / 1e12:10.4f} TFLOP/s  {peak.label}{extra}")
    del torch


def _export_hf(args, _overrides) -> None:
    from ...weights import load_weights
    from ..formats.export import check_not_into_work, to_hf

    check_not_into_work(args.out_dir, "export folder", source=args.run_dir)  # before the load
    model, tokenizer = load_weights(args.run_dir)
    out = to_hf(model, args.out_dir, tokenizer=tokenizer)
    # What was written, as transformers will read it: a model with experts is a MixtralForCausalLM.
    (written,) = json.loads((out / "config.json").read_text())["architectures"]
    print(f"wrote a Hugging Face {written} to {out}")


def _export_checkpoint(args, _overrides) -> None:
    from ..formats.export import export_hf, export_torch

    if args.format == "hf":
        out = export_hf(args.checkpoint, args.out)
    else:
        out = export_torch(args.checkpoint, args.out, full=args.format == "torch-full")
    print(f"wrote {out}")


def _doctor(args, _overrides) -> None:
    from ... import is_smoke
    from .doctor import run_doctor

    smoke = args.smoke or is_smoke()
    print(f"titanlite doctor{' (smoke scale)' if smoke else ''}: checking this machine ...")
    checks, report = run_doctor(args.device, smoke=smoke, out=args.out)
    failed = [c.name for c in checks if c.status == "fail"]
    print(
        f"{'FAILED: ' + ', '.join(failed) if failed else 'nothing failed'}; report: {report} "
        f"(attach it to a bug report)"
    )
    if failed:
        raise SystemExit(1)


def _progress(args, _overrides) -> None:
    from ..course.editions import progress_command

    progress_command(
        args.folder, saved=args.saved, only=args.only, full=args.full, checks=args.checks
    )


def main(argv: list[str] | None = None) -> int:
    from ..display.notebook import quiet_third_party

    quiet_third_party()  # before anything imports torchao: its "Failed to load" lines are noise
    parser = argparse.ArgumentParser(prog="titanlite", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="train a model; any --section.key value overrides the config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="titanlite train [-h] [--config TOML] [--nproc-per-node N] [--section.key VALUE ...]",
        description=textwrap.fill(
            "Train a model. Settings start from the defaults below, then the "
            "--config file, then --section.key VALUE overrides (e.g. --training.steps "
            "50); every key is checked before any work starts.",
            88,
        ),
        epilog=overrides_help(),
    )
    p.add_argument(
        "--config",
        metavar="TOML",
        help="a TOML file with [section] tables of the keys below (examples in configs/)",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        metavar="N",
        help="train on N processes of this machine, started here (as torchrun --nproc-per-node "
        "N would start them, but bad input is one line and exit 2, before any starts)",
    )
    p.set_defaults(func=_train)
    p = sub.add_parser("peaks", help="measure (and cache) this device's matmul peaks per dtype")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--refresh", action="store_true", help="measure again instead of using the cache"
    )
    p.set_defaults(func=_peaks)
    p = sub.add_parser(
        "export-hf", help="export a finished run's model to a Hugging Face directory"
    )
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.set_defaults(func=_export_hf)
    sentence = (
        "Write a distributed checkpoint (runs/<name>/checkpoints/step-N) out as a Hugging "
        "Face directory or as a single torch.save file."
    )
    p = sub.add_parser(
        "export-checkpoint", help=sentence[0].lower() + sentence[1:-1], description=sentence
    )
    p.add_argument("checkpoint", help="a committed checkpoint's step-N folder")
    p.add_argument("out", help="where to write it: a folder (hf) or a file (torch, torch-full)")
    p.add_argument(
        "--format",
        choices=("hf", "torch", "torch-full"),
        default="hf",
        help="hf: LlamaForCausalLM directory; torch: the weights in one torch.save "
        "file; torch-full: the whole training state in one file",
    )
    p.set_defaults(func=_export_checkpoint)

    p = sub.add_parser(
        "doctor",
        help="self-check this machine: peaks, attention kernel, precisions, "
        "compile, FP8, two processes; writes runs/doctor/report.md",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--smoke", action="store_true", help="shrink every check (also TITANLITE_SMOKE=1)"
    )
    p.add_argument("--out", default="runs/doctor", help="where report.md and report.json go")
    p.set_defaults(func=_doctor)

    p = sub.add_parser(
        "progress",
        help="which exercises pass: runs each notebook with exercises "
        "(smoke scale) and prints notebook × exercise → pass / fail / not attempted",
    )
    p.add_argument(
        "folder",
        nargs="?",
        default="notebooks",
        help="notebooks/, a student's copy, or one notebook",
    )
    p.add_argument(
        "--saved",
        action="store_true",
        help="read the outputs the notebooks were saved "
        "with instead of running them (fast; as current as the student's last run)",
    )
    p.add_argument("--only", help="notebooks whose name starts with this, e.g. 07")
    p.add_argument("--full", action="store_true", help="run at full scale, not smoke scale")
    p.add_argument(
        "--checks",
        action="store_true",
        help="run only the exercise cells (each answer, its "
        "check, and the notebook's imports): a whole class folder in minutes",
    )
    p.set_defaults(func=_progress)

    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in sub.choices:
        # argparse would print the usage and "invalid choice: ... (choose from ...)": two lines
        # that bury the likely typo. One line, the nearest command, exit 2 as argparse does.
        near = difflib.get_close_matches(command, list(sub.choices), n=1, cutoff=0.5)
        hint = f": did you mean '{near[0]}'?" if near else f": use one of {', '.join(sub.choices)}"
        return _report(f"unknown command '{command}'{hint}", 2)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.func(args, rest)
    except TitanliteError as e:  # one line; bad input exits 2, unless the error carries its status
        # (WriteFailed: 1 for a disk that filled up; JobFailed: the ranks' job, as one process)
        return _report(str(e), getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        return _report("interrupted", 130)
    except Exception as e:
        err = disk_error(e)
        if err is not None and err.errno in (errno.ENOSPC, errno.EDQUOT):  # a write no `writing`
            where = f" '{err.filename}'" if err.filename else ""  # block named: still one line
            return _report(f"{(err.strerror or '').lower()}{where}: {DISK_FIX[err.errno]}", 1)
        if not isinstance(e, OSError) or e.filename is None:
            raise
        # A path the user gave (or one derived from it) that cannot be used: name it.
        bad_path = e.errno in (
            errno.ENOENT,
            errno.ENOTDIR,
            errno.EISDIR,
            errno.EACCES,
            errno.EPERM,
            errno.EEXIST,
            errno.EROFS,
            errno.ENAMETOOLONG,
        )
        fix = (
            "check the path (and its folders), or choose another"
            if bad_path
            else "free space or fix the disk, then run again (checkpoints resume the run)"
        )
        return _report(f"{e.strerror or e}: '{e.filename}': {fix}", 2 if bad_path else 1)
    return 0


def _report(message: str, code: int) -> int:
    """Print `titanlite: error: <message>` as one line and return `code`. Under torchrun the
    first rank with this message prints it and the others stay quiet (every rank refuses the
    same bad config; N copies would only bury it). One write with its newline: with
    PYTHONUNBUFFERED two writes ("msg", "\\n") from two ranks interleave into one line."""
    line = f"titanlite: {message}\n" if code == 130 else f"titanlite: error: {message}\n"
    if _first_to_report(line):
        sys.stderr.write(line)
        sys.stderr.flush()
    return code


def _first_to_report(line: str) -> bool:
    """True outside torchrun; inside, True for the first rank of this attempt to claim `line`
    (an O_EXCL file named by the line's hash, in the job's folder or the temp folder; the
    agent's pid keeps two jobs with torchrun's default run id apart)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or "RANK" not in os.environ:
        return True
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    folder = (
        Path(os.environ.get("TITANLITE_JOB_DIR") or tempfile.gettempdir())
        / f".titanlite-errors-{run_id}-{os.getppid()}-{attempt}"
    )  # the parent: this node's agent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha1(line.encode()).hexdigest()[:16]
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot coordinate: better twice than never
    return True


if __name__ == "__main__":
    sys.exit(main())
