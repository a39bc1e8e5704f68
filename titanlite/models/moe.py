"""Mixture of experts (MoE): each token's feed-forward is k of E expert MLPs, picked by a router.

    block.feed_forward = args.moe.feed_forward(layer, args.dim, args.hidden_dim)  # models/llama.py

A router (a Linear dim → E) scores every token for every expert; the token goes to its top k and
their outputs are summed, weighted by the scores (normalised to sum to 1). A token costs k
experts' FLOPs while the model holds E experts' parameters: compute per token stays small as the
parameters grow (DeepSeek-V3: 37B active of 671B). Shared experts, if any, see every token.

Left alone, a router sends most tokens to a few experts, which then learn fastest and attract
more. Two cures, both here:
- aux_free (the default, DeepSeek-V3): a bias per expert, added to the scores only to *choose*
  experts (never to weight them), moved after each optimizer step by `bias_update`: down for
  the experts that got more than their share of the step's tokens, up for the others.
- aux_loss (Switch Transformer, GShard): coef · E · Σ_e f_e · P_e added to the loss (f_e: the
  share of this micro-batch's choices that went to e, P_e: e's mean score), which is smallest
  when both are uniform. Its gradient enters through `AuxLoss` (no change to the trainer's loss).
Dropless by default: every token reaches its experts. A `capacity_factor` C instead caps each
expert at C · N · k / E tokens of a micro-batch and drops the rest (the older way; notebook 18
counts what it loses).

Expert parallelism (distributed/expert_parallel.py) places E/ep experts on each rank and moves
tokens to them and back with all-to-all: `self.dispatch` is where tokens go to meet experts."""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._compat.torch_internals import in_backward
from ..device_policy import capability_of
from ..errors import TitanliteError
from .layers import FeedForward, initialise  # FeedForward: the shared experts, as wide as they are

ROUTERS, BALANCES = ("softmax", "sigmoid"), ("aux_free", "aux_loss", "none")


@dataclass
class MoEArgs:
    n_experts: int = 4
    experts_per_token: int = 2  # k
    n_shared_experts: int = 0  # experts every token goes through as well
    every: int = 1  # blocks every-1, 2·every-1, ... are MoE; the others dense
    hidden_dim: int | None = None  # of each expert; None: the dense feed-forward's
    router: str = "softmax"  # the scores: softmax over experts, or each expert's sigmoid
    balance: str = "aux_free"
    aux_loss_coef: float = 0.01
    bias_update: float = 1e-3  # aux_free: the bias step after each optimizer step
    capacity_factor: float | None = None  # None: dropless

    def validate(self, n_layers: int) -> "MoEArgs":
        k, e = self.experts_per_token, self.n_experts
        if e < 2 or not 1 <= k <= e:
            raise TitanliteError(
                f"model.n_experts={e} and model.experts_per_token={k}: a mixture needs at least 2 "
                f"experts and 1 <= experts_per_token <= n_experts"
            )
        if self.router not in ROUTERS or self.balance not in BALANCES:
            raise TitanliteError(
                f"model.moe_router={self.router!r} / model.moe_balance={self.balance!r}: use one "
                f"of {', '.join(ROUTERS)} / {', '.join(BALANCES)}"
            )
        if self.every > n_layers:
            raise TitanliteError(
                f"model.moe_every={self.every} leaves none of the {n_layers} blocks an MoE: "
                f"use a value <= {n_layers}"
            )
        return self

    def feed_forward(self, layer: int, dim: int, dense_hidden: int) -> "MoE | None":
        """Block `layer`'s mixture of experts, or None where the block stays dense (`every`)."""
        return MoE(dim, self, dense_hidden) if (layer + 1) % self.every == 0 else None


