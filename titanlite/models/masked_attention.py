"""Document masks: in a packed sequence each token attends only to the earlier tokens of its own document.

The data pipeline packs documents end to end into fixed-length windows (data/pipeline.py), so with
causal attention alone a token also attends to the tail of an unrelated document before it. Llama 3
trained with "an attention mask that prevents self-attention between different documents within the
same sequence" (The Llama 3 Herd of Models, 2024, §3.2: of limited effect in standard pre-training,
important for continued pre-training on very long sequences). `--data.document_mask true`: each batch
says which document each token is in (data/sampler.py: a document starts at each end-of-document
token, which opens it as a BOS would), and attention keeps the pairs (query q, key k) with k <= q in
the same document: a block-causal mask, built once a batch for every layer (`mask_for`).

Two kernels take it (`--model.attention`): `sdpa`, SDPA with the mask as a dense boolean
[B, 1, Tq, Tk] (it trains everywhere, and computes every pair the kernel visits); `flex`,
FlexAttention with a `BlockMask`: the mask cut into 128 × 128 tiles, the empty ones never computed,
compiled into one kernel, where torch has its backward (CUDA; torch 2.13 has none on the CPU or MPS).
`auto` takes flex where it trains, else sdpa.

RoPE's positions run on across documents (0 … T−1, not restarted at each start), as torchtitan's
Llama 3 indexes its rotary table by position in the packed sequence; the Llama 3 paper describes the
mask alone. RoPE scores depend on q − k only, so a document attends the same at any offset: up to
rounding, a masked batch is each of its documents run alone (tests/test_document_mask.py).

Under context parallelism the mask needs every key's document: the all-gather form (each rank's
queries against every rank's keys, masked; Llama 3 §3.3.2 chose it partly for such masks)."""

from dataclasses import dataclass

import torch

from .flex import compiled_flex, flex_module
from .llama import causal_attention


def apply_masked_attention(model: torch.nn.Module, kernel: str = "sdpa", compiled: bool = True):
    """Hand the model and every attention layer the kernel that takes the mask (models/llama.py
    reads `masked`): "sdpa" or "flex" (`compiled`: torch.compile'd once, as torchtitan runs it;
    eager flex materialises the whole score matrix)."""
    masked = MaskedAttention(kernel, compiled)
    for module in model.modules():
        if hasattr(type(module), "masked"):
            module.masked = masked
    return masked


@dataclass
class MaskedAttention:
    """What a masked model's attention holds: its kernel ("sdpa" or "flex")."""

    kernel: str = "sdpa"
    compiled: bool = True

    def __deepcopy__(self, memo):  # pipeline stages' copies share it
        return self

    def mask_for(self, documents, local_len: int, device, cp=None):
        """This batch's mask: a boolean [B, 1, Tq, Tk] (True: attend) for sdpa, a BlockMask for flex.
        `documents` [B, T]: each token's document over the whole sequence. Under CP, Tq: this
        rank's queries; Tk: every rank's keys, in rank order."""
        total = local_len * (cp.size if cp is not None else 1)
        documents = documents.to(device)
        # each query's and key's position in the whole sequence (under CP: this rank's queries)
        q_pos, k_pos = (
            (torch.arange(total, device=device),) * 2
            if cp is None
            else (cp.positions(local_len, device), cp.key_positions(local_len, device))
        )
        if self.kernel == "sdpa":
            same = documents[:, q_pos, None] == documents[:, None, k_pos]
            return (same & (q_pos[:, None] >= k_pos[None, :]))[:, None]

        def block_causal(b, h, q, k):  # flex's mask_mod: q and k index this call's queries and keys
            same = documents[b, q_pos[q]] == documents[b, k_pos[k]]
            return same & (q_pos[q] >= k_pos[k])

        return flex_module().create_block_mask(
            block_causal, documents.shape[0], None, len(q_pos), total, device=device
        )

    def attend(self, q, k, v, mask, cp=None):
        """Attention of q [B, H, Tq, D] over k and v [B, H_kv, Tk, D] under `mask_for`'s mask;
        under CP (all-gather) every rank's k and v are gathered first, differentiably."""
        if cp is not None:
            k, v = cp.gather_sequence(torch.stack([k, v]))
        if self.kernel == "sdpa":
            return causal_attention(q, k, v, mask=mask)
        attend = compiled_flex() if self.compiled else flex_module().flex_attention
        return attend(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
