"""From a distributed checkpoint to files anyone can load: one torch file, or Hugging Face.

A DCP checkpoint is many files (one per rank) plus an index; `dcp.load` in one process reads
the pieces back into whole tensors, whatever layout wrote them. That is all an export is:

    model = load_model(ckpt)                   # a plain Transformer on CPU
    export_torch(ckpt, "model.pt")             # its weights, one torch.save file
    export_torch(ckpt, "state.pt", full=True)  # the whole training state (torch's dcp_to_torch_save)
    export_hf(ckpt, "hf-model/")               # LlamaForCausalLM + tokenizer, for transformers

The Hugging Face bridge itself: `to_hf(model, dir)` writes a directory
`LlamaForCausalLM.from_pretrained` loads, `from_hf(dir or model)` reads one back into a
titanlite Transformer, `to_hf_model(model)` builds it in memory for side-by-side checks. The
names and config translation are shared with starting a run from a published model
(titanlite/tools/hf_start.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from ...errors import TitanliteError, writing
from ...models.llama import ModelArgs, Transformer, build_model
from ...models.rope import rope_cache
from ...paths import check_output_dir
from ...resilience.checkpoint_files import RawReader, dcp_load, verify
from .hf_names import decoder_config, hf_name, titanlite_name
from .hf_start import from_hf_config, read_hf_config

TOKENIZER_DIR = "tokenizer"  # the trainer keeps a copy beside its checkpoints


def check_new_output(path: str | Path, what: str, source: str | Path | None = None) -> Path:
    """`path` can be written as a file (an existing file is replaced, a folder never is), and is
    not inside `source` (what the export reads) or a run or checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        raise TitanliteError(
            f"{what} '{path}' is an existing folder, not a file: name a file "
            f"inside it, e.g. '{path / 'model.pt'}'"
        )
    check_output_dir(path.parent, f"the folder of {what}")
    check_not_into_work(path.parent, what, source)
    return path


# What a run folder or a checkpoint holds: an export never writes beside these.
_WORK_MARKERS = ("run.json", "metrics.jsonl", "titanlite.json", ".metadata")
# What an export folder holds: a folder of only these may be replaced by a new export.
_EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model.*\.safetensors(\.index\.json)?|tokenizer.*|"
    r"special_tokens_map\.json|chat_template\.j(inja|son)"
)


def check_not_into_work(out: str | Path, what: str, source: str | Path | None = None) -> None:
    """Refuse, before anything is written, an output folder that is the export's own input (or
    inside it), or that holds a run or a checkpoint: an export never writes over work. (A folder
    that holds the input further down is refused by `new_folder`: it holds other files.)"""
    out = Path(out).resolve()
    if source is not None:
        src = Path(source).resolve()
        if out == src or src in out.parents:
            raise TitanliteError(
                f"{what} '{out}' would write into what it exports from ('{src}'): "
                f"choose a folder outside it, e.g. '{src.parent / (src.name + '-hf')}'"
            )
    for folder in (out, *out.parents):
        held = [m for m in _WORK_MARKERS if (folder / m).exists()] + [
            p.name for p in folder.glob("step-????????*")
        ]
        if held:
            kind = "a checkpoint" if set(held) - {"run.json", "metrics.jsonl"} else "a run"
            raise TitanliteError(
                f"{what} '{out}' is inside '{folder}', which holds {kind} ({', '.join(held[:3])}): "
                f"choose a folder outside any run or checkpoint"
            )


