"""What the model can do so far: its loss on held-out text, and text it writes.

loss = validation_loss(loss_on, batches, device)         # mean over target tokens
text = generate(model, tokenizer, "The ", max_new_tokens=48, context=256)
"""

import contextlib

import torch

from .data.transfer import to_device
from .distributed.env import all_reduce_sum
from .efficiency.accumulation import count_targets


@torch.no_grad()
def validation_loss(loss_on, batches, device, distributed: bool = False, parts=()) -> float:
    """Mean loss per target token over `batches` (each data-parallel rank passes its own
    shard's), summed over every rank. `loss_on(x, y)` is one batch's mean token loss (a number
    or a one-element tensor). The model's `parts`, if given, are in eval mode meanwhile (no dropout-like
    behaviour; no autograd either), and back in training mode afterwards."""
    for part in parts:
        part.eval()
    loss_total, tokens = 0.0, 0
    try:
        for batch in batches:
            x, y, *documents = to_device(batch, device)  # documents: under a document mask
            n = max(1, count_targets(batch[1]))  # counted on the host copy
            loss_total, tokens = loss_total + float(loss_on(x, y, *documents)) * n, tokens + n
    finally:
        for part in parts:
            part.train()
    if distributed:
        # TP and PP ranks of one slice add the same pair twice over: the ratio is unchanged;
        # CP ranks each add their part of the sequences.
        both = torch.tensor([loss_total, float(tokens)], dtype=torch.float64, device=device)
        loss_total, tokens = all_reduce_sum(both).tolist()
    return loss_total / tokens


@contextlib.contextmanager
def whole_sequences(model: torch.nn.Module):
    """`model` on whole sequences for a while (generating text under context parallelism): its
    layers (models/llama.py's Transformer and Attention) set their cp group aside, and get it
    back after."""
    held = [
        (m, m.context_parallel) for m in model.modules() if getattr(m, "context_parallel", None)
    ]
    for module, _ in held:
        module.context_parallel = None
    try:
        yield
    finally:
        for module, cp in held:
            module.context_parallel = cp


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 1234,
) -> str:
    """Continue `prompt` with top-k sampling over the last `context` tokens. A generator of
    its own, so sampling never moves the training run's random streams."""
    ids = tokenizer.encode(prompt) or [tokenizer.eos_token_id or 0]
    x = torch.tensor([ids], device=next(model.parameters()).device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        # eager: prompts of every length would each trigger a recompile; whole sequences: under
        # context parallelism every rank runs the whole prompt (a few tokens, not worth cutting)
        with torch.compiler.set_stance("force_eager"), whole_sequences(model):
            logits = model(x[:, -context:])
        # TP: vocab-sharded
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logits = logits[0, -1].float().cpu() / max(temperature, 1e-5)
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)
        x = torch.cat(
            [x, torch.multinomial(probs, 1, generator=gen).to(x.device).view(1, 1)], dim=1
        )
    model.train(was_training)
    return tokenizer.decode(x[0].tolist())
