"""Checks for notebooks 01-06: loss, schedule, accumulation, mixed precision, activation
checkpointing, FP8. Each compares the student's function with the package's own."""
from __future__ import annotations

import random

import torch

from ...exercises import call, fail, fresh_seed, passed, same_tensor, same_value
from . import exercise

IGNORE = -100  # the targets' padding value (titanlite.efficiency.accumulation.IGNORE_INDEX)


def _logits_and_targets(g: torch.Generator, batch: int, seq: int, vocab: int):
    logits = torch.randn(batch, seq, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[torch.rand(batch, seq, generator=g) < 0.2] = IGNORE  # padding the loss must skip
    targets.view(-1)[int(torch.randint(targets.numel(), (1,), generator=g))] = IGNORE  # at least one
    return logits, targets


@exercise("01_cross_entropy", "summed next-token cross-entropy, skipping padding")
def cross_entropy(fn):
    from ...efficiency.accumulation import IGNORE_INDEX, loss_sum
    assert IGNORE_INDEX == IGNORE
    name, seed = "01_cross_entropy", fresh_seed()
    g = torch.Generator().manual_seed(seed)
    for batch, seq, vocab in ((2, 5, 7), (3, 4, 11)):
        logits, targets = _logits_and_targets(g, batch, seq, vocab)
        got = call(name, fn, logits.clone(), targets.clone())
        same_tensor(name, got, loss_sum(logits, targets), f"the loss for logits {tuple(logits.shape)}",
                    seed=seed, rtol=1e-4)
    return passed(name, "equals titanlite.efficiency.accumulation.loss_sum on random logits")


@exercise("01_lr_schedule", "linear warm-up, then cosine decay to a floor")
def lr_schedule(fn):
    from ...config import load_config
    from ...train import lr_lambda
    name, seed = "01_lr_schedule", fresh_seed()
    rng = random.Random(seed)
    cfg = load_config(overrides={"scheduler.decay": "cosine"})
    for _ in range(3):
        warmup, total, floor = rng.randint(1, 20), rng.randint(25, 120), round(rng.uniform(0, 0.5), 3)
        cfg.scheduler.warmup_steps, cfg.training.steps, cfg.scheduler.min_lr_ratio = warmup, total, floor
        want = lr_lambda(cfg)
        for step in range(total + 3):
            same_value(name, call(name, fn, step, warmup, total, floor), want(step),
                       f"lr_factor({step}, warmup={warmup}, total={total}, floor={floor})",
                       seed=seed, rel=1e-9)
    return passed(name, "equals titanlite.train.lr_lambda at every step of 3 random schedules")


@exercise("02_global_token_loss", "per-micro-batch losses normalised by the global token count")
def global_token_loss(fn):
    from ...efficiency.accumulation import count_targets, loss_sum
    name, seed = "02_global_token_loss", fresh_seed()
    g = torch.Generator().manual_seed(seed)
    while True:  # uneven token counts, or the mean of per-micro-batch means would pass too
        micro = [_logits_and_targets(g, 2, int(torch.randint(3, 9, (1,), generator=g)), 13) for _ in range(3)]
        for _, t in micro[1:]:
            t[:, : int(torch.randint(1, t.shape[1], (1,), generator=g))] = IGNORE
        if len({count_targets(t) for _, t in micro}) > 1:
            break
    logits, targets = [m[0] for m in micro], [m[1] for m in micro]
    got = call(name, fn, [x.clone() for x in logits], [t.clone() for t in targets])
    if not isinstance(got, (list, tuple)) or len(got) != len(micro):
        fail(name, f"return one loss per micro-batch ({len(micro)}), got {type(got).__name__}"
                   f"{' of length ' + str(len(got)) if isinstance(got, (list, tuple)) else ''}", seed)
    total = sum(count_targets(t) for t in targets)
    for i, (x, t) in enumerate(zip(logits, targets)):
        same_tensor(name, got[i], loss_sum(x, t) / total,
                    f"micro-batch {i}'s loss (it has {count_targets(t)} of {total} real tokens)",
                    seed=seed, rtol=1e-4)
    return passed(name, f"the micro-batch losses add up to the mean over all {total} real tokens")


@exercise("02_accum_steps", "micro-batches per optimizer step from the global batch")
def accum_steps(fn):
    from ...efficiency.accumulation import resolve_batch
    name, seed = "02_accum_steps", fresh_seed()
    rng = random.Random(seed)
    for _ in range(20):
        micro, dp, accum = rng.randint(1, 16), rng.choice([1, 2, 4, 8]), rng.randint(1, 12)
        global_batch = micro * dp * accum
        want = resolve_batch(micro, 1, global_batch, dp)[1]
        same_value(name, call(name, fn, global_batch, micro, dp), want,
                   f"accum_steps(global_batch={global_batch}, micro_batch={micro}, dp={dp})", seed=seed)
    return passed(name, "equals titanlite.efficiency.accumulation.resolve_batch on 20 random batches")


@exercise("03_scaler_step", "GradScaler's skip-and-rescale rule")
def scaler_step(fn):
    name, seed = "03_scaler_step", fresh_seed()
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    init, interval = 2.0 ** rng.randint(8, 16), rng.randint(2, 4)
    param = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.SGD([param], lr=1.0)
    real = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    scale, tracker = init, 0
    for step in range(12):
        grad = torch.randn(6, generator=g) * scale  # gradients of the scaled loss
        if rng.random() < 0.3:
            grad[rng.randrange(6)] = rng.choice([float("inf"), float("-inf"), float("nan")])
        before = param.detach().clone()
        real.scale(torch.ones(()))  # what training does first (it also sets the scaler up)
        param.grad = grad.clone()
        real.step(opt)
        real.update()
        real_skipped = torch.equal(before, param.detach())
        got = call(name, fn, [grad.clone()], scale, tracker, interval)
        if not isinstance(got, tuple) or len(got) != 3:
            fail(name, f"return (skipped, new_scale, new_tracker), got {got!r}", seed)
        skipped, new_scale, tracker = got
        has_inf = not torch.isfinite(grad).all()
        same_value(name, bool(skipped), real_skipped, f"step {step} ({'inf/nan' if has_inf else 'finite'} "
                   f"gradients): skipped", seed=seed)
        same_value(name, float(new_scale), float(real.get_scale()),
                   f"step {step} ({'inf/nan' if has_inf else 'finite'} gradients, scale {scale:g}, "
                   f"growth_interval {interval}): the new scale", seed=seed)
        scale = float(new_scale)
    return passed(name, "skips and rescales exactly as torch.amp.GradScaler over 12 random steps")


@exercise("03_autocast_policy", "which mixed precision a device gets by default")
def autocast_policy(fn):
    from ...device_policy import default_mixed_precision
    name = "03_autocast_policy"
    cases = [("cpu", None), ("mps", None)] + [("cuda", (major, minor)) for major in (6, 7, 8, 9, 10)
                                              for minor in (0, 5)]
    for device_type, capability in cases:
        same_value(name, call(name, fn, device_type, capability),
                   default_mixed_precision(device_type, capability),
                   f"the default for {device_type}{'' if capability is None else f' SM {capability}'}")
    return passed(name, f"agrees with titanlite.device_policy on {len(cases)} devices")


@exercise("04_sac_policy", "selective activation checkpointing: save matmuls, recompute the rest")
def sac_policy(fn):
    from torch.utils.checkpoint import CheckpointPolicy

    from ...efficiency.checkpointing import SAVE_OPS, save_matmuls_policy
    aten = torch.ops.aten
    name = "04_sac_policy"
    ops = list(SAVE_OPS) + [aten.mul.Tensor, aten.add.Tensor, aten.silu.default, aten.rsqrt.default,
                            aten.mean.dim, aten.pow.Tensor_Scalar, aten.t.default, aten.view.default,
                            aten._softmax.default, aten.embedding.default]
    random.shuffle(ops)
    for op in ops:
        got, want = call(name, fn, None, op), save_matmuls_policy(None, op)
        if not isinstance(got, CheckpointPolicy):
            fail(name, f"return a torch.utils.checkpoint.CheckpointPolicy, got {got!r} for {op}")
        same_value(name, got, want, f"the policy for {op}")
    return passed(name, f"agrees with save_matmuls_policy on {len(ops)} ops")


@exercise("04_selective_blocks", "which blocks apply_ac wraps")
def selective_blocks(fn):
    from ...efficiency.checkpointing import apply_ac, checkpointed_blocks
    from ...models.llama import ModelArgs, build_model
    name, seed = "04_selective_blocks", fresh_seed()
    rng = random.Random(seed)
    cases = [(rng.randint(1, 7), rng.choice(["none", "full", "selective"]), rng.randint(1, 4)) for _ in range(2)]
    every = rng.randint(2, 4)  # and always one of each mode, with a selective stride that skips blocks
    cases += [(rng.randint(1, 7), "none", rng.randint(1, 4)), (rng.randint(1, 7), "full", rng.randint(1, 4)),
              (rng.randint(every + 1, 8), "selective", every)]
    rng.shuffle(cases)
    for n_layers, mode, every in cases:
        model = apply_ac(build_model(ModelArgs(dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                                               vocab_size=32, max_seq_len=8)), mode, every)
        want = [int(n) for n in checkpointed_blocks(model)]
        got = call(name, fn, n_layers, mode, every)
        same_value(name, sorted(got) if isinstance(got, (list, tuple)) else got, want,
                   f"blocks_to_checkpoint({n_layers}, '{mode}', every={every})", seed=seed)
    return passed(name, f"matches the blocks apply_ac really wrapped in {len(cases)} random models")


@exercise("05_no_graph_break", "the same function, rewritten to compile into one graph")
def no_graph_break(fn):
    from ...efficiency.compile import graph_break_report
    name, seed = "05_no_graph_break", fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(int(torch.randint(4, 32, (1,), generator=g)), generator=g)
    want = torch.sin(x) * torch.sin(x).abs().max()
    same_tensor(name, call(name, fn, x.clone()), want, "the result (sin(x) scaled by its largest |value|)",
                seed=seed, rtol=1e-5)
    report = call(name, graph_break_report, fn, x.clone())
    if report["graph_breaks"] or report["graphs"] != 1:
        why = "; ".join(f"{r['reason']} at {r['where']}" for r in report["break_reasons"]) or "?"
        fail(name, f"Dynamo still splits it into {report['graphs']} graphs ({report['graph_breaks']} "
                   f"breaks): {why}")
    return passed(name, f"one graph of {report['ops']} ops, no breaks (graph_break_report)")


@exercise("06_tensorwise_fp8", "tensorwise FP8 (e4m3) quantise and dequantise")
def tensorwise_fp8(fn):
    from ...efficiency.fp8 import fp8_roundtrip
    name, seed = "06_tensorwise_fp8", fresh_seed()
    g = torch.Generator().manual_seed(seed)
    for shape, spread in (((8, 16), 1.0), ((4, 32), 1e-3), ((16, 8), 50.0)):
        x = torch.randn(*shape, generator=g) * spread
        want = fp8_roundtrip(x, "tensorwise", "input")
        got = call(name, fn, x.clone())
        same_tensor(name, got, want, f"the round trip of a {shape} tensor (amax {x.abs().max():.3g})",
                    seed=seed, rtol=1e-5, atol=1e-6 * spread)
    return passed(name, "equals the cast torchao's Float8Linear does (titanlite.efficiency.fp8)")


@exercise("06_fp8_dtype", "which FP8 format each operand gets")
def fp8_format(fn):
    from ...efficiency.fp8 import fp8_dtype_for
    name = "06_fp8_dtype"
    for role in ("input", "weight", "grad_output"):
        same_value(name, call(name, fn, role), fp8_dtype_for("tensorwise", role), f"the format for '{role}'")
    return passed(name, "e4m3 and e5m2 where torchao's tensorwise recipe puts them")
