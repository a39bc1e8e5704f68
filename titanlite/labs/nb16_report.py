"""Notebook 16's reading of the ladder: how much two rows can differ by noise alone, each row
against its one reference, the ablation table, the published figures beside it (labelled), why
this machine differs (every sentence computed from the rows), "choose your recipe", and the
drill's goodput against the model.

    print(table(rows))                          # rows from nb16_capstone.run_ladder
    print(published_table(rows))                # torchtitan's and SageMaker's steps next to ours
    check = drill_vs_model(drill.run_dir)       # measured goodput vs the model's replay
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

FLAG = "⚑"  # an MFU above 100%: its peak is wrong, not the row fast
WIDTH = 96  # characters: what a notebook's output shows unwrapped on a 1280-px laptop screen


def drift(rows: list[dict]) -> float:
    """Relative gap between the first and the last baseline's tokens/s: the machine's drift."""
    first, last = rows[0], rows[-1]
    a, b = first["tokens_per_sec"], last["tokens_per_sec"]
    return abs(a - b) / ((a + b) / 2)


def verdict(ratio: float, band: float, what: str = "drift") -> str:
    """A speed ratio read against a noise band: a direction only where it is beyond the noise.
    An infinite band (the reference itself an outlier: `against_reference`) tells nothing."""
    if math.isinf(band):
        return "too noisy to tell here (its reference is an outlier)"
    if ratio > 1 + band:
        return f"faster (beyond {what})"
    if ratio < 1 - band:
        return f"slower (beyond {what})"
    return f"within {what}"


def noise(row: dict, ref: dict, rows: list[dict]) -> float:
    """How far `row`'s speed may sit from `ref`'s by noise alone, all measured in this run: the
    drift between the two baselines, plus half of each row's own step-to-step spread."""
    return drift(rows) + (row.get("spread", 0.0) + ref.get("spread", 0.0)) / 2


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["row"]: r for r in rows}


def against_reference(rows: list[dict]) -> list[tuple[dict, dict, float, float]]:
    """(row, its reference row, speed ratio, noise band) for every measured row that has one; the
    band is infinite where the reference is an outlier (`outlier_between`): read against it, every
    later row would look faster (or slower) by the outlier's own gap."""
    named, out = by_name(rows), []
    for r in rows:
        ref = named.get(r.get("reference") or "")
        if ref is not None and "error" not in r and "error" not in ref:
            band = math.inf if outlier_between(r, ref, named, rows) else noise(r, ref, rows)
            out.append((r, ref, r["tokens_per_sec"] / ref["tokens_per_sec"], band))
    return out


def outlier_between(row: dict, ref: dict, named: dict, rows: list[dict]) -> bool:
    """Is `ref` one odd measurement between `row` and ref's own reference? It sits beyond noise
    from its reference, `row` sits beyond noise from it the other way, and `row` lands within
    noise of ref's reference: one slow (or fast) run in between, not two effects that cancel
    exactly (which two runs of one noisy row could not tell apart from it either)."""
    grand = named.get(ref.get("reference") or "")
    if grand is None or "error" in grand:
        return False
    there = ref["tokens_per_sec"] / grand["tokens_per_sec"]
    back = row["tokens_per_sec"] / ref["tokens_per_sec"]
    b_there, b_back = noise(ref, grand, rows), noise(row, ref, rows)
    opposite = (there > 1 + b_there and back < 1 - b_back) or (
        there < 1 - b_there and back > 1 + b_back
    )
    return opposite and abs(row["tokens_per_sec"] / grand["tokens_per_sec"] - 1) <= noise(
        row, grand, rows
    )


def _mfu(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0%}{FLAG}" if value > 1 else f"{value:.1%}"


def _notes(r: dict) -> str:
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        r["compute_dtype"], r["compute_dtype"]
    )
    # "bf16, FP8 tensorwise emulated"
    return ", ".join(x for x in (dtype, r["fp8"].replace(", ", " ")) if x)


