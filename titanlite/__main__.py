"""`python -m titanlite ...`: the command line (tools/cli/commands.py), and the one entry of a torchrun worker:

    torchrun --nproc-per-node 2 -m titanlite train --config configs/debug.toml

One entry, so `titanlite.train` is imported once, as itself: `-m titanlite.train` would also
run it as `__main__`, a second module with a second `Trainer` class.
"""

import os
import sys

from .tools.cli.commands import main

if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun (or the notebook launcher's)
    # `record` writes an unexpected exception's traceback to the file torchrun names, so the
    # launcher can show the failing rank's traceback (TitanliteErrors stay one line); written
    # atomically, so an agent tearing this rank down mid-report still restarts the job.
    from .distributed.env import exit_worker
    from .tools.jobs.worker_errors import record

    exit_worker(record(main)() or 0)  # see exit_worker: no interpreter teardown under gloo
sys.exit(main())
