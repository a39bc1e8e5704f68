"""Notebook 20's experiments: what each optimizer keeps per parameter (the formula, per tensor, that
the measured state must equal), what 8-bit and 4-bit quantization does to real moments (torchao's
own code, and block-wise absmax from scratch equal to it), Adafactor's factored second moment, and
Muon from scratch (equal to torch.optim.Muon) and under FSDP (bytes counted against the formula).

    state_bytes((4096, 64), "adamw8bit")          # the bytes one tensor's state holds
    muon_step(param, grad, buffer, lr=..., ...)   # one Muon step in plain torch
"""

from __future__ import annotations

import math

import torch

# torchao's block sizes and its threshold (torchao/optim/adam.py: AdamW8bit 256, AdamW4bit 128;
# "follow bitsandbytes, only quantize tensors >= 4096 values")
BLOCK = {"adamw8bit": 256, "adamw4bit": 128}
CODES = {"adamw8bit": 256, "adamw4bit": 16}  # entries of each moment's lookup table (fp32)
MIN_QUANTIZED = 4096
COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default


# ----- what each optimizer keeps --------------------------------------------------------------
def state_bytes(shape, name: str, shards: int = 1, rank: int = 0) -> int:
    """Bytes of the optimizer state one parameter of `shape` holds on `rank` of `shards` FSDP ranks
    (its dim-0 shard: notebook 08's `fsdp_shard_numel`), leaving out the per-tensor step counter.

    adamw: two fp32 moments. adamw8bit/adamw4bit: two moments as codes (1 byte, or half a byte, a
    value), one fp32 absmax scale a block, and the moment's lookup table of 256 (16) fp32 values -
    where the whole tensor has >= 4096 values in whole blocks and the shard is whole blocks, else two
    fp32 moments (titanlite's rule, the same on one process and N ranks). adafactor: a matrix's row
    and column means (fp32), a vector's full second moment. muon: one fp32 momentum (its matrices;
    the rest is AdamW's)."""
    from ..tools.predict.zero import fsdp_shard_numel

    numel = math.prod(shape)
    local = fsdp_shard_numel(shape, shards, rank) if shards > 1 else numel
    if name in BLOCK:
        block = BLOCK[name]
        even = local * shards == numel and local % block == 0  # every rank: whole blocks
        if numel >= MIN_QUANTIZED and numel % block == 0 and even:
            code_bytes = local if name == "adamw8bit" else local // 2
            return 2 * (code_bytes + 4 * (local // block) + 4 * CODES[name])
        return 8 * local
    if name == "adafactor":
        if len(shape) < 2:
            return 4 * numel
        *lead, rows, cols = shape
        return 4 * math.prod(lead) * (rows + cols)
    if name == "muon":
        return 4 * local
    return 8 * local


def predicted_state(model, name: str, shards: int = 1, rank: int = 0) -> int:
    """The formula over a model's parameters: `state_bytes` of each, Muon's hidden matrices as muon
    and the rest as AdamW for name="muon" (titanlite.optimizer.hidden_matrices decides which)."""
    from ..optimizer import hidden_matrices

    hidden = {id(p) for p in hidden_matrices([model])} if name == "muon" else set()
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        kind = "muon" if id(p) in hidden else ("adamw" if name == "muon" else name)
        total += state_bytes(tuple(p.shape), kind, shards, rank)
    return total


# ----- quantized moments ----------------------------------------------------------------------
def qmap(name: str, signed: bool) -> torch.Tensor:
    """torchao's lookup table of a moment: 8-bit, the dynamic tree map of bitsandbytes (signed for
    the first moment, unsigned for the second); 4-bit, a signed dynamic map with 3 exponent bits and
    a linear unsigned one without zero (the 4-bit optimizers paper's choice)."""
    from torchao.optim.subclass_4bit import get_qmap_signed as signed4
    from torchao.optim.subclass_4bit import get_qmap_unsigned as unsigned4
    from torchao.optim.subclass_8bit import get_qmap_signed as signed8
    from torchao.optim.subclass_8bit import get_qmap_unsigned as unsigned8

    table = {
        ("adamw8bit", True): signed8,
        ("adamw8bit", False): unsigned8,
        ("adamw4bit", True): signed4,
        ("adamw4bit", False): unsigned4,
    }[(name, signed)]()
    return torch.tensor(table, dtype=torch.float32)


def quantize_blockwise(x: torch.Tensor, table: torch.Tensor, block: int):
    """From scratch: cut x's values into blocks of `block`, divide each block by its absmax, and
    store each value as the index of the nearest table entry (halfway rounds up, as torchao's
    search does). Returns (codes, scales)."""
    blocks = x.reshape(-1, block)
    scales = blocks.abs().amax(-1).clip(1e-12)  # torchao's floor: an all-zero block
    scaled = (blocks / scales[:, None]).reshape(-1)
    # the two table entries around each value, then whichever is nearer (a tie goes up)
    up = torch.searchsorted(table, scaled, right=True).clamp(1, len(table) - 1)
    low = up - 1
    nearer_up = (scaled - table[low]) >= (table[up] - table[low]) * 0.5
    codes = torch.where(nearer_up, up, low)
    return codes.reshape(x.shape), scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor):
    return (table[codes].reshape(scales.numel(), -1) * scales[:, None]).reshape(codes.shape)


def torchao_roundtrip(x: torch.Tensor, name: str, signed: bool):
    """What torchao's optimizer state holds for the fp32 moment `x`: its own subclass (the one
    AdamW8bit/4bit keep), filled by copy_ (quantize) and read back (dequantize)."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    cls = OptimState8bit if name == "adamw8bit" else OptimState4bit
    state = cls.zeros(x.shape, signed, BLOCK[name], x.device)
    state.copy_(x)
    return state, state.dequantize()


def rounding_bound(table: torch.Tensor, signed: bool) -> float:
    """The largest error nearest rounding to `table` can make on a value scaled into [-1, 1]
    (signed) or [0, 1]: half the widest gap between entries, or the distance from an end of the
    range to the entry nearest it (4-bit's second moment has no 0: a 0 is stored as 1/16)."""
    low = -1.0 if signed else 0.0
    gaps = [float((table[1:] - table[:-1]).max()) / 2, float(table[0]) - low, 1 - float(table[-1])]
    return max(gaps)


def quantization_error(moment: torch.Tensor, name: str, signed: bool) -> dict:
    """The error torchao's quantization puts on one real moment: relative error per value (of the
    values a tenth of their block's absmax or more: below that a relative error says little),
    the largest error per block over `rounding_bound` times the block's absmax (nearest rounding
    can do no worse: at most 1), and the relative norm of the error."""
    state, back = torchao_roundtrip(moment, name, signed)
    block = BLOCK[name]
    err = (back - moment).reshape(-1, block)
    scale = moment.reshape(-1, block).abs().amax(-1, keepdim=True)
    bound = rounding_bound(qmap(name, signed), signed) * scale
    big = moment.reshape(-1, block).abs() >= 0.1 * scale
    rel = (err.abs() / moment.reshape(-1, block).abs().clamp(min=1e-30))[big]
    return {
        "relative": rel,
        "worst_over_bound": float((err.abs() / bound.clamp(min=1e-30)).max()),
        "relative_norm": float(err.norm() / moment.norm()),
        "state": state,
    }


def adam_update(m, v, step: int, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """AdamW's step direction from its moments (bias-corrected), as torch's AdamW computes it."""
    return (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)


# ----- Adafactor's factored second moment -------------------------------------------------------
def factored(v: torch.Tensor) -> torch.Tensor:
    """Adafactor's estimate of a matrix of second moments from its row and column means alone:
    V̂ᵢⱼ = Rᵢ·Cⱼ / mean(R) (Shazeer & Stern 2018, eq. 4; torch's `row_var @ col_var / row_var.mean()`)."""
    rows, cols = v.mean(-1, keepdim=True), v.mean(-2, keepdim=True)
    return rows @ cols / rows.mean(-2, keepdim=True)


def factored_over_shards(v: torch.Tensor, shards: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same estimate with the rows split over `shards` ranks (FSDP's dim-0 shards): each rank's
    row means are its own, but the column means and mean(R) are sums over every rank's rows - two
    all-reduces a matrix a step, here the sums written out. Returns (the whole estimate, what each
    rank would compute from its rows alone)."""
    pieces = torch.chunk(v, shards, dim=0)
    column_sums = sum(p.sum(0, keepdim=True) for p in pieces)  # the all-reduce of the columns
    cols = column_sums / v.shape[0]
    row_means = [p.mean(-1, keepdim=True) for p in pieces]
    mean_r = sum(r.sum() for r in row_means) / v.shape[0]  # the all-reduce of mean(R)
    whole = torch.cat([r @ cols / mean_r for r in row_means])
    alone = [factored(p) for p in pieces]  # a rank that used its own rows as the whole matrix
    return whole, alone


# ----- Muon, from scratch -----------------------------------------------------------------------
def newton_schulz_step(x: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One quintic Newton-Schulz iteration on a wide matrix x (rows <= cols): with A = x·xᵀ,
    x ← a·x + (b·A + c·A²)·x, which maps each singular value s to a·s + b·s³ + c·s⁵."""
    gram = x @ x.T
    return a * x + (b * gram + c * gram @ gram) @ x


def orthogonalise(g: torch.Tensor, steps: int = 5, coefficients=COEFFICIENTS) -> torch.Tensor:
    """g's nearest semi-orthogonal matrix, approximately: scaled so every singular value is <= 1
    (the Frobenius norm bounds the largest), then `steps` iterations on the wide orientation, in
    g's own dtype. In bf16 torch fuses b·A + c·A² into one addmm, rounded once: so do we here."""
    a, b, c = coefficients
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        if x.dtype == torch.bfloat16:  # torch's rounding: the same numbers, rounded as it does
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            x = newton_schulz_step(x, a, b, c)
    return x.T if tall else x


def muon_step(param, grad, buffer, *, lr, weight_decay, momentum=0.95, nesterov=True, steps=5):
    """One Muon step on a 2-D `param` in place, as torch.optim.Muon takes it (torch 2.13): the
    momentum buffer moves towards the gradient, Nesterov looks one step ahead along it, the update
    is orthogonalised in bf16, the weight decays by lr·weight_decay, and the step is lr scaled by
    0.2·√max(rows, cols) (torch's "match_rms_adamw", Moonshot's: an update RMS like AdamW's)."""
    # B ← μ·B + (1-μ)·g, written as torch writes it (lerp: B + (1-μ)(g - B), the same bits)
    buffer.lerp_(grad, 1 - momentum)
    # Nesterov: g + μ·(B - g), the gradient pulled towards where the momentum goes next
    update = grad.lerp(buffer, momentum) if nesterov else buffer
    orthogonal = orthogonalise(update.bfloat16(), steps)
    param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal, alpha=-lr * (0.2 * math.sqrt(max(param.shape))))
    return param


def singular_values(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(m.double())


def iterated_polynomial(s: torch.Tensor, steps: int = 5, coefficients=COEFFICIENTS):
    """What `steps` iterations do to a singular value s in [0, 1]: p(p(...p(s))), p(s) = as+bs³+cs⁵."""
    a, b, c = coefficients
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


# ----- Muon under FSDP: the gather, counted --------------------------------------------------
def sharded_muon_step(shapes: list, seed: int = 0, steps: int = 2) -> dict:
    """On each of the job's ranks: the same random matrices and gradients (one seed), sharded by
    dim 0 over a 1-D mesh; `steps` steps of titanlite's ShardedMuon (the update all-gathered whole)
    under CommCounter, then the same on the whole matrices in one process with torch.optim.Muon
    itself (its Newton-Schulz in bf16: ShardedMuon's ns_dtype set to match). Returns this rank's
    largest difference from torch's result, and the collectives counted."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..muon import ShardedMuon
    from ..tools.measure.comm import CommCounter
    from ._common import join

    env, mesh = join(mesh_dim="dp_shard")
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    kwargs = dict(lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    reference = torch.optim.Muon(whole, **kwargs)
    sharded = [
        torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)], src_data_rank=None))
        for w in weights
    ]
    muon = ShardedMuon(sharded, **kwargs)
    muon.ns_dtype = torch.bfloat16  # torch's own Newton-Schulz dtype, to compare with it
    with CommCounter() as counter:
        for step in range(steps):
            for p, gr in zip(sharded, grads[step]):
                p.grad = distribute_tensor(gr, mesh, [Shard(0)], src_data_rank=None)
            muon.step()
    for step in range(steps):
        for p, gr in zip(whole, grads[step]):
            p.grad = gr.clone()
        reference.step()
    diff = max(float((s.full_tensor() - w).abs().max()) for s, w in zip(sharded, whole))
    return {
        "rank": env.rank,
        "world": env.world_size,
        "diff": diff,
        "collectives": counter.summary(),
    }


def implicit_dtensor_muon(shapes: list, seed: int = 0) -> dict:
    """torch.optim.Muon stepped directly on the DTensor shards, as `sharded_muon_step` sets them up:
    DTensor's sharding propagation decides every matmul's communication. Returns this rank's
    largest difference from one process, and the collectives counted (or the error, if it fails)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..tools.measure.comm import CommCounter
    from ._common import join

    env, mesh = join(mesh_dim="dp_shard")
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    kwargs = dict(lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    sharded = [
        torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)], src_data_rank=None))
        for w in weights
    ]
    for p, gr in zip(sharded, grads):
        p.grad = distribute_tensor(gr, mesh, [Shard(0)], src_data_rank=None)
    for p, gr in zip(whole, grads):
        p.grad = gr.clone()
    torch.optim.Muon(whole, **kwargs).step()
    try:
        with CommCounter() as counter:
            torch.optim.Muon(sharded, **kwargs).step()
    except Exception as e:  # what torch says, in one line
        return {"rank": env.rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    diff = max(float((s.full_tensor() - w).abs().max()) for s, w in zip(sharded, whole))
    return {"rank": env.rank, "diff": diff, "collectives": counter.summary()}


def state_per_rank(overrides: dict, names: list[str]) -> dict:
    """Each rank: the optimizer state bytes it holds after one step of a trainer built with
    `overrides` (an FSDP layout), for each optimizer in `names` in turn, as measure_state_bytes
    reads them off the state's tensors (a DTensor's local shard; a quantized state's codes,
    scales and tables)."""
    import torch.distributed as dist

    from ..config import load_config
    from ..tools.predict.zero import measure_state_bytes
    from ..train import Trainer

    held = {}
    for name in names:  # each trainer joins the job's one process group (left open between them)
        trainer = Trainer(load_config(None, {**overrides, "optimizer.name": name}))
        trainer.train_step(trainer.next_micro_batches())
        held[name] = measure_state_bytes(trainer.model, trainer.optimizer)["optimizer"]
    return {"rank": dist.get_rank(), "bytes": held}


# ----- the comparison, read against its noise ------------------------------------------------------
def row_of(name: str, trainer, history, warmup: int = 2) -> dict:
    """One optimizer's row from its finished run: the final validation loss, the median tokens/s
    of the steps after `warmup` and their spread (the capstone's measures), and the state's bytes,
    measured off its tensors and by the formula."""
    import statistics

    from ..tools.predict.zero import measure_state_bytes

    speeds = [r["tokens_per_sec"] for r in history.train[warmup:]] or [
        history.train[-1]["tokens_per_sec"]
    ]
    model = trainer.model
    return {
        "row": name,
        "lr": trainer.cfg.optimizer.lr,
        "val_loss": history.val_losses[-1],
        "first_loss": history.losses[0],
        "loss": history.losses[-1],
        "tokens": history.train[-1].get("tokens"),
        "tokens_per_sec": statistics.median(speeds),
        "spread": (max(speeds) - min(speeds)) / statistics.median(speeds),
        "state_bytes": measure_state_bytes(model, trainer.optimizer)["optimizer"],
        "formula_bytes": predicted_state(model, trainer.cfg.optimizer.name),
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
    }


def loss_verdict(row: dict, ref: dict, band: float) -> str:
    """A validation loss read against `band`, the gap two AdamW runs of different seeds left."""
    if row["val_loss"] < ref["val_loss"] - band:
        return "lower (beyond seed noise)"
    if row["val_loss"] > ref["val_loss"] + band:
        return "higher (beyond seed noise)"
    return "within seed noise"


def comparison_table(rows: list[dict]) -> str:
    """The optimizers against the first AdamW row: validation loss against the seed band (the two
    AdamW rows, first and last), tokens/s against the capstone's band (the AdamW rows' drift plus
    half of each row's step spread: nb16_report.noise), state bytes measured and by the formula."""
    from .nb16_report import noise, verdict

    ref, again = rows[0], rows[-1]
    seed_band = abs(ref["val_loss"] - again["val_loss"])
    head = (
        f"{'optimizer':<18}{'lr':>7}{'val loss':>10}{'Δ':>8}  {'loss reading':<27}"
        f"{'tok/s':>8}{'×':>6}{'band':>6}  {'speed reading':<22}{'state kB':>10}{'formula':>9}{'B/param':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["tokens_per_sec"] / ref["tokens_per_sec"]
        same, band = r is ref, noise(r, ref, rows)
        lines.append(
            f"{r['row']:<18}{r['lr']:>7.0e}{r['val_loss']:>10.4f}"
            f"{r['val_loss'] - ref['val_loss']:>+8.4f}  "
            f"{'(the reference)' if same else loss_verdict(r, ref, seed_band):<27}"
            f"{r['tokens_per_sec']:>8,.0f}{ratio:>6.2f}{'' if same else f'±{band:.0%}':>6}  "
            f"{'(the reference)' if same else verdict(ratio, band):<22}"
            f"{r['state_bytes'] / 1e3:>10,.1f}{r['formula_bytes'] / 1e3:>9,.1f}"
            f"{r['state_bytes'] / r['params']:>8.3f}"
        )
    return "\n".join(lines)


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Matmul FLOPs of Newton-Schulz on a rows × cols matrix (m = the smaller side, n the larger):
    each iteration X·Xᵀ (2m²n), A·A (2m³) and B·X (2m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def sharded_steps(shapes: list, seed: int = 0) -> dict:
    """For the notebook, in one job: one step of `sharded_muon_step` (the update gathered whole),
    `implicit_dtensor_muon` (torch's Muon left to DTensor), and what torch's Adafactor says when
    asked to step the same DTensor shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ._common import join

    gathered = sharded_muon_step(shapes, seed=seed, steps=1)
    implicit = implicit_dtensor_muon(shapes, seed=seed)
    _, mesh = join(mesh_dim="dp_shard")
    p = torch.nn.Parameter(distribute_tensor(torch.randn(shapes[0]), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.randn(shapes[0]), mesh, [Shard(0)])
    try:
        torch.optim.Adafactor([p]).step()
        adafactor = "it stepped"
    except Exception as e:  # what torch says, in one line
        adafactor = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return {**gathered, "implicit": implicit, "adafactor": adafactor}


def rounding_sensitivity(matrices: list, relative: float = 1e-6, seed: int = 0) -> dict:
    """How far Newton-Schulz's output moves when each input value moves by ~`relative` of itself
    (what summing a gradient over N ranks in another order does to fp32's last bits), in bf16 and in
    fp32: the largest change of an output over that output's largest value, and how many of the
    inputs round to another bf16 number (of how many)."""
    from ..muon import newton_schulz

    g = torch.Generator().manual_seed(seed)
    out = {"bfloat16": 0.0, "float32": 0.0, "flipped": 0, "values": 0}
    for m in matrices:
        nudged = m * (1 + relative * torch.randn(m.shape, generator=g))
        out["flipped"] += int((m.bfloat16() != nudged.bfloat16()).sum())
        out["values"] += m.numel()
        for dtype in (torch.bfloat16, torch.float32):
            a = newton_schulz(m.to(dtype), COEFFICIENTS, 5).float()
            b = newton_schulz(nudged.to(dtype), COEFFICIENTS, 5).float()
            moved = float((a - b).abs().max() / a.abs().max())
            out[str(dtype).replace("torch.", "")] = max(
                out[str(dtype).replace("torch.", "")], moved
            )
    return out
