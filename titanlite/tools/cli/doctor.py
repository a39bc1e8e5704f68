"""`titanlite doctor`: what this machine can do, measured, in one report to attach to a bug.

    titanlite doctor                 # a few minutes on whatever device is here
    titanlite doctor --smoke         # the same checks, shrunk (TITANLITE_SMOKE=1 does too)

It writes runs/doctor/report.md and report.json. Each check ends pass, warn, fail or skipped,
with the reason; the exit status is 0 only when nothing failed. A run whose MFU comes out above
100% is a warning, never a pass: its peak was measured too low (a busy machine), not the run. Which checks apply is decided by
`plan(facts)` from the device's facts alone (type, GPU count, compute capability), so the
decision for an H100 pair or a Mac is tested on any machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...errors import TitanliteError

MODES = ("fp32", "bf16", "fp16")
MATMUL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "cuda", "mps" or "cpu"
    gpus: int = 0  # CUDA devices visible
    capability: tuple[int, int] | None = None  # CUDA compute capability (SM major, minor)
    name: str = ""


@dataclass
class Check:
    name: str
    status: str  # pass | warn (MFU above 100%: the peak, not the run) | fail | skipped
    detail: str  # the measurement, or why it failed / was skipped
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Planned:
    name: str
    args: dict
    skip: str | None = None  # why it does not apply here; None: run it


def device_facts(device: torch.device) -> DeviceFacts:
    from ...hardware import device_name

    if device.type == "cuda":
        return DeviceFacts(
            "cuda",
            torch.cuda.device_count(),
            tuple(torch.cuda.get_device_capability(device)),
            device_name(device),
        )
    return DeviceFacts(device.type, 0, None, device_name(device))


def plan(facts: DeviceFacts) -> list[Planned]:
    """The checks that apply to a device with these facts, in the order they run."""
    steps = [Planned("device", {}), Planned("matmul peaks", {}), Planned("attention kernel", {})]
    for mode in MODES:
        skip = None
        if mode == "bf16" and facts.kind == "cuda" and facts.capability < (8, 0):
            skip = f"bf16 needs SM 8.0+ (Ampere); this GPU is SM {facts.capability[0]}.{facts.capability[1]}"
        steps.append(Planned(f"train {mode}", {"mode": mode}, skip))
    if facts.kind == "mps":
        steps.append(Planned("bf16 autocast probe", {}))
    steps.append(Planned("compile", {}))
    # Real FP8 needs FP8 tensor cores (SM 8.9+); elsewhere torchao emulates it, labelled so.
    real = facts.kind == "cuda" and facts.capability >= (8, 9)
    steps.append(Planned("fp8 (real)" if real else "fp8 (emulated)", {"real": real}))
    if facts.kind == "cuda" and facts.gpus >= 2:
        two = {"on": "cuda", "backend": "nccl", "why": "two GPUs, NCCL"}
    else:
        why = {
            "cuda": "one GPU cannot host two NCCL ranks",
            "mps": "MPS has no collective backend: the gloo fallback on the CPU",
            "cpu": "gloo on the CPU",
        }[facts.kind]
        two = {"on": "cpu", "backend": "gloo", "why": why}
    steps.append(Planned("2 processes", two))
    return steps


# ----- the checks ----------------------------------------------------------------------------


def _device(device, facts, smoke, out) -> list[Check]:
    from ..probe.vendors import gpu_line, links_summary, topology, xpu_line

    cap = f", SM {facts.capability[0]}.{facts.capability[1]}" if facts.capability else ""
    gpus = f", {facts.gpus} GPU(s)" if facts.kind == "cuda" else ""
    # Whose GPU and through what (NVIDIA/CUDA or AMD/ROCm), an Intel GPU torch sees but titanlite
    # does not train on, and how the GPUs are wired (nvidia-smi topo -m), for bug reports.
    notes = [gpu_line(facts.name)] if facts.kind == "cuda" else []
    notes += [line] if (line := xpu_line()) else []
    matrix = topology() if facts.kind == "cuda" else None
    notes += [f"topology: {links_summary(matrix)} (matrix below)"] if matrix else []
    detail = f"{facts.name} ({facts.kind}{cap}{gpus}), torch {torch.__version__}"
    data = {**asdict(facts), "notes": notes, "topology": matrix}
    return [Check("device", "pass", "; ".join([detail, *notes]), data)]


def _matmul_peaks(device, facts, smoke, out) -> list[Check]:
    from ... import hardware
    from ..probe import datasheet, matmul_peak

    checks, dtypes = [], {}
    for name in MATMUL_DTYPES:
        try:
            dtypes[name] = hardware.resolve_dtype(name, device)
        except TitanliteError as e:
            checks.append(Check(f"matmul {name}", "skipped", str(e)))
    # Interleaved rounds, so a busy moment hits every dtype alike; the best of each is offered to
    # the cache the trainer and notebook 00 read (kept only if it beats the cached one by more than
    # its spread), so the doctor, a run's MFU and notebook 00 quote one peak per device and dtype.
    measured = matmul_peak.measure_peaks(
        device, list(dtypes.values()), budget_s=0.6 if smoke else 3.0
    )
    for name, dtype in dtypes.items():
        now, spread = measured[dtype]
        in_force = matmul_peak.record_peak(device, dtype, now, spread)
        sheet = datasheet.datasheet_peak(device, dtype)
        vs = (
            f"; datasheet {_flops(sheet.flops)}, measured is {in_force.flops / sheet.flops:.0%} of it"
            if sheet
            else "; no datasheet entry for this device"
        )
        kept = "" if in_force.flops == now.flops else f" (cached; {_flops(now.flops)} now)"
        if spread > matmul_peak.MAX_SPREAD:  # a busy moment: used, never cached as the peak
            kept += f" (spread over {matmul_peak.MAX_SPREAD:.0%}: too noisy to keep as the peak)"
        checks.append(
            Check(
                f"matmul {name}",
                "pass",
                f"{_flops(in_force.flops)} measured, spread {spread:.0%}{kept}{vs}",
                {
                    "measured_flops": in_force.flops,
                    "measured_now_flops": now.flops,
                    "spread": spread,
                    "datasheet_flops": sheet.flops if sheet else None,
                    "label": in_force.label,
                    "cached": spread <= matmul_peak.MAX_SPREAD or in_force.flops != now.flops,
                },
            )
        )
    return checks


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def _attention(device, facts, smoke, out) -> list[Check]:
    """Which SDPA kernels run the model's attention shapes, and which one SDPA picks."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ...device_policy import sdpa_priority
    from ...models.llama import ModelArgs

    args = ModelArgs.preset("debug" if smoke else "small")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(2, args.n_heads, 128, args.head_dim, device=device, dtype=dtype)
    kv = torch.randn(2, args.n_kv_heads, 128, args.head_dim, device=device, dtype=dtype)
    works = []
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            works.append(backend.name)
        except RuntimeError:
            pass
    # what titanlite's attention asks for (None: torch's own order)
    order = sdpa_priority(device.type, facts.capability)
    try:  # what SDPA chooses with every backend allowed, in that order
        with sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext():
            picked = SDPBackend(
                torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=True)
            ).name
    except (RuntimeError, AttributeError, ValueError, TypeError):
        picked = works[0] if works else "none"
    status = "pass" if works else "fail"
    tried = f" (tried in titanlite's order: {', '.join(b.name for b in order)})" if order else ""
    return [
        Check(
            "attention kernel",
            status,
            f"SDPA picks {picked}{tried} for {tuple(q.shape)} q, "
            f"{tuple(kv.shape)} k/v ({str(dtype).removeprefix('torch.')}, causal, GQA); runnable: {', '.join(works) or 'none'}",
            {"picked": picked, "runnable": works},
        )
    ]


