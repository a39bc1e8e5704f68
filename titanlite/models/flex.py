"""FlexAttention in titanlite: whether it trains on a device, and its kernel compiled once.

FlexAttention (`torch.nn.attention.flex_attention`) turns a mask into a block-sparse kernel
(models/masked_attention.py builds its BlockMask). Its backward exists where torch generates its
kernels for training: CUDA in torch 2.13; on the CPU and MPS torch refuses it ("FlexAttention does
not support backward on CPU"), so `--model.attention flex` is refused there in one line, until a
torch that has it trains. Imported only by runs that ask for a mask or for flex."""

import functools

import torch

from ..errors import TitanliteError


def attention_for(asked: str, device_type: str) -> str:
    """The kernel `--model.attention` asks for, checked on this device: flex where torch has no
    FlexAttention backward is refused in one line (it trains, once torch has one)."""
    if asked == "flex" and not flex_trains(device_type):
        raise TitanliteError(
            f"--model.attention flex: torch {torch.__version__} has no FlexAttention backward on "
            f"{device_type} (it refuses: 'FlexAttention does not support backward'): use "
            f"--model.attention auto (SDPA with the mask as a boolean here), or train on CUDA"
        )
    return asked


@functools.cache
def flex_trains(device_type: str) -> bool:
    """Does torch have FlexAttention's backward on this device? CUDA: yes (its Triton kernels).
    Elsewhere torch is asked, on a tiny input: torch 2.13 refuses on the CPU and MPS at once."""
    if device_type == "cuda":
        return True
    q = torch.zeros(1, 1, 16, 8, device=device_type, requires_grad=True)
    try:
        flex_module().flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True


def flex_module():  # torch's FlexAttention, imported by masked runs only
    import torch.nn.attention.flex_attention as flex

    return flex


@functools.cache
def compiled_flex():
    # Compiled once for every layer and batch (torchtitan's FlexAttentionWrapper does the same).
    return torch.compile(flex_module().flex_attention, dynamic=False)
