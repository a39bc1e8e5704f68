"""Notebook 16's experiment: the whole recipe as one ablation table, measured row by row.

    rows = run_ladder(cfg, ladder(nproc=2, every=2), warmup=2)   # each row: a fresh torchrun job
    print(table(rows))                                           # tokens/s, MFU, memory, loss

Like torchtitan's table (FSDP → +compile → +FP8 ...), each row adds one technique to the row
before it (`Rung.carry`), except siblings that are measured *instead of* the row before
(FP8 rowwise next to tensorwise). At full scale every row is its own job started by `launch`, so
its peak memory and compile caches are its own; in smoke scale (`in_process=True`) the
one-process rows train in this process one after another, and the multi-process rows in one job
whose ranks train them one after another (`train_rows`): seconds of start-up saved per row. A
peak-memory figure that is then not the row's own is reported as None. The baseline runs first
and again last, and the difference between those two is the machine's drift: the noise band for
every speed ratio.

A row that the device runs in a slower, emulated form (FP8 without FP8 tensor cores; bf16 on a
CPU without bf16 units) is measured as what it is and labelled so. A row the device cannot run
at all keeps its one-line error instead of numbers.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import TitanliteError
from .nb16_report import (  # noqa: F401
    DrillCheck,
    against_reference,
    by_name,
    choose_recipe,
    drift,
    drill_vs_model,
    noise,
    published_bars,
    published_table,
    step_gains,
    table,
    verdict,
    why_cpu_differs,  # the reading of the rows, re-exported
)

# Published, not measured here (labelled wherever they are shown). Both are cumulative tables:
# each row adds one technique to the row before, so a technique's own gain is its row ÷ the row before.
# torchtitan (Liang et al., ICLR 2025; docs/performance.md): Llama 3.1 8B on 8×H100 (96 GB HBM2e, 500 W),
# local batch 2, selective activation checkpointing; tokens/s per GPU.
TORCHTITAN_8B_H100 = {"FSDP": 5762, "+compile": 6667, "+FP8": 8532}
# AWS's SageMaker study of torchtitan ("Efficient Pre-training of Llama 3-like model architectures using
# torchtitan on Amazon SageMaker", 2024): Llama 3 8B on 32×H100 (4 p5.48xlarge); tokens/s. Its "+33%"
# for FP8 is over the FSDP baseline, with compile: FP8's own step is 8,624 / 7,166.
SAGEMAKER_8B_H100 = {"FSDP": 6475, "+compile": 7166, "+FP8": 8624, "+FP8 all-gather": 8950}
# The ladder's row that takes each published step.
PUBLISHED_ROWS = {
    "+compile": "+compile",
    "+FP8": "+FP8 tensorwise",
    "+FP8 all-gather": "+FP8 all-gather",
}


def _published(step: str) -> str:
    """The labelled published figures for one step, each as its row ÷ the row before."""
    out = []
    for source, rows in (
        ("torchtitan 8×H100", TORCHTITAN_8B_H100),
        ("SageMaker 32×H100", SAGEMAKER_8B_H100),
    ):
        if step in rows:
            before = list(rows)[list(rows).index(step) - 1]
            out.append(
                f"{source}: {before} {rows[before]:,} → {rows[step]:,} ({rows[step] / rows[before]:.2f}×)"
            )
    return "; ".join(out)


@dataclass
class Rung:
    name: str
    overrides: dict
    nproc: int = 1
    carry: bool = True  # False: measured instead of the previous row, not kept for the next
    published: str = ""  # the labelled real-world figure for this step, if one exists


def ladder(nproc: int, every: int, ac_mode: str = "full", carry_compile: bool = True) -> list[Rung]:
    """The recipe, in torchtitan's order: precision, compile, FP8 on one device; then shard
    over `nproc` ranks, FP8 all-gathers (an FSDP feature: it needs the sharding) and async
    checkpoints every `every` steps (what resilience costs once everything else is on).
    `carry_compile=False` (smoke scale) measures compile on its own row only: every later row
    would compile its own graphs (48 s for one, cold, measured on 2 cores at load average 4)."""
    return [
        Rung("baseline", {}),
        Rung("+bf16", {"training.mixed_precision": "bf16"}),
        Rung(
            "+compile",
            {"compile.enable": True, "compile.scope": "regional"},
            carry=carry_compile,
            published=_published("+compile"),
        ),
        Rung("+FP8 rowwise", {"float8.enable": True, "float8.recipe": "rowwise"}, carry=False),
        Rung(
            "+FP8 tensorwise",
            {"float8.enable": True, "float8.recipe": "tensorwise"},
            published=_published("+FP8"),
        ),
        Rung(f"+AC ({ac_mode})", {"activation_checkpoint.mode": ac_mode}),
        Rung(f"FSDP ×{nproc}", {"parallel.dp_shard": nproc}, nproc=nproc),
        Rung(
            "+FP8 all-gather",
            {"float8.fsdp_all_gather": True},
            nproc=nproc,
            published=_published("+FP8 all-gather"),
        ),
        Rung(
            "+async checkpoint",
            {"checkpoint.enable": True, "checkpoint.every": every, "checkpoint.mode": "async"},
            nproc=nproc,
        ),
    ]


def references(rungs: list[Rung]) -> dict[str, str]:
    """Each rung's one reference: the row it adds its technique to, the last carried one before it
    (FP8 rowwise and tensorwise, siblings, share theirs). The first row has none."""
    out, last = {}, None
    for rung in rungs:
        if last is not None:
            out[rung.name] = last
        if rung.carry:
            last = rung.name
    return out


def ladder_layout(n_gpus: int, cores: int, smoke: bool) -> tuple[str, int]:
    """Where the table runs and how many ranks the FSDP rows take. Every row on one kind of
    device, or the rows cannot be compared: CUDA when there is a GPU per rank (up to 8), else
    CPU ranks (gloo), 2 of them, 4 on a roomy CPU at full scale. One GPU alone cannot hold
    FSDP's ranks (NCCL refuses two ranks on one GPU), so it runs on the CPU as well."""
    if n_gpus >= 2:
        return "cuda", 1 << (min(n_gpus, 8).bit_length() - 1)  # a power of two divides the batch
    return "cpu", 4 if not smoke and cores >= 8 else 2


