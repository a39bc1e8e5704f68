"""The optimizer [optimizer] names, and its learning-rate schedule: linear warm-up, then cosine
(or linear) decay. Each optimizer's step and what it keeps per parameter (notebook 20):

    adamw      torch's AdamW: two fp32 moments, 8 bytes a parameter (fused on CUDA)
    adamw8bit  torchao's AdamW8bit: both moments in 8 bits, block-wise absmax scales (256 values a block)
    adamw4bit  torchao's AdamW4bit: both moments in 4 bits (128 values a block)
    adafactor  torch's Adafactor: a matrix's second moment as its row and column means, no first moment
    muon       torch's Muon on the hidden matrices (momentum, then Newton-Schulz), AdamW on the rest

The schedule scales every group's lr alike. Weight decay is decoupled (lr × weight_decay × w a step)
and applies to matrices only: shrinking a norm's gain towards zero regularises nothing and hurts.
adafactor's lr is the largest relative step (its update is lr × the parameter's RMS; torch's default
is 1e-2). muon's matrices step lr × 0.2·√max(rows, cols) (torch's "match_rms_adamw", Moonshot's
scale): an update as large as AdamW's, so [optimizer] lr and weight_decay serve both parts.

    optimizer = build_optimizer(model_parts, cfg.optimizer, device)
    scheduler = build_schedule(optimizer, cfg.scheduler, cfg.training.steps)
"""

import math

import torch
from torch import nn

from ._compat.torch_internals import is_compiled_in_place
from .device_policy import use_fused_adamw
from .errors import TitanliteError

QUANTIZED = {"adamw8bit": 8, "adamw4bit": 4}  # bits a moment
# torchao tests its low-bit optimizers on CPU and CUDA only (torchao/optim/README.md)
QUANTIZED_DEVICES = ("cpu", "cuda")


