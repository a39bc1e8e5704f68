"""The torchao internals titanlite touches beyond the public `torchao.float8`, checked in torchao
0.14-0.18. Imported on first use: one that moved fails with a TitanliteError naming the fix, never at
`import titanlite`."""

from ..errors import TitanliteError

# the operands a Linear casts; upper-cased, GemmInputRoles
ROLES = ("input", "weight", "grad_output")


def _moved(what: str, error: ImportError) -> TitanliteError:
    import torchao

    return TitanliteError(
        f"this torchao ({getattr(torchao, '__version__', '?')}) has no {what} "
        f"({error}); titanlite's FP8 was checked with torchao 0.14-0.18: "
        f"pip install 'torchao>=0.14,<0.19'"
    )


def float8_linear_class() -> type:
    """torchao's Float8Linear: convert_to_float8_training swaps it in, torchao.float8 does not export it."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise _moved("torchao.float8.float8_linear.Float8Linear", e) from e
    return Float8Linear


def is_float8_linear(module) -> bool:
    return isinstance(module, float8_linear_class())
