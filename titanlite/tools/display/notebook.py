"""A notebook's first cell, and the command line's first step: what a learner should see.

    from titanlite.tools.display.notebook import notebook_setup
    notebook_setup()

Importing titanlite changes nothing (a library must not reconfigure the program that imports
it). Entry points opt in: `notebook_setup()` in a notebook's first cell; the CLI's `main()` and
the torchrun workers of `launch_function` call `quiet_third_party()` before they import torchao.

- `quiet_third_party`: torchao tries to load CUDA-only extensions (`_C_mxfp8`,
  `_C_cutlass_90a`) and logs "Failed to load ..." on every CPU import; torch's pytree logs a
  deprecation note for torchao's enums; transformers adds advisory notes. None of it affects
  anything titanlite does.
- `install_notebook_handler`: a TitanliteError shows as one line per link of its chain
  instead of a traceback; other errors keep IPython's full traceback.
- `one_line_warnings`: a warning shows as `RuntimeWarning: <message>`, one line, without the
  file, line number and source line Python adds (noise next to a notebook's own output).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings

from ...errors import TitanliteError

# Logger name -> the level it gets: only messages at this level or above still show.
NOISY_LOGGERS = {
    "torchao": logging.ERROR,
    "torch.utils._pytree": logging.ERROR,
    # torchft's notes on every quorum (NCCL's flight recorder, absent on a CPU); its errors stay
    "torchft": logging.ERROR,
}
# torchft's Rust side (lighthouse, managers) logs each quorum tick at INFO, read at its import
ENVIRONMENT = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "RUST_LOG": "warn"}


def quiet_third_party() -> None:
    """Raise the noisy loggers' levels and turn off transformers' advice. Idempotent; call it
    before torchao is imported (its "Failed to load" lines are logged at import). A value the
    user already set in the environment is kept."""
    for name, level in NOISY_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def notebook_setup() -> None:
    """Run once in a notebook's first cell, before anything imports torchao: quiets third-party
    noise (`quiet_third_party`), shows a TitanliteError as one line per link of its chain
    (`install_notebook_handler`) and a warning as one line (`one_line_warnings`). Calling it
    again changes nothing."""
    quiet_third_party()
    install_notebook_handler()
    one_line_warnings()


def one_line_warnings() -> None:
    """Show every warning as one line: its category and message. Python's default adds where it
    was raised and that source line, which in a notebook reads as a second, cryptic line."""

    def one_line(message, category, filename, lineno, line=None):
        return f"{category.__name__}: {message}\n"

    warnings.formatwarning = one_line


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
