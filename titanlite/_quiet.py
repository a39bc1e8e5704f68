"""Silence harmless third-party noise that would only confuse learners - when asked to.

torchao tries to load CUDA-only extensions (`_C_mxfp8`, `_C_cutlass_90a`) and logs
"Failed to load ..." on every CPU import; torch's pytree logs a deprecation note for
torchao's enums; transformers adds advisory notes (e.g. "TensorFlow not found"). None of it
affects anything titanlite does.

Importing titanlite changes nothing (a library must not reconfigure the program that imports
it). Entry points opt in: `titanlite.notebook_setup()` in a notebook's first cell, the CLI's
`main()` and the torchrun workers of `launch_function` call `quiet_third_party()` before they
import torchao.
"""
from __future__ import annotations

import logging
import os

# Logger name -> the level it gets: only messages at this level or above still show.
NOISY_LOGGERS = {"torchao": logging.ERROR, "torch.utils._pytree": logging.ERROR}
ENVIRONMENT = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def quiet_third_party() -> None:
    """Raise the noisy loggers' levels and turn off transformers' advice. Idempotent; call it
    before torchao is imported (its "Failed to load" lines are logged at import). A value the
    user already set in the environment is kept."""
    for name, level in NOISY_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
