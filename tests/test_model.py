"""The model: sizes, FLOP formula vs counted FLOPs, meta-device init, causality, errors."""

import pytest
import torch

from titanlite import TitanliteError
from titanlite.models.llama import PRESETS, ModelArgs, Transformer, build_model
from titanlite.tools.measure.flops import count_training_flops


def manual_param_count(a: ModelArgs) -> int:
    attn = a.dim * a.head_dim * (a.n_heads * 2 + a.n_kv_heads * 2)
    mlp = 3 * a.dim * a.hidden_dim
    per_layer = attn + mlp + 2 * a.dim
    emb = a.vocab_size * a.dim
    return a.n_layers * per_layer + a.dim + emb * (1 if a.tie_embeddings else 2)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_the_advertised_sizes(name):
    with torch.device("meta"):
        model = Transformer(ModelArgs.preset(name))
    n = model.num_params()
    assert n == manual_param_count(model.args)
    expected = {
        "debug": (0, 1e6),
        "small": (10e6, 30e6),
        "125M": (110e6, 140e6),
        "1B": (1.1e9, 1.3e9),
        "8B": (7.9e9, 8.1e9),
    }[name]
    assert expected[0] < n < expected[1], n


def test_meta_construction_allocates_nothing_and_init_materialises():
    with torch.device("meta"):
        model = Transformer(ModelArgs.preset("debug"))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight  # tying survives to_empty
    w = model.layers["0"].attention.q_proj.weight
    assert torch.isfinite(w).all() and abs(w.std().item() - 0.02) < 0.005
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_untied_output_is_a_separate_matrix():
    model = build_model(ModelArgs.preset("debug", tie_embeddings=False))
    assert model.output.weight is not model.tok_embeddings.weight
    assert model.num_params() - model.num_params(exclude_embedding=True) == 4096 * 64


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model(ModelArgs.preset("debug"))
    x = torch.randint(0, 4096, (1, 32))
    y = x.clone()
    y[0, 20:] = torch.randint(0, 4096, (12,))
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


@pytest.mark.parametrize("tie", [True, False])
def test_flops_formula_matches_counted_flops(tie):
    """6·N counts every weight matmul exactly; 12·L·H·Q·T counts attention with a backward
    twice the forward, while the flash kernel's backward recomputes the scores (2.5×): so the
    counted total may exceed the formula by that extra recompute and nothing else."""
    torch.manual_seed(0)
    args = ModelArgs.preset("debug", tie_embeddings=tie, max_seq_len=256)
    model = build_model(args)
    T = 256
    counted = count_training_flops(model, torch.randint(0, args.vocab_size, (2, T)))
    formula = model.flops_per_token(T)
    matmul_per_token = counted["by_op"]["aten.mm"] / (2 * T)
    attention_formula = 12 * args.n_layers * args.n_heads * args.head_dim * T
    norm_params = (2 * args.n_layers + 1) * args.dim  # in N by convention, but no matmul
    assert matmul_per_token == formula - attention_formula - 6 * norm_params
    ratio = counted["per_token"] / formula
    assert ratio >= 1.0 and ratio < 1.05, ratio


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(TitanliteError, match="not a multiple of model.n_kv_heads"):
        ModelArgs.preset("debug", n_kv_heads=3)
    with pytest.raises(TitanliteError, match="not divisible by model.n_heads"):
        ModelArgs.preset("debug", n_heads=5)
    with pytest.raises(TitanliteError, match="did you mean: small"):
        ModelArgs.preset("smal")
    model = build_model(ModelArgs.preset("debug", max_seq_len=16))
    with pytest.raises(TitanliteError, match="exceeds the model's max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


# ---- attention paths ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_paths_give_the_same_numbers(dtype):
    """SDPA's enable_gqa and our own k/v repeat (what CUDA kernels without enable_gqa get)
    must be the same math: outputs and gradients equal on the CPU."""
    from titanlite.models.llama import causal_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, h, 32, 16, generator=g, dtype=dtype).requires_grad_() for h in (6, 2, 2)
    )
    outs, grads = [], []
    for expand in (False, True):
        out = causal_attention(q, k, v, expand_kv=expand)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    assert causal_attention(q, k, v).shape == (2, 6, 32, 16)


def test_model_on_cpu_keeps_sdpa_gqa_path():
    """CPU behaviour must not change: the default path equals the enable_gqa path bit for bit."""
    from titanlite.models import llama

    model = build_model(ModelArgs.preset("debug"))
    x = torch.randint(0, 4096, (2, 32))
    ref = model(x)
    original = llama.causal_attention
    llama.causal_attention = lambda q, k, v: original(q, k, v, expand_kv=False)
    try:
        assert torch.equal(model(x), ref)
    finally:
        llama.causal_attention = original
