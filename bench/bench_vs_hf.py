"""titanlite vs Hugging Face `LlamaForCausalLM`: eager fp32 training throughput, side by side.

Equal work on both sides:
  * the same weights (the HF model is a copy made by `to_hf_model` before any step);
  * the same batches (windows of the pydoc corpus from `titanlite.data.build_data`, or
    fixed random tokens with --data random), in the same order;
  * the same step as titanlite's Trainer: logits → mean cross-entropy over all B·T
    positions (computed outside the model on the returned logits, identically for both),
    backward, clip_grad_norm_(1.0), AdamW(lr 3e-4, betas (0.9, 0.95), wd 0.1);
  * fp32, eager, no torch.compile. HF runs in its normal configuration:
    attn_implementation="sdpa", training mode, use_cache=False (a training loop has no
    KV cache; with the default use_cache=True HF would also fill a DynamicCache).

A shared 2-core machine drifts (thermal, neighbours), so after warm-up the timed steps
alternate A B, B A, … and we report the median tokens/s of each and their ratio (and the
ratio of the best steps, the least disturbed by neighbours on a busy machine). The first
losses of both are printed as well: equal losses show that the two did the same computation.

    python bench/bench_vs_hf.py --preset small
    TITANLITE_SMOKE=1 python bench/bench_vs_hf.py      # ~20 s
"""

from __future__ import annotations

import argparse
import statistics
import time

import titanlite
from titanlite.tools.display.notebook import quiet_third_party

quiet_third_party()  # first: hides torchao's import noise before transformers loads
import torch  # noqa: E402 (after quiet_third_party, on purpose)
import torch.nn.functional as F  # noqa: E402

from titanlite.models.llama import ModelArgs, build_model  # noqa: E402
from titanlite.tools.formats.export import to_hf_model  # noqa: E402

# Batch shapes of configs/debug.toml and configs/small.toml: what the notebooks train with.
DEFAULT_SHAPE = {"debug": (16, 128), "small": (16, 256)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug", help="titanlite model preset (debug, small, ...)")
    p.add_argument("--batch-size", type=int, help="default: the preset's config (16)")
    p.add_argument("--seq-len", type=int, help="default: the preset's config (128 / 256)")
    p.add_argument("--steps", type=int, help="timed steps per model, interleaved (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--data", choices=("pydoc", "random"), default="pydoc")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    batch, seq = DEFAULT_SHAPE.get(a.preset, (8, 256))
    if titanlite.is_smoke():  # explicit flags still win
        batch, seq, a.warmup = 4, 64, 1
    a.batch_size = a.batch_size or batch
    a.seq_len = a.seq_len or seq
    a.steps = a.steps or (6 if titanlite.is_smoke() else 20)
    return a


def batches(
    a, vocab_size: int, n: int = 4
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, str]:
    """n (inputs, targets) batches, the vocabulary size they need, and where they came from."""
    if a.data == "pydoc":
        from titanlite.data import build_data

        data = build_data(
            "pydoc", vocab_size=vocab_size, seq_len=a.seq_len, batch_size=a.batch_size, seed=a.seed
        )
        return [data.train.next_batch() for _ in range(n)], data.vocab_size, data.corpus_id
    g = torch.Generator().manual_seed(a.seed)
    rows = [
        torch.randint(0, vocab_size, (a.batch_size, a.seq_len + 1), generator=g) for _ in range(n)
    ]
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows], vocab_size, "random"


def make_stepper(forward, params, data, vocab: int):
    """The Trainer's step: CE over all tokens → backward → clip → AdamW, cycling the batches."""
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    i = 0

    def step() -> float:
        nonlocal i
        x, y = data[i % len(data)]
        i += 1
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data, vocab, source = batches(a, ModelArgs.preset(a.preset).vocab_size)
    margs = ModelArgs.preset(
        a.preset,
        vocab_size=vocab,
        max_seq_len=max(a.seq_len, ModelArgs.preset(a.preset).max_seq_len),
    )
    tl = build_model(margs).train()
    hf = to_hf_model(tl).train()

    steppers = {
        "titanlite": make_stepper(tl, list(tl.parameters()), data, vocab),
        "HF Llama (sdpa)": make_stepper(
            lambda x: hf(input_ids=x, use_cache=False).logits, list(hf.parameters()), data, vocab
        ),
    }
    first = {name: step() for name, step in steppers.items()}
    for _ in range(a.warmup - 1):
        for step in steppers.values():
            step()

    tok = a.batch_size * a.seq_len
    rates: dict[str, list[float]] = {name: [] for name in steppers}
    for i in range(a.steps):
        for name in list(steppers) if i % 2 == 0 else list(reversed(steppers)):
            t0 = time.perf_counter()
            steppers[name]()
            rates[name].append(tok / (time.perf_counter() - t0))

    med = {n: statistics.median(r) for n, r in rates.items()}
    ratio = med["titanlite"] / med["HF Llama (sdpa)"]
    print(
        f"preset={a.preset} ({tl.num_params() / 1e6:.2f}M params, vocab {vocab}) "
        f"batch={a.batch_size} seq_len={a.seq_len} data={source} threads={a.threads} "
        f"timed_steps={a.steps}/model warmup={a.warmup} fp32 eager, torch {torch.__version__}"
    )
    print(f"{'model':<18}{'loss@0':>9}{'median tok/s':>14}{'min':>9}{'max':>9}{'ms/step':>9}")
    for n, r in rates.items():
        print(
            f"{n:<18}{first[n]:>9.4f}{med[n]:>14,.0f}{min(r):>9,.0f}{max(r):>9,.0f}"
            f"{1000 * tok / med[n]:>9.1f}"
        )
    best = max(rates["titanlite"]) / max(rates["HF Llama (sdpa)"])
    # The best step is the least disturbed by neighbours: a second view when the box is busy.
    print(f"ratio titanlite / HF: {ratio:.2f}x (median tok/s), {best:.2f}x (best step)")
    return {"tokens_per_s": med, "ratio": ratio, "ratio_best": best, "first_loss": first}


if __name__ == "__main__":
    main()