def row_overrides(rungs: list[Rung]) -> list[tuple[Rung, dict]]:
    """Each rung with the overrides it runs under: its own on top of every carried one before."""
    kept, out = {}, []
    for rung in rungs:
        out.append((rung, {**kept, **rung.overrides}))
        if rung.carry:
            kept.update(rung.overrides)
    return out


def memory_is_own(device_type: str, fresh_process: bool) -> bool:
    """Whether a row's peak-memory figure is the row's alone. A row that its process trained
    first always has it. After other rows (in this kernel, or later in a shared job): CUDA's
    allocator peak is reset every step and counts live tensors only, so it is; a CPU figure is
    the resident set of the whole process (every row before, the kernel's imports and caches)
    and MPS keeps a lifetime peak, so they are not comparable."""
    return fresh_process or device_type == "cuda"


def measure_row(
    name: str, result, warmup: int, nproc: int, datasheet_peak=None, memory_own: bool = True
) -> dict:
    """One row from a finished job's records: medians over the steps after `warmup` (the first
    steps compile and warm caches) and their spread, the set-up time before step 1 (wall time
    minus the steps'), memory the largest of any rank (None where the figure is not the row's
    own: `memory_is_own`), the last step's loss."""
    train = [r for r in result.records if r.get("kind") == "train"]
    rank0 = {r["step"]: r for r in train if r.get("rank", 0) == 0}  # the last attempt of each step
    steps = sorted(rank0)
    timed = [rank0[s] for s in steps[warmup:]] or [rank0[steps[-1]]]
    info = _run_info(result.run_dir)
    mfu_ds = [r["mfu_datasheet"] for r in timed if r.get("mfu_datasheet") is not None]
    if not mfu_ds and datasheet_peak is not None and info.get("peak_flops"):
        # a trainer that does not log it yet: the same FLOPs over the vendor's peak instead
        mfu_ds = [r["mfu"] * info["peak_flops"] / datasheet_peak.flops for r in timed]
    fp8 = info.get("float8") or {}
    speeds = [r["tokens_per_sec"] for r in timed]
    return {
        "row": name,
        "nproc": nproc,
        "run_dir": str(result.run_dir),
        "tokens_per_sec": statistics.median(speeds),
        # the row's own noise: how far its timed steps spread, relative to their median
        "spread": (max(speeds) - min(speeds)) / statistics.median(speeds),
        # what came before step 1: start-up, building the model and, with compile, compiling
        "setup_s": max(0.0, result.wall_s - sum(rank0[s]["step_time_s"] for s in steps)),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "first_step_s": rank0[steps[0]]["step_time_s"],
        "mfu": statistics.median(r["mfu"] for r in timed),
        "mfu_datasheet": statistics.median(mfu_ds) if mfu_ds else None,
        "peak_label": timed[-1].get("peak_label", ""),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in train) if memory_own else None,
        "loss": rank0[steps[-1]]["loss"],
        "first_loss": rank0[steps[0]]["loss"],
        "tokens": rank0[steps[-1]].get("tokens"),
        "steps": len(steps),
        "compute_dtype": info.get("compute_dtype", "?").replace("torch.", ""),
        "threads": ((info.get("config") or {}).get("training") or {}).get(
            "threads"
        ),  # per rank; None: torch's
        "fp8": (f"FP8 {fp8.get('recipe')}, " + ("emulated" if fp8.get("emulated") else "real"))
        if fp8
        else "",
        "wall_s": result.wall_s,
    }