def table(rows: list[dict]) -> str:
    """The ablation table, measured here, in two blocks that fit a laptop's notebook width: speed,
    each row against its one reference (the row it adds its technique to) with the noise band of
    that comparison; then what each row used and learned. Published figures: published_table."""
    versus = {
        r["row"]: (ref["row"], ratio, band) for r, ref, ratio, band in against_reference(rows)
    }
    head = f"{'row':18} {'ranks':>5} {'tokens/s':>9} {'× ref':>6}  {'reference':16} {'noise':>6}  reading"
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['row']:18} {r['nproc']:5d}  failed: {r['error'][:70]}")
            continue
        ref, ratio, band = versus.get(r["row"], ("—", None, None))
        reading = (
            "" if ratio is None else verdict(ratio, band).split(" ")[0].replace("within", "noise")
        ).replace("too", "outlier ref")
        out.append(
            f"{r['row']:18} {r['nproc']:5d} {r['tokens_per_sec']:9,.0f} "
            f"{'' if ratio is None else f'{ratio:.2f}×':>6}  {ref:16} {'' if band is None else '?' if math.isinf(band) else f'±{band:.0%}':>6}  "
            f"{reading}"
        )
    out += textwrap.wrap(
        f"× ref: tokens/s over the reference row's; noise: the baselines' drift ({drift(rows):.1%}) "
        "plus half of each row's step-to-step spread; a ratio inside it says nothing; ?: the "
        "reference is an outlier (beyond noise from its own reference, this row back within noise "
        "of that one), so nothing can be read against it",
        WIDTH,
    )
    head = f"{'row':18} {'MFU':>7} {'sheet':>6} {'MiB/rank':>8} {'loss':>6} {'set-up s':>8} {'1st s':>6}  compute"
    out += ["", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            continue
        mem = "—*" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:,.0f}"
        out.append(
            f"{r['row']:18} {_mfu(r['mfu']):>7} {_mfu(r['mfu_datasheet']):>6} {mem:>8} {r['loss']:6.3f} "
            f"{r.get('setup_s', 0.0):8.1f} {r['first_step_s']:6.2f}  {_notes(r)}"
        )
    if any("error" not in r and r["peak_memory_bytes"] is None for r in rows):
        out += textwrap.wrap(
            "—* trained in a process after other rows: its peak memory is the process's, not "
            "the row's own (a fresh job per row, the full lab, measures it)",
            WIDTH,
        )
    flagged = sorted(
        {
            r["peak_label"].split(" [cached")[0]
            for r in rows
            if "error" not in r and (r["mfu"] or 0) > 1
        }
    )
    if flagged:
        out += textwrap.wrap(
            f"{FLAG} above 100%: not a real MFU. The peak it divides by ({'; '.join(flagged)}) is "
            "lower than this run reached (measured on a busier machine or with other threads): "
            "`titanlite peaks --refresh` measures it again",
            WIDTH,
        )
    return "\n".join(out)


def step_gains(cumulative: dict[str, float]) -> dict[str, float]:
    """Each row of a cumulative table over the row before it: what that step alone bought."""
    names = list(cumulative)
    return {name: cumulative[name] / cumulative[before] for before, name in zip(names, names[1:])}


def published_bars(rows: list[dict], published_rows: dict, tables: dict[str, dict]) -> list[dict]:
    """Per published step: our row over its reference, and each published table's row over the
    row before it (both cumulative tables: a step's own gain is its row ÷ the one before)."""
    named, gains = by_name(rows), {source: step_gains(t) for source, t in tables.items()}
    out = []
    for step, row_name in published_rows.items():
        r = named.get(row_name, {})
        ref = named.get(r.get("reference") or "", {})
        ours = (
            r["tokens_per_sec"] / ref["tokens_per_sec"]
            if "tokens_per_sec" in r and "tokens_per_sec" in ref
            else None
        )
        out.append(
            {
                "step": step,
                "row": row_name,
                "reference": r.get("reference"),
                "ours": ours,
                "band": noise(r, ref, rows) if ours is not None else None,
                **{source: g.get(step) for source, g in gains.items()},
            }
        )
    return out


def published_table(bars: list[dict]) -> str:
    """The bars as text: ours against the published steps, the published columns labelled."""
    sources = (
        [k for k in bars[0] if k not in ("step", "row", "reference", "ours", "band")]
        if bars
        else []
    )
    out = [
        f"{'step':16} {'here':>6}  {'(row ÷ reference, noise)':38}"
        + "".join(f"{s.split()[0]:>12}" for s in sources)
    ]
    for b in bars:
        here, how = (
            ("—", "not measured")
            if b["ours"] is None
            else (f"{b['ours']:.2f}×", f"{b['row']} ÷ {b['reference']}, ±{b['band']:.0%}")
        )
        out.append(
            f"{b['step']:16} {here:>6}  {how:38}"
            + "".join(f"{'—' if b[s] is None else f'{b[s]:.2f}×':>12}" for s in sources)
        )
    out += textwrap.wrap(
        f"{' and '.join(sources)}: published, not measured here; each step is that table's row "
        "÷ the row before it",
        WIDTH,
    )
    return "\n".join(out)


