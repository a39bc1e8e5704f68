"""--checkpoint.initial_load_path: continue pretraining a Llama written by transformers itself
(a tool, tools/formats/hf_start.py, handed to the trainer; `titanlite train` and `launch` hand it in).

A small random `LlamaForCausalLM` (GQA, Llama 3 RoPE scaling, tied or untied) is saved with
`save_pretrained`, beside a tokenizer.json trained here. The trainer's first logged loss is the
loss *before* any update, so it must equal transformers' loss on the same global batch, in
every layout: the weights arrived whole, in the right slices, with the right RoPE.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_overrides

import titanlite  # noqa: F401  (first: quiet torchao before transformers imports it)
from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.data import build_data
from titanlite.tools.formats.hf_start import HuggingFaceStart
from titanlite.train import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 320  # the model's rows; the tokenizer trained below has at most this many tokens
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LINES = [
    "def train(model, data):",
    "    for x, y in data:",
    "        loss = model(x, y)",
    "        loss.backward()",
    "return the mean of the losses",
    "import torch.nn as nn",
    "class Attention(nn.Module): pass",
    "the quick brown fox jumps over the lazy dog",
] * 20


def write_checkpoint(folder, tie: bool, seed: int = 0, mixtral: bool = False, **changes):
    """A random transformers Llama (or Mixtral) plus a tiny trained BPE tokenizer, as on the Hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50_000.0,
        rope_scaling=ROPE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=0.2,
    )
    if mixtral:  # 4 experts, top 2, each 96 wide; Mixtral's RoPE is plain
        del cfg["rope_scaling"]
        cfg.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)
        cfg.update(router_aux_loss_coef=0.02)
    cfg.update(changes)
    model = (
        MixtralForCausalLM(MixtralConfig(**cfg))
        if mixtral
        else LlamaForCausalLM(LlamaConfig(**cfg))
    ).eval()
    model.save_pretrained(folder, safe_serialization=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        LINES,
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|end|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    assert tok.get_vocab_size() <= VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>").save_pretrained(folder)
    return model


def trainer_for(cfg) -> Trainer:
    return Trainer(cfg, start_from=HuggingFaceStart.from_config(cfg))


def overrides(data_dir, tmp_path, folder, **extra):
    return tiny_overrides(
        data_dir,
        tmp_path,
        **{
            "checkpoint.initial_load_path": str(folder),
            "training.steps": 1,
            "metrics.log_every": 1,
            "eval.every": 0,
            "eval.sample_tokens": 4,
            "data.max_chars": 100_000,
            "training.dtype": "float32",
            "training.mixed_precision": "fp32",
            "training.threads": 1,
            **extra,
        },
    )


def hf_loss(hf, cfg, dp: int) -> float:
    """transformers' mean cross-entropy over the first global batch the trainer reads: every
    data-parallel rank's first micro-batch, each built the way the trainer builds it."""
    total, count = 0.0, 0
    for rank in range(dp):
        data = build_data(
            cfg.data.dataset,
            tokenizer=cfg.checkpoint.initial_load_path,
            seq_len=cfg.training.seq_len,
            batch_size=cfg.training.batch_size,
            val_fraction=cfg.data.val_fraction,
            seed=cfg.training.seed,
            data_dir=cfg.data.data_dir,
            max_chars=cfg.data.max_chars,
            rank=rank,
            world_size=dp,
        )
        x, y = data.train.next_batch()
        with torch.no_grad():
            logits = hf(input_ids=x).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


@pytest.mark.parametrize("tie", [True, False])
def test_first_loss_equals_transformers_in_one_process(data_dir, tmp_path, tie):
    hf = write_checkpoint(tmp_path / "hf", tie)
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "hf"))
    with pytest.raises(
        TitanliteError,
        match="^checkpoint.initial_load_path starts from a Hugging Face "
        r"model, which a tool reads: pass Trainer\(cfg, start_from=",
    ):
        Trainer(cfg)  # not handed in: one line naming how
    trainer = trainer_for(cfg)
    # The shape and the vocabulary are the checkpoint's, not the debug preset's.
    args = trainer.model_args
    assert (
        args.dim,
        args.n_layers,
        args.n_heads,
        args.n_kv_heads,
        args.vocab_size,
        args.tie_embeddings,
        args.rope_theta,
    ) == (64, 2, 4, 2, VOCAB, tie, 50_000.0)
    assert args.rope_scaling["rope_type"] == "llama3"
    assert trainer.tokenizer.eos_token == "<|end|>" and len(trainer.tokenizer) <= VOCAB
    history = trainer.fit()
    trainer.close()
    assert history.losses[0] == pytest.approx(hf_loss(hf, cfg, dp=1), rel=1e-5)
    # Step 1 changed the weights (fresh optimizer, real training), not the published model.
    assert trainer.step == 1
    assert not torch.equal(
        trainer.model.tok_embeddings.weight.detach(), hf.model.embed_tokens.weight
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, tie, nproc",
    [
        ({"parallel.dp_shard": 2}, True, 2),  # FSDP: each rank reads half a tensor
        ({"parallel.dp_shard": 1, "parallel.tp": 2}, False, 2),  # TP: column / row slices
        (
            {"parallel.dp_shard": 1, "parallel.pp": 2},
            False,
            2,
        ),  # PP: each stage reads its layers only
        # FSDP over TP shards: FSDP cuts each TP slice again (a strided shard of the whole).
        ({"parallel.dp_shard": 2, "parallel.tp": 2}, True, 4),
    ],
    ids=["fsdp", "tp", "pp", "fsdp+tp"],
)
def test_first_loss_equals_transformers_on_several_ranks(data_dir, tmp_path, layout, tie, nproc):
    from titanlite.tools.jobs.launcher import launch

    hf = write_checkpoint(tmp_path / "hf", tie)
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "hf", **layout))
    dp = layout["parallel.dp_shard"]
    expected = hf_loss(hf, cfg, dp=dp)  # also builds the token cache the ranks then share
    result = launch(cfg, nproc=nproc, timeout_s=400)
    assert result.train[0]["step"] == 1
    assert result.train[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_own_checkpoint_takes_precedence(data_dir, tmp_path):
    write_checkpoint(tmp_path / "hf", tie=False)
    o = overrides(
        data_dir, tmp_path, tmp_path / "hf", **{"checkpoint.enable": True, "training.steps": 2}
    )
    first = trainer_for(load_config(None, o))
    first.fit()
    first.close()
    # Restarted with more steps: it continues from its own step 2, not the published weights.
    again = trainer_for(load_config(None, {**o, "training.steps": 3}))
    history = again.fit()
    again.close()
    assert history.resumed_from is not None and [r["step"] for r in history.train] == [3]


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("model.vocab_size", 512, "vocab_size"),
        ("model.dim", 32, "dim"),
        ("model.n_kv_heads", 4, "n_kv_heads"),
    ],
)
def test_mismatched_model_settings_are_refused_in_one_line(data_dir, tmp_path, key, value, field):
    write_checkpoint(tmp_path / "hf", tie=False)
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "hf", **{key: value}))
    with pytest.raises(TitanliteError, match=rf"^model\.{field}={value} but the checkpoint") as err:
        trainer_for(cfg)
    assert "\n" not in str(err.value)


