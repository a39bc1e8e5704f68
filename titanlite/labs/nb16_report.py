"""Notebook 16's reading of the ladder: the drift between the two baselines (the noise band),
each ratio's verdict against it, the ablation table with its labelled published column, why
this machine differs, "choose your recipe", and the drill's goodput against the model.

    print(table(rows))                          # rows from nb16_capstone.run_ladder
    check = drill_vs_model(drill.run_dir)       # measured goodput vs the model's replay
"""
from __future__ import annotations

from dataclasses import dataclass, field


def drift(rows: list[dict]) -> float:
    """Relative gap between the first and the last baseline's tokens/s: the noise band."""
    first, last = rows[0], rows[-1]
    a, b = first["tokens_per_sec"], last["tokens_per_sec"]
    return abs(a - b) / ((a + b) / 2)


def verdict(ratio: float, band: float) -> str:
    """A speed ratio read against the drift: a direction only where it is beyond the noise."""
    if ratio > 1 + band:
        return "faster (beyond drift)"
    if ratio < 1 - band:
        return "slower (beyond drift)"
    return "within drift"


def table(rows: list[dict]) -> str:
    """The ablation table: measured here, with the published figure in its own labelled column."""
    base, band = rows[0]["tokens_per_sec"], drift(rows)
    head = (f"{'row':22} {'ranks':>5} {'tokens/s':>9} {'vs base':>8} {'MFU meas.':>9} {'MFU sheet':>9} "
            f"{'peak MiB/rank':>13} {'loss':>7} {'1st step s':>10}  {'dtype / notes':30}  published (not measured here)")
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['row']:22} {r['nproc']:5d} {'—':>9} {'—':>8} {'—':>9} {'—':>9} {'—':>13} {'—':>7} "
                       f"{'—':>10}  failed: {r['error'][:80]}")
            continue
        ratio = r["tokens_per_sec"] / base
        sheet = "—" if r["mfu_datasheet"] is None else f"{r['mfu_datasheet']:.1%}"
        notes = ", ".join(x for x in (r["compute_dtype"], r["fp8"], verdict(ratio, band) if r is not rows[0] else "") if x)
        mem = "—*" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:,.0f}"
        out.append(f"{r['row']:22} {r['nproc']:5d} {r['tokens_per_sec']:9,.0f} {ratio:7.2f}× {r['mfu']:9.1%} "
                   f"{sheet:>9} {mem:>13} {r['loss']:7.3f} {r['first_step_s']:10.1f}  "
                   f"{notes:30}  {r.get('published', '')}")
    out.append(f"drift of the baseline, first vs last: {band:.1%} (a ratio within 1 ± {band:.2f} is noise)")
    if any(r.get("peak_memory_bytes", 0) is None for r in rows):
        out.append("—* trained in this process after other rows: its peak memory is the process's, "
                   "not the row's own, so it is not shown (a fresh job per row measures it)")
    return "\n".join(out)


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["row"]: r for r in rows}


def why_cpu_differs(rows: list[dict], device: str, native_bf16: bool | None) -> str:
    """The paragraph on why this machine's table is not torchtitan's, citing the rows above."""
    got, band, base = by_name(rows), drift(rows), rows[0]["tokens_per_sec"]

    def ratio(name: str) -> str:
        r = got.get(name)
        if r is None or "error" in r:
            return "not measured"
        return f"{r['tokens_per_sec'] / base:.2f}× ({verdict(r['tokens_per_sec'] / base, band)})"

    fp8 = next((r for r in rows if "tensorwise" in r["row"]), {})
    units = {True: "has bf16 units", False: "has no bf16 units (bf16 is converted to fp32 to multiply)",
             None: "may or may not have bf16 units"}[native_bf16]
    return (f"On {device} the recipe's steps change different things than on an H100. bf16 measured "
            f"{ratio('+bf16')}: this processor {units}, and a CPU's memory system is no HBM, so halving the "
            f"bytes buys less. Compile measured {ratio('+compile')} relative to the baseline: it fuses the "
            f"element-wise glue, a small share of a step whose time is mostly matmuls. FP8 measured "
            f"{ratio('+FP8 tensorwise')}: {'emulated' if 'emulated' in fp8.get('fp8', '') else 'real'} FP8 — without "
            f"FP8 tensor cores every matmul is cast to FP8 and back and still multiplied at fp32 or bf16 "
            f"speed, so it can only cost time here, while an H100's FP8 units run at twice its bf16 peak "
            f"(torchtitan's 1.48×). Sharding over ranks that share one CPU (FSDP measured {ratio(next((r['row'] for r in rows if r['row'].startswith('FSDP')), ''))}) "
            f"splits the same cores, not adds devices: it buys memory per rank, not speed. The drift of "
            f"{band:.0%} between the two baselines is the yardstick: a ratio inside it says nothing.")


def choose_recipe(args, n_devices: int, mem_bytes: float, rows: list[dict], *, seq_len: int,
                  micro_batch: int = 1, gpus_per_node: int | None = None) -> str:
    """The planner's layout for a model, device count and memory, and each technique's measured
    evidence from the table: kept where this machine measured it faster beyond the drift (or,
    for memory techniques, smaller), flagged where the device only emulates it."""
    from ..distributed.planner import plan
    p = plan(args, n_devices, mem_bytes, seq_len=seq_len, micro_batch=micro_batch,
             gpus_per_node=gpus_per_node or n_devices)
    lines = [p.report(top=2), "", "measured evidence on this machine (rows above; ratio to the row before):"]
    band = drift(rows)
    measured = [r for r in rows[:-1] if "error" not in r]
    for prev, r in zip(measured, measured[1:]):
        speed = r["tokens_per_sec"] / prev["tokens_per_sec"]
        known = r["peak_memory_bytes"] is not None and prev["peak_memory_bytes"] is not None
        mem = f"{r['peak_memory_bytes'] / prev['peak_memory_bytes']:5.2f}×" if known else "not comparable"
        lines.append(f"  {r['row']:20} speed {speed:5.2f}× ({verdict(speed, band)}), memory per rank {mem}"
                     + (f"   [{r['fp8']}]" if r["fp8"] and "emulated" in r["fp8"] else ""))
    return "\n".join(lines)


@dataclass
class DrillCheck:
    measured: dict            # goodput.summarize of the drill
    model: dict               # the replay model's prediction from the drill's own costs
    restored_from: list[int] = field(default_factory=list)
    lost_steps: int = 0
    step_s: float = 0.0       # the mean kept step the model charges each lost step at

    @property
    def error(self) -> float:
        return self.model["goodput"] / self.measured["goodput"] - 1

    @property
    def band(self) -> float:
        """Notebook 13's 3%, plus what charging lost steps at the *mean* step costs: with compile
        the first step of an attempt is long, so the mean is far from the lost steps' own time."""
        charged = self.lost_steps * self.step_s
        return 0.03 + abs(charged - self.measured["lost_s"]) / self.measured["wall_s"]


def drill_vs_model(run_dir) -> DrillCheck:
    """Goodput measured from the drill's goodput.jsonl next to goodput_model's replay of the
    same run (notebook 13's `measured_vs_model`, reused)."""
    from . import nb13_fault_tolerance as faults_lab
    cmp = faults_lab.measured_vs_model(run_dir)
    c = cmp["costs"]
    return DrillCheck(cmp["measured"], cmp["model"], c.restored_from, c.lost_steps, c.step_s)