def why_cpu_differs(
    rows: list[dict],
    device: str,
    native_bf16: bool | None,
    matmul_peaks: dict[str, float] | None = None,
    cores: int | None = None,
) -> str:
    """The paragraph on why this machine's table is not torchtitan's. Every claim in it is read off
    the rows (and the measured matmul peaks, `{"float32": flops, "bfloat16": flops}`), so it says
    what this run measured, in whichever direction that went."""
    named = by_name(rows)
    steps = {r["row"]: (ref, ratio, band) for r, ref, ratio, band in against_reference(rows)}
    peaks = matmul_peaks or {}
    fp32_over_bf16 = (
        peaks["float32"] / peaks["bfloat16"] if {"float32", "bfloat16"} <= set(peaks) else None
    )
    out = [
        f"On {device}, each row is compared with the row it adds its technique to, and a ratio counts only "
        f"beyond that comparison's noise band (the baselines' drift, {drift(rows):.0%}, plus the two rows' "
        "step-to-step spread)."
    ]

    def measured(name: str) -> str:
        ref, ratio, band = steps[name]
        # The verdict after a comma: it carries its own parentheses ("faster (beyond noise)").
        return f"{name} ran at {ratio:.2f}× {ref['row']}, {verdict(ratio, band, 'noise')}"

    if "+bf16" in steps:
        ref, ratio, band = steps["+bf16"]
        units = {
            True: "has bf16 units",
            False: "has no bf16 units (bf16 is converted to fp32 to multiply)",
            None: "may or may not have bf16 units",
        }[native_bf16]
        faster, slower = (
            ("float32", "bfloat16") if (fp32_over_bf16 or 1) >= 1 else ("bfloat16", "float32")
        )
        peak = (
            ""
            if fp32_over_bf16 is None
            else f"; its measured matmul peaks: {faster} at {max(fp32_over_bf16, 1 / fp32_over_bf16):.2g}× {slower}"
        )
        elsewhere = ratio < 1 - band and fp32_over_bf16 is not None and fp32_over_bf16 < 1
        out.append(
            f"{measured('+bf16')}: this processor {units}{peak}"
            + (
                ", so the time went elsewhere than into the matmuls' arithmetic (autocast's casts, "
                "kernels too small to keep the bf16 units busy)."
                if elsewhere
                else "."
            )
        )
    if "+compile" in steps:
        row, (ref, ratio, band) = named["+compile"], steps["+compile"]
        # How much set-up and first-step times vary without a compile: the rows trained the same way
        # (here or in a job of their own) that compile nothing, the first row (one-off costs) aside.
        peers = [
            r
            for r in rows[1:]
            if "error" not in r
            and not (r.get("overrides") or {}).get("compile.enable")
            and r["nproc"] == row["nproc"]
            and r.get("in_process") == row.get("in_process")
        ]

        def beyond(key: str, floor: float) -> tuple[bool, str]:
            """Is the compiled row's `key` above its reference's by more than peers vary? And their range."""
            spread = [r[key] for r in peers] or [ref[key]]
            extra = row[key] - ref[key]
            return extra > max(
                max(spread) - min(spread), floor
            ), f"{min(spread):.2f}–{max(spread):.2f} s"

        (setup_paid, setup_range), (first_paid, first_range) = (
            beyond("setup_s", 1.0),
            beyond("first_step_s", 0.05),
        )
        paid = (
            f"compiling cost {row['setup_s'] - ref['setup_s']:.0f} s before step 1 (set-up {row['setup_s']:.0f} s "
            f"against {ref['setup_s']:.0f} s: a trial compiles block 0 before training starts)"
            if setup_paid
            else f"its set-up ({row['setup_s']:.1f} s against {ref['setup_s']:.1f} s) stayed within that of rows that "
            f"compile nothing ({setup_range}), as when the compile cache already holds these graphs"
        )
        first = (
            f"its first step took {row['first_step_s']:.2f} s against {ref['first_step_s']:.2f} s (more graphs "
            "compiled during it)"
            if first_paid
            else f"its first step ({row['first_step_s']:.2f} s against {ref['first_step_s']:.2f} s) stayed within "
            f"the first steps of rows that compile nothing ({first_range})"
        )
        out.append(
            f"{measured('+compile')}; {paid}, and {first}. Compile fuses the element-wise glue between "
            "the matmuls: what that buys depends on how much of a step the glue takes."
        )
    fp8 = "+FP8 tensorwise"
    if fp8 in steps:
        row, (ref, ratio, band) = named[fp8], steps[fp8]
        emulated = "emulated" in row.get("fp8", "")
        if emulated:
            how = (
                "torchao emulates FP8 here: each matmul's operands are cast to FP8 and back, then multiplied "
                "in float32 (torch.mm)"
            )
            bf16_ref = ref.get("compute_dtype") == "bfloat16"
            if ratio > 1 + band and bf16_ref and fp32_over_bf16 and fp32_over_bf16 > 1:
                why = (
                    f". Next to {ref['row']}'s bf16 matmuls that switches the Linears to float32 matmuls, "
                    f"{fp32_over_bf16:.2g}× faster on this processor: the speed-up is the dtype, not FP8"
                )
            elif ratio > 1 + band:
                why = ". Faster although emulated: the casts add work, so the gain comes from the matmul path, not FP8"
            elif ratio < 1 - band:
                why = ": the casts add work and no FP8 unit multiplies faster, so it costs time"
            else:
                why = ": the casts' cost and the float32 matmuls' speed leave no difference beyond noise"
            out.append(f"{measured(fp8)}. {how}{why}.")
        else:
            out.append(f"{measured(fp8)}: real FP8 matmuls on FP8 tensor cores.")
    fsdp = next((r["row"] for r in rows if r["row"].startswith("FSDP")), None)
    if fsdp in steps:
        row, (ref, ratio, band) = named[fsdp], steps[fsdp]
        shared = f"the {cores} cores of this one machine" if cores else "this one machine's cores"
        used, before = (
            (row["nproc"] * row["threads"], ref["nproc"] * ref["threads"])
            if row.get("threads") and ref.get("threads")
            else (None, None)
        )
        if ratio > 1 + band and used and used > before:
            out.append(
                f"{measured(fsdp)}: its {row['nproc']} ranks ran {used} threads in all on {shared}, where "
                f"{ref['row']} ran {before}: more cores at work, not the sharding, which adds no device here."
            )
        else:
            out.append(
                f"{measured(fsdp)}: its ranks split {shared}, they do not add devices, so sharding buys "
                "memory per rank here, not speed."
            )
    if "+FP8 all-gather" in steps:
        out.append(
            f"{measured('+FP8 all-gather')}: the weights travel as FP8 in FSDP's all-gather, a quarter "
            "of float32's bytes, through memory shared by the ranks."
        )
    return " ".join(out)


