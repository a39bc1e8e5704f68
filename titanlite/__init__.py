"""titanlite: efficient and resilient LLM pretraining you can learn from on a laptop."""
from __future__ import annotations

import os

from . import _quiet  # noqa: F401  (must run before torchao/transformers are imported)
from .errors import TitanliteError, install_notebook_handler

__version__ = "0.1.0"


def is_smoke() -> bool:
    """True when TITANLITE_SMOKE=1: notebooks and benches shrink steps and sizes to run in
    well under two minutes on a 2-core CPU."""
    return os.environ.get("TITANLITE_SMOKE", "0").strip().lower() in ("1", "true", "yes", "on")


install_notebook_handler()

__all__ = ["TitanliteError", "is_smoke", "__version__"]
