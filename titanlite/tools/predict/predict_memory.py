"""Per-GPU memory of a preset under FSDP, predicted on a CPU: **predicted, not measured**.

Fake tensors (shapes and dtypes, no bytes) on a fake N-rank process group go through titanlite's
own model, `apply_fsdp` and CUDA defaults (`device_policy.device_defaults` with the GPU's facts),
one forward is run, and what it leaves for backward is read off autograd's saved-tensor hooks:

    predict("8B", seq_len=8192, world_size=8, capability=(9, 0))   # eight H100s
    python -m titanlite.tools.predict.predict_memory > docs/hardware/predicted-h100.md

Under FSDP with fp32 parameters, bf16 autocast casts each gathered weight and autograd keeps the
cast for backward, where FSDP cannot free it: `weight_copies` counts those bytes (torchtitan's
defaults, bf16 parameters without autocast, leave none). The fake tensors live on the CPU device
type: autograd on fake CUDA tensors needs a CUDA build. The bytes do not depend on it, and the
attention kernels CUDA would pick here (cuDNN or flash) save what the CPU's flash kernel does.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn

from ..._compat.torch_tools import FakeTensorMode, TorchDispatchMode, fake_process_group
from ...config import Config
from ...device_policy import default_mixed_precision, device_defaults
from ...distributed.fsdp import apply_fsdp
from ...efficiency.activation_checkpoint import apply_ac
from ...errors import TitanliteError
from ...models.llama import ModelArgs, Transformer
from .activation_memory import activation_memory_estimate
from .zero import zero_bytes_per_rank

GiB = 2**30
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def cuda_policy(capability: tuple[int, int], before: bool = False) -> dict:
    """FSDP's param_dtype and the autocast dtype CUDA's defaults give a GPU of this capability.
    before: titanlite's defaults until torchtitan's were adopted (fp32 parameters, autocast)."""
    cfg = Config()
    if before:
        cfg.parallel.param_dtype = "float32"
    cfg = cfg.with_overrides(device_defaults(cfg, "cuda", capability, fsdp=True), "device defaults")
    mode = cfg.training.mixed_precision
    mode = default_mixed_precision("cuda", capability, scaler_ok=False) if mode == "auto" else mode
    return {"param_dtype": DTYPES[cfg.parallel.param_dtype], "autocast": DTYPES[mode]}


class _Parameters(TorchDispatchMode):
    """Notes the storages of the parameters ops read (FSDP's gathered weights, which it frees after
    forward and gathers again for backward) and of every copy made of one (autocast's casts)."""

    def __init__(self):
        super().__init__()
        self.gathered: set[int] = set()
        self.casts: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.gathered |= {id(a.untyped_storage()) for a in args if isinstance(a, nn.Parameter)}
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
            self.casts.add(id(out.untyped_storage()))
        return out


def predict(
    preset: str,
    seq_len: int,
    world_size: int,
    capability: tuple[int, int],
    *,
    batch: int = 1,
    before: bool = False,
    ac: str = "none",
) -> dict:
    """Bytes one of `world_size` FSDP ranks holds for `preset` at `batch` x `seq_len` tokens at the
    forward's end, its peak: params, grads and optimizer (AdamW) shards, the activations one
    forward saves for backward (with activation checkpointing `ac`) and how many of those are
    copies of weights, the weights FSDP holds gathered then (the root's - embedding, final norm,
    output - and the last block's, which the default keeps for its backward), and the logits with
    what the loss keeps (`logits`: in the compute dtype, fp32 log-probabilities, their fp32
    gradient). `formula`: ZeRO-3's and the activation formula's."""
    if torch.distributed.is_initialized():
        raise TitanliteError(
            "predict() starts its own fake process group: call it outside a distributed job"
        )
    policy = cuda_policy(capability, before)
    args = ModelArgs.preset(preset, max_seq_len=max(seq_len, ModelArgs.preset(preset).max_seq_len))
    fake_process_group(world_size)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
        with torch.device("meta"):
            model = apply_ac(Transformer(args), ac)
            model = apply_fsdp(model, mesh, param_dtype=policy["param_dtype"])
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta shards become fake ones
            model.to_empty(device="cpu")
            shards = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
            saved, casts = _one_forward(
                model, torch.zeros(batch, seq_len, dtype=torch.long), policy["autocast"]
            )
    finally:
        torch.distributed.destroy_process_group()
    weight_copies = sum(nbytes for key, nbytes in saved.items() if key in casts)
    n = model.num_params()
    compute = policy["autocast"] or policy["param_dtype"] or torch.float32
    size = torch.tensor([], dtype=compute).element_size()
    last = list(model.layers.values())[-1]
    kept = [model.tok_embeddings, model.norm, model.output, last]  # gathered at the forward's end
    weights = {id(p): p for m in kept for p in m.parameters()}  # a tied output is the embedding
    gathered = sum(p.numel() for p in weights.values()) * size
    logits = batch * seq_len * args.vocab_size * (size + 4 + 4)
    zero = zero_bytes_per_rank(n, world_size, stage=3)
    activations = activation_memory_estimate(args, batch, seq_len, dtype_bytes=2, mode="none")
    return {
        "preset": preset,
        "seq_len": seq_len,
        "world_size": world_size,
        "batch": batch,
        "num_params": n,
        "policy": policy,
        "params": shards,
        "grads": shards,
        "optimizer": 2 * shards,
        "saved": sum(saved.values()),
        "weight_copies": weight_copies,
        "gathered": gathered,
        "logits": logits,
        "ac": ac,
        "formula": {"params": zero["params"], "activations": activations},
    }


def _one_forward(model: Transformer, tokens: torch.Tensor, autocast: torch.dtype | None):
    """{storage: bytes} of what autograd saves for backward (parameters, gathered or not, buffers and
    tokens excluded) and the storages that are copies of parameters."""
    owned = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers(), tokens)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(storage := t.untyped_storage()) not in owned:
            saved[id(storage)] = storage.nbytes()
        return t

    params = _Parameters()
    amp = (
        torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    with (
        torch.enable_grad(),
        params,
        amp,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        model(tokens)
    kept = {key: nbytes for key, nbytes in saved.items() if key not in params.gathered}
    return kept, params.casts


def markdown(
    world_size: int = 8, capability: tuple[int, int] = (9, 0), gpu: str = "H100 80GB"
) -> str:
    """The table docs/hardware/predicted-h100.md holds, computed now."""
    lines = [
        f"# Per-GPU memory on {world_size} × {gpu}: predicted on a CPU, not measured",
        "",
        f"Generated by `python -m titanlite.tools.predict.predict_memory` (fake tensors on a fake {world_size}-rank "
        "process group through titanlite's model and FSDP wrapping; see that module's docstring). "
        "No GPU ran this. Batch 1 per GPU, AdamW, at the forward's end (the step's peak): the "
        "weight shards with their gradients and AdamW moments, the activations saved for "
        "backward (with full activation checkpointing in the AC rows), the weights FSDP holds "
        "gathered then (embedding, final norm and output, and the last block's), and the logits "
        "with what the loss keeps (logits, fp32 log-probabilities and their fp32 gradient). Not "
        "counted: the CUDA context, NCCL buffers, allocator fragmentation, the temporaries of a "
        "single kernel.",
        "",
        "| preset | seq | FSDP param dtype | autocast | AC | params+grads+AdamW / GPU "
        "| saved activations | of which weight copies | gathered weights | logits and loss "
        "| total |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in ("1B", "8B"):
        for seq_len in (2048, 8192):
            for before, ac in ((False, "none"), (True, "none"), (False, "full")):
                p = predict(preset, seq_len, world_size, capability, before=before, ac=ac)
                state = p["params"] + p["grads"] + p["optimizer"]
                name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[
                    p["policy"]["autocast"]
                ]
                dtype = str(p["policy"]["param_dtype"]).removeprefix("torch.")
                total = state + p["saved"] + p["gathered"] + p["logits"]
                lines.append(
                    f"| {preset} | {seq_len} | {dtype}{' (before)' if before else ' (default)'} "
                    f"| {name} | {ac} | {state / GiB:.2f} GiB | {p['saved'] / GiB:.2f} GiB "
                    f"| {p['weight_copies'] / GiB:.2f} GiB | {p['gathered'] / GiB:.2f} GiB "
                    f"| {p['logits'] / GiB:.2f} GiB | {total / GiB:.2f} GiB |"
                )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.tools.predict.predict_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=8)
    print(markdown(parser.parse_args(argv).world_size), end="")


if __name__ == "__main__":
    main()