def timing_plan(device_type: str, smoke: bool) -> dict:
    """Steps to warm up (the first ones pay for allocation, kernel choice and caches: timed, they made
    one run look many times slower than the next), steps to time, and how often to log: on CUDA every
    10th step as in training, the steps between run under torch's sync detector."""
    if device_type == "cuda":
        return {"warmup": 10, "timed": 20 if smoke else 50, "log_every": 10}
    # A CPU logs every step: 12 timed steps give a median that two runs reproduce (a check of the
    # doctor run twice), and keep the whole doctor within 5 minutes on a 2-core laptop.
    return {"warmup": 2 if smoke else 3, "timed": 6 if smoke else 12, "log_every": 1}


def throughput(records: list[dict], warmup: int, log_every: int) -> dict:
    """Tokens/s of the logged records whose interval starts after the warm-up: median and spread."""
    rates = sorted(r["tokens_per_sec"] for r in records if r["step"] - log_every >= warmup)
    if not rates:
        raise TitanliteError(f"no step was timed after {warmup} warm-up steps: run more steps")
    timed = [r for r in records if r["step"] - log_every >= warmup]
    out = {
        "tokens_per_sec": statistics.median(rates),
        "tokens_per_sec_range": [rates[0], rates[-1]],
        "timed_records": len(rates),
        "warmup_steps": warmup,
    }
    if all(r.get("mfu") is not None for r in timed):  # MFU of the same intervals: a median too
        out["mfu"] = statistics.median(r["mfu"] for r in timed)
    return out


