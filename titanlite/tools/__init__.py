"""The tools: what measures, probes, predicts, plots, teaches and launches - beside the core, never
imported by it. A training run needs none of them; the command line and the notebooks use them,
and hand the ones that watch a run to the loop (`Trainer.fit(watchers=...)`, `callbacks=...`) or
the trainer (`Trainer(cfg, peaks=..., datasheet=..., start_from=...)`).

One sub-package per purpose; each says in its docstring what belongs there and what it may
import (tests/test_layering.py holds the table):

    display/   the notebook's display: live plots, a notebook's first cell, pipeline timelines
    formats/   other projects' formats: Hugging Face folders in and out, one torch file, corpora
    predict/   predicting before a run: memory (ZeRO, activations, fake tensors), the planner,
               goodput and Young/Daly
    probe/     probing the machine: matmul peaks, the roofline, datasheets, CPU, MPS, precisions
    measure/   measuring a run: profiler, FLOPs and collectives counted, host syncs, compile
               reports, data loading, checkpoint I/O, goodput, stragglers
    jobs/      launching jobs: torchrun from a cell, the fork server, Optuna's trials
    course/    the course: the workbook and student editions, progress, the reading order
    cli/       the `titanlite` command and `titanlite doctor`, the top: it may import every tool

Code that serves one lesson only lives in titanlite/labs/ beside that lesson's other code.

Where a module lived before this layout (2026-11), importing the old name fails with one line
that names the new one (`MOVED`); `make lab` lists the workbook notebooks you edited that
still import an old name, with the new one."""

import sys
from importlib.abc import MetaPathFinder

# old module -> where it lives now (tools grouped by purpose, lesson-only code moved to labs/)
MOVED = {
    f"titanlite.tools.{old}": f"titanlite.{new}"
    for old, new in {
        "cli": "tools.cli.main",
        "config_help": "tools.cli.config_help",
        "doctor": "tools.cli.doctor",
        "launcher": "tools.jobs.launcher",
        "forkserver": "tools.jobs.forkserver",
        "run_function": "tools.jobs.run_function",
        "worker_errors": "tools.jobs.worker_errors",
        "hpo": "tools.jobs.hpo",
        "export": "tools.formats.export",
        "hf_start": "tools.formats.hf_start",
        "hf_moe": "tools.formats.hf_moe",
        "corpora": "tools.formats.corpora",
        "profiling": "tools.measure.profiling",
        "comm": "tools.measure.comm",
        "flops": "tools.measure.flops",
        "host_syncs": "tools.measure.host_syncs",
        "compile_report": "tools.measure.compile_report",
        "data_loading": "tools.measure.data_loading",
        "checkpoint_io": "tools.measure.checkpoint_io",
        "goodput": "tools.measure.goodput",
        "stragglers": "tools.measure.stragglers",
        "roofline": "tools.probe.roofline",
        "cpu": "tools.probe.cpu",
        "mps": "tools.probe.mps",
        "vendors": "tools.probe.vendors",
        "precision_support": "tools.probe.precision_support",
        "datasheet": "tools.probe.datasheet",
        "planner": "tools.predict.planner",
        "predict_memory": "tools.predict.predict_memory",
        "activation_memory": "tools.predict.activation_memory",
        "zero": "tools.predict.zero",
        "goodput_model": "tools.predict.goodput_model",
        "live_plot": "tools.display.live_plot",
        "notebook": "tools.display.notebook",
        "pipeline_timeline": "tools.display.pipeline_timeline",
        "course": "tools.course.editions",
        "reading_order": "tools.course.reading_order",
        "scratch_ddp": "labs.nb07_scratch_ddp",
        "scratch_tp": "labs.nb09_scratch_tp",
        "fp8_numerics": "labs.nb06_fp8_numerics",
        "sdpa_kernels": "labs.nb04_sdpa_kernels",
    }.items()
}


def moved_to(name: str) -> str | None:
    """Where module `name` (or a module inside it, `titanlite.tools.profiling.reading`) lives now."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def moved_message(name: str) -> str:
    return (
        f"{name} moved to {moved_to(name)}: import it from there "
        "(titanlite's tools are grouped by purpose; titanlite/tools/__init__.py lists them)"
    )


class _MovedModules(MetaPathFinder):
    """Asked last, when no file answered: an old name fails with the new one in its one line."""

    def find_spec(self, name, path=None, target=None):
        if moved_to(name) is not None:
            # no `name=`: `from titanlite.tools import live_plot` would otherwise swallow this
            # error and say only "cannot import name 'live_plot'"
            raise ModuleNotFoundError(moved_message(name))
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
