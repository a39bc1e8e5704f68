"""Document masks (issue 49): the batches say where each document starts, from the tokenizer's
end-of-document token; a masked batch is its documents run alone (values and gradients); the
from-scratch block-sparse attention and FlexAttention's forward equal SDPA with the dense mask;
the masked block compiles without a graph break; and the trainer with a mask gives one process's
losses on 2 ranks (FSDP, all-gather CP, DDP, TP, PP), deterministic, to 1e-5."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import parity_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.data import build_data
from titanlite.data.sampler import TokenBatches
from titanlite.data.tokenizer import encode_documents
from titanlite.efficiency.accumulation import count_targets, loss_sum
from titanlite.labs import nb21_documents_and_masks as lab
from titanlite.models.llama import ModelArgs, build_model
from titanlite.models.masked_attention import MaskedAttention, apply_masked_attention
from titanlite.models.rope import apply_rope
from titanlite.tools.jobs.launcher import launch, launch_function
from titanlite.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
EOS = 1  # our tokenizers' <|eos|> (data/tokenizer.py: BOS, EOS, PAD are ids 0, 1, 2)


# ----- the data: where documents start -----------------------------------------------------------


def test_the_batches_say_where_each_document_starts_from_the_end_of_document_token(data_dir):
    masked = build_data(
        "pydoc", vocab_size=512, seq_len=128, batch_size=8, data_dir=data_dir, document_mask=True
    )
    assert masked.eos_token_id == EOS
    # The tokenizer ends every document with its end-of-document token
    tokens, lengths = encode_documents(masked.tokenizer, ["def f(x):", "return x", "pass"])
    assert (tokens[np.cumsum(lengths) - 1] == EOS).all() and (tokens == EOS).sum() == 3
    # Without the mask, the same windows as (x, y) pairs, as before
    plain = TokenBatches(masked.train.windows.flatten(), 128, 8, seed=0)
    boundaries = 0
    for _ in range(4):
        x, y, documents = masked.train.next_batch()
        assert all(map(torch.equal, plain.next_batch(), (x, y)))
        assert documents.dtype == torch.int32 and documents.shape == x.shape
        # a document starts at each end-of-document token, which opens it: +1 there, nowhere else
        steps = torch.diff(documents, dim=1, prepend=torch.zeros_like(documents[:, :1]))
        assert torch.equal(steps, (x == EOS).int())
        boundaries += int((x == EOS).sum())
    assert boundaries > 0  # these batches do pack several documents
    assert len(masked.val.eval_batches(1)[0]) == 3 and len(plain.eval_batches(1)[0]) == 2
    # Under context parallelism x and y are cut, the documents stay whole (every key's is needed)
    masked.train.part = lambda t: t[:, :64]
    x, y, documents = masked.train.next_batch()
    assert x.shape == (8, 64) and documents.shape == (8, 128)


# ----- the model: a masked batch is its documents run alone --------------------------------------


def _packed_batch(T=48, vocab=64, seed=0):
    """Two rows of tokens with end-of-document tokens planted: documents of several lengths,
    one of a single token and one at the very start."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, vocab, (2, T), generator=g)
    for row, starts in ((0, (11, 12, 30)), (1, (0, 40))):
        x[row, list(starts)] = EOS
    return x, lab.documents_of(x, EOS)


def _model(vocab=64, seed=0):
    torch.manual_seed(seed)
    model = build_model(ModelArgs.preset("debug", vocab_size=vocab, max_seq_len=64))
    apply_masked_attention(model, "sdpa")
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_masked_batch_equals_its_documents_run_alone_in_values_and_gradients():
    """The mask's definition: every document of the packed batch, run alone from position 0,
    gives the same logits and, summed over the documents, the same gradients of the training
    loss (the batch's summed cross-entropy over its targets' count) (<= 1e-5)."""
    model, (x, documents) = _model(), _packed_batch()
    y = torch.randint(3, model.args.vocab_size, x.shape, generator=torch.Generator().manual_seed(1))
    logits = model(x, documents)
    (loss_sum(logits, y) / y.numel()).backward()
    packed = _grads(model)
    model.zero_grad()
    pieces = 0
    for b in range(x.shape[0]):
        for d in documents[b].unique().tolist():
            cols = (documents[b] == d).nonzero().flatten()
            alone = model(x[b : b + 1, cols])  # one document: the causal mask alone
            assert (alone[0] - logits[b, cols]).abs().max() <= 1e-5
            (loss_sum(alone, y[b : b + 1, cols]) / y.numel()).backward()
            pieces += 1
    assert pieces == 6  # 4 in row 0 (one of a single token), 2 in row 1 (one opened at 0)
    for name, grad in _grads(model).items():
        assert (grad - packed[name]).abs().max() <= 1e-5, name
    # without the mask the same batch is not its documents alone: the mask did this
    unmasked = build_model(model.args)
    unmasked.load_state_dict(model.state_dict())
    assert (unmasked(x) - logits).abs().max() > 1e-3


