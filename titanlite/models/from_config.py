"""The model shape a run's config asks for: a preset, its overrides, and the tokenizer's size."""
from __future__ import annotations

from ..errors import TitanliteError
from .llama import ModelArgs

# Presets sized for training here take their vocabulary from the tokenizer; the large ones
# keep the published vocabulary so their parameter counts stay true.
VOCAB_FROM_TOKENIZER = ("debug", "small")


def model_args_for(cfg, tokenizer_vocab: int) -> ModelArgs:
    """ModelArgs for `cfg.model` (a titanlite Config), checked against the tokenizer and seq_len."""
    m = cfg.model
    if cfg.checkpoint.initial_load_path:  # a published checkpoint's shape, not a preset's
        from ..resilience.initial_load import checkpoint_model_args
        args = checkpoint_model_args(cfg)
    else:
        args = ModelArgs.preset(m.preset, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                                n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
                                max_seq_len=m.max_seq_len, tie_embeddings=m.tie_embeddings)
        if m.vocab_size is None and m.preset in VOCAB_FROM_TOKENIZER:
            args.vocab_size = tokenizer_vocab
    if args.vocab_size < tokenizer_vocab:
        raise TitanliteError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is "
            f"{args.vocab_size}, so token ids would be out of range: set --model.vocab_size "
            f"{tokenizer_vocab} (or leave it unset), or use a smaller tokenizer")
    if cfg.training.seq_len > args.max_seq_len:
        raise TitanliteError(
            f"training.seq_len={cfg.training.seq_len} exceeds the model's maximum "
            f"({args.max_seq_len} for preset '{m.preset}'): lower --training.seq_len or raise "
            f"--model.max_seq_len")
    return args
