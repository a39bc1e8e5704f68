"""How much activation memory a forward keeps for backward: measured, and predicted from the
shapes - notebook 04 compares the two for every activation-checkpointing mode.

    saved_activation_bytes(model, tokens)                  # measured: storages left alive
    activation_memory_estimate(args, batch, seq_len, 4, "full")   # the formula
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..._compat.torch_internals import CheckpointWrapper
from ..._compat.torch_tools import TorchDispatchMode, tree_leaves
from ...efficiency.activation_checkpoint import MODES
from ...errors import TitanliteError, closest
from ...models.llama import ModelArgs, Transformer


class _NewStorages(TorchDispatchMode):
    """Notes (by weak reference) every storage that an op creates while it is active."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # a wrapper subclass (DTensor, FP8) has no storage; its parts have
            ref = StorageWeakRef(storage)
            known = self.storages.get(ref.cdata)
            if known is None or known[0].expired():  # a freed address may be reused
                self.storages[ref.cdata] = (ref, storage.nbytes())
        return out

    def alive(self) -> dict[int, int]:
        return {key: nbytes for key, (ref, nbytes) in self.storages.items() if not ref.expired()}


def _storage_keys(tensors) -> set[int]:
    return {StorageWeakRef(t.untyped_storage()).cdata for t in tensors}


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes that one forward on `tokens` leaves alive for backward: every storage created
    during the forward that is still referenced once it returns, each shared storage counted
    once; parameters, buffers, the input and the returned logits (the caller's) excluded.

    Why not only `torch.autograd.graph.saved_tensors_hooks`: it is exact for plain autograd
    and for checkpointed blocks (whose inputs are saved through the hooks), but SAC keeps the
    outputs its policy saves in a cache of its own that no hook sees. Liveness counts both,
    on every device (tests check it equals `saved_tensors_hook_bytes` where that is exact).
    Eager models only. The transient memory of recomputing one block in backward comes on top."""
    recorder = _NewStorages()
    with torch.enable_grad(), recorder:
        logits = model(tokens)
    owned = _storage_keys([*model.parameters(), *model.buffers(), tokens, *tree_leaves(logits)])
    return sum(nbytes for key, nbytes in recorder.alive().items() if key not in owned)


def saved_tensors_hook_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """What autograd's saved-tensor hooks see during one forward (deduplicated storages,
    parameters and buffers excluded). Correct without checkpointing; blind to SAC's cache."""
    owned = _storage_keys([*model.parameters(), *model.buffers(), tokens])
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in owned:
            seen[ref.cdata] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values())


def activation_memory_estimate(
    args: ModelArgs,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    mode: str,
    every: int = 2,
    attention: str = "flash",
    expand_kv: bool = False,
) -> int:
    """Predicted `saved_activation_bytes` for a model whose parameters and activations are in
    a `dtype_bytes`-byte dtype (4: fp32, 2: bf16/fp16; autocast keeps extra casts, not modelled).

    In the style of Korthikanti et al. 2022 (per layer sbh·(34 + 5as/h) for GPT in 16 bits),
    re-derived for this Llama block with n = batch·seq_len tokens, D = dim, K = the KV width
    (n_kv_heads·head_dim, GQA), F = the SwiGLU hidden size, A = heads, b = dtype_bytes:
      RMSNorm (×2)    4nD + 4n          its input in fp32 (a copy, in 16 bits), fp32 1/rms
                      + 2b·nD           x/rms (the weight's gradient), normed (matmul input)
      attention       b·n(2D + 2K)      q, k after rotary, v, SDPA output (o_proj's input)
                      + 4nA             the fp32 log-sum-exp flash attention keeps: no T×T
                                        scores are stored (Korthikanti's 5as/h term is gone)
                      + 2b·T·d          rotary's signed sin table, for q and k (d = head_dim)
      SwiGLU          4·b·nF            gate, silu(gate), up, their product (down's input)
    Per checkpointed block only its input survives: b·nD ("full"). "op" keeps that input plus
    every matmul/attention output: q, k, v, SDPA out + log-sum-exp, o_proj, gate, up, down =
    b·n(4D + 2K + 2F) + 4nA. Outside the blocks, the final norm (its output feeds the logits
    matmul); the embedding saves only the token ids (the input). The logits themselves, and the
    loss's log-probabilities (4·n·vocab bytes in fp32), are the caller's and not counted.

    The attention terms depend on the SDPA kernel (`labs.nb04_sdpa_kernels.sdpa_kernel_for` says which
    one runs): "flash" as above, and "cudnn" (its softmax statistics are the same fp32 log-sum-exp); "efficient" (CUDA's cutlass kernel) pads its log-sum-exp to a
    multiple of 32 queries; "math" keeps the b·batch·A·T² softmax probabilities instead of a
    log-sum-exp (the T×T term is back) and its k, v repeated to all A heads. expand_kv: k and v
    were repeated to A heads before SDPA (GQA on a kernel without `enable_gqa`), so SDPA saves
    them at width D, not K."""
    if mode not in MODES:
        raise TitanliteError(
            f"mode '{mode}' is not one of {', '.join(MODES)}{closest(mode, MODES)}"
        )
    if every < 1:
        raise TitanliteError(f"every must be a positive integer, got {every}")
    if attention not in ("cudnn", "flash", "efficient", "math"):
        raise TitanliteError(
            f"attention kernel '{attention}' is not one of cudnn, flash, efficient, math"
        )
    n, b, D, F, A = batch * seq_len, dtype_bytes, args.dim, args.hidden_dim, args.n_heads
    K = args.n_kv_heads * args.head_dim
    kv = D if expand_kv or attention == "math" else K  # width of the k, v that SDPA saves
    scores = {
        "flash": 4 * n * A,
        "cudnn": 4 * n * A,  # fp32 log-sum-exp
        "efficient": 4 * batch * A * (-(-seq_len // 32) * 32),  # ... padded to 32 rows
        "math": b * batch * A * seq_len * seq_len,
    }[attention]  # softmax probabilities
    norm = 4 * n * D + 4 * n + 2 * b * n * D
    rotary = 2 * b * seq_len * args.head_dim
    plain_block = 2 * norm + b * n * (2 * D + 2 * kv) + scores + rotary + 4 * b * n * F
    full_block = b * n * D
    # "op" keeps the projections' outputs (k, v at width K: repeating them is recomputed) and
    # the attention's own saved output: under math, that is its q·kᵀ matmul, T×T again.
    op_block = b * n * D + b * n * (4 * D + 2 * K + 2 * F) + scores
    L = args.n_layers
    per_block = {
        "none": [plain_block] * L,
        "full": [full_block] * L,
        "op": [op_block] * L,
        "selective": [full_block if i % every == 0 else plain_block for i in range(L)],
    }
    return sum(per_block[mode]) + norm


def checkpointed_blocks(model: Transformer) -> list[str]:
    """Names of the blocks `apply_ac` wrapped (for printing and tests)."""
    return [name for name, block in model.layers.items() if isinstance(block, CheckpointWrapper)]


def tokens_for(args: ModelArgs, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Random token ids [batch, seq_len] for memory measurements (the values do not matter)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (batch, seq_len), generator=gen)
