"""One kind of error for bad input: it names the problem and the fix in one line.

Library code raises `TitanliteError`; the CLI prints it as a single line and exits with
status 2, and in Jupyter `notebook_setup()` (titanlite/tools/notebook.py) shows it without the
traceback wall - but with every exception that led to it."""

import contextlib
import difflib
import errno
import os
import re


class TitanliteError(Exception):
    """Bad input or an unavailable resource, explained in one line (problem + fix)."""


def refuse_first(*refusals: tuple[object, str]) -> None:
    """Raise the first refusal (what cannot work, its one line with the fix) whose condition holds."""
    for broken, message in refusals:
        if broken:
            raise TitanliteError(message)


class WriteFailed(TitanliteError):
    """A write the disk refused (full, over quota, read-only, not ours). What was on disk before is
    intact (written aside, renamed only when whole). `exit_code`: 1 for a disk that filled up while
    running, 2 for a path that could never be written (bad input), as the CLI exits."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


# The disk errors a user can fix, and how: whatever wrapped them (DCP's CheckpointException, a
# safetensors or Rust message, an exception raised while handling another), `writing` names them.
DISK_FIX = {
    errno.ENOSPC: "free space on that disk or choose another folder, then run again (a run "
    "resumes from its last committed checkpoint)",
    errno.EDQUOT: "your disk quota is used up: free some of it or choose another folder, then run again",
    errno.EROFS: "that filesystem is read-only: choose a folder on a writable one",
    errno.EACCES: "this user may not write there: choose a folder you own",
}


def disk_error(e: BaseException) -> OSError | None:
    """The disk error (an errno in DISK_FIX) behind `e`, followed through causes, contexts, DCP's
    per-rank failures and messages that only quote it ("os error 28", "[Errno 28]"), or None."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in DISK_FIX:
            return x
        quoted = re.search(r"(?:os error |\[Errno )(\d+)", str(x))
        if quoted and int(quoted[1]) in DISK_FIX:
            return OSError(int(quoted[1]), os.strerror(int(quoted[1])))
        failures = getattr(x, "failures", None)  # DCP: {rank: (exception, its traceback)}
        for failure in failures.values() if isinstance(failures, dict) else ():
            todo += list(failure) if isinstance(failure, tuple) else [failure]
        todo += [x.__cause__, x.__context__]
    return None


@contextlib.contextmanager
def writing(path, what: str):
    """Inside, a write the disk refuses becomes one line naming `what`, `path` and the fix."""
    try:
        yield
    except BaseException as e:
        # ours already says what went wrong; anything else is a disk error or not ours to explain
        if isinstance(e, TitanliteError) or (err := disk_error(e)) is None:
            raise
        reason = (err.strerror or os.strerror(err.errno)).lower()
        raise WriteFailed(
            f"{reason} writing {what} '{path}': {DISK_FIX[err.errno]}",
            exit_code=1 if err.errno in (errno.ENOSPC, errno.EDQUOT) else 2,  # filled up: 1
        ) from None


def closest(word: str, choices, n: int = 3) -> str:
    """' (did you mean: a, b?)' for the nearest valid names, or '' when none is close."""
    hits = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""
