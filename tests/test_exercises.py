"""Course-lab exercises: every check passes the instructor's solution and fails every classic
mistake listed here, at every seed of a sweep, each with its one-line message; a failure's
message is one line (a crash: its type, first line, the student's line and the seed); the
student edition's stub is "not attempted"; notebooks carry nbgrader's metadata."""

import functools
import json
import math
import os
import re
import shutil
import statistics
import sys
import zlib
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F

from titanlite.errors import TitanliteError
from titanlite.labs.exercises import EXERCISES, check
from titanlite.labs.exercises.grading import ExerciseError
from titanlite.tools.course.editions import (
    BEGIN,
    END,
    is_check_cell,
    is_solution_cell,
    kernel_on_unix_sockets,
    strip_solution,
    strip_solutions,
    stripper,
    student_edition,
    student_notebook,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WITH_EXERCISES = [p for p in NOTEBOOKS if any(is_check_cell(c) for c in nbformat.read(p, 4).cells)]
SEEDS = range(12345, 12345 + 30 * 7_654_321, 7_654_321)  # 30 spread seeds


def _solutions() -> dict[str, tuple[str, str, Path]]:
    """exercise → (solution cell source, the function name its check passes, notebook)."""
    found = {}
    for path in WITH_EXERCISES:
        cells = nbformat.read(path, 4).cells
        for i, cell in enumerate(cells):
            if is_check_cell(cell):
                name, fn = cell.source.split('check("')[1].split('", ')
                found[name] = (cells[i - 1].source, fn.rstrip(")"), path)
    return found


SOLUTIONS = _solutions()


def _define(source: str, fn: str):
    ns = {}
    exec(compile(source, "<solution cell>", "exec"), ns)
    return ns[fn]


def _quorum_mistake(kind):
    from titanlite.labs.exercises.replicas import QUORUM_MISTAKES

    return QUORUM_MISTAKES[kind]


def _traffic_mistake(kind):
    from titanlite.labs.exercises.replicas import TRAFFIC_MISTAKES

    return TRAFFIC_MISTAKES[kind]


def _merge_mistake(kind):
    def merge(out1, lse1, out2, lse2):
        if kind == "exp in float64":  # finite up to lse ~709, then inf / inf
            out1, lse1, out2, lse2 = (t.double() for t in (out1, lse1, out2, lse2))
            w1, w2 = lse1.exp()[:, None], lse2.exp()[:, None]
            return (out1 * w1 + out2 * w2) / (w1 + w2), (lse1.exp() + lse2.exp()).log()
        w1, w2 = lse1.exp()[:, None], lse2.exp()[:, None]
        if kind == "average":
            return (out1 + out2) / 2, torch.maximum(lse1, lse2)
        if kind == "unnormalised":
            return out1 * w1 + out2 * w2, torch.logaddexp(lse1, lse2)
        if kind == "exp overflow":
            return (out1 * w1 + out2 * w2) / (w1 + w2), (lse1.exp() + lse2.exp()).log()
        total = torch.logaddexp(lse1, lse2)
        a, b = (lse1 - total).exp()[:, None], (lse2 - total).exp()[:, None]
        if kind == "max for the lse":
            return out1 * a + out2 * b, torch.maximum(lse1, lse2)
        if kind == "weights swapped":
            return out1 * b + out2 * a, total
        if kind == "lse unchanged":
            return out1 * a + out2 * b, lse1
        raise AssertionError(kind)

    return merge


def _merge_right(kind):
    """Right merges the check must accept at every seed, in float32 unless named float64."""

    def merge(out1, lse1, out2, lse2):
        if kind == "softmax":
            both = torch.stack([lse1, lse2], -1)
            w = both.softmax(-1)[..., None]
            return out1 * w[:, 0] + out2 * w[:, 1], torch.logsumexp(both, -1)
        if kind == "max shifted":
            top = torch.maximum(lse1, lse2)
            w1, w2 = (lse1 - top).exp(), (lse2 - top).exp()
            total = w1 + w2
            return (out1 * w1[:, None] + out2 * w2[:, None]) / total[:, None], top + total.log()
        if kind == "sigmoid":
            share = torch.sigmoid(lse1 - lse2)[:, None]
            return out2 + (out1 - out2) * share, torch.logaddexp(lse1, lse2)
        # the markdown's formula (the solution's) in float64, returned in float64
        o1, l1, o2, l2 = (t.double() for t in (out1, lse1, out2, lse2))
        lse = torch.logaddexp(l1, l2)
        return o1 * (l1 - lse).exp()[:, None] + o2 * (l2 - lse).exp()[:, None], lse

    return merge


def _zigzag_mistake(chunks):
    def positions(rank, cp, seq_len):
        size = seq_len // (2 * cp)
        return [p for i in chunks(rank, cp) for p in range(i * size, (i + 1) * size)]

    return positions


# ----- classic mistakes: (what the mistake is, the wrong function, a fragment its message must hold) --


def _ce_sum(lg, t, **kw):
    return F.cross_entropy(lg.flatten(0, 1), t.flatten(), **kw)


def _lr(
    step,
    warmup,
    total,
    floor,
    *,
    warm=lambda s, w: (s + 1) / w,
    p=lambda s, w, t: (s - w) / (t - w),
    floor_on=True,
    cosine=True,
):
    if step < warmup:
        return warm(step, warmup)
    q = min(1.0, p(step, warmup, total))
    shape = 0.5 * (1 + math.cos(math.pi * q)) if cosine else 1 - q
    return floor + (1 - floor) * shape if floor_on else shape


def _scaler(
    grads,
    scale,
    tracker,
    interval,
    *,
    bad=lambda g: not torch.isfinite(g).all(),
    late=False,
    reset_on_skip=True,
    reset_on_growth=True,
    only_first=False,
):
    found = any(bad(g) for g in (grads[:1] if only_first else grads))
    if found:
        return True, scale * 0.5, 0 if reset_on_skip else tracker
    tracker += 1
    if tracker == interval + (1 if late else 0):
        return False, scale * 2.0, 0 if reset_on_growth else tracker
    return False, scale, tracker


def _scaled_sin_with_item(x):
    y = torch.sin(x)
    return y * y.abs().max().item()  # right values, but .item() breaks the graph


def _scaled_sin_printing(x):
    y = torch.sin(x)
    print("debug")  # the side effect the exercise asks to drop
    return y * y.abs().max()


def _compile_model(model):
    model.compile()
    return model


def _compile_wrapped(model):
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block))
    return model


def _compile_first(model):
    next(model.layers.children()).compile()
    return model


def _compile_parts(model):
    for block in model.layers.children():
        for part in block.children():
            part.compile()
    return model


def _fp8(x, *, scale_fn, dtype=torch.float8_e4m3fn, dequant=lambda q, s: q / s):
    fmax = torch.finfo(torch.float8_e4m3fn).max
    s = scale_fn(x, fmax)
    return dequant((x * s).clamp(-fmax, fmax).to(dtype).float(), s)


def _f64_scale(x, fmax):
    return (fmax / x.abs().max().double()).float()


def _buckets(params, cap, *, by_dtype=True, strict=False, open_first=False):
    closed, open_buckets = [], {}
    for p in params:
        key = p.dtype if by_dtype else None
        bucket = open_buckets.setdefault(key, [])
        bucket.append(p)
        size = sum(q.numel() * q.element_size() for q in bucket)
        if size > cap or (size == cap and not strict):
            closed.append(open_buckets.pop(key))
    return (
        list(open_buckets.values()) + closed if open_first else closed + list(open_buckets.values())
    )


def _allreduce(grads, cap, *, per_tensor=False, one=False, op="mean"):
    from titanlite.labs.nb07_scratch_ddp import assign_buckets

    world = len(grads)
    stacked = [torch.stack([rank[i] for rank in grads]) for i in range(len(grads[0]))]
    averaged = [s.sum(0) if op == "sum" else s[0] if op == "rank0" else s.mean(0) for s in stacked]
    count = len(grads[0]) if per_tensor else 1 if one else len(assign_buckets(grads[0], cap))
    return averaged, count if world else 0


def _zero(n, w, stage, *, shard=lambda n, w: math.ceil(n / w), thresholds=(3, 2, 1), total=False):
    s = shard(n, w)
    out = {
        "params": 4 * (s if stage >= thresholds[0] else n),
        "grads": 4 * (s if stage >= thresholds[1] else n),
        "optimizer": 8 * (s if stage >= thresholds[2] else n),
    }
    if total:
        out["total"] = sum(out.values())
    return out


def _array_split(shape, w, r):
    base, extra = divmod(shape[0], w)
    return (base + (r < extra)) * math.prod(shape[1:])


