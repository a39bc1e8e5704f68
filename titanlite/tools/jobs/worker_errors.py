"""A worker's error report that torchrun's agent never reads half of.

torch's `record` writes a failing rank's traceback, as JSON, to the file torchrun names in
TORCHELASTIC_ERROR_FILE, in place. When one rank dies, the agent tears the others down with
SIGTERM, often while one of them is still writing its report of that death; the agent then
parses half a file, raises `JSONDecodeError` and exits instead of restarting the job. Here the
report is written beside that file and renamed over it (atomic on POSIX): the agent finds the
whole report or none, and a missing one only costs the traceback.

    record(main)()     # as torch's `record(main)()`; __main__.py and run_function.py use it
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as torch_record

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where torchrun's agent looks for a rank's report


class AtomicErrorHandler(ErrorHandler):
    """torch's handler, writing to a temporary name that is then renamed over the real one."""

    def record_exception(self, e: BaseException) -> None:
        final = os.environ.get(ERROR_FILE)
        if not final:  # not under torchrun: torch's handler logs the report instead
            return super().record_exception(e)
        partial = f"{final}.{os.getpid()}.partial"
        os.environ[ERROR_FILE] = partial  # torch's handler writes wherever this names
        try:
            super().record_exception(e)
        finally:
            os.environ[ERROR_FILE] = final
        os.replace(partial, final)


def record(fn):
    """torch's `record` (an uncaught exception's traceback reaches the launcher), written atomically."""
    return torch_record(fn, error_handler=AtomicErrorHandler())