def test_rope_positions_run_on_across_documents_and_a_first_token_is_predicted_from_eos_alone(
    monkeypatch,
):
    """Positions are 0..T-1, not restarted at each document (torchtitan's; Llama 3's paper
    describes the mask alone), which changes nothing but rounding: RoPE's scores depend on q - k
    only. A document's first token is the target at its end-of-document token, whose query sees
    itself alone: predicted as from a BOS, and counted in the loss like every other target."""
    model, (x, documents) = _model(), _packed_batch()
    seen = []
    block = type(model.layers["0"])
    real = block.forward
    monkeypatch.setattr(
        block,
        "forward",
        lambda self, h, cos, sin, m: seen.append(cos) or real(self, h, cos, sin, m),
    )
    logits = model(x, documents)
    assert all(torch.equal(cos, model.rope_cos[: x.shape[1]]) for cos in seen)
    # RoPE is relative: the same q·k at any offset
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 8, 16, generator=g), torch.randn(1, 1, 8, 16, generator=g)
    cos, sin = model.rope_cos, model.rope_sin

    def scores_at(p):
        rows = slice(p, p + 8)
        return apply_rope(q, cos[rows], sin[rows]) @ apply_rope(k, cos[rows], sin[rows]).mT

    assert (scores_at(0) - scores_at(37)).abs().max() <= 1e-5
    # row 0's document opened at 30: its first token, x[0, 31], is the target at position 30
    y = torch.roll(x, -1, dims=1)
    assert x[0, 30] == EOS and y[0, 30] == x[0, 31]
    alone = model(torch.tensor([[EOS]]))
    assert (alone[0, 0] - logits[0, 30]).abs().max() <= 1e-5
    assert count_targets(y) == y.numel()  # no target is dropped at a boundary