@contextlib.contextmanager
def new_folder(out: str | Path, what: str):
    """Yield a temporary folder beside `out`; when the block succeeds it becomes `out` (a previous
    export there is replaced), and when it fails it is removed: `out` is whole or as it was."""
    out = Path(out)
    if out.is_dir() and (
        others := [p.name for p in out.iterdir() if not _EXPORT_FILES.fullmatch(p.name)]
    ):
        raise TitanliteError(
            f"{what} '{out}' holds other files ({', '.join(sorted(others)[:3])}): choose a new or "
            f"empty folder (an earlier export there would be replaced)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(out, what):
            tmp.mkdir()
            yield tmp
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            if out.exists():
                os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def new_file(out: Path, what: str):
    """Yield a temporary path beside `out`; it becomes `out` only when the block succeeds."""
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        with writing(out, what):
            yield tmp
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def load_model(path: str | Path, crc: bool = True) -> Transformer:
    """The model of a committed checkpoint, whole, in this process (no process group)."""
    info = verify(path, crc=crc)
    model = build_model(ModelArgs(**info["model_args"]), "cpu")
    state = {"model": model.state_dict()}
    dcp_load(state, Path(path), crc_checked=crc, no_dist=True)  # quiet; one line if it fails
    model.load_state_dict(state["model"])
    return model


def export_torch(path: str | Path, out_file: str | Path, full: bool = False) -> Path:
    out_file = check_new_output(out_file, "export target", source=path)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    if full:
        from ..._compat.torch_tools import load_whole_dcp_state

        verify(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = load_whole_dcp_state(RawReader(path))
    else:
        state = load_model(path).state_dict()
    # through a Python file: torch.save's own C++ stream turns a full disk into "iostream error"
    with new_file(out_file, "the export") as tmp, open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return out_file


def export_hf(path: str | Path, out_dir: str | Path, tokenizer=None) -> Path:
    """A Hugging Face directory (config, safetensors, tokenizer when one is known)."""
    check_output_dir(out_dir, "export folder")  # before the (long) load, not after
    check_not_into_work(out_dir, "export folder", source=path)
    if tokenizer is None and (Path(path).parent / TOKENIZER_DIR).is_dir():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(Path(path).parent / TOKENIZER_DIR))
    return to_hf(load_model(path), out_dir, tokenizer=tokenizer)


# ----- the Hugging Face bridge --------------------------------------------------------
def to_hf_config(args: ModelArgs, **extra):
    """ModelArgs → `LlamaConfig`; `extra` (e.g. bos_token_id) is passed through."""
    from transformers import LlamaConfig

    kw = decoder_config(args) | dict(attention_bias=False, mlp_bias=False, attention_dropout=0.0)
    return LlamaConfig(**kw | extra)


# ----- models -------------------------------------------------------------------------
def to_hf_model(model: Transformer, dtype: torch.dtype | None = None):
    """A `LlamaForCausalLM` (sdpa attention) holding copies of `model`'s weights."""
    from transformers import LlamaForCausalLM

    if model.args.moe is not None:  # experts: Hugging Face's Mixtral (tools/formats/hf_moe.py)
        from transformers import MixtralForCausalLM

        from .hf_moe import check_mixtral, to_mixtral_config, to_mixtral_state

        check_mixtral(model)
        state = to_mixtral_state(model, hf_name, dtype)
        return adopt(MixtralForCausalLM, to_mixtral_config(model.args), state)
    sd = {
        hf_name(k): v.detach().clone().to(dtype or v.dtype) for k, v in model.state_dict().items()
    }
    return adopt(LlamaForCausalLM, to_hf_config(model.args), sd)


def adopt(hf_class, config, state: dict):
    """An `hf_class` model holding the tensors of `state` (Hugging Face names): built on meta, so
    nothing is initialised only to be overwritten, then each tensor adopted as it is."""
    with torch.device("meta"):
        hf = hf_class(config)
    tied = config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)  # re-tied to embed_tokens just below
    hf.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # The rotary inverse frequencies are a non-persistent buffer: rebuild it off meta.
    device = next(iter(state.values())).device
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    leftover = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if leftover:
        raise TitanliteError(
            f"internal: HF tensors left unset after conversion: {leftover}; "
            f"this transformers version lays out {hf_class.__name__} differently"
        )
    return hf.eval()


