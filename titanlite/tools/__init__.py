"""The tools: what measures, probes, plots, teaches and launches - beside the core, never
imported by it (tests/test_layering.py checks). A training run needs none of these; the
notebooks and the command line use them, and hand the ones that watch a run to the loop
(`Trainer.fit(callbacks=...)`, `watchers=...`).

    cli, config_help        the `titanlite` command line
    launcher, run_function  torchrun from a notebook cell (launch, launch_function)
    live_plot               live loss / tokens/s / MFU in JupyterLab
    doctor                  `titanlite doctor`: the self-check of this machine's device
    course                  the two editions, `titanlite progress`
    hpo                     Optuna over the trainer
    roofline, cpu, mps, data_loading   probes of the machine
    flops, comm, zero       FLOPs counted op by op, collectives counted, the ZeRO memory model
    pipeline_timeline, planner, goodput_model   timelines, choosing degrees, Young/Daly
    scratch_ddp, scratch_tp  data and tensor parallelism by hand, for teaching
    profiling               torch.profiler over training steps, and reading its traces
    export                  one torch file, a Hugging Face directory
"""

from .launcher import LaunchResult, launch, launch_function

__all__ = ["LaunchResult", "launch", "launch_function"]
