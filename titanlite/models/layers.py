"""What a dense block and a mixture of experts share: the SwiGLU feed-forward (a dense block's MLP,
and an MoE's shared experts) and the weight initialisation (of the whole model, and of an MoE
layer alone). Here, so that models/moe.py builds on them without importing the model it extends."""

import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):  # the SwiGLU MLP: a dense block's, and an MoE's shared experts
    skipped_per_token = 0  # parameters a token does not use: none, in a dense block

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def initialise(module: nn.Module, std: float, out_std: float) -> None:
    """Each weight of `module` drawn from N(0, std²), in `named_parameters` order (layer by layer; a
    tied output counts once), but those that write into the residual stream (attention's o_proj, an
    MLP's or expert's down projection) from N(0, out_std²); each norm set to ones, each buffer to 0."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)  # each norm starts as the identity
        else:
            into_residual = name.endswith(("o_proj.weight", "down_proj.weight", "w_down"))
            nn.init.normal_(p, std=out_std if into_residual else std)
    for buffer in module.buffers():  # an MoE router's bias and token counts; after `to_empty()`
        buffer.zero_()  # they hold whatever memory held