def to_hf(model: Transformer, out_dir, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write a `LlamaForCausalLM` directory (config.json + model.safetensors [+ tokenizer]): all of
    it or, if anything fails (a full disk), nothing (tools: `new_folder`)."""
    out = check_output_dir(out_dir, "Hugging Face output folder")
    check_not_into_work(out, "Hugging Face output folder")
    hf = to_hf_model(model, dtype=dtype)
    if tokenizer is not None:
        tokenizer = _as_hf_tokenizer(tokenizer)
        if len(tokenizer) > model.args.vocab_size:
            raise TitanliteError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                f"{model.args.vocab_size}: export the tokenizer the model was trained with"
            )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf.config, key, getattr(tokenizer, key, None))
    with new_folder(out, "the Hugging Face export") as tmp, _no_progress_bars():
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        hf.save_pretrained(tmp, safe_serialization=True)
        _add_legacy_rope_keys(tmp / "config.json")
    return out


@contextlib.contextmanager
def _no_progress_bars():
    """transformers 5 draws a "Writing model shards" bar for one small file: noise on stderr."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _add_legacy_rope_keys(config_json: Path) -> None:
    """transformers 5 writes RoPE settings only as `rope_parameters`; transformers 4.x and
    tools such as llama.cpp's converter read `rope_theta` / `rope_scaling` and would silently
    fall back to theta=10000. Writing both keeps the directory right for every reader (5.x
    ignores the legacy keys when `rope_parameters` is present)."""
    cfg = json.loads(config_json.read_text())
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in cfg:
        return
    cfg["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    cfg["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _as_hf_tokenizer(tokenizer):
    """A raw `tokenizers.Tokenizer` becomes a `PreTrainedTokenizerFast` so AutoTokenizer loads it."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise TitanliteError(
        f"cannot save a tokenizer of type {type(tokenizer).__name__}: pass a "
        f"tokenizers.Tokenizer or a transformers tokenizer"
    )


def from_hf(
    src, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Transformer:
    """A titanlite Transformer from a HF Llama directory or an in-memory `LlamaForCausalLM`.
    dtype None keeps the checkpoint's dtype."""
    if isinstance(src, (str, Path)):
        config, tensors = _read_dir(Path(src))
    elif hasattr(src, "config") and hasattr(src, "state_dict"):
        # Copies: the two models must not share storage (training one would change the other).
        config = src.config
        tensors = {k: v.detach().clone() for k, v in src.state_dict().items()}
    else:
        raise TitanliteError(
            f"from_hf expects a directory or a LlamaForCausalLM, got {type(src).__name__}"
        )
    args = from_hf_config(config)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.moe is not None:  # Mixtral (tools/formats/hf_moe.py)
        from .hf_moe import from_mixtral_state

        sd = from_mixtral_state(tensors, titanlite_name)
    else:  # old checkpoints saved the derived rotary buffer: dropped above
        sd = {titanlite_name(k): v for k, v in tensors.items()}
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    with torch.device("meta"):
        model = Transformer(args)
    # The routers' bias (Mixtral has none: zero) and load counter are buffers set here.
    extra = {k: torch.zeros(v.shape) for k, v in model.state_dict().items() if "expert" in k}
    sd.update({k: v for k, v in extra.items() if k.endswith("expert_bias")})
    expected = {k for k in model.state_dict() if not (args.tie_embeddings and k == "output.weight")}
    if set(sd) != expected:
        missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
        raise TitanliteError(
            f"checkpoint does not match its config: missing {missing[:4]}, "
            f"unexpected {extra[:4]}; is the directory complete?"
        )
    dtype = dtype or next(iter(sd.values())).dtype
    model.load_state_dict(
        {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=False, assign=True
    )
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # The rotary tables are derived, non-persistent buffers: compute them (still on meta).
    model.rope_cos, model.rope_sin = rope_cache(args, device=device)
    for router in (m for m in model.modules() if hasattr(m, "tokens_per_expert")):
        router.tokens_per_expert = torch.zeros(args.moe.n_experts, device=device)
        router.load = torch.zeros(args.moe.n_experts)
    return model


def _read_dir(path: Path):
    """(LlamaConfig, {name: tensor}) from a save_pretrained directory, via safetensors so no
    second full HF model is built in memory."""
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    from safetensors.torch import load_file

    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return config, tensors
