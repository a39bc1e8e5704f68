"""Muon for the hidden matrices and AdamW for the rest, as one optimizer; under FSDP, each matrix's
update gathered whole for Newton-Schulz.

    optimizer = MuonWithAdamW(hidden, adamw_groups, cfg.optimizer, fused, torch.float32)

Muon (Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024; torch.optim.Muon)
keeps one momentum buffer per matrix and steps along its orthogonalised version: the SVD's U·Vᵀ with
every singular value replaced by ~1, approximated by 5 iterations of a quintic Newton-Schulz map with
(a, b, c) = (3.4445, -4.7750, 2.0315). It is for hidden layers only: the embedding, the output layer,
norm gains and biases stay on AdamW (the Muon post's "empirical considerations"; torch's docs).

Newton-Schulz multiplies whole matrices: X·Xᵀ over a shard of the rows is not a shard of the answer.
Under FSDP2 (or TP) a parameter is a DTensor and each rank holds a shard of its gradient, so each
rank keeps its shard of the momentum (elementwise: nothing to talk about), all-gathers the update
into the whole matrix, orthogonalises it, and keeps its own rows: Moonshot's Distributed Muon ("Muon
is Scalable for LLM Training", arXiv:2502.16982, §2.3). Every rank repeats the same Newton-Schulz;
the state stays sharded. The gather is in the dtype Newton-Schulz starts by casting to (the same bits,
and bf16's half the bytes): (n-1)/n × that many bytes × the hidden matrices' elements, on each of n
ranks, every step.

Newton-Schulz runs in bf16 on CUDA (tensor cores; torch's and Keller Jordan's choice) and in fp32
elsewhere, the dtype CPU and MPS runs compute in. In bf16 the last-bit differences of a gradient
summed over N ranks flip a rounding now and then, and N ranks part from one process by ~3e-5 in
loss within 8 steps (measured on the debug model); in fp32 they agree to fp32's rounding."""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ._compat.torch_internals import muon_lr


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `hidden` (2-D matrices: `ShardedMuon`) and torch's AdamW over `adamw_groups`,
    stepped as one optimizer: one schedule scales both (one lr; Muon's scaled to AdamW's update RMS
    by torch's "match_rms_adamw"), one state dict holds both, one step hook (Keller Jordan's
    MuonWithAuxAdam, as an object). Its param_groups and state are its two optimizers' own."""

    def __init__(self, hidden: list, adamw_groups: list[dict], o, fused: bool, ns_dtype):
        self.muon = ShardedMuon(
            hidden,
            lr=o.lr,
            weight_decay=o.weight_decay,
            momentum=o.muon_momentum,
            ns_steps=o.muon_ns_steps,
            adjust_lr_fn="match_rms_adamw",
        )
        self.muon.ns_dtype = ns_dtype
        self.adamw = torch.optim.AdamW(
            adamw_groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or None
        )
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.defaults["fused"] = fused  # its AdamW part's (run.json); Muon has no fused step
        self._share()

    def _share(self) -> None:
        """Hand the groups and the state dict to the two optimizers that step them."""
        k = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = (
            self.param_groups[:k],
            self.param_groups[k:],
        )
        self.muon.state = self.adamw.state = self.state

    def __setstate__(self, state: dict) -> None:
        # load_state_dict sets new groups and a new state through here: share them again
        super().__setstate__(state)
        if "muon" in self.__dict__:
            self._share()

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon's step (`_single_tensor_muon`, torch 2.13), with a DTensor's update gathered
    whole for Newton-Schulz and cut back to its shard, and Newton-Schulz in `ns_dtype` (torch's:
    bf16). One process runs the same code, so N ranks and one differ only in how the gradient was
    summed."""

    ns_dtype = torch.bfloat16

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]  # this rank's shard, like the gradient
                buf.lerp_(p.grad, 1 - momentum)
                update = (p.grad.lerp(buf, momentum) if group["nesterov"] else buf).to(
                    self.ns_dtype
                )
                if isinstance(p, DTensor):  # the one collective: the whole matrix
                    update = update.full_tensor()
                orthogonal = newton_schulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                if isinstance(p, DTensor):  # every rank holds the whole: each keeps its shard
                    orthogonal = distribute_tensor(
                        orthogonal, p.device_mesh, p.placements, src_data_rank=None
                    )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(orthogonal, alpha=-muon_lr(lr, group["adjust_lr_fn"], p.shape))


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """The matrix `g` orthogonalised in its own dtype: scaled to spectral norm <= 1 (by its Frobenius
    norm), then `steps` times X ← aX + (bXXᵀ + c(XXᵀ)²)X, each singular value s ↦ as + bs³ + cs⁵ while
    U and V stay, on the wide orientation (XXᵀ the smaller Gram matrix). torch's
    `_zeropower_via_newtonschulz` to the bit in bf16 (tests/test_optimizers.py), in any dtype."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.T if tall else g  # (rows, cols) with rows <= cols
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T  # (rows, rows)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
