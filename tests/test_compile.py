"""torch.compile: compiled == eager (loss and gradients), names unchanged, graph breaks seen,
and a clear eager fallback where compiling cannot work.

Compiling is slow on a 2-core CPU, so the compiled models are built once per module with the
trainer's own shapes (debug preset, vocab 512, batch 4 × 32 tokens): the trainer test then
reuses the same compiled block instead of compiling again. The graph-break tests come last
because torch._dynamo.explain resets Dynamo's caches.
"""

import copy

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.efficiency.compile import (
    CompileFallbackWarning,
    apply_compile,
    compile_support,
    is_compiled,
)
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.measure.compile_report import graph_break_report, time_first_call
from titanlite.train import Trainer

ARGS = ModelArgs.preset("debug", vocab_size=512)  # what the trainer builds from tiny_overrides
BATCH, SEQ = 4, 32


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
        torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
    )


def loss_and_grads(model, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    eager = build_model(ARGS)
    regional = apply_compile(copy.deepcopy(eager), scope="regional", fallback=False)
    whole = apply_compile(copy.deepcopy(eager), scope="model", fallback=False)
    return {"eager": eager, "regional": regional, "model": whole}


@pytest.fixture(scope="module")
def results(models):
    x, y = batch()
    torch._dynamo.utils.counters.clear()
    out = {name: loss_and_grads(m, x, y) for name, m in models.items()}
    # Frames Dynamo turned into graphs: 1 for all regional blocks together, 1 for the model.
    out["unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


@pytest.mark.parametrize("scope", ["regional", "model"])
def test_compiled_loss_and_gradients_match_eager(results, scope):
    eager_loss, eager_grads = results["eager"]
    loss, grads = results[scope]
    # Inductor fuses and reorders float ops, so fp32 agrees to rounding, not bit for bit.
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        scale = eager_grads[name].abs().max()
        torch.testing.assert_close(
            g,
            eager_grads[name],
            rtol=1e-4,
            atol=1e-5 * scale.item(),
            msg=lambda m, name=name: f"{scope} gradient of {name}: {m}",
        )


def test_regional_compiles_one_block_graph_reused_by_every_layer(results):
    assert results["unique_graphs"] == 2  # one block graph (for both layers) + the whole model


@pytest.mark.parametrize("scope", ["regional", "model"])
def test_compiled_in_place_keeps_the_plain_state_dict(models, scope):
    eager, compiled = models["eager"].state_dict(), models[scope].state_dict()
    assert list(compiled) == list(eager)  # no "_orig_mod." prefixes: checkpoints stay loadable
    assert all(torch.equal(compiled[k], eager[k]) for k in eager)
    assert is_compiled(models[scope]) and not is_compiled(models["eager"])
    expected = [f"layers.{i}" for i in range(ARGS.n_layers)] if scope == "regional" else [""]
    assert [
        n
        for n, m in models[scope].named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None
    ] == expected


def test_trainer_trains_with_compile_and_matches_eager(data_dir, tmp_path, models):
    def run(enable):
        extra = {
            "compile.enable": enable,
            "training.steps": 4,
            "eval.every": 4,
            "metrics.run_name": f"compile-{enable}",
        }
        trainer = Trainer(load_config(None, tiny_overrides(data_dir, tmp_path, **extra)))
        return trainer, trainer.fit()

    trainer, compiled = run(True)
    assert is_compiled(trainer.model)
    _, eager = run(False)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    assert compiled.val_losses == pytest.approx(eager.val_losses, rel=1e-4)


def test_unknown_scope_is_one_line_with_a_suggestion():
    with pytest.raises(
        TitanliteError,
        match=r"'regonal' is not one of regional, model "
        r"\(did you mean: regional\?\)",
    ) as e:
        apply_compile(build_model(ARGS), scope="regonal")
    assert "\n" not in str(e.value)


def failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_failing_backend_warns_once_and_the_model_still_trains_eagerly():
    model = build_model(ARGS)
    with pytest.warns(CompileFallbackWarning) as caught:
        apply_compile(model, backend=failing_backend)
    message = str(caught[0].message)
    assert len(caught) == 1 and "\n" not in message
    assert "continues eagerly" in message and "this backend cannot compile anything" in message
    assert "enable=false" in message
    assert not is_compiled(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_without_fallback_a_failing_compile_is_a_titanlite_error():
    with pytest.raises(TitanliteError, match="fallback=true") as e:
        apply_compile(build_model(ARGS), backend=failing_backend, fallback=False)
    assert "\n" not in str(e.value) and "this backend cannot compile anything" in str(e.value)
    assert e.value.__cause__ is not None  # the full traceback is one `raise from` away


def fails_on_attention(graph_module, example_inputs):
    """A real backend that compiles a toy (runs its graph as is) but not a transformer block:
    like a backend without a kernel for the attention op a real model calls."""
    if any(node.target is F.scaled_dot_product_attention for node in graph_module.graph.nodes):
        raise RuntimeError("this backend has no scaled_dot_product_attention kernel")
    return graph_module.forward


if "fails_on_attention" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(fails_on_attention, name="fails_on_attention")


def test_the_trial_compiles_a_real_block_so_a_toy_that_compiles_proves_nothing():
    # The tiny matmul trial passes with this backend: without the run's shape the model is
    # compiled, and would fail at its first step.
    assert is_compiled(apply_compile(build_model(ARGS), backend=fails_on_attention))
    # With it, block 0 is compiled for real on a batch of that shape, and fails here.
    model = build_model(ARGS)
    with pytest.warns(
        CompileFallbackWarning, match="block 0 on a 4x32 batch.*no scaled_dot_product"
    ):
        apply_compile(model, backend=fails_on_attention, example_shape=(BATCH, SEQ))
    assert not is_compiled(model)
    assert all(p.grad is None for p in model.parameters())  # the trial ran on a copy


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_trial_traces_the_graph_training_runs_so_step_one_compiles_nothing_new(
    data_dir, tmp_path, precision, monkeypatch
):
    # The trial runs block 0 as the model will (its autocast too): Dynamo then reuses the
    # trial's graph for every block at step 1 instead of tracing and compiling a second one,
    # which on a cold cache halves the compile time of a run.
    from torch._dynamo.utils import counters

    from titanlite.efficiency import compile_trial

    extra = {
        "compile.enable": True,
        "training.mixed_precision": precision,
        "training.steps": 1,
        "eval.every": 0,
        "eval.sample_every": 0,
        "metrics.run_name": f"trial-{precision}",
    }
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **extra))
    torch._dynamo.reset()
    compile_trial._TRIALS.clear()  # this process's earlier trials would skip this one's
    trainer = Trainer(cfg)
    traced = counters["stats"]["unique_graphs"]
    assert traced > 0, "the trial compiled block 0"
    trainer.fit()
    trainer.close()
    assert counters["stats"]["unique_graphs"] == traced, "step 1 traced no graph the trial had not"


def test_a_trial_is_remembered_for_the_process_and_failures_too(tmp_path):
    """One trial per process and key: a second call traces nothing; other arguments are tried."""
    from torch._dynamo.utils import counters

    from titanlite.efficiency import compile_trial

    block, shape = build_model(ARGS).layers["0"], (BATCH, SEQ)
    compile_trial._TRIALS.clear()
    torch._dynamo.reset()

    def support_and_traced(**kwargs):
        before = counters["stats"]["unique_graphs"]
        support = compile_support("cpu", block=block, args=ARGS, example_shape=shape, **kwargs)
        return support, counters["stats"]["unique_graphs"] - before

    support, traced = support_and_traced()
    assert support.works and traced > 0
    support, traced = support_and_traced()
    assert support.works and traced == 0
    support, _ = support_and_traced(backend="fails_on_attention")
    assert not support.works and "fails_on_attention" in support.why


def test_a_model_that_cannot_compile_trains_eagerly_in_the_trainer_and_says_why(data_dir, tmp_path):
    extra = {
        "compile.enable": True,
        "compile.backend": "fails_on_attention",
        "training.steps": 3,
        "eval.every": 0,
        "metrics.run_name": "compile-fails",
    }
    with pytest.warns(CompileFallbackWarning) as caught:
        trainer = Trainer(load_config(None, tiny_overrides(data_dir, tmp_path, **extra)))
    message = str(caught[0].message)
    assert "continues eagerly" in message and "no scaled_dot_product_attention kernel" in message
    assert "\n" not in message
    assert not is_compiled(trainer.model)
    losses = trainer.fit().losses
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_missing_cpp_compiler_is_detected_before_any_compile():
    from torch._inductor.cpp_builder import cpp_compiler_search

    try:
        with torch._inductor.config.patch({"cpp.cxx": (None, "/no/such/g++")}):
            support = compile_support("cpu")
            assert not support.works and "C++ compiler" in support.why and support.fix
            with pytest.warns(CompileFallbackWarning, match=r"C\+\+ compiler"):
                model = apply_compile(build_model(ARGS), scope="model")
            assert not is_compiled(model)
    finally:  # torch remembers the last compiler search: later tests must find the real g++
        cpp_compiler_search.cache_clear()


def test_time_first_call_separates_compile_from_steady_state():
    # A backend that takes a known 0.5 s per graph: the first call must contain every such
    # compile, the steady steps none. (Comparing the two times directly is not a test on a busy
    # machine: one stalled steady step outlasts Dynamo's tracing of this small model.)
    import time

    compiled_at = []

    def slow_backend(gm, example_inputs):
        compiled_at.append(time.perf_counter())
        time.sleep(0.5)
        return gm.forward

    model = build_model(ARGS)
    model.compile(backend=slow_backend)
    x, y = batch()
    start = time.perf_counter()
    t = time_first_call(model, x, y, steps=3, cold=True)
    first_call_ended = start + t["first_call_s"]
    assert compiled_at and all(c < first_call_ended for c in compiled_at), (
        "steady steps compiled nothing"
    )
    assert t["first_call_s"] >= 0.5 * len(compiled_at) and t["steady_s"] > 0
    assert t["compile_s"] == pytest.approx(max(0.0, t["first_call_s"] - t["steady_s"]))


# ----- graph breaks (last: explain() resets Dynamo) ------------------------------------------


def test_a_block_and_the_model_trace_without_graph_breaks(models):
    block = models["eager"].layers["0"]
    h = torch.randn(BATCH, SEQ, ARGS.dim)
    cos, sin = models["eager"].rope_cos[:SEQ], models["eager"].rope_sin[:SEQ]
    report = graph_break_report(block, h, cos, sin)
    assert report["graphs"] == 1 and report["graph_breaks"] == 0 and report["break_reasons"] == []
    assert report["ops"] > 20  # norms, 7 projections, rotary, attention, SwiGLU, residuals
    x, _ = batch()
    # The max_seq_len check in forward is resolved at trace time: no break for it.
    for name in ("eager", "model", "regional"):  # compiled models are explained as eager
        report = graph_break_report(models[name], x)
        assert (report["graphs"], report["graph_breaks"]) == (1, 0), name
    # With a dynamic sequence length the check becomes a guard (T <= max_seq_len), not a break.
    dynamic = x.clone()
    torch._dynamo.mark_dynamic(dynamic, 1)
    report = graph_break_report(models["eager"], dynamic)
    assert (report["graphs"], report["graph_breaks"]) == (1, 0)


def test_the_report_shows_where_and_why_a_graph_breaks():
    def chatty(x):
        y = x.sin()
        print("a Python side effect")
        return y * y.sum().item()

    report = graph_break_report(chatty, torch.randn(4))
    assert report["graph_breaks"] == 2 and report["graphs"] == 3
    reasons = " | ".join(r["reason"] for r in report["break_reasons"])
    assert "print" in reasons or "builtin" in reasons
    assert "item()" in reasons
    assert any("print(" in r["where"] for r in report["break_reasons"])
