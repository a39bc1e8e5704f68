"""One kind of error for bad input: it names the problem and the fix in one line.

Library code raises `TitanliteError`; the CLI prints it as a single line and exits with
status 2, and in Jupyter `notebook_setup()` (titanlite/tools/notebook.py) shows it without the
traceback wall - but with every exception that led to it."""

from __future__ import annotations

import difflib


class TitanliteError(Exception):
    """Bad input or an unavailable resource, explained in one line (problem + fix)."""


def closest(word: str, choices, n: int = 3) -> str:
    """' (did you mean: a, b?)' for the nearest valid names, or '' when none is close."""
    hits = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""