def test_block_sparse_attention_equals_the_dense_mask_and_flex_forward_equals_both():
    q, k, v = lab.random_qkv(2, 4, 2, 256, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    documents = (torch.rand(2, 256, generator=g) < 0.03).cumsum(-1, dtype=torch.int32)
    dout = torch.randn(2, 4, 256, 16, generator=g)

    def out_and_grads(attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, documents)
        out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]

    scratch = out_and_grads(lambda q, k, v, d: lab.block_sparse_attention(q, k, v, d, 32))
    dense = out_and_grads(lab.masked_sdpa)
    for name, a, b in zip(("out", "dq", "dk", "dv"), scratch, dense):
        assert (a - b).abs().max() <= 1e-5, name
    counts = lab.block_counts(documents, 32)
    assert 0 < counts["kept"] < counts["causal"]  # some blocks are skipped: the test bites
    # FlexAttention with the batch's BlockMask, forward (torch has no CPU backward)
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = MaskedAttention("flex").mask_for(documents, 256, "cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex's "use torch.compile" advice
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert (flex - dense[0]).abs().max() <= 1e-5 and (flex - scratch[0]).abs().max() <= 1e-5
    # its BlockMask keeps the blocks our layout keeps, at its 128-token tiles
    layout = lab.block_layout(documents, 128)
    assert torch.equal(block_mask.kv_num_blocks[:, 0], (layout == 1).sum(-1).int())
    assert torch.equal(block_mask.full_kv_num_blocks[:, 0], (layout == 2).sum(-1).int())


def test_the_tile_layout_read_off_first_and_last_tokens_is_the_pairs_counted():
    """block_layout never builds the T × T pairs: each tile's fate is read off the documents of its
    first and last tokens. Counted pair by pair, every kind agrees, at every tile size."""
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        block, n = (1, 2, 4, 8, 16)[trial % 5], 1 + trial % 7
        starts = torch.rand(3, n * block, generator=g) < (0.0, 0.05, 0.2, 0.6)[trial % 4]
        documents = starts.cumsum(-1)
        counted = lab.pair_mask(documents).view(3, n, block, n, block).sum((2, 4))
        want = (counted > 0).to(torch.int8) + (counted == block * block).to(torch.int8)
        assert torch.equal(lab.block_layout(documents, block), want), (trial, block)


def test_the_flex_model_forward_equals_the_sdpa_model():
    model, (x, documents) = _model(), _packed_batch(T=64)
    want = model(x, documents)
    apply_masked_attention(model, "flex", compiled=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (model(x, documents) - want).abs().max() <= 1e-5


def test_the_masked_block_compiles_without_a_graph_break():
    """Regional compile (notebook 05) traces each block with its mask: one graph, no break, for
    SDPA's boolean mask and for flex's BlockMask."""
    model, (x, documents) = _model(), _packed_batch(T=64)
    h = model.tok_embeddings(x)
    cos, sin = model.rope_cos[:64], model.rope_sin[:64]
    for kernel in ("sdpa", "flex"):
        masked = apply_masked_attention(model, kernel, compiled=False)
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(model.layers["0"])(
                h, cos, sin, masked.mask_for(documents, 64, "cpu")
            )
        assert explained.graph_break_count == 0 and explained.graph_count == 1, kernel


def test_documents_without_masked_attention_are_refused_and_no_mask_is_todays_path():
    torch.manual_seed(0)
    model = build_model(ModelArgs.preset("debug", vocab_size=64, max_seq_len=64))
    x, documents = _packed_batch()
    with pytest.raises(TitanliteError, match="apply_masked_attention"):
        model(x, documents)
    assert torch.equal(model(x), model(x, None))  # no mask: the unmasked path, bit for bit


# ----- masked context parallel: each rank's queries against every key ---------------------------


def test_all_gather_cp_with_a_mask_equals_one_process(tmp_path):
    results = launch_function(
        "titanlite.labs.nb21_documents_and_masks:masked_cp_matches_one_process",
        nproc=2,
        log_dir=str(tmp_path),
    )
    for r in results:
        assert r["documents"] > 2 and max(r["diffs"].values()) <= 1e-5, r


# ----- the trainer ---------------------------------------------------------------------------

MASKED = {
    "data.document_mask": True,
    "training.seq_len": 128,  # pydoc's documents are hundreds of tokens: windows hold boundaries
    "training.steps": 4,
    "model.n_layers": 4,
    "model.tie_embeddings": False,
}


def _overrides(data_dir, tmp_path, **extra):
    return parity_overrides(data_dir, tmp_path, **{**MASKED, **extra})


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process with the mask, global batch 8: losses and validation losses."""
    history = Trainer(load_config(None, _overrides(data_dir, tmp_path_factory.mktemp("ref")))).fit()
    return history.losses, history.val_losses


def test_the_mask_changes_the_losses_and_composes_with_ac_and_fp8(data_dir, tmp_path, reference):
    def losses(**extra):  # each run in a folder of its own (they start within one second)
        o = {**_overrides(data_dir, tmp_path, **extra), "metrics.run_name": str(extra)}
        return Trainer(load_config(None, o)).fit().losses

    # the first step's batch holds no boundary; the later ones do, and the mask changes them
    assert (
        max(abs(a - b) for a, b in zip(losses(**{"data.document_mask": False}), reference[0]))
        > 1e-4
    )
    assert losses(**{"activation_checkpoint.mode": "full"}) == pytest.approx(reference[0], abs=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = losses(**{"float8.enable": True, "training.steps": 2})
    assert fp8 == pytest.approx(reference[0][:2], abs=1e-2)  # emulated FP8: near, not equal


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.dp_shard": 2, "training.batch_size": 4},
        {"parallel.cp": 2, "parallel.cp_method": "allgather", "parallel.cp_layout": "contiguous"},
        {"parallel.dp_replicate": 2, "parallel.dp_shard": 1, "training.batch_size": 4},
        {"parallel.tp": 2, "parallel.dp_shard": 1},
        {"parallel.pp": 2, "parallel.dp_shard": 1},
    ],
    ids=["fsdp2", "cp2-allgather", "ddp2", "tp2", "pp2"],
)
def test_two_ranks_with_a_mask_give_one_process_losses(layout, data_dir, tmp_path, reference):
    result = launch(load_config(None, _overrides(data_dir, tmp_path)), nproc=2, overrides=layout)
    losses, val_losses = reference
    assert result.losses == pytest.approx(losses, abs=1e-5)
    evals = [r["val_loss"] for r in result.rank(0, "val")]
    assert evals == pytest.approx(val_losses, abs=1e-5) and len(evals) == len(val_losses)


def test_titanlite_train_with_the_debug_config_and_a_document_mask_trains(data_dir, tmp_path):
    from titanlite.tools.cli.commands import main

    code = main(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "debug.toml"),
            "--data.document_mask",
            "true",
            "--data.vocab_size",
            "512",
            "--data.data_dir",
            str(data_dir),
            "--training.steps",
            "2",
            "--eval.every",
            "0",
            "--metrics.log_dir",
            str(tmp_path / "runs"),
            "--metrics.progress",
            "false",
        ]
    )
    assert code == 0
    run = next((tmp_path / "runs").iterdir())
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["model"]["attention"] == "sdpa"  # auto on this CPU


def test_the_kernel_key_without_a_mask_is_said_to_have_no_effect():
    from titanlite.tools.cli.config_help import without_effect

    assert without_effect(load_config(None, {"model.attention": "sdpa"})) == [
        "--model.attention sdpa has no effect without --data.document_mask true"
    ]
    masked = {"model.attention": "sdpa", "data.document_mask": True}
    assert without_effect(load_config(None, masked)) == []
