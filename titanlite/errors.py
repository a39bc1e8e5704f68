"""One kind of error for bad input: it names the problem and the fix in one line.

Library code raises `TitanliteError`; the CLI prints it as a single line and exits with
status 2, and in Jupyter `install_notebook_handler()` shows it without the traceback wall.
"""
from __future__ import annotations

import difflib
import sys


class TitanliteError(Exception):
    """Bad input or an unavailable resource, explained in one line (problem + fix)."""


def closest(word: str, choices, n: int = 3) -> str:
    """' (did you mean: a, b?)' for the nearest valid names, or '' when none is close."""
    hits = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""


def install_notebook_handler() -> None:
    """In IPython, show a TitanliteError as one red line instead of a traceback."""
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        return

    def _show(shell, etype, value, tb, tb_offset=None):
        print(f"TitanliteError: {value}", file=sys.stderr)
        return None

    ip.set_custom_exc((TitanliteError,), _show)