def _coords(rank, shape, order=("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")):
    out = {}
    for dim, size in reversed(list(zip(order, shape))):
        out[dim] = rank % size
        rank //= size
    return out


def _route_mistake(kind):
    def route(scores, bias, k):
        picked = scores + bias
        chosen = picked.topk(1 if kind == "top 1" else k, dim=-1).indices
        if kind == "no bias":
            chosen = scores.topk(k, dim=-1).indices
        source = picked if kind == "biased weights" else scores
        w = source.gather(-1, chosen)
        if kind == "raw weights":
            return w, chosen
        if kind == "softmax":
            return w.softmax(-1), chosen
        if kind == "all experts":
            return w / scores.sum(-1, keepdim=True), chosen
        w = w / w.sum(-1, keepdim=True)
        return (chosen, w) if kind == "swapped" else (w, chosen)

    return route


def _splits_mistake(kind):
    def splits(chosen, n_experts, ep):
        per_rank = n_experts // ep
        if kind == "tokens":
            return [int((chosen // per_rank == g).any(-1).sum()) for g in range(ep)]
        if kind == "round robin":
            return torch.bincount((chosen % ep).flatten(), minlength=ep).tolist()
        if kind == "per expert":
            return torch.bincount(chosen.flatten(), minlength=n_experts).tolist()
        if kind == "first":
            return torch.bincount(chosen[:, 0] // per_rank, minlength=ep).tolist()
        if kind == "no minlength":  # stops at the highest rank chosen
            return torch.bincount((chosen // per_rank).flatten()).tolist()
        return torch.bincount((chosen // ep).flatten().clamp(max=ep - 1), minlength=ep).tolist()

    return splits


def _groups_wrong_axis(shape, dim):
    axis = 5 - ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp").index(dim)
    grid = torch.arange(math.prod(shape)).view(shape).movedim(axis, -1)
    return grid.reshape(-1, shape[axis]).tolist()


def _commit(tmp, final, step, *, after=False, fsync=True, files=True, copy=False):
    files_ = (
        {f.name: [f.stat().st_size, zlib.crc32(f.read_bytes())] for f in sorted(tmp.iterdir())}
        if files
        else {}
    )
    if after:
        os.rename(tmp, final)
        tmp = final
    record = tmp / "titanlite.json"
    record.write_text(json.dumps({"format": 1, "step": step, "files": files_}))
    if fsync:
        with open(record, "rb+") as f:
            os.fsync(f.fileno())
    if copy:
        shutil.copytree(tmp, final)
        shutil.rmtree(tmp)
    elif not after:
        os.rename(tmp, final)


def _latest(folder, *, pattern="step-????????", record=True, pick=max):
    found = [
        p
        for p in Path(folder).glob(pattern)
        if p.is_dir() and (not record or (p / "titanlite.json").is_file())
    ]
    return pick(found) if found else None


def _bf16(
    b,
    f,
    *,
    centre=statistics.median,
    floor=0.2,
    symmetric=False,
    spreads="both",
    spread_over=statistics.median,
):
    def spread(xs):
        return (max(xs) - min(xs)) / spread_over(xs)

    noise = {"both": max(spread(b), spread(f)), "bf16": spread(b), "none": 0.0}[spreads]
    band = max(floor, noise)
    ratio = centre(b) / centre(f)
    low = 1 - band if symmetric else 1 / (1 + band)
    return "fast" if ratio > 1 + band else "slow" if ratio < low else "same"


def _best_lr(study, *, keep=lambda t: t.value is not None, better=lambda a, b: a < b, swap=False):
    best = {}
    for t in study.trials:
        if not keep(t):
            continue
        accum = t.params["grad_accum_steps"]
        if accum not in best or better(t.value, best[accum][1]):
            best[accum] = (t.params["lr"], t.value)
    return {k: (v[1], v[0]) for k, v in best.items()} if swap else best


def _saved(study, *, states=None, attrs=lambda a: a["token_budget"] - a.get("tokens_trained", 0)):
    return sum(
        attrs(t.user_attrs) for t in study.trials if states is None or t.state.name in states
    )


def _carry_every_rung(rungs):
    """The classic bug: carry FP8 rowwise (carry=False) on to the rows after it too."""
    kept, out = {}, []
    for rung in rungs:
        kept.update(rung.overrides)
        out.append((rung, dict(kept)))
    return out


def _verdict(
    first, last, row, *, ratio_to=lambda a, b: a, band=lambda a, b: abs(a - b) / ((a + b) / 2)
):
    ratio, d = row / ratio_to(first, last), band(first, last)
    return (
        "faster (beyond drift)"
        if ratio > 1 + d
        else "slower (beyond drift)"
        if ratio < 1 - d
        else "within drift"
    )


def _spec_mistake(kind, layout, name, shape, n):
    from titanlite.labs.nb19_accelerators import spec_of

    right = spec_of(layout, name, shape, n)
    if kind == "swapped" and layout in ("tp", "2d"):
        return tuple(reversed(right))
    if kind == "dim 1" and right == ("data", None) and name != "batch":
        return (None, "data")
    if kind == "tp batch" and name == "batch":
        return ("data", None)
    if kind == "uneven" and layout == "fsdp" and len(shape) == 2:
        return ("data", None)
    if kind == "norms" and layout == "fsdp" and len(shape) == 1:
        return ("data",)
    if kind == "embedding" and layout in ("tp", "2d") and name == "tok_embeddings.weight":
        return ("model", None)
    if kind == "2d batch" and layout == "2d" and name == "batch":
        return ()
    return right


def _quantized_bytes(
    shape, name, block=None, table=None, value=None, scale=4, moments=2, more=False
):
    """What a quantized AdamW state holds, with any one rule of it changed (20_state_bytes)."""
    n = math.prod(shape)
    block = block or {"adamw8bit": 256, "adamw4bit": 128}[name]
    if (n <= 4096 if more else n < 4096) or n % block:
        return 8 * n
    table = {"adamw8bit": 256, "adamw4bit": 16}[name] if table is None else table
    value = (1 if name == "adamw8bit" else 0.5) if value is None else value
    return int(moments * (value * n + scale * n // block + 4 * table))


def _state_mistake(**rule):
    """20_state_bytes with one rule wrong: quantized ones (`_quantized_bytes`), Adafactor's
    ("adafactor": a function of the shape), or every optimizer 8 bytes a value ("all fp32")."""

    def state_bytes(shape, name):
        n = math.prod(shape)
        if "all fp32" in rule:
            return 8 * n
        if name == "adafactor":
            if "adafactor" in rule:
                return rule["adafactor"](shape)
            return 4 * n if len(shape) < 2 else 4 * math.prod(shape[:-2]) * sum(shape[-2:])
        if name in ("adamw8bit", "adamw4bit"):
            return _quantized_bytes(
                shape, name, **{k: v for k, v in rule.items() if k != "adafactor"}
            )
        return 8 * n

    return state_bytes


def _ns(x, a, b, c, kind="right"):
    """One Newton-Schulz iteration, or a classic way of getting it wrong (20_newton_schulz_step)."""
    gram = x @ x.T
    if kind == "right":
        return a * x + (b * gram + c * gram @ gram) @ x
    if kind == "x p(xᵀx)":  # the same polynomial on the other side: right too
        other = x.T @ x
        return a * x + b * x @ other + c * x @ other @ other
    if kind == "no x at the end":
        return (
            a * x + (b * gram + c * gram @ gram)[:, : x.shape[1]]
            if x.shape[0] == x.shape[1]
            else a * x + b * gram
        )
    if kind == "gram of the transpose":
        other = x.T @ x
        return a * x + (b * other + c * other @ other) @ x.T if x.shape[0] == x.shape[1] else other
    if kind == "a, b, c in the wrong places":
        return c * x + (a * gram + b * gram @ gram) @ x
    if kind == "squared gram as gram²·c only":
        return a * x + c * gram @ gram @ x
    if kind == "float32":
        x32 = x.float()
        g32 = x32 @ x32.T
        return a * x32 + (b * g32 + c * g32 @ g32) @ x32
    if kind == "the transpose":
        return (
            (a * x + (b * gram + c * gram @ gram) @ x).T.contiguous()
            if x.shape[0] == x.shape[1]
            else x.T
        )
    if kind == "normalised again":
        y = a * x + (b * gram + c * gram @ gram) @ x
        return y / y.norm()
    raise AssertionError(kind)


def _block_mask_answer(pairs_of=None, reduce="any", by_firsts=False):
    """A student's block_mask(documents, block): the pairs (query, key) some rule keeps, then a
    block kept where any (or all) of its pairs are."""

    def block_mask(documents, block):
        T = documents.shape[0]
        n = T // block
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        same = documents[:, None] == documents[None, :]
        if by_firsts:  # each block judged by its first token only
            firsts = documents[::block]
            return (firsts[:, None] == firsts[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        pairs = (pairs_of or (lambda same, q, k: same & (q >= k)))(same, q, k)
        blocks = pairs.reshape(n, block, n, block)
        return blocks.all(3).all(1) if reduce == "all" else blocks.any(3).any(1)

    return block_mask


def _fractions_right(lengths):
    from fractions import Fraction

    T = sum(lengths)
    return (
        float(Fraction(T * (T + 1), 2 * T * T)),
        float(sum(Fraction(n * (n + 1), 2) for n in lengths) / (T * T)),
    )


def _fractions_answer(causal, block_causal):
    return lambda ls: (causal(sum(ls)), block_causal(ls, sum(ls)))


MISTAKES = {
    "21_block_mask": [
        ("causal blocks only", _block_mask_answer(lambda s, q, k: q >= k), "the kept blocks"),
        ("documents only, no causality", _block_mask_answer(lambda s, q, k: s), "the kept blocks"),
        (
            "keys strictly earlier",
            _block_mask_answer(lambda s, q, k: s & (q > k)),
            "the kept blocks",
        ),
        ("transposed", _block_mask_answer(lambda s, q, k: s & (q <= k)), "the kept blocks"),
        ("full blocks only", _block_mask_answer(reduce="all"), "the kept blocks"),
        ("a block by its first token", _block_mask_answer(by_firsts=True), "the kept blocks"),
        ("the pair mask, not blocks", lambda d, b: _block_mask_answer()(d, 1), "has shape"),
    ],
    "21_attended_fraction": [
        (
            "the diagonal left out",
            _fractions_answer(
                lambda T: (T - 1) / 2 / T, lambda ls, T: sum(n * (n - 1) / 2 for n in ls) / T**2
            ),
            "item [0]",
        ),
        (
            "half the square",
            _fractions_answer(lambda T: 0.5, lambda ls, T: sum(n * n / 2 for n in ls) / T**2),
            "item [0]",
        ),
        (
            "no causality within a document",
            _fractions_answer(
                lambda T: (T + 1) / 2 / T, lambda ls, T: sum(n * n for n in ls) / T**2
            ),
            "item [1]",
        ),
        (
            "block-causal over the causal pairs",
            _fractions_answer(
                lambda T: (T + 1) / 2 / T,
                lambda ls, T: sum(n * (n + 1) for n in ls) / (T * (T + 1)),
            ),
            "item [1]",
        ),
        ("swapped", lambda ls: _fractions_right(ls)[::-1], "item [0]"),
        (
            "integer division",
            _fractions_answer(
                lambda T: T * (T + 1) // 2 // T**2, lambda ls, T: sum(n * n for n in ls) // T**2
            ),
            "item [0]",
        ),
        ("one number", lambda ls: _fractions_right(ls)[1], "should be a tuple"),
    ],
    "01_cross_entropy": [
        (
            "padding counted as class 0",
            lambda lg, t: _ce_sum(lg, t.clamp(min=0), reduction="sum"),
            "the loss for",
        ),
        ("the mean, not the sum", lambda lg, t: _ce_sum(lg, t), "expected"),
        (
            "logits taken as log-probabilities",
            lambda lg, t: (
                -(lg.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (t != -100)).sum()
            ),
            "expected",
        ),
        (
            "targets shifted once more",
            lambda lg, t: _ce_sum(lg[:, :-1], t[:, 1:], reduction="sum"),
            "expected",
        ),
        (
            "a Python float",
            lambda lg, t: _ce_sum(lg, t, reduction="sum").item(),
            "should be a torch.Tensor",
        ),
    ],
    "01_lr_schedule": [
        ("no decay", lambda s, w, t, f: s / w if s < w else 1.0, "lr_factor(0"),
        (
            "warm-up from 0",
            lambda s, w, t, f: _lr(s, w, t, f, warm=lambda s, w: s / w),
            "lr_factor(0",
        ),
        ("decay to 0", lambda s, w, t, f: _lr(s, w, t, f, floor_on=False), "lr_factor("),
        (
            "decay measured from step 0",
            lambda s, w, t, f: _lr(s, w, t, f, p=lambda s, w, t: s / t),
            "lr_factor(",
        ),
        ("linear decay", lambda s, w, t, f: _lr(s, w, t, f, cosine=False), "lr_factor("),
    ],
    "02_accum_steps": [
        ("dp forgotten", lambda g, m, dp: g // m, "accum_steps("),
        ("precedence", lambda g, m, dp: g // m * dp, "accum_steps("),
        ("micro-batch forgotten", lambda g, m, dp: g // dp, "accum_steps("),
    ],
    "02_global_token_loss": [
        (
            "mean of means",
            lambda xs, ts: [
                _ce_sum(x, t, reduction="sum") / (t != -100).sum() / len(xs) for x, t in zip(xs, ts)
            ],
            "real tokens)",
        ),
        (
            "each by its own count",
            lambda xs, ts: [
                _ce_sum(x, t, reduction="sum") / (t != -100).sum() for x, t in zip(xs, ts)
            ],
            "real tokens)",
        ),
        (
            "padding counted",
            lambda xs, ts: [
                _ce_sum(x, t, reduction="sum") / sum(u.numel() for u in ts) for x, t in zip(xs, ts)
            ],
            "real tokens)",
        ),
        (
            "detached",
            lambda xs, ts: [
                (_ce_sum(x, t, reduction="sum") / sum((u != -100).sum() for u in ts)).detach()
                for x, t in zip(xs, ts)
            ],
            "carries no gradient",
        ),
    ],
    "03_scaler_step": [
        ("never skips", lambda grads, s, tr, gi: (False, s, tr), "step "),
        (
            "inf only, no nan",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi, bad=lambda x: bool(torch.isinf(x).any())),
            "nan in grads",
        ),
        (
            "nan only, no inf",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi, bad=lambda x: bool(torch.isnan(x).any())),
            "inf in grads",
        ),
        ("grown one step late", lambda g, s, tr, gi: _scaler(g, s, tr, gi, late=True), "the new"),
        (
            "tracker kept on a skip",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi, reset_on_skip=False),
            "the new tracker",
        ),
        (
            "tracker kept after growing",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi, reset_on_growth=False),
            "the new tracker",
        ),
        (
            "tracker never returned",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi)[:2] + (tr,),
            "the new tracker",
        ),
        (
            "only grads[0] looked at",
            lambda g, s, tr, gi: _scaler(g, s, tr, gi, only_first=True),
            "skipped",
        ),
    ],
    "03_autocast_policy": [
        ("never fp16", lambda d, c: "bf16" if d == "cuda" else "fp32", "expected 'fp16'"),
        (
            "fp16 on MPS",
            lambda d, c: (
                "fp16"
                if d == "mps"
                else "fp32"
                if d != "cuda"
                else "bf16"
                if c >= (8, 0)
                else "fp16"
            ),
            "the default for mps",
        ),
        (
            "Ampere excluded",
            lambda d, c: "fp32" if d != "cuda" else "bf16" if c > (8, 0) else "fp16",
            "SM (8, 0)",
        ),
    ],
    "04_sac_policy": [
        (
            "save everything",
            lambda ctx, op, *a, **k: (
                __import__("torch.utils.checkpoint").utils.checkpoint.CheckpointPolicy.MUST_SAVE
            ),
            "the policy for",
        ),
        ("PREFER_SAVE", lambda ctx, op, *a, **k: _sac(op, save="PREFER_SAVE"), "the policy for"),
        (
            "recompute everything",
            lambda ctx, op, *a, **k: _sac(op, save="PREFER_RECOMPUTE"),
            "the policy for",
        ),
    ],
    "04_selective_blocks": [
        ("every block", lambda n, mode, every: list(range(n)), "blocks_to_checkpoint("),
        (
            "every-th, 1-based",
            lambda n, mode, every: (
                []
                if mode == "none"
                else list(range(every - 1, n, every))
                if mode == "selective"
                else list(range(n))
            ),
            "'selective'",
        ),
        (
            "selective means all",
            lambda n, mode, every: [] if mode == "none" else list(range(n)),
            "'selective'",
        ),
    ],
    "05_no_graph_break": [
        (".item()", _scaled_sin_with_item, "graph"),
        ("no abs()", lambda x: torch.sin(x) * torch.sin(x).max(), "largest |sin| is negative"),
        ("-min()", lambda x: torch.sin(x) * -torch.sin(x).min(), "largest |sin| is positive"),
        ("the print kept", _scaled_sin_printing, "graph"),
        ("abs of x", lambda x: torch.sin(x) * x.abs().max(), "the result for"),
    ],
    "05_regional_compile": [
        ("the whole model", _compile_model, "(the whole model)"),
        ("torch.compile(block)", _compile_wrapped, "OptimizedModule"),
        ("torch.compile(model)", lambda m: torch.compile(m), "OptimizedModule"),
        ("only the first block", _compile_first, "compiled in place"),
        ("a block's parts", _compile_parts, "compiled in place"),
        (
            "nothing returned",
            lambda m: [b.compile() for b in m.layers.children()] and None,
            "return the model",
        ),
    ],
    "06_tensorwise_fp8": [
        ("no scaling", lambda x: x.to(torch.float8_e4m3fn).float(), "round trip"),
        (
            "a float32 scale (448 / amax)",
            lambda x: _fp8(x, scale_fn=lambda x, fmax: fmax / x.abs().max()),
            "bit for bit",
        ),
        ("e5m2", lambda x: _fp8(x, scale_fn=_f64_scale, dtype=torch.float8_e5m2), "round trip"),
        ("float64 out", lambda x: _fp8(x, scale_fn=_f64_scale).double(), "dtype torch.float64"),
        (
            "not scaled back",
            lambda x: _fp8(x, scale_fn=_f64_scale, dequant=lambda q, s: q),
            "round trip",
        ),
    ],
    "06_fp8_dtype": [
        ("e4m3 everywhere", lambda role: torch.float8_e4m3fn, "'grad_output'"),
        (
            "e5m2 for weights",
            lambda role: torch.float8_e4m3fn if role == "input" else torch.float8_e5m2,
            "'weight'",
        ),
        (
            "AMD's fnuz",
            lambda role: torch.float8_e5m2fnuz if role == "grad_output" else torch.float8_e4m3fnuz,
            "'input'",
        ),
    ],
    "07_buckets": [
        ("one bucket", lambda ps, cap: [list(ps)], "bucket 0"),
        (
            "one bucket for all dtypes",
            lambda ps, cap: _buckets(ps, cap, by_dtype=False),
            "with cap",
        ),
        ("closed only above the cap", lambda ps, cap: _buckets(ps, cap, strict=True), "with cap"),
        ("open buckets first", lambda ps, cap: _buckets(ps, cap, open_first=True), "with cap"),
    ],
    "07_bucketed_allreduce": [
        (
            "one collective per tensor",
            lambda g, cap: _allreduce(g, cap, per_tensor=True),
            "(one per bucket)",
        ),
        ("one collective", lambda g, cap: _allreduce(g, cap, one=True), "(one per bucket)"),
        ("rank 0 only", lambda g, cap: ([t for t in g[0]], 1), "averaged over"),
        ("summed, not averaged", lambda g, cap: _allreduce(g, cap, op="sum"), "averaged over"),
    ],
    "08_zero_bytes": [
        (
            "optimizer floored",
            lambda n, w, s: {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n // w},
            "zero_bytes(",
        ),
        ("floor shards", lambda n, w, s: _zero(n, w, s, shard=lambda n, w: n // w), "zero_bytes("),
        (
            "grads sharded from stage 1",
            lambda n, w, s: _zero(n, w, s, thresholds=(3, 1, 1)),
            "['grads']",
        ),
        (
            "params sharded from stage 2",
            lambda n, w, s: _zero(n, w, s, thresholds=(2, 2, 1)),
            "['params']",
        ),
        ("a total", lambda n, w, s: _zero(n, w, s, total=True), "'total'"),
    ],
    "08_fsdp_shard": [
        ("numel // world", lambda shape, w, r: math.prod(shape) // w, "shard_numel("),
        ("array_split", _array_split, "shard_numel("),
        (
            "ceil(numel / world)",
            lambda shape, w, r: math.ceil(math.prod(shape) / w),
            "shard_numel(",
        ),
    ],
    "09_tp_mlp": [
        (
            "wrong dims",
            lambda g, u, d, tp, r: (g.chunk(tp, 1)[r], u.chunk(tp, 1)[r], d.chunk(tp, 0)[r]),
            "rank 0's gate shard",
        ),
        (
            "strided rows",
            lambda g, u, d, tp, r: (g[r::tp], u[r::tp], d[:, r::tp]),
            "rank 0's gate shard",
        ),
        (
            "down split by rows",
            lambda g, u, d, tp, r: (g.chunk(tp, 0)[r], u.chunk(tp, 0)[r], d.chunk(tp, 0)[r]),
            "rank 0's down shard",
        ),
    ],
    "09_block_comm": [
        (
            "all-reduce always",
            lambda b, s, d, sp: {"all_reduce": 2 * b * s * d * 4},
            "sequence_parallel=True",
        ),
        (
            "shard bytes",
            lambda b, s, d, sp: (
                {"all_gather": b * s * d * 4, "reduce_scatter": b * s * d * 4}
                if sp
                else {"all_reduce": 2 * b * s * d * 4}
            ),
            "sequence_parallel=True",
        ),
        (
            "one all-reduce",
            lambda b, s, d, sp: {"all_reduce": b * s * d * 4},
            "sequence_parallel=False",
        ),
    ],
    "10_one_f_one_b": [
        (
            "GPipe's order",
            lambda r, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
            "rank 1 of p=2, m=2: op 1",
        ),
        ("warm-up one longer", lambda r, p, m: _ofob(r, p, m, extra=1), "of p=2, m=2"),
    ],
    "10_bubble": [
        ("p / m", lambda p, m: p / m, "the bubble for"),
        ("over the total time", lambda p, m: (p - 1) / (m + p - 1), "the bubble for"),
    ],
    "11_rank_grid": [
        (
            "tp = rank",
            lambda r, shape: {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "ep": 0, "cp": 0, "tp": r},
            "the coordinates of rank",
        ),
        (
            "pp fastest",
            lambda r, shape: dict(
                zip(
                    ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp"),
                    list(
                        _coords(
                            r, shape[::-1], ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")
                        ).values()
                    ),
                )
            ),
            "the coordinates of rank",
        ),
        ("a tuple", lambda r, shape: tuple(_coords(r, shape).values()), "should be a dict"),
        (
            "the 4-D grid of before cp",
            lambda r, shape: _coords(
                r, shape[:3] + shape[5:], ("pp", "dp_replicate", "dp_shard", "tp")
            ),
            "the coordinates of rank",
        ),
        (
            "the 5-D grid of before ep",
            lambda r, shape: _coords(
                r, shape[:3] + shape[4:], ("pp", "dp_replicate", "dp_shard", "cp", "tp")
            ),
            "the coordinates of rank",
        ),
    ],
    "19_partition_spec": [
        (what, functools.partial(_spec_mistake, kind), "the spec of")
        for what, kind in (
            ("column and row swapped", "swapped"),
            ("fsdp splits dim 1", "dim 1"),
            ("tp splits the batch", "tp batch"),
            ("fsdp splits what n does not divide", "uneven"),
            ("fsdp splits the norms", "norms"),
            ("the embedding split as a column", "embedding"),
            ("2d keeps the batch whole", "2d batch"),
        )
    ],
    "19_busbw": [
        ("algbw", lambda s, t, n: s / t, "busbw of an all-reduce"),
        ("(n-1)/n", lambda s, t, n: s / t * (n - 1) / n, "busbw of an all-reduce"),
        ("2(n-1)", lambda s, t, n: s / t * 2 * (n - 1), "busbw of an all-reduce"),
        ("n/(n-1)", lambda s, t, n: s / t * n / (n - 1), "busbw of an all-reduce"),
        ("in bits", lambda s, t, n: 8 * s / t * 2 * (n - 1) / n, "busbw of an all-reduce"),
        ("t/S", lambda s, t, n: t / s * 2 * (n - 1) / n, "busbw of an all-reduce"),
        ("GB/s", lambda s, t, n: s / t * 2 * (n - 1) / n / 1e9, "busbw of an all-reduce"),
    ],
    "20_state_bytes": [
        ("8 bytes a value for all", _state_mistake(**{"all fp32": True}), "state_bytes("),
        ("no block scales", _state_mistake(scale=0), "state_bytes("),
        ("bf16 block scales", _state_mistake(scale=2), "state_bytes("),
        ("no lookup table", _state_mistake(table=0), "state_bytes("),
        ("one table of 256 for 4-bit", _state_mistake(table=256), "state_bytes("),
        ("one moment", _state_mistake(moments=1), "state_bytes("),
        ("4-bit as a byte a value", _state_mistake(value=1), "state_bytes("),
        ("4-bit in blocks of 256", _state_mistake(block=256), "state_bytes("),
        ("8-bit in blocks of 128", _state_mistake(block=128), "state_bytes("),
        ("quantized above 4096 only", _state_mistake(more=True), "state_bytes("),
        (
            "Adafactor keeps rows × cols",
            _state_mistake(adafactor=lambda sh: 4 * math.prod(sh)),
            "state_bytes(",
        ),
        (
            "Adafactor's leading dims dropped",
            _state_mistake(adafactor=lambda sh: 4 * sum(sh[-2:]) if len(sh) > 1 else 4 * sh[0]),
            "state_bytes(",
        ),
        (
            "Adafactor factors vectors too",
            _state_mistake(
                adafactor=lambda sh: (
                    4 * (math.prod(sh[:-2]) * sum(sh[-2:]) if len(sh) > 1 else 1 + sh[0])
                )
            ),
            "state_bytes(",
        ),
    ],
    "20_newton_schulz_step": [
        (what, functools.partial(_ns, kind=what), says)
        for what, says in (
            ("no x at the end", "one iteration on a"),
            ("gram of the transpose", "one iteration on a"),
            ("a, b, c in the wrong places", "one iteration on a"),
            ("squared gram as gram²·c only", "one iteration on a"),
            ("float32", "one iteration on a"),
            ("the transpose", "one iteration on a"),
            ("normalised again", "one iteration on a"),
        )
    ],
    "18_topk_route": [
        ("weights from scores + bias", _route_mistake("biased weights"), "each token's chosen"),
        ("bias ignored", _route_mistake("no bias"), "each token's chosen"),
        ("not normalised", _route_mistake("raw weights"), "each token's chosen"),
        ("softmax of the chosen", _route_mistake("softmax"), "each token's chosen"),
        ("normalised over all experts", _route_mistake("all experts"), "each token's chosen"),
        ("the top 1 only", _route_mistake("top 1"), "should have shape"),
        ("(chosen, weights)", _route_mistake("swapped"), ""),
    ],
    "18_dispatch_splits": [
        ("tokens, not choices", _splits_mistake("tokens"), "the rows sent to each"),
        ("round-robin experts", _splits_mistake("round robin"), "the rows sent to each"),
        ("per expert", _splits_mistake("per expert"), "items"),
        ("first choice only", _splits_mistake("first"), "the rows sent to each"),
        ("rank of an expert e // ep", _splits_mistake("e // ep"), ""),
        ("bincount without minlength", _splits_mistake("no minlength"), "the rows sent to each"),
    ],
    "17_lse_merge": [
        ("an average", _merge_mistake("average"), "the merged output"),
        ("weighted by exp(lse), not normalised", _merge_mistake("unnormalised"), "the merged"),
        ("exp(lse) normalised: overflows", _merge_mistake("exp overflow"), "the merged"),
        (
            "exp(lse) normalised in float64: overflows past 709",
            _merge_mistake("exp in float64"),
            "log-sum-exps near 800",
        ),
        ("max for the log-sum-exp", _merge_mistake("max for the lse"), "the merged log-sum-exp"),
        ("the weights swapped", _merge_mistake("weights swapped"), "the merged output"),
        ("the first lse kept", _merge_mistake("lse unchanged"), "the merged log-sum-exp"),
    ],
    "17_zigzag_positions": [
        (
            "contiguous",
            lambda r, cp, t: list(range(r * t // cp, (r + 1) * t // cp)),
            "the positions rank",
        ),
        ("tail 2cp - r", _zigzag_mistake(lambda r, cp: (r, 2 * cp - r)), "the positions rank"),
        ("tail cp + r", _zigzag_mistake(lambda r, cp: (r, cp + r)), "the positions rank"),
        ("tail first", _zigzag_mistake(lambda r, cp: (2 * cp - 1 - r, r)), "the positions rank"),
        ("chunks of t/cp", lambda r, cp, t: [r, 2 * cp - 1 - r], "the positions rank"),
    ],
    "11_groups": [
        ("one group", lambda shape, dim: [[0]], "groups of shape"),
        ("axis counted from the end", _groups_wrong_axis, "groups of shape"),
    ],
    "12_atomic_commit": [
        (
            "record after the rename",
            lambda t, f, s: _commit(t, f, s, after=True),
            "was not in the folder when it was renamed",
        ),
        ("no fsync", lambda t, f, s: _commit(t, f, s, fsync=False), "not flushed to disk"),
        ("an empty file list", lambda t, f, s: _commit(t, f, s, files=False), "'files'"),
        ("copied, not renamed", lambda t, f, s: _commit(t, f, s, copy=True), "no rename happened"),
    ],
    "12_latest_committed": [
        (
            "anything named newest",
            lambda folder: max(Path(folder).iterdir(), default=None),
            "the latest committed checkpoint",
        ),
        ("the record ignored", lambda folder: _latest(folder, record=False), "no titanlite.json"),
        (
            "a .partial with a record",
            lambda folder: _latest(folder, pattern="step-*"),
            ".partial (has titanlite.json)",
        ),
        ("the oldest", lambda folder: _latest(folder, pick=min), "the latest committed checkpoint"),
    ],
    "22_quorum_gradient": [
        ("÷ every group", _quorum_mistake("÷ every group"), "groups in the quorum"),
        (
            "the dead group's kept",
            _quorum_mistake("the dead group's gradient kept"),
            "in the quorum",
        ),
        ("the sum", _quorum_mistake("the sum, not the mean"), "groups in the quorum"),
        ("÷ (groups - 1)", _quorum_mistake("÷ (groups - 1)"), "groups in the quorum"),
        ("one live group's", _quorum_mistake("one live group's"), "groups in the quorum"),
        ("the mean of every group", _quorum_mistake("mean of every group"), "in the quorum"),
        ("a list, not a tensor", lambda g, a: [0.0], "should be a torch.Tensor"),
    ],
    "22_bytes_per_step": [
        (name, _traffic_mistake(name), "bytes_sent_per_step(")
        for name in (
            "the tensor's size, no ring",
            "2·S, not 2·(G-1)/G·S",
            "(G-1)/G·S: no factor 2",
            "× H, not ÷ H",
            "H ignored",
            "in bits",
            "whole bytes (//)",
            "÷ (H + 1)",
        )
    ],
    "13_young": [
        ("no factor 2", lambda d, m: math.sqrt(d * m), "the interval for"),
        (
            "Daly's first-order term added",
            lambda d, m: math.sqrt(2 * d * m) + d,
            "the interval for",
        ),
    ],
    "13_cluster_mtbf": [
        ("hours", lambda n, rate: 1 / (n * rate), "the MTBF in seconds"),
        ("one instance", lambda n, rate: 3600 / rate, "the MTBF in seconds"),
    ],
    "14_state_bytes": [
        ("weights only", lambda n, b, s, v: 16 * n, "state_bytes("),
        ("one Adam moment", lambda n, b, s, v: 12 * n + 12 * b * s * v, "state_bytes("),
        ("two logits tensors", lambda n, b, s, v: 16 * n + 8 * b * s * v, "state_bytes("),
    ],
    "14_bf16_verdict": [
        ("means", lambda b, f: _bf16(b, f, centre=statistics.mean), "the verdict for"),
        (
            "means throughout",
            lambda b, f: _bf16(b, f, centre=statistics.mean, spread_over=statistics.mean),
            "the verdict for",
        ),
        (
            "spreads over means",
            lambda b, f: _bf16(b, f, spread_over=statistics.mean),
            "the verdict for",
        ),
        ("no 0.2 floor", lambda b, f: _bf16(b, f, floor=0.0), "the verdict for"),
        ("1 - band below", lambda b, f: _bf16(b, f, symmetric=True), "the verdict for"),
        ("bf16's spread only", lambda b, f: _bf16(b, f, spreads="bf16"), "the verdict for"),
        ("0.2 only", lambda b, f: _bf16(b, f, spreads="none"), "the verdict for"),
    ],
    "15_best_lr_per_accum": [
        (
            "(loss, lr)",
            lambda st: _best_lr(st, keep=lambda t: t.state.name == "COMPLETE", swap=True),
            "the lr for",
        ),
        ("every trial with a value", lambda st: _best_lr(st), "grad_accum_steps="),
        (
            "the worst",
            lambda st: _best_lr(
                st, keep=lambda t: t.state.name == "COMPLETE", better=lambda a, b: a > b
            ),
            "the lr for",
        ),
        ("None compared", lambda st: _best_lr(st, keep=lambda t: True), "raised TypeError"),
    ],
    "15_compute_saved": [
        ("every trial", lambda st: _saved(st), "the tokens saved"),
        (
            "every trial, attrs indexed",
            lambda st: _saved(st, attrs=lambda a: a["token_budget"] - a["tokens_trained"]),
            "raised KeyError",
        ),
        (
            "tokens trained",
            lambda st: _saved(st, states=("PRUNED",), attrs=lambda a: a["tokens_trained"]),
            "the tokens saved",
        ),
        (
            "pruned budgets",
            lambda st: _saved(st, states=("PRUNED",), attrs=lambda a: a["token_budget"]),
            "the tokens saved",
        ),
    ],
    "16_row_overrides": [
        ("carry every rung", _carry_every_rung, "the overrides of"),
        (
            "own overrides only",
            lambda rungs: [(r, dict(r.overrides)) for r in rungs],
            "the overrides of",
        ),
        ("the rung's own dict", lambda rungs: [(r, r.overrides) for r in rungs], "a new dict"),
    ],
    "16_speed_verdict": [
        (
            "no band",
            lambda first, last, row: (
                "faster (beyond drift)" if row > first else "slower (beyond drift)"
            ),
            "the verdict for baselines",
        ),
        (
            "against the mean baseline",
            lambda a, b, r: _verdict(a, b, r, ratio_to=lambda a, b: (a + b) / 2),
            "the verdict for baselines",
        ),
        (
            "gap over the first",
            lambda a, b, r: _verdict(a, b, r, band=lambda a, b: abs(a - b) / a),
            "the verdict for baselines",
        ),
        (
            "against the last",
            lambda a, b, r: _verdict(a, b, r, ratio_to=lambda a, b: b),
            "the verdict for baselines",
        ),
        (
            "signed drift (no abs), first minus last",
            lambda a, b, r: _verdict(a, b, r, band=lambda a, b: (a - b) / ((a + b) / 2)),
            "the verdict for baselines",
        ),
        (
            "signed drift (no abs), last minus first",
            lambda a, b, r: _verdict(a, b, r, band=lambda a, b: (b - a) / ((a + b) / 2)),
            "the verdict for baselines",
        ),
    ],
}

# Right answers other than the notebook's solution, which each check must accept at every seed.
ALSO_RIGHT = {
    "20_state_bytes": [
        (
            "a float that is a whole number",
            lambda shape, name: float(_state_mistake()(shape, name)),
        ),
    ],
    "20_newton_schulz_step": [
        ("x·p(xᵀx), the polynomial on the other side", functools.partial(_ns, kind="x p(xᵀx)")),
    ],
    "21_block_mask": [
        ("an int tensor of 0 and 1", lambda d, b: _block_mask_answer()(d, b).int()),
        (
            "a loop over the blocks",
            lambda d, b: torch.tensor(
                [
                    [
                        any(
                            d[q] == d[k] and k <= q
                            for q in range(i * b, (i + 1) * b)
                            for k in range(j * b, (j + 1) * b)
                        )
                        for j in range(len(d) // b)
                    ]
                    for i in range(len(d) // b)
                ]
            ),
        ),
    ],
    "21_attended_fraction": [
        ("exact fractions", _fractions_right),
        (
            "a dense mask's mean",
            lambda ls: (
                torch.ones(sum(ls), sum(ls)).tril().mean().item(),
                torch.block_diag(*[torch.ones(n, n).tril() for n in ls]).double().mean().item(),
            ),
        ),
    ],
    "22_quorum_gradient": [
        (
            "a stacked mean over the live groups",
            lambda g, a: torch.stack([x for x, alive in zip(g, a) if alive]).mean(0),
        ),
        (
            "zeros for the missing, ÷ the live count (float64)",
            lambda g, a: sum(x.double() * alive for x, alive in zip(g, a)) / sum(a),
        ),
    ],
    "22_bytes_per_step": [
        ("bytes in another order", lambda n, b, g, h: n * b * 2 * (g - 1) / (g * h)),
        ("in numpy", lambda n, b, g, h: __import__("numpy").float64(2 * (g - 1) * n * b) / (g * h)),
    ],
    "17_lse_merge": [
        ("the softmax of the stacked log-sum-exps (float32)", _merge_right("softmax")),
        ("weights exp(lse - max), normalised (float32)", _merge_right("max shifted")),
        ("a sigmoid of the difference (float32)", _merge_right("sigmoid")),
        ("the markdown's formula in float64", _merge_right("float64")),
    ],
    "18_dispatch_splits": [
        (
            "choices counted per rank",
            lambda ch, e, ep: [int((ch // (e // ep) == g).sum()) for g in range(ep)],
        ),
        (
            "a bincount of ranks, as a tensor",
            lambda ch, e, ep: torch.bincount((ch // (e // ep)).flatten(), minlength=ep),
        ),
    ],
}

# Answers that once slipped through, and right ones once refused at a few seeds (issue 47), swept
# over more seeds than SEEDS: exercise -> (seeds, the MISTAKES among them); every right answer
# (the solution, ALSO_RIGHT) is swept too. Each sweep holds the seeds they were found at: the
# speed verdict's signed drift passed at 66; a right lse merge was refused at 9, 19, 161, 162 and
# 168, whose first five draws are the same today. The lse merge sweeps fewer: a softmax over a
# tiny tensor can take 10 ms on a loaded 2-core machine (torch's threads wait for each other).
LONG_SWEEPS = {
    # a whole number of bytes (//) is within 1e-9 of the answer once it is large: the small model
    # the check now always draws refuses it; it passed at 3 of the 30 seeds before
    "22_bytes_per_step": (range(200), ["whole bytes (//)"]),
    "18_dispatch_splits": (range(200), ["bincount without minlength"]),
    "17_lse_merge": (
        (*range(100), 161, 162, 168),
        ["exp(lse) normalised in float64: overflows past 709"],
    ),
    "16_speed_verdict": (
        range(200),
        ["signed drift (no abs), first minus last", "signed drift (no abs), last minus first"],
    ),
    "14_bf16_verdict": (range(100), ["means", "means throughout", "spreads over means"]),
}


def _sac(op, save):
    from torch.utils.checkpoint import CheckpointPolicy

    from titanlite.efficiency.activation_checkpoint import SAVE_OPS

    return getattr(CheckpointPolicy, save) if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _ofob(rank, p, m, extra=0):
    warmup = min(p - rank - 1 + extra, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


def test_every_exercise_has_a_notebook_cell_a_check_and_mistakes():
    assert set(SOLUTIONS) == set(EXERCISES), set(SOLUTIONS) ^ set(EXERCISES)
    assert set(MISTAKES) == set(EXERCISES), set(MISTAKES) ^ set(EXERCISES)
    assert len(EXERCISES) >= 32 and all(len(m) >= 2 for m in MISTAKES.values())
    per_notebook = {}
    for name in EXERCISES:
        per_notebook[name[:2]] = per_notebook.get(name[:2], 0) + 1
    assert all(n >= 2 for n in per_notebook.values()), per_notebook  # 05 and 14 too


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_check_passes_the_solution_once_and_fails_the_stub(name, capsys):
    source, fn, _ = SOLUTIONS[name]
    assert check(name, _define(source, fn)) is None, (
        "check() returns nothing: a notebook would echo it"
    )
    out, err = capsys.readouterr()
    assert out.count(f"✓ {name}: passed") == 1 and out.count("\n") == 1 and not err, (out, err)
    with pytest.raises(ExerciseError, match=f"^{name}: not attempted yet"):
        check(name, _define(strip_solution(source), fn))


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_check_separates_solution_and_mistakes_at_every_seed(name, capsys):
    """At 30 spread seeds the solution passes and every classic mistake fails, with its fragment,
    in one line that ends with the seed: a check is not right only most of the time."""
    source, fn, _ = SOLUTIONS[name]
    solution = _define(source, fn)
    for seed in SEEDS:
        check(name, solution, seed=seed)
        for what, wrong, says in MISTAKES[name]:
            with pytest.raises(ExerciseError) as e:
                check(name, wrong, seed=seed)
            message = str(e.value)
            assert (
                message.startswith(f"{name}: ")
                and says in message
                and "\n" not in message
                and message.endswith(f"[seed {seed}]")
            ), f"{what}: {message}"
    assert capsys.readouterr().out.count("passed") == len(SEEDS)


@pytest.mark.parametrize("name", sorted(ALSO_RIGHT))
def test_every_right_answer_passes_at_every_seed(name, capsys):
    for what, right in ALSO_RIGHT[name]:
        for seed in SEEDS:
            try:
                check(name, right, seed=seed)
            except ExerciseError as e:
                raise AssertionError(f"{what} refused: {e}") from None
    assert capsys.readouterr().out.count("passed") == len(SEEDS) * len(ALSO_RIGHT[name])


@pytest.mark.parametrize("name", sorted(LONG_SWEEPS))
def test_answers_that_slipped_through_are_refused_at_every_seed_of_a_long_sweep(name, capsys):
    """The wrong answers a check once let through at some seeds are refused at all of them, and
    the solution and every other right answer pass at all of them."""
    seeds, slipped = LONG_SWEEPS[name]
    wrong = {what: (fn, says) for what, fn, says in MISTAKES[name]}
    source, fn, _ = SOLUTIONS[name]
    rights = [("the solution", _define(source, fn)), *ALSO_RIGHT.get(name, [])]
    for seed in seeds:
        for what, right in rights:
            try:
                check(name, right, seed=seed)
            except ExerciseError as e:
                raise AssertionError(f"{what} refused: {e}") from None
        for what in slipped:
            mistake, says = wrong[what]
            with pytest.raises(ExerciseError, match=re.escape(says)) as e:
                check(name, mistake, seed=seed)
            assert str(e.value).endswith(f"[seed {seed}]"), f"{what}: {e.value}"
    assert capsys.readouterr().out.count("passed") == len(seeds) * len(rights)


def test_a_message_names_an_item_apart_from_its_description():
    """'... of a sequence of 20, item [5] is ...', never '... of 20[5] is ...'."""

    def one_off(rank, cp, seq_len):
        from titanlite.distributed.context_parallel import positions_of

        got = positions_of(rank, cp, seq_len // cp, "zigzag").tolist()
        got[-1] += 1
        return got

    with pytest.raises(ExerciseError) as e:
        check("17_zigzag_positions", one_off, seed=4)
    assert re.search(
        r"of a sequence of \d+, item \[\d+\] is \d+, expected \d+ \[seed 4\]$", str(e.value)
    ), str(e.value)

    def off_in_a_dict(n, w, s):
        from titanlite.tools.predict.zero import zero_bytes_per_rank

        real = zero_bytes_per_rank(n, w, s)
        return {"params": real["params"], "grads": 1, "optimizer": real["optimizer"]}

    with pytest.raises(ExerciseError) as e:
        check("08_zero_bytes", off_in_a_dict, seed=4)
    assert re.search(r"\), item \['grads'\] is 1, expected [\d,]+ \[seed 4\]$", str(e.value)), str(
        e.value
    )

    with pytest.raises(ExerciseError) as e:  # nested: a token, its expert pair, the weight
        check("18_topk_route", _route_mistake("raw weights"), seed=4)
    assert re.search(r"E=\d+\), item \[\d+\]\[\d+\]\[1\] is [\d.]+, expected", str(e.value)), str(
        e.value
    )


def test_a_crash_is_one_line_with_its_type_first_line_the_students_line_and_the_seed():
    def broken(step, warmup, total, floor):
        x = 1
        return x / 0

    with pytest.raises(ExerciseError) as e:
        check("01_lr_schedule", broken, seed=7)
    assert re.fullmatch(
        r"01_lr_schedule: your function raised ZeroDivisionError: division by zero "
        r"\(line \d+ of broken: return x / 0\) \[seed 7\]",
        str(e.value),
    ), str(e.value)

    def torch_crash(logits, targets):  # raised inside torch: the line named is the student's call
        return torch.log_softmax(logits, dim=5).sum()

    with pytest.raises(ExerciseError) as e:
        check("01_cross_entropy", torch_crash, seed=3)
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        "01_cross_entropy: your function raised IndexError: "
    )
    assert (
        "of torch_crash: return torch.log_softmax(logits, dim=5).sum())" in message
        and message.endswith("[seed 3]")
    )

    def many_lines(step, warmup, total, floor):
        text = "first line\nsecond line\nthird"
        raise ValueError(text)

    with pytest.raises(ExerciseError) as e:
        check("01_lr_schedule", many_lines, seed=1)
    assert "ValueError: first line (line" in str(e.value) and "second" not in str(e.value)
    with pytest.raises(ExerciseError, match="did you mean: 13_young"):
        check("13_yung", broken)
    assert issubclass(ExerciseError, TitanliteError)  # the notebook handler shows it as one line


def test_a_seed_repeats_the_same_inputs_and_message():
    wrong = dict((w, f) for w, f, _ in MISTAKES["08_zero_bytes"])["optimizer floored"]
    messages = set()
    for _ in range(2):
        with pytest.raises(ExerciseError) as e:
            check("08_zero_bytes", wrong, seed=99)
        messages.add(str(e.value))
    assert len(messages) == 1
    with pytest.raises(ExerciseError, match="seed must be a whole number"):
        check("08_zero_bytes", wrong, seed=-1)


def test_numbers_are_printed_with_the_digits_that_differ():
    from titanlite.labs.exercises.grading import show_pair

    assert show_pair(114_257_004, 114_257_008) == ("114,257,004", "114,257,008")
    assert show_pair(1.1425700381, 1.1425700382) == ("1.1425700381", "1.1425700382")
    assert show_pair(0.5, 0.25) == ("0.5", "0.25")

    def off_by_one_byte(n, w, s):  # close to the answer: the message must still show a difference
        from titanlite.tools.predict.zero import zero_bytes_per_rank

        real = zero_bytes_per_rank(n, w, s)
        return {
            "params": real["params"],
            "grads": real["grads"],
            "optimizer": real["optimizer"] + 8,
        }

    with pytest.raises(ExerciseError) as e:
        check("08_zero_bytes", off_by_one_byte, seed=5)
    got, want = re.search(r"is ([\d,]+), expected ([\d,]+)", str(e.value)).groups()
    assert got != want and int(got.replace(",", "")) - int(want.replace(",", "")) == 8, str(e.value)

    def close(step, warmup, total, floor):
        from titanlite.config import load_config
        from titanlite.optimizer import lr_lambda

        cfg = load_config(overrides={"scheduler.decay": "cosine"})
        cfg.scheduler.warmup_steps, cfg.training.steps, cfg.scheduler.min_lr_ratio = (
            warmup,
            total,
            floor,
        )
        return lr_lambda(cfg.scheduler, cfg.training.steps)(step) * (1 + 1e-7)

    with pytest.raises(ExerciseError) as e:
        check("01_lr_schedule", close, seed=5)
    got, want = re.search(r"is ([\d.e+-]+), expected ([\d.e+-]+)", str(e.value)).groups()
    assert got != want, str(e.value)


def test_the_best_lr_message_names_the_key_not_two_dicts():
    def worst(study):
        return _best_lr(study, keep=lambda t: t.state.name == "COMPLETE", better=lambda a, b: a > b)

    with pytest.raises(ExerciseError) as e:
        check("15_best_lr_per_accum", worst, seed=11)
    assert re.search(
        r"the lr for grad_accum_steps=\d+ \(of its best complete trial, loss [\d.]+\) in a study "
        r"of \d+ trials \(\d+ complete, ",
        str(e.value),
    ), str(e.value)
    assert str(e.value).count("{") == 0


def test_a_check_prints_nothing_on_stderr_and_hides_warnings(capsys):
    import warnings

    def warns(step, warmup, total, floor):
        warnings.warn("a student's warning", stacklevel=2)
        return _lr(step, warmup, total, floor)

    check("01_lr_schedule", warns, seed=2)
    assert not capsys.readouterr().err


def test_strip_solution_is_nbgraders_stub():
    source = (
        f"def f(x):\n    '''doc'''\n    {BEGIN}\n    y = x + 1\n    return y\n    {END}\n\nprint(1)"
    )
    assert strip_solution(source) == (
        "def f(x):\n    '''doc'''\n    # YOUR CODE HERE\n"
        "    raise NotImplementedError()\n\nprint(1)"
    )
    for bad, says in (
        (f"{BEGIN}\nx = 1", "never closed"),
        (f"x = 1\n{END}", "without"),
        (f"{BEGIN}\n{BEGIN}\n{END}", "inside another"),
    ):
        with pytest.raises(TitanliteError, match=says):
            strip_solution(bad)


FAKE_NBGRADER = '''
CALLS = []

class ClearSolutions:
    """Stands in for nbgrader's preprocessor: records each call, stubs the solution cells."""
    def preprocess(self, nb, resources):
        CALLS.append((nb, resources))
        if any("FAIL" in c.source for c in nb.cells):
            raise RuntimeError("unclosed solution region\\nsecond line")
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("solution"):
                cell.source = "# stripped by nbgrader"
        return nb, resources
'''


@pytest.fixture
def no_nbgrader(monkeypatch):
    """Hide any nbgrader (real or fake) from this test and put sys.modules back after it."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "nbgrader"}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nbgrader", None)  # find_spec says None: not installed
    yield monkeypatch
    for k in [k for k in sys.modules if k.split(".")[0] == "nbgrader"]:
        del sys.modules[k]
    sys.modules.update(saved)


def _fake_nbgrader(tmp_path, monkeypatch):
    package = tmp_path / "site" / "nbgrader"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "preprocessors.py").write_text(FAKE_NBGRADER)
    monkeypatch.delitem(sys.modules, "nbgrader")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_strip_solutions_without_nbgrader_uses_the_stripper(no_nbgrader):
    nb = nbformat.read(ROOT / "notebooks" / "16_capstone.ipynb", 4)
    assert stripper() == "titanlite" and stripper(False) == "titanlite"
    assert strip_solutions(nb) == student_notebook(nb)
    with pytest.raises(TitanliteError, match="^nbgrader is not installed: `pip install nbgrader`"):
        strip_solutions(nb, use_nbgrader=True)


def test_strip_solutions_with_nbgrader_calls_its_clear_solutions(no_nbgrader, tmp_path):
    _fake_nbgrader(tmp_path, no_nbgrader)
    assert (
        stripper() == "nbgrader" and stripper(True) == "nbgrader" and stripper(False) == "titanlite"
    )
    calls = __import__("nbgrader.preprocessors").preprocessors.CALLS
    nb = nbformat.read(ROOT / "notebooks" / "16_capstone.ipynb", 4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="old output")]
    student = strip_solutions(nb)
    # (nb, {}) as documented
    assert len(calls) == 1 and calls[0][1] == {} and calls[0][0] is student
    solutions = [i for i, c in enumerate(nb.cells) if is_solution_cell(c)]
    assert solutions and all(student.cells[i].source == "# stripped by nbgrader" for i in solutions)
    assert not student.cells[2].outputs and nb.cells[2].outputs, "outputs cleared, on a copy"
    assert BEGIN in nb.cells[solutions[0]].source, "the instructor's notebook is untouched"
    assert strip_solutions(nb, use_nbgrader=False) == student_notebook(nb) and len(calls) == 1
    # `make student` (student_edition) goes the same way: one ClearSolutions call per notebook
    source = tmp_path / "nbs"
    source.mkdir()
    shutil.copy(ROOT / "notebooks" / "16_capstone.ipynb", source)
    shutil.copy(ROOT / "notebooks" / "14_cpu_and_apple_silicon.ipynb", source)
    student_edition(source, tmp_path / "student")
    assert len(calls) == 3
    written = nbformat.read(tmp_path / "student" / "16_capstone.ipynb", 4)
    assert written.cells[solutions[0]].source == "# stripped by nbgrader"
    nb.cells[0].source = "FAIL"
    with pytest.raises(
        TitanliteError, match="^nbgrader's ClearSolutions refused the notebook: unclosed"
    ) as e:
        strip_solutions(nb)
    assert "\n" not in str(e.value), "one line, however many nbgrader's message has"


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_instructor_notebook_is_nbgrader_ready(path):
    """Solution cells carry nbgrader's metadata and markers, each is followed by its locked
    check cell and preceded by its task's markdown, and grade ids are unique (nbgrader refuses
    duplicates)."""
    cells = nbformat.read(path, 4).cells
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids))
    solutions = [i for i, c in enumerate(cells) if is_solution_cell(c)]
    assert 2 <= len(solutions) <= 3
    for i in solutions:
        meta = cells[i].metadata["nbgrader"]
        assert meta["schema_version"] == 3 and meta["locked"] is False and meta["grade"] is False
        assert BEGIN in cells[i].source and END in cells[i].source
        check_meta = cells[i + 1].metadata["nbgrader"]
        assert check_meta["grade"] and check_meta["locked"] and check_meta["points"] == 1
        name = cells[i + 1].source.split('check("')[1].split('"')[0]
        assert cells[i - 1].cell_type == "markdown" and "seed=N)` repeats" in cells[i - 1].source
        assert cells[i - 1].source.startswith(f"### ✍️ Exercise `{name}`: {EXERCISES[name][0]}\n")
        assert BEGIN not in student_notebook(nbformat.read(path, 4)).cells[i].source


def test_the_markdown_states_the_rules_the_checks_enforce():
    """The rules a check enforces beyond the obvious, each stated in its exercise's markdown."""
    tasks = {}
    for path in WITH_EXERCISES:
        cells = nbformat.read(path, 4).cells
        for i, cell in enumerate(cells):
            if is_solution_cell(cell):
                tasks[cells[i + 1].source.split('check("')[1].split('"')[0]] = cells[i - 1].source
    rules = {
        "03_autocast_policy": ['Every other device gets `"fp32"`', "MPS"],
        "03_scaler_step": ["inf, -inf or nan", "`(skipped, new_scale, new_tracker)`", "all three"],
        "05_no_graph_break": ["**absolute**", "negative"],
        "06_tensorwise_fp8": ["**bit for bit**", "`448 / amax.double()`"],
        "07_buckets": [
            "**its own dtype**",
            "exactly `cap_bytes` is enough",
            "order they were opened",
        ],
        "07_bucketed_allreduce": ["one per bucket, not one per tensor"],
        "12_atomic_commit": ["`os.fsync`", "not the record itself", "`os.rename`"],
        "12_latest_committed": ["even a `.partial` that has its record", "`None`"],
        "15_best_lr_per_accum": ["a pruned trial has a value too", "failed or still running"],
        "15_compute_saved": ["**complete and pruned** trials only", "no `tokens_trained`"],
        "02_global_token_loss": ["carry their gradient"],
        "16_speed_verdict": ["*first* baseline", "over their mean", "`|first - last|`"],
        "14_bf16_verdict": ["**medians**", "`(max - min) / median`"],
        "17_lse_merge": ["even in float64", "float32's rounding"],
        "18_dispatch_splits": ["the list of `ep` numbers", "its own included"],
        "20_state_bytes": ["**4096 values or more**", "whole blocks", "one table per moment"],
        "20_newton_schulz_step": ["float64", "any `a`, `b`, `c`"],
        "21_block_mask": ["**at least one**", "**a token attends to itself**"],
        "21_attended_fraction": [
            "**all `T × T` query–key pairs**",
            "**A token attends to itself.**",
        ],
        "22_quorum_gradient": ["divided by the number", "counts in neither"],
        "22_bytes_per_step": ["**one**", "**on average**", "not bits", "not rounded"],
    }
    for name, phrases in rules.items():
        for phrase in phrases:
            assert phrase in tasks[name], (name, phrase)


def _run_until_first_check(path: Path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    work = tmp_path / "notebooks"
    shutil.copytree(path.parent, work, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    monkeypatch.setenv("TITANLITE_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = student_notebook(nbformat.read(path, 4))
    first = next(i for i, c in enumerate(nb.cells) if is_check_cell(c))
    # The cells before the first check run in the solution edition (tests/test_notebooks.py) and
    # differ here only in the stubbed solution cells, which no earlier cell calls (checked by
    # test_no_cell_calls_a_stub_before_its_check): run the setup, the stub and the check.
    setup = [c for c in nb.cells[:first] if "notebook_setup()" in c.source]
    nb.cells = [*setup, nb.cells[first - 1], nb.cells[first]]
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(work)}},
        **kernel_on_unix_sockets(tmp_path),
    )
    return nb, client


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_student_edition_fails_at_its_first_check_in_one_line(path, tmp_path, monkeypatch):
    from nbclient.exceptions import CellExecutionError

    nb, client = _run_until_first_check(path, tmp_path, monkeypatch)
    with pytest.raises(CellExecutionError) as e:
        client.execute()
    name = nb.cells[-1].source.split('check("')[1].split('"')[0]
    shown = [o["text"] for o in nb.cells[-1].outputs if o.get("name") == "stderr"]
    assert shown == [
        f"ExerciseError: {name}: not attempted yet - replace `raise NotImplementedError()` "
        f"in the cell above with your code, run it, then run this check\n"
    ], f"the first error was not the check's: {str(e.value)[-1500:]}"
    assert "Traceback" not in str(e.value) and f"ExerciseError: {name}: not attempted" in str(
        e.value
    )


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_no_cell_calls_a_stub_before_its_check(path):
    """In the student edition a solution cell defines a function that raises until the student
    writes it: a cell that used that name before the exercise's check would fail first, with a
    traceback, instead of the check's one line."""
    import ast

    cells = [c for c in nbformat.read(path, 4).cells if c.cell_type == "code"]
    for i, cell in enumerate(cells):
        if not is_check_cell(cell):
            continue
        defined = {
            node.name
            for node in ast.parse(cells[i - 1].source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        }
        earlier = [c.source for c in cells[: i - 1] if not is_check_cell(c)]
        called = {
            n.func.id
            for src in earlier
            for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not defined & called, (path.name, defined & called)
