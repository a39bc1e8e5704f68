"""titanlite: efficient and resilient LLM pretraining you can learn from on a laptop.

Importing titanlite configures nothing: no logger levels, environment variables, warning
filters or exception handlers change. A notebook opts in with its first cell,

    import titanlite
    titanlite.notebook_setup()

and the command line (`python -m titanlite`, torchrun workers) calls `quiet_third_party()`.
"""
from __future__ import annotations

import os

from ._quiet import quiet_third_party
from .errors import TitanliteError, install_notebook_handler

__version__ = "0.1.0"


def is_smoke() -> bool:
    """True when TITANLITE_SMOKE=1: notebooks and benches shrink steps and sizes to run in
    well under two minutes on a 2-core CPU."""
    return os.environ.get("TITANLITE_SMOKE", "0").strip().lower() in ("1", "true", "yes", "on")


def notebook_setup() -> None:
    """Run once in a notebook's first cell, before anything imports torchao:
    quiets torchao's "Failed to load ..." lines and similar third-party noise
    (`quiet_third_party`), and shows a TitanliteError as one line per link of its chain
    instead of a traceback (`install_notebook_handler`; other errors keep theirs).
    Calling it again changes nothing."""
    quiet_third_party()
    install_notebook_handler()


__all__ = ["TitanliteError", "is_smoke", "notebook_setup", "quiet_third_party", "__version__"]