def test_missing_directory_is_refused_in_one_line(data_dir, tmp_path):
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "nowhere"))
    with pytest.raises(TitanliteError, match="no Hugging Face checkpoint directory") as err:
        trainer_for(cfg)
    assert "\n" not in str(err.value) and "huggingface-cli download" in str(err.value)


def test_checkpoint_of_another_shape_is_refused_at_load(tmp_path):
    # Weights that disagree with the model they are loaded into (e.g. the files were replaced
    # by another download after start-up): one line, not DCP's traceback.
    from titanlite.models.llama import ModelArgs, build_model
    from titanlite.tools.formats.hf_start import load_initial_weights

    write_checkpoint(tmp_path / "hf", tie=False)
    model = build_model(
        ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=999, max_seq_len=128)
    )
    with pytest.raises(TitanliteError, match="cannot load the weights") as err:
        load_initial_weights([model], tmp_path / "hf")
    assert "\n" not in str(err.value)


# ----- a Mixtral: one saved by transformers, and our own export of a mixture of experts -------


def first_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits as `titanlite train` starts it: the weights loaded as fit() loads them."""
    trainer.start_from.load(trainer.model_parts, trainer.model_args.tie_embeddings)
    with torch.no_grad():
        return trainer.model(tokens)


def test_a_run_starts_from_a_transformers_mixtral_with_its_logits(data_dir, tmp_path):
    """Issue 47: the start refused every Mixtral ("no Hugging Face name for titanlite tensor
    'layers.0.feed_forward.router.expert_bias': only Llama weights map"). Its files keep one tensor
    per expert (block_sparse_moe.experts.j.w1/w2/w3); transformers 5 holds them stacked in memory
    (mlp.experts.gate_up_proj, down_proj): both layouts load, to the folder's logits."""
    from safetensors.torch import save_file

    from titanlite.tools.jobs.launcher import launch, rank_output

    hf = write_checkpoint(tmp_path / "mx", tie=False, mixtral=True)
    given = {"model.moe_balance": "aux_loss", "model.n_experts": 4}  # as the checkpoint has them
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "mx", **given))
    trainer = trainer_for(cfg)
    assert trainer.model_args.moe.n_experts == 4 and trainer.model_args.moe.aux_loss_coef == 0.02
    tokens = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (first_logits(trainer, tokens) - theirs).abs().max() <= 1e-5
    bias = trainer.model.layers["0"].feed_forward.router.expert_bias
    assert bias.eq(0).all()  # Mixtral's routers have none
    # transformers 5's in-memory names, stacked, written as they are: the same logits.
    (tmp_path / "mx" / "model.safetensors").unlink()
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()},
        tmp_path / "mx" / "fused.safetensors",
    )
    with torch.no_grad():
        trainer.model.layers["1"].feed_forward.experts.w_up.zero_()
    assert (first_logits(trainer, tokens) - theirs).abs().max() <= 1e-5
    trainer.close()
    # Through the command line on two expert-parallel ranks, each reading its two experts: the
    # first loss is transformers' on the same batch, and --model.moe_balance gets no false note.
    ep2 = {"parallel.ep": 2, "parallel.dp_shard": 1, "metrics.run_name": "ep2"}
    result = launch(cfg, nproc=2, overrides=ep2, timeout_s=300)
    assert result.train[0]["loss"] == pytest.approx(hf_loss(hf, cfg, dp=2), rel=1e-5)
    out = rank_output(result.run_dir, "stdout")
    assert "a Mixtral (the routers' expert_bias, which it has not, starts at zero)" in out
    assert "--model.moe_balance" not in out  # was: "has no effect without --model.n_experts"


