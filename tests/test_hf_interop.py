"""titanlite ↔ Hugging Face LlamaForCausalLM: same weights must give the same numbers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import titanlite  # noqa: F401  (first: quiet torchao before transformers imports it)
from titanlite import TitanliteError
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.formats.export import from_hf, to_hf, to_hf_config, to_hf_model
from titanlite.tools.formats.hf_names import hf_name
from titanlite.tools.formats.hf_start import from_hf_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second OpenMP thread buys nothing, and on a busy 2-core
    machine it turns a 2 ms forward into hundreds of ms of waiting at barriers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def random_model(seed: int = 0, **overrides):
    """Debug preset with *every* weight random, norms included: with the default all-ones
    norms a swapped input/post-attention norm, or a wrong name map, would go unnoticed."""
    torch.manual_seed(seed)
    model = build_model(ModelArgs.preset("debug", init_std=0.1, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def tokens(model, batch=2, seq=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.args.vocab_size, (batch, seq), generator=g)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # tied embeddings, GQA (4 query heads, 2 KV heads)
        {"tie_embeddings": False},  # separate lm_head
        {"n_kv_heads": 4},  # plain multi-head attention
        {"n_kv_heads": 1},  # multi-query attention
        {"rope_scaling": LLAMA3_SCALING},  # Llama 3.1 long-context RoPE
    ],
    ids=["tied-gqa", "untied", "mha", "mqa", "llama3-rope"],
)
def test_logits_match_hf(overrides):
    model = random_model(**overrides).eval()
    hf = to_hf_model(model)
    x = tokens(model)
    with torch.no_grad():
        ours, theirs = model(x), hf(input_ids=x).logits
    assert ours.std() > 0.1  # logits far from zero, so 1e-4 is a real tolerance
    assert (ours - theirs).abs().max().item() < 1e-4


def test_llama3_rope_scaling_is_not_a_no_op():
    """Control for the llama3 case above: ignoring the scaling must break parity."""
    scaled = random_model(rope_scaling=LLAMA3_SCALING).eval()
    plain = random_model().eval()
    plain.load_state_dict(scaled.state_dict())
    x = tokens(plain)
    with torch.no_grad():
        diff = (plain(x) - to_hf_model(scaled)(input_ids=x).logits).abs().max().item()
    assert diff > 1e-3


@pytest.mark.parametrize("tie", [True, False])
def test_loss_and_gradients_match_hf(tie):
    model = random_model(tie_embeddings=tie).train()
    hf = to_hf_model(model).train()
    x = tokens(model, seq=33)
    inp, tgt = x[:, :-1], x[:, 1:]
    V = model.args.vocab_size
    ours = F.cross_entropy(model(inp).reshape(-1, V), tgt.reshape(-1))
    theirs = F.cross_entropy(
        hf(input_ids=inp, use_cache=False).logits.reshape(-1, V), tgt.reshape(-1)
    )
    assert abs(ours.item() - theirs.item()) < 1e-5
    # HF's built-in loss (labels = input_ids, shifted inside) is the same mean CE over
    # the T-1 positions that have a next token.
    hf_loss = hf(input_ids=x, labels=x, use_cache=False).loss
    with torch.no_grad():
        full = F.cross_entropy(model(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
    assert abs(full.item() - hf_loss.item()) < 1e-5
    ours.backward()
    theirs.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        g_ref = hf_params[hf_name(name)].grad
        assert torch.allclose(p.grad, g_ref, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-rope"])
def test_directory_round_trip(tmp_path, rope_scaling):
    model = random_model(tie_embeddings=False, rope_scaling=rope_scaling).eval()
    out = to_hf(model, tmp_path / "hf")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    # The legacy keys that transformers 4.x and llama.cpp's converter read.
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == model.args.rope_theta
    assert written["rope_scaling"] == rope_scaling

    # transformers itself, offline, reads what we wrote.
    hf = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True)
    cfg = hf.config
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.head_dim) == (2, 192, 16)
    assert cfg.rms_norm_eps == model.args.norm_eps and cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == model.args.max_seq_len
    x = tokens(model)
    with torch.no_grad():
        assert (model(x) - hf(input_ids=x).logits).abs().max().item() < 1e-4

    back = from_hf(out)
    assert back.args == model.args
    sd, sd_back = model.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys()
    assert all(torch.equal(sd[k], sd_back[k]) for k in sd)


def test_tied_round_trip_keeps_the_tie(tmp_path):
    model = random_model(tie_embeddings=True)
    back = from_hf(to_hf(model, tmp_path))
    assert back.output.weight is back.tok_embeddings.weight
    assert torch.equal(back.tok_embeddings.weight, model.tok_embeddings.weight)
    assert torch.equal(back.rope_cos, model.rope_cos) and torch.equal(back.rope_sin, model.rope_sin)


def test_from_in_memory_hf_model_copies():
    config = to_hf_config(ModelArgs.preset("debug", tie_embeddings=False))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    model = from_hf(hf).eval()
    x = tokens(model)
    with torch.no_grad():
        assert (model(x) - hf(input_ids=x).logits).abs().max().item() < 1e-4
        model.norm.weight.add_(1.0)  # must not leak into the HF model
    assert torch.equal(hf.model.norm.weight, torch.ones_like(hf.model.norm.weight))


def test_bf16_export(tmp_path):
    out = to_hf(random_model(), tmp_path, dtype=torch.bfloat16)
    back = from_hf(out)
    assert back.tok_embeddings.weight.dtype == torch.bfloat16
    assert from_hf(out, dtype=torch.float32).norm.weight.dtype == torch.float32


def test_tokenizer_saved_alongside(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]),
    )
    out = to_hf(random_model(), tmp_path, tokenizer=tok)
    loaded = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert loaded("the lazy dog")["input_ids"] == tok.encode("the lazy dog").ids
    with pytest.raises(TitanliteError, match="vocab_size"):
        to_hf(random_model(vocab_size=len(loaded) - 1), tmp_path / "small-vocab", tokenizer=tok)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"attention_bias": True}, "bias"),
        ({"mlp_bias": True}, "bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 32}, "head_dim"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "yarn",
        ),
    ],
)
def test_unsupported_configs_are_refused(change, words):
    config = to_hf_config(ModelArgs.preset("debug"), **change)
    with pytest.raises(TitanliteError, match=words):
        from_hf_config(config)


def test_non_llama_architecture_is_refused():
    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with pytest.raises(TitanliteError, match="model_type 'llama'"):
        from_hf_config(config)


def test_bad_sources_are_refused(tmp_path):
    with pytest.raises(TitanliteError, match="config.json"):
        from_hf(tmp_path)
    with pytest.raises(TitanliteError, match="LlamaForCausalLM"):
        from_hf(42)
    with pytest.raises(TitanliteError, match="no Hugging Face name"):
        hf_name("layers.0.attention.qkv.weight")


def test_bench_vs_hf_runs_the_same_work(capsys):
    """The benchmark's two sides must compute the same loss (no timings are checked)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_vs_hf.py"
    spec = importlib.util.spec_from_file_location("bench_vs_hf", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(
        [
            "--preset",
            "debug",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--threads",
            "1",
            "--data",
            "random",
        ]
    )
    losses = list(out["first_loss"].values())
    assert abs(losses[0] - losses[1]) < 1e-5
    assert set(out["tokens_per_s"]) == {"titanlite", "HF Llama (sdpa)"}
    assert "ratio titanlite / HF" in capsys.readouterr().out