class MoE(nn.Module):
    """Router, experts (all of them, or this rank's under EP) and shared experts of one block."""

    def __init__(self, dim: int, args: MoEArgs, dense_hidden: int):
        super().__init__()
        self.args = args
        hidden = args.hidden_dim or dense_hidden
        self.router = Router(dim, args)
        self.experts = Experts(args.n_experts, dim, hidden)
        self.shared = (
            FeedForward(dim, hidden * args.n_shared_experts) if args.n_shared_experts else None
        )
        self.dispatch = dispatch_locally  # expert parallel: distributed/expert_parallel.py
        self.dropped = 0  # token choices the capacity dropped, since the counter was last read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen, scores = self.router(tokens)
        if self.args.balance == "aux_loss" and self.training:
            tokens = AuxLoss.apply(tokens, self.aux_loss(scores, chosen))
        if self.args.capacity_factor is not None:
            weights = self.drop_over_capacity(weights, chosen)
        out = self.dispatch(tokens, weights, chosen, self.experts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(x.shape)

    @property
    def skipped_per_token(self) -> int:
        """Parameters a token skips here: the E - k routed experts it is not sent to."""
        E, hidden, dim = self.experts.w_gate.shape
        return (E - self.args.experts_per_token) * 3 * hidden * dim

    def aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's balance loss on this micro-batch: coef · E · Σ f_e · P_e."""
        E = self.args.n_experts
        share = torch.bincount(chosen.flatten(), minlength=E).float() / chosen.numel()
        return self.args.aux_loss_coef * E * (share * scores.mean(0)).sum()

    def drop_over_capacity(self, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Zero the weights of the choices beyond each expert's capacity (first come, first
        served in token order): a dropped choice adds nothing; the residual carries the token."""
        E, k = self.args.n_experts, self.args.experts_per_token
        capacity = math.ceil(self.args.capacity_factor * chosen.shape[0] * k / E)
        one_hot = F.one_hot(chosen.flatten(), E)
        place = (one_hot.cumsum(0) * one_hot).sum(-1).view_as(chosen)  # 1-based, per expert
        kept = place <= capacity
        if self.training:  # a device count: read it when you want it (reading waits for a GPU)
            self.dropped = self.dropped + (~kept).sum()
        return weights * kept

    def init_weights(self, std: float, out_std: float) -> None:
        # The router's, experts' and shared experts' weights; the router's bias and counts zeroed.
        initialise(self, std, out_std)


class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=False)
        # Saved in checkpoints: a resumed run keeps its balance.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        # Token choices per expert since the last optimizer step (all micro-batches): what the
        # bias update reads, and `load` keeps for plots.
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.load = torch.zeros(args.n_experts)

    def forward(self, tokens: torch.Tensor):
        """(weights [N, k], chosen experts [N, k], scores [N, E]) for tokens [N, D]."""
        a = self.args
        logits = self.gate(tokens).float()  # fp32: a softmax over experts, as the loss's
        scores = logits.softmax(-1) if a.router == "softmax" else logits.sigmoid()
        pick = scores + self.expert_bias if a.balance == "aux_free" else scores
        chosen = pick.topk(a.experts_per_token, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        # Counted once: not in evaluation, nor when activation checkpointing recomputes this
        # forward during the backward.
        if self.training and not in_backward():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=a.n_experts)
        return weights.to(tokens.dtype), chosen, scores

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The step's load, summed over every rank's tokens (ranks that hold the same tokens -
        TP - add them alike: the sign below does not change), then aux_free's bias update."""
        counts = self.tokens_per_expert
        if dist.is_initialized():
            dist.all_reduce(counts)
        if self.args.balance == "aux_free":
            self.expert_bias += self.args.bias_update * torch.sign(counts.mean() - counts)
        self.load = counts.clone()
        counts.zero_()


class Experts(nn.Module):
    """E SwiGLU MLPs as three stacked weights, [E, H, D], [E, H, D] and [E, D, H]: one grouped
    matmul each on a GPU that has them (torch._grouped_mm), a loop over the experts elsewhere."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(n, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(n, dim, hidden))
        self.grad_scale = 1.0  # expert parallel: 1/ep (its tokens come from every ep rank)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes=None) -> torch.Tensor:
        """x: tokens grouped by expert, counts[e] of them for local expert e, in order (a device
        tensor); `sizes`: the same counts as host integers, if the caller has them."""
        # Under expert parallelism the stacked weights are DTensors: compute on this rank's experts,
        # their gradient scaled by grad_scale (1/ep there, 1 elsewhere).
        w_gate, w_up, w_down = (
            ScaleGrad.apply(w.to_local() if hasattr(w, "to_local") else w, self.grad_scale)
            for w in (self.w_gate, self.w_up, self.w_down)
        )
        # Under autocast (CUDA's default) the rows arrive in fp32: choose and feed the kernel in
        # the dtype autocast computes matmuls in (cast here: CPU autocast leaves _grouped_mm be).
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        facts = capability_of(x), torch.version.hip is not None, (x.shape[-1], w_up.shape[-2])
        if expert_kernel(kind, dtype, *facts) == "grouped_mm":
            return grouped_swiglu(x.to(dtype), w_gate, w_up, w_down, counts.cumsum(0).int())
        # The loop needs the sizes on the host (one wait for the device, unless the caller has
        # them there already: expert parallel's `sizes`). xe: expert e's rows of x.
        outs = [
            F.linear(F.silu(F.linear(xe, w_gate[e])) * F.linear(xe, w_up[e]), w_down[e])
            for e, xe in enumerate(x.split(sizes if sizes is not None else counts.tolist()))
        ]
        return torch.cat(outs) if outs else x[:0]


def dispatch_locally(tokens, weights, chosen, experts):
    """All experts on this rank: group the token choices by expert, run the experts, put each
    result back on its token weighted by its score (expert_parallel.py: across ranks)."""
    order, counts = sort_by_expert(chosen, experts.w_gate.shape[0])
    out = experts(tokens[order // chosen.shape[1]], counts)
    return combine(out, order, weights, chosen, tokens)


def sort_by_expert(chosen: torch.Tensor, n_experts: int):
    """(the token choices' order grouped by expert - stable, so by token within an expert - and
    how many each expert got)."""
    flat = chosen.flatten()
    # ones added up (bincount's length depends on the values: a graph break, no fake shape)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device)
    return flat.argsort(stable=True), counts.scatter_add_(0, flat, torch.ones_like(flat))


def combine(out, order, weights, chosen, tokens):
    """Each choice's expert output (in `order`), weighted by its score and summed per token."""
    # Summed in fp32: under autocast the experts' outputs are bf16 and the weights fp32.
    weighted = out.float() * weights.flatten()[order, None].float()
    result = torch.zeros_like(tokens, dtype=torch.float32)
    return result.index_add(0, order // chosen.shape[1], weighted).to(tokens.dtype)


def grouped_swiglu(x, w_gate, w_up, w_down, ends: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU on its rows of x (rows ends[e-1]:ends[e]), three grouped GEMMs; the
    ends stay on the device, so nothing waits for it."""
    gate = torch._grouped_mm(x, w_gate.transpose(-2, -1).to(x.dtype), offs=ends)
    up = torch._grouped_mm(x, w_up.transpose(-2, -1).to(x.dtype), offs=ends)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1).to(x.dtype), offs=ends)


def expert_kernel(
    device_type: str, dtype: torch.dtype, capability=None, rocm=False, widths=()
) -> str:
    """torch._grouped_mm where torch runs its grouped kernel, which reads the group ends on the
    device: NVIDIA SM 9.x and 10.x in bf16 (aten's GroupedBlas.cpp, _grouped_mm_cuda's fast path,
    as torchtitan calls it), its rows 16-byte aligned (`widths`, dim and hidden: multiples of 8).
    Elsewhere torch 2.13 loops over the groups itself, reading their sizes on the host
    (_grouped_mm_fallback: SM 8.x, SM 12.x, ROCm, whose MI300X reports "9.4"); there, and on the
    CPU and MPS, the same loop is written out here."""
    fast = capability is not None and capability[0] in (9, 10) and not rocm
    aligned = all(w % 8 == 0 for w in widths)
    grouped = device_type == "cuda" and dtype == torch.bfloat16 and fast and aligned
    return "grouped_mm" if grouped else "loop"


def experts_record(args, device: torch.device, dtype: torch.dtype, ep: int) -> dict:
    """What run.json records of a mixture: the experts' kernel on this device in the dtype the
    matmuls run in, and how many times a layer's forward waits for the device with it."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    widths = (args.dim, args.moe.hidden_dim or args.hidden_dim)
    kernel = expert_kernel(device.type, dtype, capability, torch.version.hip is not None, widths)
    return {"kernel": kernel, "host_waits_per_layer": host_waits(kernel, ep)}


def host_waits(kernel: str, ep: int) -> int:
    """Times an MoE layer's forward waits for the device: expert parallel reads its split sizes
    on the host once (and hands them to the loop); alone, the loop reads its group sizes once and
    the grouped GEMM reads nothing."""
    return int(ep > 1 or kernel == "loop")


class AuxLoss(torch.autograd.Function):
    """Identity on the tokens; in the backward, the balance loss's gradient (∂loss/∂loss = 1) joins
    the tokens': the loss acts without the trainer adding it (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, tokens, loss):
        ctx.save_for_backward(loss)
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (expert parallel: see expert_parallel.py)."""

    @staticmethod
    def forward(ctx, w, scale: float):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None
