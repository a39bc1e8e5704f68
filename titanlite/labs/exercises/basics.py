"""Checks for notebooks 01-06: loss, schedule, accumulation, mixed precision, activation
checkpointing, torch.compile, FP8. Each compares the student's function with the package's own,
on inputs drawn so that the cases which tell the classic mistakes apart are always there."""

from __future__ import annotations

import math

import torch

from .grading import exercise

IGNORE = -100  # the targets' padding value (titanlite.efficiency.accumulation.IGNORE_INDEX)


def _logits_and_targets(g: torch.Generator, batch: int, seq: int, vocab: int):
    logits = torch.randn(batch, seq, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[torch.rand(batch, seq, generator=g) < 0.2] = IGNORE  # padding the loss must skip
    # at least one
    targets.view(-1)[int(torch.randint(targets.numel(), (1,), generator=g))] = IGNORE
    return logits, targets


@exercise("01_cross_entropy", "summed next-token cross-entropy, skipping padding")
def cross_entropy(c, fn):
    from ...efficiency.accumulation import IGNORE_INDEX, loss_sum

    assert IGNORE_INDEX == IGNORE
    for batch, seq, vocab in ((2, 5, 7), (3, 4, 11)):
        logits, targets = _logits_and_targets(c.gen, batch, seq, vocab)
        got = c.call(fn, logits.clone(), targets.clone())
        c.same_tensor(
            got,
            loss_sum(logits, targets),
            f"the loss for logits {tuple(logits.shape)} with "
            f"{int((targets == IGNORE).sum())} padding targets",
            rtol=1e-4,
        )
    c.passed("equals titanlite.efficiency.accumulation.loss_sum on random logits")


@exercise("01_lr_schedule", "linear warm-up, then cosine decay to a floor")
def lr_schedule(c, fn):
    from ...config import load_config
    from ...optimizer import lr_lambda

    cfg = load_config(overrides={"scheduler.decay": "cosine"})
    for i in range(3):  # the first has a floor well above 0: a decay to 0 must not pass
        warmup, total = c.rng.randint(1, 20), c.rng.randint(25, 120)
        floor = round(c.rng.uniform(0.1 if i == 0 else 0.0, 0.5), 3)
        cfg.scheduler.warmup_steps, cfg.training.steps, cfg.scheduler.min_lr_ratio = (
            warmup,
            total,
            floor,
        )
        want = lr_lambda(cfg.scheduler, cfg.training.steps)
        for step in range(total + 3):
            c.same_value(
                c.call(fn, step, warmup, total, floor),
                want(step),
                f"lr_factor({step}, warmup={warmup}, total={total}, floor={floor})",
            )
    c.passed("equals titanlite.optimizer.lr_lambda at every step of 3 random schedules")


@exercise("02_global_token_loss", "per-micro-batch losses normalised by the global token count")
def global_token_loss(c, fn):
    from ...efficiency.accumulation import count_targets, loss_sum

    g = c.gen
    while True:  # uneven token counts, or the mean of per-micro-batch means would pass too
        micro = [
            _logits_and_targets(g, 2, int(torch.randint(3, 9, (1,), generator=g)), 13)
            for _ in range(3)
        ]
        for _, t in micro[1:]:
            t[:, : int(torch.randint(1, t.shape[1], (1,), generator=g))] = IGNORE
        if len({count_targets(t) for _, t in micro}) > 1:
            break
    logits, targets = [m[0] for m in micro], [m[1] for m in micro]
    inputs = [x.clone().requires_grad_() for x in logits]
    got = c.call(fn, inputs, [t.clone() for t in targets])
    if not isinstance(got, (list, tuple)) or len(got) != len(micro):
        c.fail(
            f"return one loss per micro-batch ({len(micro)}), got {type(got).__name__}"
            f"{' of length ' + str(len(got)) if isinstance(got, (list, tuple)) else ''}"
        )
    total = sum(count_targets(t) for t in targets)
    reference = [x.clone().requires_grad_() for x in logits]
    want = [loss_sum(x, t) / total for x, t in zip(reference, targets)]
    for i, t in enumerate(targets):
        what = f"micro-batch {i}'s loss (it has {count_targets(t)} of {total} real tokens)"
        c.same_tensor(got[i], want[i], what, rtol=1e-4)
        if got[i].grad_fn is None:
            c.fail(
                f"{what} carries no gradient (.item(), .detach() or torch.no_grad()?): "
                f"backward() needs the tensor the loss was computed as"
            )
    got_grads = torch.autograd.grad(sum(got), inputs, allow_unused=True)
    want_grads = torch.autograd.grad(sum(want), reference)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        c.same_tensor(
            torch.zeros_like(b) if a is None else a,
            b,
            f"the gradient of micro-batch {i}'s logits through your losses",
            rtol=1e-4,
            atol=1e-7,
        )
    c.passed(
        f"the micro-batch losses and their gradients add up to the mean over all {total} real tokens"
    )


@exercise("02_accum_steps", "micro-batches per optimizer step from the global batch")
def accum_steps(c, fn):
    from ...efficiency.accumulation import resolve_batch

    rng = c.rng
    # Three with every factor above 1 (dp forgotten, or a wrong precedence, must not pass), then random.
    cases = [(rng.randint(2, 16), rng.choice([2, 4, 8]), rng.randint(2, 12)) for _ in range(3)]
    cases += [(rng.randint(1, 16), rng.choice([1, 2, 4, 8]), rng.randint(1, 12)) for _ in range(17)]
    rng.shuffle(cases)
    for micro, dp, accum in cases:
        global_batch = micro * dp * accum
        want = resolve_batch(micro, 1, global_batch, dp)[1]
        c.same_value(
            c.call(fn, global_batch, micro, dp),
            want,
            f"accum_steps(global_batch={global_batch}, micro_batch={micro}, dp={dp})",
        )
    c.passed(
        f"equals titanlite.efficiency.accumulation.resolve_batch on {len(cases)} random batches"
    )


@exercise("03_scaler_step", "GradScaler's skip-and-rescale rule")
def scaler_step(c, fn):
    rng, g = c.rng, c.gen
    init, interval = 2.0 ** rng.randint(8, 16), rng.randint(2, 4)
    # Every rule in the plan: two growths in a row (the tracker restarts after growing), nan, +inf
    # and -inf, a skip while the tracker is above 0 (it restarts), growth exactly `interval` clean
    # steps after a skip (not one late); then a few random steps.
    plan = (
        ["clean"] * (2 * interval + 1)
        + ["nan"]
        + ["clean"] * (interval - 1)
        + ["inf"]
        + ["clean"] * interval
        + ["-inf"]
        + [
            rng.choice(["clean", "clean", "clean", "nan", "inf", "-inf"])
            for _ in range(rng.randint(3, 6))
        ]
    )
    shapes = [(rng.randint(2, 6),) for _ in range(rng.randint(2, 4))]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = torch.optim.SGD(params, lr=1.0)
    real = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    first_bad = True
    for step, kind in enumerate(plan):
        real.scale(torch.ones(()))  # what training does first (it also sets the scaler up)
        scale, tracker = float(real.get_scale()), int(real.state_dict()["_growth_tracker"])
        grads = [
            torch.randn(s, generator=g) * scale for s in shapes
        ]  # gradients of the scaled loss
        desc = "finite gradients"
        if (
            kind != "clean"
        ):  # the first bad value sits past grads[0]: every tensor must be looked at
            t = rng.randrange(1, len(grads)) if first_bad else rng.randrange(len(grads))
            first_bad = False
            grads[t][rng.randrange(grads[t].numel())] = float(kind)
            desc = f"{kind} in grads[{t}]"
        before = [p.detach().clone() for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        real.step(opt)
        real.update()
        real_skipped = all(torch.equal(b, p.detach()) for b, p in zip(before, params))
        got = c.call(fn, [x.clone() for x in grads], scale, tracker, interval)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            c.fail(f"return (skipped, new_scale, new_tracker), got {got!r}")
        what = (
            f"step {step} ({desc}; scale {scale:g}, tracker {tracker}, growth_interval {interval})"
        )
        c.same_value(got[0], real_skipped, f"{what}: skipped")
        c.same_value(got[1], float(real.get_scale()), f"{what}: the new scale")
        c.same_value(got[2], int(real.state_dict()["_growth_tracker"]), f"{what}: the new tracker")
    c.passed(f"skips, rescales and counts exactly as torch.amp.GradScaler over {len(plan)} steps")


@exercise("03_autocast_policy", "which mixed precision a device gets by default")
def autocast_policy(c, fn):
    from ...device_policy import default_mixed_precision

    cases = [("cpu", None), ("mps", None)] + [
        ("cuda", cap)
        for cap in (
            (6, 0),
            (6, 1),
            (7, 0),
            (7, 5),
            (8, 0),
            (8, 6),
            (8, 9),
            (9, 0),
            (10, 0),
            (12, 0),
        )
    ]
    c.rng.shuffle(cases)
    for device_type, capability in cases:
        c.same_value(
            c.call(fn, device_type, capability),
            default_mixed_precision(device_type, capability),
            f"the default for {device_type}{'' if capability is None else f' SM {capability}'}",
        )
    c.passed(f"agrees with titanlite.device_policy on {len(cases)} devices")


@exercise("04_sac_policy", "selective activation checkpointing: save matmuls, recompute the rest")
def sac_policy(c, fn):
    from torch.utils.checkpoint import CheckpointPolicy

    from ...efficiency.activation_checkpoint import SAVE_OPS, save_matmuls_policy

    aten = torch.ops.aten
    ops = list(SAVE_OPS) + [
        aten.mul.Tensor,
        aten.add.Tensor,
        aten.silu.default,
        aten.rsqrt.default,
        aten.mean.dim,
        aten.pow.Tensor_Scalar,
        aten.t.default,
        aten.view.default,
        aten._softmax.default,
        aten.embedding.default,
        aten.cat.default,
    ]
    c.rng.shuffle(ops)
    for op in ops:
        got, want = c.call(fn, None, op), save_matmuls_policy(None, op)
        if not isinstance(got, CheckpointPolicy):
            c.fail(f"return a torch.utils.checkpoint.CheckpointPolicy, got {got!r} for {op}")
        c.same_value(got, want, f"the policy for {op}")
    c.passed(f"agrees with save_matmuls_policy on {len(ops)} ops")


@exercise("04_selective_blocks", "which blocks apply_ac wraps")
def selective_blocks(c, fn):
    from ...efficiency.activation_checkpoint import apply_ac
    from ...models.llama import ModelArgs, build_model
    from ...tools.predict.activation_memory import checkpointed_blocks

    rng = c.rng
    cases = [
        (rng.randint(1, 7), rng.choice(["none", "full", "selective"]), rng.randint(1, 4))
        for _ in range(2)
    ]
    # and always one of each mode, with a selective stride that skips blocks
    every = rng.randint(2, 4)
    cases += [
        (rng.randint(1, 7), "none", rng.randint(1, 4)),
        (rng.randint(1, 7), "full", rng.randint(1, 4)),
        (rng.randint(every + 1, 8), "selective", every),
    ]
    rng.shuffle(cases)
    for n_layers, mode, every in cases:
        model = apply_ac(
            build_model(
                ModelArgs(
                    dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8
                )
            ),
            mode,
            every,
        )
        want = [int(n) for n in checkpointed_blocks(model)]
        got = c.call(fn, n_layers, mode, every)
        c.same_value(
            sorted(got) if isinstance(got, (list, tuple, range)) else got,
            want,
            f"blocks_to_checkpoint({n_layers}, '{mode}', every={every})",
        )
    c.passed(f"matches the blocks apply_ac really wrapped in {len(cases)} random models")


def _extreme_sin_input(c, negative: bool) -> torch.Tensor:
    """x whose sin(x) has its largest |value| at one element, negative or positive: elsewhere
    |x| < 1.3 (|sin| < 0.964), there x = ∓(π/2 - δ) (|sin| > 0.995)."""
    n = c.rng.randint(4, 32)
    x = (torch.rand(n, generator=c.gen) * 2 - 1) * 1.3
    x[c.rng.randrange(n)] = (-1 if negative else 1) * (math.pi / 2 - c.rng.uniform(0, 0.1))
    return x


@exercise("05_no_graph_break", "the same function, rewritten to compile into one graph")
def no_graph_break(c, fn):
    from ...tools.measure.compile_report import graph_break_report

    for negative in (True, False):  # the largest |sin| is negative in one input: abs() matters
        x = _extreme_sin_input(c, negative)
        want = torch.sin(x) * torch.sin(x).abs().max()
        c.same_tensor(
            c.call(fn, x.clone()),
            want,
            f"the result for {x.numel()} values whose largest |sin| is "
            f"{'negative' if negative else 'positive'} (sin(x) times its largest |value|)",
            rtol=1e-6,
        )
    report = c.call(graph_break_report, fn, x.clone())
    if report["graph_breaks"] or report["graphs"] != 1:
        why = "; ".join(f"{r['reason']} at {r['where']}" for r in report["break_reasons"]) or "?"
        c.fail(
            f"Dynamo still splits it into {report['graphs']} graphs ({report['graph_breaks']} "
            f"breaks): {why}"
        )
    c.passed(f"one graph of {report['ops']} ops, no breaks (graph_break_report), right values")


@exercise("05_regional_compile", "torch.compile, one transformer block at a time, in place")
def regional_compile(c, fn):
    from ..._compat.torch_internals import compiled_call
    from ...models.llama import ModelArgs, build_model

    for n_layers in (c.rng.randint(1, 2), c.rng.randint(3, 5)):
        model = build_model(
            ModelArgs(
                dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8
            )
        )
        names = list(model.state_dict())
        got = c.call(fn, model)
        what = f"a {n_layers}-layer model"
        wrapped = [
            n or "the model"
            for n, m in model.named_modules()
            if type(m).__name__ == "OptimizedModule"
        ]
        if wrapped or type(got).__name__ == "OptimizedModule":
            c.fail(
                f"in {what}, {(wrapped or ['the model'])[0]} was wrapped by torch.compile(...) "
                f"(an OptimizedModule, whose parameter names gain '_orig_mod.'): compile each block "
                f"in place with block.compile()"
            )
        if got is not model:
            c.fail(
                f"return the model you were given, compiled in place; got "
                f"{'None' if got is None else type(got).__name__}"
            )
        compiled = [
            n or "(the whole model)"
            for n, m in model.named_modules()
            if compiled_call(m) is not None
        ]
        c.same_value(
            compiled,
            [f"layers.{name}" for name in model.layers.keys()],
            f"the modules compiled in place in {what}",
        )
        if list(model.state_dict()) != names:
            c.fail(
                f"the parameter names of {what} changed (e.g. {next(iter(set(model.state_dict()) - set(names)), '?')}): "
                f"compile in place, so checkpoints keep their names"
            )
    c.passed(
        "compiles exactly the blocks apply_compile(scope='regional') compiles, in place, names unchanged"
    )


def _f32_scale_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The mistake notebook 06 warns about: `448 / amax` on a float32 tensor, which PyTorch
    computes as 448 × (1/amax), two float32 roundings."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = fmax / x.abs().max()
    return (x * scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() / scale


def _fp8_input(c, shape, spread) -> torch.Tensor:
    """A random tensor whose amax puts a float32-computed scale one bit off torchao's, so far
    that the round trip differs: about one tensor in four does; draw until this one does."""
    from ..nb06_fp8_numerics import fp8_roundtrip

    for _ in range(200):
        x = torch.randn(*shape, generator=c.gen) * spread
        if not torch.equal(_f32_scale_roundtrip(x), fp8_roundtrip(x, "tensorwise", "input")):
            return x
    raise RuntimeError(
        f"{c.name}: no separating input in 200 draws (seed {c.seed}): a bug in the check"
    )


@exercise("06_tensorwise_fp8", "tensorwise FP8 (e4m3) quantise and dequantise")
def tensorwise_fp8(c, fn):
    from ..nb06_fp8_numerics import fp8_roundtrip

    for shape, spread in (((8, 16), 1.0), ((4, 32), 1e-3), ((16, 8), 50.0)):
        x = _fp8_input(c, shape, spread)
        want = fp8_roundtrip(x, "tensorwise", "input")
        c.same_tensor(
            c.call(fn, x.clone()),
            want,
            f"the round trip of a {shape} tensor (amax {x.abs().max().item():.9g})",
            exact=True,
        )
    c.passed("bit for bit the cast torchao's Float8Linear does (titanlite.efficiency.fp8)")


@exercise("06_fp8_dtype", "which FP8 format each operand gets")
def fp8_format(c, fn):
    from ..nb06_fp8_numerics import fp8_dtype_for

    for role in ("input", "weight", "grad_output"):
        c.same_value(
            c.call(fn, role), fp8_dtype_for("tensorwise", role), f"the format for '{role}'"
        )
    c.passed("e4m3 and e5m2 where torchao's tensorwise recipe puts them")
