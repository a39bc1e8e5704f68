"""titanlite: efficient and resilient LLM pretraining you can learn from on a laptop.

The core (what a training run imports) is the top level and models/, data/, efficiency/,
distributed/, resilience/; tools/ measures, probes, plots, teaches and launches; labs/ holds the
notebooks' experiments. Importing titanlite configures nothing: a notebook opts in with `notebook_setup()`."""

import os

from .errors import TitanliteError

__version__ = "0.1.0"


def is_smoke() -> bool:
    """True when TITANLITE_SMOKE=1: notebooks and benches shrink to run in under 2 minutes on a 2-core CPU."""
    return os.environ.get("TITANLITE_SMOKE", "0").strip().lower() in ("1", "true", "yes", "on")


__all__ = ["TitanliteError", "is_smoke", "__version__"]
