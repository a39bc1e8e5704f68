"""The model: a Llama-3-style decoder (llama.py) and its rotary position embeddings (rope.py).
Reading and writing Hugging Face checkpoints are tools: titanlite.tools.hf_start and .export."""
