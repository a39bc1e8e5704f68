"""One kind of error for bad input: it names the problem and the fix in one line.

Library code raises `TitanliteError`; the CLI prints it as a single line and exits with
status 2, and in Jupyter `titanlite.notebook_setup()` installs `install_notebook_handler()`,
which shows it without the traceback wall - but with every exception that led to it.
"""
from __future__ import annotations

import difflib
import sys
import traceback


class TitanliteError(Exception):
    """Bad input or an unavailable resource, explained in one line (problem + fix)."""


def closest(word: str, choices, n: int = 3) -> str:
    """' (did you mean: a, b?)' for the nearest valid names, or '' when none is close."""
    hits = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""


def chain_lines(error: BaseException) -> list[str]:
    """One line per exception in `error`'s chain, outermost first: the TitanliteError itself,
    then each cause (`raise ... from cause`) or context (raised while handling another), the
    same links Python's own traceback would print, each with where it was raised."""
    lines, seen, link, prefix = [], set(), error, ""
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        text = f"{type(link).__name__}: {link}" if str(link) else type(link).__name__
        if prefix:  # a cause is usually not a TitanliteError: say where it came from
            frames = traceback.extract_tb(link.__traceback__)
            if frames:
                text += f"  ({frames[-1].filename}:{frames[-1].lineno})"
        lines.append(prefix + text)
        if link.__cause__ is not None:
            link, prefix = link.__cause__, "  caused by "
        elif link.__context__ is not None and not link.__suppress_context__:
            link, prefix = link.__context__, "  while handling "
        else:
            link = None
    return lines


def install_notebook_handler() -> bool:
    """In IPython, show a TitanliteError as its one line (plus one line per chained cause)
    instead of a traceback; other errors keep IPython's full traceback. Idempotent (IPython
    keeps one custom handler). Returns False outside IPython, where it does nothing."""
    shell = _ipython()
    if shell is None:
        return False

    def show(shell, etype, value, tb, tb_offset=None):
        print("\n".join(chain_lines(value)), file=sys.stderr)
        return None

    shell.set_custom_exc((TitanliteError,), show)
    return True


def _ipython():
    """The running IPython shell, or None. IPython is only asked if something imported it
    already: a plain Python process never pays for importing it."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython
    return get_ipython()
