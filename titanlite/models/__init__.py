"""Model definitions: a Llama-3-style decoder and its Hugging Face bridge."""
from .from_config import model_args_for
from .hf_interop import from_hf, to_hf, to_hf_model
from .llama import PRESETS, ModelArgs, Transformer, build_model

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model", "from_hf", "to_hf", "to_hf_model",
           "model_args_for"]
