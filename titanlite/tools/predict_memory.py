"""Per-GPU memory of a preset under FSDP, predicted on a CPU: **predicted, not measured**.

Fake tensors (shapes and dtypes, no bytes) on a fake N-rank process group go through titanlite's
own model, `apply_fsdp` and CUDA defaults (`device_policy.device_defaults` with the GPU's facts),
one forward is run, and what it leaves for backward is read off autograd's saved-tensor hooks:

    predict("8B", seq_len=8192, world_size=8, capability=(9, 0))   # eight H100s
    python -m titanlite.tools.predict_memory > docs/hardware/predicted-h100.md

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

from .._compat.torch_tools import FakeTensorMode, TorchDispatchMode, fake_process_group
from ..config import Config
from ..device_policy import default_mixed_precision, device_defaults
from ..distributed.fsdp import apply_fsdp
from ..errors import TitanliteError
from ..models.llama import ModelArgs, Transformer
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
) -> dict:
    """Bytes one of `world_size` FSDP ranks holds for `preset` at `batch` x `seq_len` tokens:
    params, grads and optimizer (AdamW) shards, the activations one forward saves for backward, and
    how many of those are copies of weights. `formula`: ZeRO-3's and the activation formula's."""
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
            model = apply_fsdp(Transformer(args), mesh, param_dtype=policy["param_dtype"])
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
        f"Generated by `python -m titanlite.tools.predict_memory` (fake tensors on a fake {world_size}-rank "
        "process group through titanlite's model and FSDP wrapping; see that module's docstring). "
        "No GPU ran this. Batch 1 per GPU, no activation checkpointing, AdamW. Not counted: the "
        "gathered weights of the block in flight, logits and loss, the CUDA context, NCCL buffers, "
        "allocator fragmentation.",
        "",
        "| preset | seq | FSDP param dtype | autocast | params+grads+AdamW / GPU | saved activations "
        "| of which weight copies | total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset in ("1B", "8B"):
        for seq_len in (2048, 8192):
            for before in (False, True):
                p = predict(preset, seq_len, world_size, capability, before=before)
                state = p["params"] + p["grads"] + p["optimizer"]
                name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[
                    p["policy"]["autocast"]
                ]
                lines.append(
                    f"| {preset} | {seq_len} | {str(p['policy']['param_dtype'])[6:]}"
                    f"{' (before)' if before else ' (default)'} | {name} | {state / GiB:.2f} GiB "
                    f"| {p['saved'] / GiB:.2f} GiB | {p['weight_copies'] / GiB:.2f} GiB "
                    f"| {(state + p['saved']) / GiB:.2f} GiB |"
                )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.tools.predict_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=8)
    print(markdown(parser.parse_args(argv).world_size), end="")


if __name__ == "__main__":
    main()
