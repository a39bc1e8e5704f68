"""Ablation: the same model trained with each single-device technique off and on, one table.

    python bench/ablation.py                       # "small" preset, every variant
    python bench/ablation.py --preset debug --variants baseline,compile
    TITANLITE_SMOKE=1 python bench/ablation.py     # a quick check that every variant runs

Like torchtitan's table (baseline, +compile, +FP8, ...): tokens/s, MFU, peak memory and the
ratio to the baseline, measured on this machine in one run. Each variant runs in a fresh
process (so its peak memory is its own, and one variant's compiled code or allocator cache
cannot help or hurt the next); the baseline is measured first and again last, so the drift
of a shared, noisy machine shows in the table instead of hiding in a ratio.

MFU is against the measured matmul peak of the dtype each variant's matmuls run in (fp32 for
the baseline, bf16 for +bf16, ...): a bf16 variant is judged against what bf16 can do here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> config overrides (dotted keys, as on the command line)
VARIANTS = {
    "baseline": {},
    "compile": {"compile.enable": True, "compile.scope": "regional"},
    "compile-model": {"compile.enable": True, "compile.scope": "model"},
    "bf16": {"training.mixed_precision": "bf16"},
    "compile+bf16": {"compile.enable": True, "training.mixed_precision": "bf16"},
    "fp8": {"float8.enable": True},
    "compile+fp8": {"compile.enable": True, "float8.enable": True},
    "ac-full": {"activation_checkpoint.mode": "full"},
    "ac-op": {"activation_checkpoint.mode": "op"},
    "accum-2": {"training.grad_accum_steps": 2, "_micro_divisor": 2},
}


def measure(variant: str, args) -> dict:
    """Runs in the child process: warm up, then time `args.steps` optimizer steps."""
    import torch

    from titanlite import hardware, memory, peaks
    from titanlite.tools.display.notebook import quiet_third_party

    quiet_third_party()  # before torchao is imported: its "Failed to load" lines are noise here
    from titanlite.config import load_config
    from titanlite.tools.probe.matmul_peak import MatmulPeaks
    from titanlite.train import Trainer

    overrides = dict(VARIANTS[variant])
    micro = args.batch_size // overrides.pop("_micro_divisor", 1)
    overrides.update(
        {
            "model.preset": args.preset,
            "training.batch_size": micro,
            "training.seq_len": args.seq_len,
            "training.steps": args.warmup + args.steps,
            "eval.every": 0,
            "metrics.progress": False,
            "metrics.log_dir": args.log_dir,
            "metrics.run_name": f"ablation-{variant}",
            "metrics.overwrite": True,
        }
    )
    if args.threads:
        overrides["training.threads"] = args.threads
    trainer = Trainer(load_config(None, overrides), peaks=MatmulPeaks())
    t0 = time.perf_counter()
    trainer.train_step(trainer.next_micro_batches())  # compile (if any) happens here
    first_step_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        trainer.train_step(trainer.next_micro_batches())
    memory.reset_peak_memory(trainer.device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_micro_batches())
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = trainer.global_batch * args.seq_len
    tps = tokens / step_s
    info = getattr(trainer.model, "fp8_info", None)
    return {
        "variant": variant,
        "tokens_per_sec": tps,
        "step_s": step_s,
        "first_step_s": first_step_s,
        "mfu": peaks.mfu(trainer.flops_per_token * tps, trainer.peak),
        "peak_label": trainer.peak.label,
        "compute_dtype": str(trainer.compute_dtype),
        "peak_memory_bytes": memory.peak_memory_bytes(trainer.device),
        "device": hardware.device_name(trainer.device),
        "threads": torch.get_num_threads(),
        "fp8_emulated": None if info is None else info.get("emulated"),
    }


def run_child(variant: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--log-dir",
        args.log_dir,
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"variant": variant, "error": err}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    base = rows[0]
    out = [
        f"{'variant':16} {'tokens/s':>10} {'vs base':>8} {'MFU':>7} {'peak MiB':>9} "
        f"{'1st step s':>10}  matmul dtype / notes"
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"{r['variant']:16} {'—':>10} {'—':>8} {'—':>7} {'—':>9} {'—':>10}  failed: {r['error']}"
            )
            continue
        note = r["compute_dtype"].replace("torch.", "")
        if r.get("fp8_emulated"):
            note += ", FP8 emulated (no FP8 hardware: slower by design)"
        if r["mfu"] > 1:  # never let an impossible MFU pass silently
            note += (
                f"; MFU > 100%: the measured peak ({r['peak_label']}) is too low to judge against"
            )
        out.append(
            f"{r['variant']:16} {r['tokens_per_sec']:10,.0f} {r['tokens_per_sec'] / base['tokens_per_sec']:7.2f}x "
            f"{100 * r['mfu']:6.1f}% {r['peak_memory_bytes'] / 2**20:9,.0f} {r['first_step_s']:10.1f}  {note}"
        )
    return "\n".join(out)


def main() -> None:
    from titanlite import is_smoke
    from titanlite.tools.display.notebook import quiet_third_party

    quiet_third_party()

    smoke = is_smoke()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug" if smoke else "small")
    p.add_argument("--batch-size", type=int, default=4 if smoke else 8)
    p.add_argument("--seq-len", type=int, default=64 if smoke else 256)
    p.add_argument("--steps", type=int, default=2 if smoke else 8)
    p.add_argument("--warmup", type=int, default=1 if smoke else 3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--log-dir", default=str(ROOT / "runs"))
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if names[0] != "baseline":
        names.insert(0, "baseline")
    rows = []
    for name in names + ["baseline"]:  # the baseline again at the end: drift made visible
        print(f"running {name} ...", file=sys.stderr, flush=True)
        row = run_child(name, args)
        if rows and name == "baseline":
            row["variant"] = "baseline (again)"
        rows.append(row)
    first = rows[0]
    print(
        f"\n{first.get('device', '?')}, {first.get('threads', '?')} threads; preset {args.preset}, "
        f"batch {args.batch_size} × seq {args.seq_len}; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
