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


def write_checkpoint(folder, tie: bool, seed: int = 0, **changes):
    """A random transformers Llama plus a tiny trained BPE tokenizer, as on the Hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    cfg.update(changes)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
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