def _overrides(device, smoke, out, name, **extra) -> dict:
    timing = timing_plan(device.type, smoke)
    o = {
        "model.preset": "debug" if smoke else "small",
        "data.vocab_size": 512 if smoke else 4096,
        "data.max_chars": 300_000 if smoke else None,
        "training.device": str(device.type),
        "training.steps": timing["warmup"] + timing["timed"],
        "metrics.log_every": timing["log_every"],
        # a CPU step of 8 x 256 tokens of the small model takes about a second on 2 cores
        "training.batch_size": 4 if smoke else (16 if device.type == "cuda" else 8),
        "training.seq_len": 32 if smoke else 256,
        "eval.every": 0,
        "eval.sample_tokens": 4,
        "scheduler.warmup_steps": 1,
        "metrics.log_dir": str(out / "runs"),
        "metrics.run_name": name,
        "metrics.overwrite": True,
        "metrics.progress": False,
    }  # its own scratch runs
    o.update(extra)
    return {k: v for k, v in o.items() if v is not None}


def _train_once(device, smoke, out, name, **extra) -> tuple[dict, object]:
    """A short in-process run: its last record (loss, tokens/s, MFU) + memory, and the trainer."""
    from ...config import load_config
    from ...train import Trainer
    from ..measure.host_syncs import CudaSyncDebug
    from ..probe.matmul_peak import MatmulPeaks

    cfg = load_config(None, _overrides(device, smoke, out, name, **extra))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # MFU against the measured peak, as `titanlite train` hands it in
    trainer, syncs = Trainer(cfg, peaks=MatmulPeaks()), []
    watchers = (
        [lambda run: syncs.append(CudaSyncDebug(run)) or syncs[-1]] if device.type == "cuda" else []
    )
    try:
        with warnings.catch_warnings(record=True) as said:  # MFU > 1: in the check's line
            warnings.simplefilter("always")
            history = trainer.fit(watchers=watchers)
    finally:
        trainer.close()
    timing = timing_plan(device.type, smoke)
    last = {**history.train[-1], **throughput(history.train, timing["warmup"], timing["log_every"])}
    if syncs:
        last["sync_checked_steps"] = syncs[0].checked
    last["warnings"] = sorted({str(w.message).split(":")[0] for w in said})
    if device.type == "cuda":
        last["memory"] = {
            "allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device),
        }
    else:  # no allocator counters: the process's peak resident set (all of Python included)
        last["memory"] = {"peak_rss": last["peak_memory_bytes"]}
    return last, trainer


