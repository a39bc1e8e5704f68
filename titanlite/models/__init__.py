"""The model: a Llama-3-style decoder (llama.py) and how a Hugging Face Llama checkpoint's
names and config map onto it (hf_llama.py). Writing one out is a tool: titanlite.tools.export."""