def build_optimizer(parts: list[nn.Module], o, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `o.name` over this rank's model parts, as [optimizer] `o` says. AdamW runs as
    one fused kernel on CUDA; torchao's step is compiled where the model's blocks are (eager
    otherwise: compiling it costs half a minute a run on a small CPU). A module with an
    `after_optimizer_step` (an MoE router's balancing) is called after every step."""
    params = [p for part in parts for p in part.parameters()]
    fused = use_fused_adamw(device.type)
    if o.name in QUANTIZED and device.type not in QUANTIZED_DEVICES:
        raise TitanliteError(
            f"optimizer.name {o.name}: torchao's block-quantized moments run on "
            f"{' and '.join(QUANTIZED_DEVICES)} only, not on {device.type}: use --optimizer.name "
            f"adamw (or adafactor, whose state is small too)"
        )
    if o.name == "muon":
        from .muon import MuonWithAdamW  # muon runs only

        hidden = hidden_matrices(parts)
        if not hidden:
            raise TitanliteError(
                "optimizer.name muon takes the 2-D hidden matrices (attention and MLP weights), and "
                "this model part has none: only embeddings, norms and an output layer, which stay "
                "on AdamW: use --optimizer.name adamw"
            )
        rest = [p for p in params if id(p) not in {id(h) for h in hidden}]
        # Newton-Schulz in bf16 on CUDA (tensor cores; torch's choice), else in fp32 (muon.py: why)
        ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        optimizer = MuonWithAdamW(hidden, decay_groups(rest, o.weight_decay), o, fused, ns_dtype)
    elif o.name in QUANTIZED:
        from ._compat.torchao_internals import quantized_adamw  # adamw8bit / adamw4bit runs only

        compiled = any(is_compiled_in_place(part) for part in parts)
        optimizer = quantized_adamw(QUANTIZED[o.name], compiled)(
            decay_groups(params, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps
        )
        optimizer.defaults["fused"] = compiled  # compiled: one fused kernel a parameter (run.json)
    elif o.name == "adafactor":
        optimizer = torch.optim.Adafactor(decay_groups(params, o.weight_decay), lr=o.lr)
    else:
        optimizer = torch.optim.AdamW(
            decay_groups(params, o.weight_decay),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            fused=fused or None,
        )
    for module in (m for part in parts for m in part.modules()):
        if hasattr(module, "after_optimizer_step"):
            optimizer.register_step_post_hook(lambda *_, m=module: m.after_optimizer_step())
    return optimizer


def decay_groups(params: list, weight_decay: float) -> list[dict]:
    """Parameter groups: matrices decay, vectors do not. Parameters sharded over different meshes
    (expert parallel: the experts) go in groups of their own: one multi-tensor kernel cannot mix them."""
    groups = {}
    for p in params:
        # a DTensor's mesh dimensions (expert parallel: the experts'); None for a plain tensor
        mesh_dims = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None)
        groups.setdefault((p.dim() >= 2, mesh_dims), []).append(p)
    return [
        {"params": group, "weight_decay": weight_decay if decays else 0.0}
        for (decays, _), group in sorted(groups.items(), key=lambda kv: not kv[0][0])
    ]


def hidden_matrices(parts: list[nn.Module]) -> list[torch.Tensor]:
    """What Muon takes: every 2-D weight but the embedding and the output layer, which map tokens
    in and out rather than one hidden state to another (torch.optim.Muon's docs and the Muon post:
    embeddings, the classifier head and every vector stay on AdamW). The experts' stacked 3-D weights
    stay on AdamW too: torch's Muon takes matrices only."""
    outside = {
        id(p)
        for part in parts
        for name, m in part.named_modules()
        if isinstance(m, nn.Embedding) or name.split(".")[-1] == "output"
        for p in m.parameters()
    }
    params = {id(p): p for part in parts for p in part.parameters()}  # a tied weight once
    return [p for p in params.values() if p.dim() == 2 and id(p) not in outside]


def check_optimizer(o, dims, cpu_offload: bool = False) -> None:
    """An [optimizer] key that the chosen optimizer does not have, or an optimizer this layout
    cannot step right: one line naming the key and the fix, before anything starts."""
    default = type(o)()  # a key left at its default was not given (or changes nothing)
    for key in ("muon_momentum", "muon_ns_steps"):
        if o.name != "muon" and getattr(o, key) != getattr(default, key):
            raise TitanliteError(
                f"optimizer.{key} is Muon's, but optimizer.name is {o.name}: drop "
                f"--optimizer.{key}, or use --optimizer.name muon"
            )
    for key in ("beta1", "beta2", "eps"):
        if o.name == "adafactor" and getattr(o, key) != getattr(default, key):
            raise TitanliteError(
                f"optimizer.{key} is AdamW's, and adafactor has no such setting (no first moment; "
                f"its second decays by 1 - t^-0.8, torch's beta2_decay): drop --optimizer.{key}, "
                f"or use --optimizer.name adamw"
            )
    if o.name == "adafactor" and (dims.sharded or dims.tp > 1):
        raise TitanliteError(
            "optimizer.name adafactor factors each matrix's second moment into its row and column "
            "means, which need every row of the matrix, and FSDP and tensor parallelism keep a "
            "shard of it on each rank (torch's Adafactor cannot step their DTensors): use another "
            "--optimizer.name with dp_shard or tp > 1, or adafactor with DDP "
            "(--parallel.dp_replicate) or one process"
        )
    if o.name in QUANTIZED and dims.tp > 1:
        raise TitanliteError(
            f"optimizer.name {o.name} quantizes each shard's moments in blocks of its flattened "
            f"values, and tensor parallelism cuts row-parallel matrices by columns: their blocks "
            f"are not the whole matrix's, so the moments differ from one process's and torchao "
            f"cannot reshard their checkpoints (it slices quantized states along dim 0 only): use "
            f"{o.name} with FSDP (--parallel.dp_shard), or --optimizer.name adamw with tp"
        )
    if o.name == "muon" and cpu_offload:
        raise TitanliteError(
            "optimizer.name muon gathers each matrix's update over the FSDP ranks every step, and "
            "parallel.cpu_offload keeps the shards in host memory, where the ranks' GPUs cannot "
            "gather them: drop --parallel.cpu_offload, or use --optimizer.name adamw"
        )


def build_schedule(optimizer, scheduler, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR over `optimizer`: the peak lr times `lr_lambda`'s factor at each step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(scheduler, total))


def lr_lambda(scheduler, total: int):
    """The factor on the peak lr after `step` optimizer steps, as [scheduler] says: linear warm-up
    over `warmup_steps`, then cosine/linear decay to min_lr_ratio·peak at step `total` (or constant)."""
    warmup, floor, decay = scheduler.warmup_steps, scheduler.min_lr_ratio, scheduler.decay

    def factor(step: int) -> float:  # step counts completed optimizer steps (0-based)
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor
