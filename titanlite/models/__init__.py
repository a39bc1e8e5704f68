"""The model: a Llama-3-style decoder (llama.py), its rotary position embeddings (rope.py) and its
mixture-of-experts feed-forward (moe.py, notebook 18).
Reading and writing Hugging Face checkpoints are tools: titanlite.tools.formats.hf_start and .export."""