def _describe_run(r: dict) -> str:
    mem = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["memory"].items())
    busy = (
        (
            " (MFU over 100% is no pass: the peak was measured while the machine was busy, or "
            "too noisily; `titanlite peaks --refresh` re-measures it when it is quiet)"
        )
        if r["mfu"] > 1
        else ""
    )
    low, high = r["tokens_per_sec_range"]
    synced = (
        f"; {r['sync_checked_steps']} unlogged steps ran under torch.cuda.set_sync_debug_mode('error')"
        if "sync_checked_steps" in r
        else ""
    )
    spread = _spread(r)
    # A range this wide on a busy machine: two runs' figures can differ by as much, by noise alone.
    noisy = f"; too noisy here to tell apart runs within {spread:.0%}" if spread > 0.2 else ""
    return (
        f"loss {r['loss']:.3f} after {r['step']} steps, {r['tokens_per_sec']:,.0f} tokens/s and MFU "
        f"{100 * r['mfu']:.2f}% (medians of {r['timed_records']} logged intervals after "
        f"{r['warmup_steps']} warm-up steps; tokens/s range {low:,.0f}-{high:,.0f}){noisy}{busy}, "
        f"{mem}{synced}"
    )


def _spread(r: dict) -> float:
    """A run's tokens/s range as a fraction of its median: how far two runs can differ by noise."""
    low, high = r["tokens_per_sec_range"]
    return (high - low) / r["tokens_per_sec"]


def _finite(r: dict) -> str:
    """fail for a non-finite loss; warn for an MFU above 100% (a peak measured too low, which no
    run can honestly beat); else pass."""
    if not math.isfinite(r["loss"]):
        return "fail"
    return "warn" if r.get("mfu") is not None and r["mfu"] > 1 else "pass"


def _train(device, facts, smoke, out, mode) -> list[Check]:
    from ..probe.precision_support import support

    s = support(mode, device)
    if s.works is False:
        return [Check(f"train {mode}", "skipped", s.why)]
    r, _ = _train_once(device, smoke, out, f"train-{mode}", **{"training.mixed_precision": mode})
    return [Check(f"train {mode}", _finite(r), _describe_run(r), r)]


def _bf16_probe(device, facts, smoke, out) -> list[Check]:
    from ..probe.precision_support import support

    s = support("bf16", device)
    return [Check("bf16 autocast probe", "pass" if s.works else "skipped", s.why)]


def _compile(device, facts, smoke, out) -> list[Check]:
    from ...efficiency.compile import is_compiled

    r, trainer = _train_once(
        device, smoke, out, "compile", **{"compile.enable": True, "compile.fallback": False}
    )
    status = _finite(r) if is_compiled(trainer.model) else "fail"
    return [Check("compile", status, "regional torch.compile (inductor): " + _describe_run(r), r)]


def _fp8(device, facts, smoke, out, real) -> list[Check]:
    from ...efficiency.fp8 import fp8_support

    name = "fp8 (real)" if real else "fp8 (emulated)"
    s = fp8_support(device)
    if not s.available:
        return [Check(name, "skipped", s.why)]
    r, trainer = _train_once(
        device,
        smoke,
        out,
        "fp8",
        **{
            "float8.enable": True,
            "float8.min_dim": 16,
            "float8.emulate": "auto" if real else "true",
        },
    )
    info = trainer.model.fp8_info
    status = _finite(r) if info["emulated"] != real else "fail"
    return [
        Check(
            name,
            status,
            f"{info['label']}, {len(info['converted'])} Linear "
            f"layers in FP8 ({info['why']}): " + _describe_run(r),
            {**r, "why": info["why"]},
        )
    ]


