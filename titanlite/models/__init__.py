"""Model definitions: a Llama-3-style decoder and its Hugging Face bridge."""
from .llama import PRESETS, ModelArgs, Transformer, build_model

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model"]
