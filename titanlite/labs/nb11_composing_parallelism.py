"""Notebook 11's lab: a layout (pp × dp × tp) checked against what torch builds, through the
trainer. Run in every rank by
`launch_function("titanlite.labs.nb11_composing_parallelism:layout_lab", nproc=4, cfg=cfg)`.

    inspect_layout(mesh, parts)   # this rank's mesh coordinates, process groups, stored elements
    layout_lab(cfg)               # the trainer for cfg: its layout, then training, streamed live

The planner (distributed/planner.py) predicts; this measures what it predicted: the ranks of
each process group, and the parameter elements each rank stores (vs `planner.stage_params`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..distributed.mesh import DIM_NAMES
from ..tools.jobs.run_function import report
from ..train import Trainer
from ..weights import save_weights


def inspect_layout(mesh, parts) -> dict:
    """What this rank really has under a layout: its mesh coordinates; for each dim, the ranks
    of its process group as torch holds them and the ranks that answer an all-gather over it;
    and the parameter elements it stores (its DTensor shards), to hold against `planner.stage_params`."""
    rank, device = dist.get_rank(), mesh.device_type
    out = {"rank": rank, "coordinates": {n: mesh.get_local_rank(n) for n in DIM_NAMES}}
    for n in DIM_NAMES:
        group = mesh.get_group(n)
        answered = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(mesh[n].size())]
        dist.all_gather(answered, torch.tensor([rank], device=device), group=group)
        out[n] = {
            "mesh": mesh[n].mesh.tolist(),
            "group": dist.get_process_group_ranks(group),
            "answered": [int(t) for t in answered],
        }
    out["param_elements"] = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for part in parts
        for p in part.parameters()
    )
    return out


def layout_lab(cfg) -> dict:
    """A `launch_function` target: each rank builds the Trainer for `cfg` (a Config), reports
    what the layout gave it (`inspect_layout`), trains while streaming its records to the
    launcher's callbacks, and saves the gathered weights, exactly as `titanlite train` does."""
    job = os.environ.get("TITANLITE_JOB_DIR", cfg.metrics.log_dir)
    cfg.metrics.log_dir, cfg.metrics.run_name, cfg.metrics.progress = job, "trainer", False
    trainer = Trainer(cfg)
    layout = inspect_layout(trainer.mesh, trainer.model_parts)
    history = trainer.fit(callbacks=[report])
    save_weights(
        trainer.model_parts,
        trainer.model_args,
        trainer.dtype,
        trainer.tokenizer,
        history.run_dir,
        pp=trainer.dims.pp,
        is_main=trainer.dist.is_main,
    )
    return {
        "layout": layout,
        "losses": history.losses,
        "grad_norms": [r["grad_norm"] for r in history.train],
        "run_dir": str(history.run_dir),
    }