def _two_processes(device, facts, smoke, out, on, backend, why) -> list[Check]:
    """DDP, then FSDP with bf16 params whose async checkpoints carry a kill-and-resume drill."""
    from ...config import load_config
    from ..jobs.launcher import launch

    steps = 5 if smoke else 10  # the drill kills at step 6, resumes from step 4's checkpoint
    base = _overrides(
        torch.device(on),
        smoke,
        out,
        "",
        **{"training.steps": steps, "metrics.log_every": 1, "parallel.backend": backend},
    )
    label = f"({backend} on {on}: {why})"
    checks = []
    ddp = launch(
        load_config(None, {**base, "metrics.run_name": "ddp"}),
        2,
        timeout_s=600,
        overrides={"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    )
    ok = len(ddp.losses) == steps and all(map(math.isfinite, ddp.losses))
    checks.append(
        Check(
            "2-process DDP",
            "pass" if ok else "fail",
            f"{label} loss {ddp.losses[0]:.3f} -> {ddp.losses[-1]:.3f} over {steps} steps",
            {"losses": ddp.losses, "run_dir": str(ddp.run_dir)},
        )
    )
    kill_at = steps // 2 + 1
    fsdp = launch(
        load_config(None, {**base, "metrics.run_name": "fsdp-kill"}),
        2,
        timeout_s=600,
        max_restarts=1,
        overrides={
            "parallel.dp_shard": 2,
            "parallel.param_dtype": "bfloat16",
            "checkpoint.enable": True,
            "checkpoint.mode": "async",
            "checkpoint.every": 2,
            "fault.kind": "kill",
            "fault.rank": 1,
            "fault.step": kill_at,
        },
    )
    ok = len(fsdp.losses) == steps and all(map(math.isfinite, fsdp.losses))
    checks.append(
        Check(
            "2-process FSDP, bf16 params",
            "pass" if ok else "fail",
            f"{label} loss {fsdp.losses[0]:.3f} -> {fsdp.losses[-1]:.3f} over {steps} steps",
            {"losses": fsdp.losses, "run_dir": str(fsdp.run_dir)},
        )
    )
    saves = [x for x in fsdp.records if x.get("kind") == "checkpoint" and x.get("rank", 0) == 0]
    ok = bool(saves) and all(x["mode"] == "async" for x in saves)
    blocked = max((x["blocked_s"] for x in saves), default=float("nan"))
    checks.append(
        Check(
            "async checkpoint save",
            "pass" if ok else "fail",
            f"{len(saves)} async saves, training blocked at most {blocked * 1e3:.0f} ms each",
        )
    )
    ok = fsdp.attempts == 2 and len(fsdp.losses) == steps
    checks.append(
        Check(
            "kill-and-resume drill",
            "pass" if ok else "fail",
            f"rank 1 killed at step {kill_at}; {fsdp.attempts} attempts, resumed from the "
            f"last checkpoint and finished all {steps} steps",
        )
    )
    return checks


RUNNERS = {
    "device": _device,
    "matmul peaks": _matmul_peaks,
    "attention kernel": _attention,
    "bf16 autocast probe": _bf16_probe,
    "compile": _compile,
    "2 processes": _two_processes,
}


def _runner(name: str):
    if name.startswith("train "):
        return _train
    if name.startswith("fp8"):
        return _fp8
    return RUNNERS[name]


# ----- the whole self-check ------------------------------------------------------------------


def run_doctor(
    device: str = "auto", smoke: bool = False, out: str | Path = "runs/doctor", say=print
) -> tuple[list[Check], Path]:
    """Run every check that applies here; write report.md and report.json into `out`."""
    from ...hardware import detect_device

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fresh_scratch(out / "runs")
    dev = detect_device(device)
    facts = device_facts(dev)
    checks: list[Check] = []
    start = time.perf_counter()
    for step in plan(facts):
        if step.skip:
            new = [Check(step.name, "skipped", step.skip)]
        else:
            t0 = time.perf_counter()
            try:
                new = _runner(step.name)(dev, facts, smoke, out, **step.args)
            except Exception as e:  # a failed check is a report line, not a crash
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                new = [
                    Check(
                        step.name,
                        "fail",
                        f"{type(e).__name__}: {why}",
                        {"traceback": traceback.format_exc()},
                    )
                ]
            for c in new:
                c.data.setdefault("seconds", round(time.perf_counter() - t0, 2))
        for c in new:
            say(f"  {c.status:8s} {c.name}: {c.detail}")
        checks.extend(new)
    _compare_fp8(checks)
    _write(out, facts, checks, smoke, time.perf_counter() - start)
    return checks, out / "report.md"


def _compare_fp8(checks: list[Check]) -> None:
    """The FP8 row's speed, said from the numbers: its median tokens/s over the fp32 run's (the
    FP8 run computes in fp32 around its FP8 Linears), read against the wider of the two runs'
    own tokens/s ranges. A fixed "slower than fp32" was once printed beside a faster run."""
    rows = {
        c.name: c for c in checks if c.status in ("pass", "warn") and "tokens_per_sec" in c.data
    }
    fp8 = next((c for name, c in rows.items() if name.startswith("fp8")), None)
    if fp8 is None or "train fp32" not in rows:
        return
    ref = rows["train fp32"].data
    ratio = fp8.data["tokens_per_sec"] / ref["tokens_per_sec"]
    band = max(_spread(fp8.data), _spread(ref))
    reading = (
        "faster" if ratio > 1 + band else "slower" if ratio < 1 - band else "level, within noise"
    )
    fp8.detail += (
        f"; measured here at {ratio:.2f}× the fp32 run's tokens/s ({reading}: the two runs' "
        f"tokens/s ranges span up to {band:.0%} of their medians)"
    )
    fp8.data["vs_fp32"] = {"ratio": ratio, "band": band, "reading": reading}


SCRATCH_MARK = ".titanlite-doctor-scratch"  # in the runs folder the doctor made: its own to delete


def fresh_scratch(runs: Path) -> None:
    """An empty folder for this doctor's runs. An earlier doctor's is removed (its kill drill would
    otherwise resume the finished run and train nothing); a folder without the doctor's mark is
    someone else's and is refused in one line, never deleted."""
    # before the mark existed: the run folders the doctor names (an earlier version's scratch)
    earlier = runs.is_dir() and all(
        p.is_dir() and p.name.startswith(("train-", "compile", "fp8", "ddp", "fsdp-kill"))
        for p in runs.iterdir()
    )
    if runs.exists():
        if not (runs / SCRATCH_MARK).is_file() and not earlier:
            raise TitanliteError(
                f"'{runs}' exists but the doctor did not make it: move it away, or pass another "
                f"--out folder"
            )
        shutil.rmtree(runs)
    runs.mkdir(parents=True)
    (runs / SCRATCH_MARK).write_text("made by `titanlite doctor`; deleted by the next one\n")


def _write(out: Path, facts: DeviceFacts, checks: list[Check], smoke: bool, wall_s: float) -> None:
    failed = [c.name for c in checks if c.status == "fail"]
    doc = {
        "torch": torch.__version__,
        "device": asdict(facts),
        "smoke": smoke,
        "wall_s": round(wall_s, 1),
        "passed": not failed,
        "failed": failed,
        "checks": [asdict(c) for c in checks],
    }
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=str))
    lines = [
        f"# titanlite doctor: {facts.name}",
        "",
        f"torch {torch.__version__}, {facts.kind}"
        + (
            f", SM {facts.capability[0]}.{facts.capability[1]}, {facts.gpus} GPU(s)"
            if facts.capability
            else ""
        )
        + f"; {'smoke scale, ' if smoke else ''}{wall_s:.0f} s; "
        + (
            "**all checks passed or were skipped**"
            if not failed
            else f"**failed: {', '.join(failed)}**"
        ),
        "",
        "| status | check | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {c.status} | {c.name} | {c.detail.replace('|', '/')} |" for c in checks]
    matrix = next((c.data.get("topology") for c in checks if c.name == "device"), None)
    if matrix:  # the GPUs' wiring, as the vendor's tool printed it
        lines += ["", "## GPU topology", "", "```", matrix, "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
