"""What each rank of `launch_function` runs: join the job, call the function, save its result.

torchrun --nproc-per-node 2 -m titanlite.tools.jobs.run_function <job_dir>
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from ...distributed.env import destroy_distributed, exit_worker, init_distributed
from ..display.notebook import quiet_third_party
from .worker_errors import record


@record  # an exception's traceback goes to the file torchrun names (whole or not at all): the launcher shows it
def main(job_dir: str) -> None:
    quiet_third_party()  # before unpickling the job imports torchao: its CPU import is noisy
    job = Path(job_dir)
    spec = torch.load(job / "function.pt", weights_only=False)
    env = init_distributed(spec["device"], spec["backend"], spec["timeout_s"])
    module, name = spec["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(**spec["kwargs"])
    except BaseException:
        destroy_distributed()
        raise
    destroy_distributed(barrier=True)
    tmp = job / f"result.rank{env.rank}.pt.tmp"
    torch.save(result, tmp)
    tmp.rename(job / f"result.rank{env.rank}.pt")  # the launcher never reads half a file


def report(record: dict) -> None:
    """From inside a launched function: send one record to the launcher's callbacks (the live
    plot), the way training steps are sent."""
    import json
    import os

    rank = int(os.environ.get("RANK", 0))
    job = os.environ.get("TITANLITE_JOB_DIR")
    if job:
        with open(Path(job) / f"metrics.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": rank, **record}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker(0)  # result saved, group left: skip finalization (see exit_worker)