def choose_recipe(
    args,
    n_devices: int,
    mem_bytes: float,
    rows: list[dict],
    *,
    seq_len: int,
    micro_batch: int = 1,
    gpus_per_node: int | None = None,
) -> str:
    """The planner's layout for a model, device count and memory, and each technique's measured
    evidence from the table, against the same reference as the table: its speed ratio read
    against that comparison's noise band, its memory ratio where both figures are the rows' own."""
    from ..tools.predict.planner import plan

    p = plan(
        args,
        n_devices,
        mem_bytes,
        seq_len=seq_len,
        micro_batch=micro_batch,
        gpus_per_node=gpus_per_node or n_devices,
    )
    lines = [
        p.report(top=2),
        "",
        "measured evidence on this machine (each row against its reference, as in the table):",
    ]
    hidden = False
    for r, ref, speed, band in against_reference(rows):
        if r["row"] == "baseline (again)":
            continue
        known = r["peak_memory_bytes"] is not None and ref["peak_memory_bytes"] is not None
        hidden |= not known
        mem = (
            f", memory per rank {r['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f}×"
            if known
            else ""
        )
        lines.append(
            f"  {r['row']:18} {speed:5.2f}× {ref['row']:16} {verdict(speed, band, 'noise')}{mem}"
            + ("  [FP8 emulated]" if r["fp8"] and "emulated" in r["fp8"] else "")
        )
    if hidden:
        lines.append("  (memory only where both rows' figures are their own: see the table's —*)")
    return "\n".join(lines)


@dataclass
class DrillCheck:
    measured: dict  # goodput.summarize of the drill
    model: dict  # the replay model's prediction from the drill's own costs
    restored_from: list[int] = field(default_factory=list)
    lost_steps: int = 0
    step_s: float = 0.0  # the mean kept step the model charges each lost step at

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
