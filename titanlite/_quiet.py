"""Silence harmless import-time noise that would only confuse learners.

torchao tries to load CUDA-only extensions (`_C_mxfp8`, `_C_cutlass_90a`) and logs
"Failed to load ..." on every CPU import; torch's pytree logs a deprecation note for
torchao's enums. Neither affects anything titanlite does, so we raise those loggers'
level before anything imports torchao (transformers imports it too when installed).
"""
import logging
import os

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# transformers' advisory messages (e.g. "TensorFlow not found") add nothing here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