def test_a_run_starts_from_our_own_mixtral_export(data_dir, tmp_path, capsys):
    """An aux_loss mixture trained here, exported by `titanlite export-hf` (which says it wrote a
    Mixtral), then started from: the start's logits are the trained model's and transformers'."""
    from transformers import MixtralForCausalLM

    from titanlite.tools.cli.commands import main
    from titanlite.tools.jobs.launcher import launch
    from titanlite.weights import load_weights

    moe = {"model.n_experts": 4, "model.moe_balance": "aux_loss", "training.steps": 2}
    o = tiny_overrides(data_dir, tmp_path, **moe, **{"eval.every": 0, "metrics.run_name": "moe"})
    trained = launch(load_config(None, o), nproc=1)
    capsys.readouterr()
    assert main(["export-hf", str(trained.run_dir), str(tmp_path / "mx")]) == 0
    assert capsys.readouterr().out.startswith("wrote a Hugging Face MixtralForCausalLM to ")
    cfg = load_config(
        None, overrides(data_dir, tmp_path, tmp_path / "mx", **{"model.moe_balance": "aux_loss"})
    )
    trainer = trainer_for(cfg)
    tokens = torch.randint(0, trainer.model_args.vocab_size, (2, 24))
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "mx").eval()
    model, _ = load_weights(trained.run_dir)
    with torch.no_grad():
        theirs, ours = hf(tokens).logits, model(tokens)
    logits = first_logits(trainer, tokens)
    assert (logits - theirs).abs().max() <= 1e-5 and (logits - ours).abs().max() <= 1e-5
    history = trainer.fit()
    trainer.close()
    assert history.losses[0] == pytest.approx(hf_loss(hf, cfg, dp=1), rel=1e-5)


@pytest.mark.parametrize(
    "given, has",
    [
        ({"model.n_experts": 8}, "n_experts=4"),
        ({"model.moe_balance": "none"}, "moe_balance=aux_loss"),
        ({"model.n_shared_experts": 1}, "n_shared_experts=0"),
    ],
)
def test_mixture_settings_a_mixtral_disagrees_with_are_refused_in_one_line(
    data_dir, tmp_path, given, has
):
    write_checkpoint(tmp_path / "mx", tie=False, mixtral=True)
    cfg = load_config(None, overrides(data_dir, tmp_path, tmp_path / "mx", **given))
    ((key, value),) = given.items()
    with pytest.raises(
        TitanliteError, match=rf"^{key}={value} but the checkpoint .* has {has}: drop --{key} "
    ):
        trainer_for(cfg)


def test_experts_asked_of_a_dense_checkpoint_are_refused_in_one_line(data_dir, tmp_path):
    write_checkpoint(tmp_path / "hf", tie=False)
    cfg = load_config(
        None, overrides(data_dir, tmp_path, tmp_path / "hf", **{"model.n_experts": 4})
    )
    with pytest.raises(
        TitanliteError, match=r"^model\.n_experts=4 but the checkpoint .* has no experts"
    ):
        trainer_for(cfg)
