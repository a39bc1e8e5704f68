"""Notebook 08's experiments, run inside every rank: ZeRO stages side by side, FP8 all-gather.

The caller started the ranks (torchrun, or titanlite's launcher) and joined the process group
(`init_distributed`); called in a plain process (a notebook kernel) they run as a world of one.
Each function builds the same tiny Llama on every rank, trains it on random tokens (a different
slice per rank) and returns a plain, picklable dict:

    state_memory("zero3")      # bytes stored vs ZeRO's formula, collectives of one step, losses
    fsdp_anatomy()             # meta-device init, DTensor shards, the bf16 policy in forward
    fp8_all_gather_check()     # all-gather bytes and losses with and without FP8 weights
    run_lab()                  # all of them in one job (each job costs seconds of start-up)

    strategy           how                                           ZeRO stage
    ddp                apply_ddp + AdamW                             0
    zero1              apply_ddp + ZeroRedundancyOptimizer(AdamW)    1
    zero2              apply_fsdp(reshard_after_forward="never")     "2", see below
    zero3              apply_fsdp(reshard_after_forward="default")   3
    zero3_always       apply_fsdp(reshard_after_forward="always")    3
    fsdp_cpu_offload   zero3 with shards, gradients and the optimizer step in CPU memory

FSDP2 has no true ZeRO-2. Its parameters are sharded at rest in every mode. With "never" a
block keeps its gathered weights from its forward until its backward, so *during the step* it
holds the full parameters like ZeRO-2 and gathers each block once per step, like ZeRO-2 (one
all-gather of updated weights, one reduce-scatter of gradients); *between steps* it holds
only shards: less than ZeRO-2. `mid_step_full_param_bytes` measures the difference.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.ddp import apply_ddp
from ..distributed.fsdp import apply_fsdp, shard_and_init
from ..efficiency.fp8 import precompute_fp8_scales
from ..errors import TitanliteError, closest
from ..models.llama import ModelArgs, Transformer
from ..tools.measure.comm import CommCounter
from ..tools.predict.zero import (
    describe_sharding,
    fsdp_shard_numel,
    measure_state_bytes,
    unsharded_param_bytes,
    zero1_partition,
    zero_bytes_per_rank,
)
from ._common import Progress, join, next_token_loss, random_tokens, seeded_model

STRATEGIES = {
    "ddp": 0,
    "zero1": 1,
    "zero2": 2,
    "zero3": 3,
    "zero3_always": 3,
    "fsdp_cpu_offload": 3,
}
_RESHARD = {
    "zero2": "never",
    "zero3": "default",
    "zero3_always": "always",
    "fsdp_cpu_offload": "default",
}


def _batches(args, steps, batch_size, seq_len, seed, rank, device) -> torch.Tensor:
    """[steps, batch, seq_len + 1] tokens: each rank its own data."""
    return random_tokens(
        args.vocab_size, (steps, batch_size, seq_len + 1), seed * 1000 + rank + 1, device
    )


def _train(model, optimizer, batches, after_step=None) -> dict:
    """One optimizer step per batch; the last runs inside a CommCounter. Counting a later step
    shows the steady state: step 1 creates the optimizer state, and at the start of step 2 DDP
    rebuilds its buckets in gradient-arrival order (a small broadcast of bucket indices)."""
    losses, mid_bytes, counter = [], None, CommCounter()
    for i, tokens in enumerate(batches):
        optimizer.zero_grad()
        with counter if i == len(batches) - 1 else contextlib.nullcontext():
            loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
            # Between forward and backward: which gathered weights did forward leave alive?
            mid_bytes = unsharded_param_bytes(model)
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss, the number a single process would see
        losses.append(mean.item() / dist.get_world_size())
    return {"losses": losses, "mid_step_full_param_bytes": mid_bytes, "comm": counter.summary()}


def _padded_full(p, n) -> int:
    """Bytes of one parameter once FSDP gathers it: N padded shards."""
    return fsdp_shard_numel(p.shape, n) * n * p.element_size()


def expected_bytes(
    strategy: str,
    model,
    world_size: int,
    rank: int,
    zero1_owned: int | None = None,
    ddp_buffer_bytes: int = 0,
) -> dict:
    """What `state_memory` should measure, exactly: ZeRO's accounting with torch's real
    shard sizes (FSDP2's padding, ZeroRedundancyOptimizer's whole-tensor partition)."""
    params = list(model.parameters())
    n = world_size
    psi_bytes = sum(p.numel() * p.element_size() for p in params)
    padded = sum(fsdp_shard_numel(p.shape, n) * p.element_size() for p in params)
    if strategy in ("ddp", "zero1"):
        # AdamW: exp_avg + exp_avg_sq
        optim = 2 * psi_bytes if strategy == "ddp" else 2 * params[0].element_size() * zero1_owned
        grad_bytes = psi_bytes
        state = {"params": psi_bytes, "grads": grad_bytes, "optimizer": optim}
        comm = {"all_reduce": grad_bytes}
        if ddp_buffer_bytes:  # DDP re-sends rank 0's buffers before every forward
            comm["broadcast"] = ddp_buffer_bytes
        if strategy == "zero1":  # each owner sends its updated weights to all
            comm["broadcast"] = comm.get("broadcast", 0) + psi_bytes
        mid = psi_bytes
    else:
        owned = sum(fsdp_shard_numel(p.shape, n, rank) * p.element_size() for p in params)
        state = {"params": padded, "grads": padded, "optimizer": 2 * owned}
        full = {name: _padded_full(p, n) for name, p in model.named_parameters()}
        last = f"layers.{len(model.layers) - 1}."
        reshard = _RESHARD[strategy]
        # The root group (embeddings, final norm) is never resharded after forward (FSDP2's
        # rule for the root); "default" also keeps the last block, "never" every block.
        kept = {
            k: v
            for k, v in full.items()
            if not k.startswith("layers.")
            or reshard == "never"
            or (reshard == "default" and k.startswith(last))
        }
        mid = sum(kept.values())
        # Every group is gathered for forward; the resharded ones again for backward.
        comm = {
            "all_gather": sum(full.values()) + sum(full.values()) - mid,
            "reduce_scatter": sum(full.values()),
        }
    state["total"] = sum(state.values())
    return {"state": state, "mid_step_full_param_bytes": mid, "comm_bytes": comm}


def state_memory(
    strategy: str,
    preset: str = "debug",
    vocab_size: int | None = None,
    steps: int = 3,
    batch_size: int = 2,
    seq_len: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | None = None,
) -> dict:
    """Train `steps` steps under `strategy`, then measure what this rank stores.

    Returns {"measured", "expected" (exact, see `expected_bytes`), "formula" (ZeRO's Ψ/N),
    "mid_step_full_param_bytes", "comm" (CommCounter summary of the last step), "losses", ...}.
    """
    if strategy not in STRATEGIES:
        raise TitanliteError(
            f"unknown strategy '{strategy}'{closest(strategy, STRATEGIES)}: "
            f"choose one of {', '.join(STRATEGIES)}"
        )
    env, mesh = join(device, mesh_dim="dp", world_of_one=True)  # a kernel: a world of one
    args = ModelArgs.preset(preset, vocab_size=vocab_size)
    model = seeded_model(args, seed, env.device)
    num_params = model.num_params()
    buffer_bytes = 0
    if strategy in ("ddp", "zero1"):
        model = apply_ddp(model, mesh)
        inner = model.module
        if model.broadcast_buffers:  # the RoPE tables: identical everywhere, sent anyway
            buffer_bytes = sum(b.numel() * b.element_size() for b in inner.buffers())
    else:
        try:
            model = inner = apply_fsdp(
                model,
                mesh,
                reshard_after_forward=_RESHARD[strategy],
                cpu_offload=strategy == "fsdp_cpu_offload",
            )
        except RuntimeError as e:  # raised on every rank alike, before any collective
            if strategy != "fsdp_cpu_offload":
                raise
            raise TitanliteError(
                f"fsdp_cpu_offload failed on {env.device.type}: FSDP pins the CPU "
                f"copies of the shards (page-locked memory, for fast copies to an "
                f"accelerator), and torch said '{e}': run it on GPUs, or use zero3 "
                f"here"
            ) from None
    zero1_owned = None
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=lr,
            process_group=mesh.get_group(),
        )
        zero1_owned = zero1_partition([p.numel() for p in model.parameters()], env.world_size)[
            env.rank
        ]
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    run = _train(
        model, optimizer, _batches(args, steps, batch_size, seq_len, seed, env.rank, env.device)
    )
    return {
        "strategy": strategy,
        "stage": STRATEGIES[strategy],
        "rank": env.rank,
        "world_size": env.world_size,
        "num_params": num_params,
        "device": env.device.type,
        "param_shapes": {k: list(p.shape) for k, p in inner.named_parameters()},
        "measured": measure_state_bytes(model, optimizer),
        "where": _where(model, optimizer),
        # What the accelerator holds between steps: CPU offload's whole point.
        "accelerator_bytes_at_rest": (
            torch.cuda.memory_allocated(env.device) if env.device.type == "cuda" else None
        ),
        "expected": expected_bytes(
            strategy, inner, env.world_size, env.rank, zero1_owned, buffer_bytes
        ),
        "formula": zero_bytes_per_rank(num_params, env.world_size, STRATEGIES[strategy]),
        **run,
    }


def _where(model, optimizer) -> dict:
    """Device types holding the weights, gradients and optimizer state (local shards), and
    whether every CPU-resident one is pinned (what FSDP's CPU offload does)."""
    inner = getattr(optimizer, "optim", optimizer)
    groups = {
        "params": list(model.parameters()),
        "grads": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer": [
            v
            for st in inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ],
    }
    out = {}
    for kind, tensors in groups.items():
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        on_cpu = [t for t in local if t.device.type == "cpu"]
        out[kind] = sorted({t.device.type for t in local})
        out[f"{kind}_pinned"] = bool(on_cpu) and all(t.is_pinned() for t in on_cpu)
    return out


def fsdp_anatomy(
    preset: str = "debug",
    vocab_size: int | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    batch_size: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    device: str | None = None,
) -> dict:
    """One FSDP2 step seen from inside a rank, the way the trainer builds it: a weightless
    model on the meta device, `shard_and_init`, then forward and backward under the
    MixedPrecisionPolicy (gathered weights in `param_dtype`, gradients reduced in fp32).

    Returns {"on_meta", "init_max_abs_diff" (rank 0: gathered weights vs a single process's
    init; other ranks None), "params" and "grads" (name -> type, shape, local_shape,
    placements, dtype, device), "description" (describe_sharding), "in_forward" (block 0's
    q_proj weight as its forward sees it, and its input's dtype), "logits_dtype",
    "mid_step_full_param_bytes", "comm", "param_shapes", "rank", "world_size"}.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    env, mesh = join(device, mesh_dim="dp", world_of_one=True)  # a kernel: a world of one
    args = ModelArgs.preset(preset, vocab_size=vocab_size)
    with torch.device("meta"):
        model = Transformer(args)
    on_meta = {
        "devices": sorted({p.device.type for p in model.parameters()}),
        "num_params": model.num_params(),
    }
    model = shard_and_init(
        model,
        lambda: seeded_model(args, seed, "cpu"),
        mesh,
        env.device,
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
    )
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    init_diff = None
    if env.rank == 0:  # the full weights are gathered to rank 0 only
        reference = seeded_model(args, seed, "cpu").state_dict()
        init_diff = max((full[k] - reference[k]).abs().max().item() for k in reference)

    def info(t) -> dict:
        local = t.to_local() if hasattr(t, "to_local") else t
        return {
            "type": type(t).__name__,
            "shape": list(t.shape),
            "local_shape": list(local.shape),
            "placements": [str(p) for p in getattr(t, "placements", ())],
            "dtype": str(t.dtype),
            "device": local.device.type,
        }

    params = {name: info(p) for name, p in model.named_parameters()}
    seen = {}
    probe = model.layers["0"].attention.q_proj
    hook = probe.register_forward_pre_hook(
        lambda m, inputs: seen.update(info(m.weight), input_dtype=str(inputs[0].dtype))
    )
    tokens = _batches(args, 1, batch_size, seq_len, seed, env.rank, env.device)[0]
    with CommCounter() as counter:
        logits = model(tokens[:, :-1])
        mid_bytes = unsharded_param_bytes(model)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    hook.remove()
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "on_meta": on_meta,
        "init_max_abs_diff": init_diff,
        "params": params,
        "description": describe_sharding(model),
        "in_forward": seen,
        "logits_dtype": str(logits.dtype),
        "grads": {name: info(p.grad) for name, p in model.named_parameters()},
        "mid_step_full_param_bytes": mid_bytes,
        "comm": counter.summary(),
        "param_shapes": {k: v["shape"] for k, v in params.items()},
    }


def run_lab(
    strategies=tuple(STRATEGIES),
    anatomy: bool = True,
    fp8: bool = True,
    preset: str = "debug",
    vocab_size: int | None = None,
    steps: int = 3,
    batch_size: int = 2,
    seq_len: int = 32,
) -> dict:
    """Notebook 08's experiments in one job: {"anatomy", each strategy, "fp8", "errors"}.

    A strategy this machine cannot run (CPU offload without an accelerator) lands in
    "errors" with its message. Each finished experiment is streamed to the launcher's
    callbacks as {"kind": "lab", "done": name, "seconds": ...} (run_function.report)."""
    common = {
        "preset": preset,
        "vocab_size": vocab_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
    }
    out, done = {"errors": {}}, Progress().done
    if anatomy:
        out["anatomy"] = fsdp_anatomy(**common)
        done("anatomy")
    for strategy in strategies:
        try:
            out[strategy] = state_memory(strategy, steps=steps, **common)
        except TitanliteError as e:  # every rank fails alike, so the job stays in step
            out["errors"][strategy] = str(e)
        done(strategy)
    if fp8:
        out["fp8"] = fp8_all_gather_check(steps=steps, **common)
        done("fp8")
    return out


def fp8_all_gather_check(
    preset: str = "debug",
    vocab_size: int | None = None,
    steps: int = 3,
    min_dim: int = 32,
    param_dtype: torch.dtype | None = None,
    batch_size: int = 2,
    seq_len: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | None = None,
) -> dict:
    """FSDP2 with and without FP8 all-gather of the Float8Linear weights (torchao, emulated on
    CPU): same weights, same data. Every block is gathered once per step (reshard "never"),
    so the last step's all-gather bytes split cleanly into converted and other weights.

    Returns {"converted", "converted_numel", and per run ("high", "fp8"): "all_gather_bytes",
    "bytes_per_converted_element", "mid_step_full_param_bytes", "losses", "comm"}.
    """
    from ..efficiency.fp8 import apply_fp8

    env, mesh = join(device, mesh_dim="dp", world_of_one=True)  # a kernel: a world of one
    args = ModelArgs.preset(preset, vocab_size=vocab_size)
    n = env.world_size
    out = {
        "converted": None,
        "all_gather_bytes": {},
        "bytes_per_converted_element": {},
        "mid_step_full_param_bytes": {},
        "losses": {},
        "comm": {},
        "rank": env.rank,
        "world_size": n,
    }
    for run in ("fp8", "high"):  # FP8 first: it names the layers it converts
        model = seeded_model(args, seed, env.device)
        if run == "fp8":
            model = apply_fp8(
                model, device=env.device, min_dim=min_dim, emulate=True, fsdp_all_gather=True
            )
            out["converted"] = model.fp8_info["converted"]
        converted = {f"{name}.weight" for name in out["converted"]}
        model = apply_fsdp(model, mesh, param_dtype=param_dtype, reshard_after_forward="never")
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        batches = _batches(args, steps, batch_size, seq_len, seed, env.rank, env.device)
        result = _train(
            model, optimizer, batches, after_step=functools.partial(precompute_fp8_scales, model)
        )
        gathered = result["comm"]["all_gather"]["bytes"]
        gather_bytes = (param_dtype or torch.float32).itemsize
        numel = {name: fsdp_shard_numel(p.shape, n) * n for name, p in model.named_parameters()}
        conv_numel = sum(v for k, v in numel.items() if k in converted)
        other_bytes = sum(v for k, v in numel.items() if k not in converted) * gather_bytes
        out["converted_numel"] = conv_numel
        out["all_gather_bytes"][run] = gathered
        out["bytes_per_converted_element"][run] = (gathered - other_bytes) / conv_numel
        # The gathered weights themselves are FP8 too: less memory while they are held.
        out["mid_step_full_param_bytes"][run] = result["mid_step_full_param_bytes"]
        out["losses"][run] = result["losses"]
        out["comm"][run] = result["comm"]
    return out