def _run_info(run_dir) -> dict:
    import json
    from pathlib import Path

    path = Path(run_dir) / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _row_config(cfg, overrides: dict):
    row_cfg = cfg.with_overrides(overrides, source="ladder overrides")
    row_cfg.metrics.progress = False  # the live plot is the progress
    return row_cfg


@contextmanager
def as_a_fresh_process():
    """Compile state as a fresh process has it, for a row trained after others in the same
    process: no Dynamo graphs of the row before, and Inductor's config given back afterwards (a
    row may set a flag that the rows after it must not inherit: compiled rowwise FP8 turns
    `emulate_precision_casts` on, which would change the tensorwise rows' kernels)."""
    import torch
    import torch._inductor.config as inductor_config

    saved = inductor_config.get_config_copy()
    torch._dynamo.reset()
    try:
        yield
    finally:
        inductor_config.load_config(saved)


def train_here(cfg, overrides: dict, callbacks=()):
    """One row in this process: `Trainer(cfg)` under the row's overrides, `fit`, close. Returns
    what `launch` would (run folder, records, wall time) so a row is measured the same way."""
    import gc
    import time

    import torch

    from ..tools.jobs.launcher import LaunchResult
    from ..tools.probe.matmul_peak import MatmulPeaks
    from ..train import Trainer

    cfg = _row_config(cfg, overrides)
    threads = torch.get_num_threads()  # the Trainer sets the row's; the kernel gets its own back
    gc.collect()  # the row before's tensors go now, not inside this row's memory peak
    start = time.perf_counter()
    with as_a_fresh_process():
        trainer = Trainer(cfg, peaks=MatmulPeaks())  # MFU against the measured peak, as the CLI
        try:
            history = trainer.fit(callbacks=list(callbacks))
        finally:
            trainer.close()
            torch.set_num_threads(threads)
    return LaunchResult(
        run_dir=history.run_dir,
        command="in this process: Trainer(cfg).fit()",
        wall_s=time.perf_counter() - start,
        job_id="in-process",
        records=history.train,
    )


def train_rows(cfg, rows: list[tuple[str, dict]]) -> list[dict]:
    """In every rank of one job (`launch_function`): train the rows one after another, each a
    `Trainer(cfg)` under its overrides in the process group the job already joined, sending
    each record, tagged with its row, to the launcher's callbacks. Returns, per row, its run
    folder and wall time, or its one-line error."""
    import time

    from ..tools.jobs.run_function import report
    from ..tools.probe.matmul_peak import MatmulPeaks
    from ..train import Trainer

    out = []
    for name, overrides in rows:
        row_cfg = _row_config(cfg, overrides)
        start = time.perf_counter()
        try:  # no trainer.close(): it would leave the job's process group, which the next row uses
            with as_a_fresh_process():
                history = Trainer(row_cfg, peaks=MatmulPeaks()).fit(
                    callbacks=[lambda r, name=name: report({**r, "row": name})]
                )
        except (
            TitanliteError
        ) as e:  # raised alike on every rank (config, device): the next row runs
            out.append({"row": name, "error": str(e)})
            continue
        out.append(
            {"row": name, "run_dir": str(history.run_dir), "wall_s": time.perf_counter() - start}
        )
    return out


def run_ladder(
    cfg,
    rungs: list[Rung],
    *,
    warmup: int,
    callbacks_for=None,
    timeout_s: float = 900,
    datasheet_peak=None,
    in_process: bool = False,
    on_phase=None,
) -> list[dict]:
    """Every row, then the baseline again; return the measured rows. Each row is a fresh job
    (`launch`), or with `in_process` (smoke scale) the one-process rows train here, one after
    another (`train_here`), and each run of multi-process rows in one job (`train_rows`).
    Every row trains the same global batch in the same micro-batches (batch / the most ranks
    any row has; a row on fewer ranks accumulates), so after the same steps every row has seen
    the same tokens. `callbacks_for(row_name)` gives a row's callbacks; `on_phase(text)` hears
    what starts before a row's first step (a compile, processes), e.g. LivePlot.phase."""
    from ..tools.jobs.launcher import launch

    batch = cfg.training.batch_size
    plan = row_overrides(rungs)
    plan.append((Rung("baseline (again)", {}, carry=False), {}))
    reference = {**references(rungs), "baseline (again)": "baseline"}
    ranks = max(r.nproc for r, _ in plan)
    if batch % ranks or any(ranks % r.nproc for r, _ in plan):  # before any job: minutes of rows
        raise TitanliteError(
            f"training.batch_size={batch} does not split over "  # must not end here
            f"{sorted({r.nproc for r, _ in plan})} ranks: use a multiple of {ranks}"
        )
    # The same micro-batches everywhere: one process accumulates `ranks` of them where FSDP's
    # ranks take one each. Every row then runs the same kernels per micro-batch (and compiles
    # the same graphs), so what a row changes is its technique, not its shapes.
    plan = [
        (
            rung,
            {
                **overrides,
                "training.batch_size": batch // ranks,
                "training.grad_accum_steps": ranks // rung.nproc,
                "metrics.run_name": f"{cfg.metrics.run_name or 'ladder'}-{_slug(rung.name)}",
            },
        )
        for rung, overrides in plan
    ]
    device_type = cfg.training.device.split(":")[0]
    rows, i = [], 0
    while i < len(plan):
        rung, overrides = plan[i]
        group = [plan[i]]
        if in_process and rung.nproc > 1:  # the run of rows on as many ranks: one job
            while i + len(group) < len(plan) and plan[i + len(group)][0].nproc == rung.nproc:
                group.append(plan[i + len(group)])
        i += len(group)
        for _, o in group:
            _fresh(cfg, o["metrics.run_name"])
        if on_phase is not None:
            on_phase(phase(group, in_process))
        try:
            if len(group) > 1:
                results = _run_group(cfg, group, callbacks_for, timeout_s)
            else:
                callbacks = callbacks_for(rung.name) if callbacks_for else ()
                results = [
                    train_here(cfg, overrides, callbacks)
                    if in_process and rung.nproc == 1
                    else launch(
                        cfg,
                        rung.nproc,
                        overrides=overrides,
                        callbacks=callbacks,
                        timeout_s=timeout_s,
                    )
                ]
        except TitanliteError as e:  # rows this device cannot run: their one line, no numbers
            results = [e] * len(group)
        for n, ((rung, overrides), result) in enumerate(zip(group, results)):
            if isinstance(result, Exception):
                rows.append(
                    {
                        "row": rung.name,
                        "nproc": rung.nproc,
                        "error": str(result),
                        "published": rung.published,
                        "reference": reference.get(rung.name),
                    }
                )
                continue
            here = in_process and rung.nproc == 1
            fresh = not in_process or (rung.nproc > 1 and n == 0)  # the first its process trained
            row = measure_row(
                rung.name,
                result,
                warmup,
                rung.nproc,
                datasheet_peak,
                memory_own=memory_is_own(device_type, fresh),
            )
            row.update(
                published=rung.published,
                overrides=overrides,
                in_process=here,
                fresh_process=fresh,
                reference=reference.get(rung.name),
            )
            rows.append(row)
    return rows


def phase(group: list[tuple[Rung, dict]], in_process: bool = False) -> str:
    """What happens before the first step of `group` (rows trained by one process or job), for the
    status line: starting processes, building the model, compiling (slowest on a first run, when
    Inductor's cache is empty)."""
    names = ", ".join(rung.name for rung, _ in group)
    nproc = group[0][0].nproc
    doing = (
        f"building {names}"
        if in_process and nproc == 1
        else f"starting {nproc} process{'es' * (nproc > 1)} for {names}"
    )
    compiled = any(o.get("compile.enable") for _, o in group)
    return doing + (
        " and compiling its graphs (slowest with an empty compile cache)" if compiled else ""
    )


def _run_group(cfg, group, callbacks_for, timeout_s: float) -> list:
    """Multi-process rows on the same ranks, one job (`train_rows`): each row's records go to
    its callbacks as they arrive; returns a LaunchResult per row, or its error."""
    from pathlib import Path

    from ..tools.jobs.launcher import LaunchResult, launch_function

    nproc = group[0][0].nproc
    callbacks = {
        rung.name: list(callbacks_for(rung.name)) if callbacks_for else [] for rung, _ in group
    }
    records = {rung.name: [] for rung, _ in group}

    def dispatch(record):
        name = record.pop("row", None)
        if name in records:
            records[name].append(record)
            for cb in callbacks[name]:
                cb(record)

    outs = launch_function(
        "titanlite.labs.nb16_capstone:train_rows",
        nproc,
        device=cfg.training.device,
        backend=cfg.parallel.backend,
        timeout_s=timeout_s,
        callbacks=[dispatch],
        log_dir=cfg.metrics.log_dir,
        cfg=cfg,
        rows=[(rung.name, overrides) for rung, overrides in group],
    )
    results = []
    for out in outs[0]:  # rank 0's account of each row
        if "error" in out:
            results.append(TitanliteError(out["error"]))
            continue
        results.append(
            LaunchResult(
                run_dir=Path(out["run_dir"]),
                wall_s=out["wall_s"],
                job_id="shared job",
                command=f"one job for {len(group)} rows: Trainer(cfg).fit() per row",
                records=records[out["row"]],
            )
        )
    for cb in (cb for cbs in callbacks.values() for cb in cbs):
        if hasattr(cb, "on_train_end"):
            cb.on_train_end()
    return results


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def _fresh(cfg, run_name: str) -> None:
    # A run directory with checkpoints would be resumed: every row starts from step 0.
    import shutil
    from pathlib import Path

    shutil.rmtree(Path(cfg.metrics.log_dir) / run_name, ignore_errors=True)


def full_scale_floor_s(
    rungs: list[Rung],
    steps: int,
    tokens_per_step: int,
    flops_per_token: float,
    peaks: dict[str, float],
) -> float:
    """A floor under a full-scale ladder's training time (predicted, not measured): every row's
    steps (the baseline twice) with every matmul at this machine's measured peak for its dtype,
    `peaks` = {"float32": FLOP/s, "bfloat16": FLOP/s}; FP8 rows, emulated in float32 off FP8 tensor
    cores, at the faster of the two. Real steps are slower, and compiling comes on top."""
    total = 0.0
    for _, overrides in row_overrides(rungs) + [(rungs[0], {})]:
        bf16 = overrides.get("training.mixed_precision") == "bf16"
        peak = (
            max(peaks.values())
            if overrides.get("float8.enable")
            else peaks["bfloat16" if bf16 else "float32"]
        )
        total += steps * tokens_per_step * flops_per_token / peak
    return total
