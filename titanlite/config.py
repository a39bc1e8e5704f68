"""Run configuration: dataclasses, TOML files, dotted overrides.

    cfg = load_config("configs/debug.toml", ["--training.steps", "50"])
    cfg = Config(); cfg.training.steps = 50          # the same from Python

Every key is checked: an unknown key names the closest valid ones, a wrong type says which
type was expected, and impossible values (non-positive steps, ...) are refused before any
work starts. Sections mirror torchtitan's job config, trimmed to what titanlite teaches.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TitanliteError, closest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib


# ----- what each key accepts -----------------------------------------------------------------
# Declared beside each field (dataclass metadata) and checked by Config.validate, so a bad
# value is refused in one line before any work starts, never by a torch constructor later.

INF = math.inf


def ranged(default, interval: str, also: tuple = ()):
    """A number in `interval`, written as in maths: "[1, inf)", "(0, 1]"; `also`: extra
    allowed values outside it (dp_shard's -1). Floats must be finite whatever the interval."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return field(default=default, metadata={"range": Range(lo, hi, interval[0] == "(",
                                                           interval[-1] == ")", also, interval)})


def one_of(*choices: str):
    """One of `choices`; the first is the default."""
    return field(default=choices[0], metadata={"choices": choices})


def matching(default: str, regex: str, shape: str, example: str | None = None):
    """A string matching `regex` in full; `shape` says which in words; `example` is the value an
    error message suggests where the default (say, "" for off) would not show the shape."""
    meta = {"pattern": (regex, shape)} | ({"example": example} if example is not None else {})
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    also: tuple
    text: str

    def admits(self, v) -> bool:
        if v in self.also:
            return True
        if not math.isfinite(v):
            return False
        return (self.lo < v if self.lo_open else self.lo <= v) and \
               (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        if self.hi == INF and (self.lo, self.lo_open) in ((0, True), (1, False)):
            words = "positive"
        elif self.hi == INF and (self.lo, self.lo_open) == (0, False):
            words = "zero or positive"
        elif self.hi == INF:
            words = f"> {_num(self.lo)}" if self.lo_open else f">= {_num(self.lo)}"
        else:
            words = f"between {_num(self.lo)} and {_num(self.hi)}, in {self.text}"
        return words + "".join(f" or {a}" for a in self.also)


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() else str(x)


@dataclass
class ModelSection:
    # debug | small | 125M | 1B | 8B (titanlite.models.PRESETS)
    preset: str = one_of("debug", "small", "125M", "1B", "8B")
    # Overrides of the preset; None keeps the preset's value.
    dim: int | None = ranged(None, "[1, inf)")
    n_layers: int | None = ranged(None, "[1, inf)")
    n_heads: int | None = ranged(None, "[1, inf)")
    n_kv_heads: int | None = ranged(None, "[1, inf)")
    # None: the tokenizer's vocabulary size (debug/small), or the preset's (125M/1B/8B).
    vocab_size: int | None = ranged(None, "[1, inf)")
    max_seq_len: int | None = ranged(None, "[1, inf)")
    tie_embeddings: bool | None = None


@dataclass
class DataSection:
    # pydoc (offline) | tinyshakespeare | file:<path> | hf:<name>[:<config>] | file / hf with path
    dataset: str = matching("pydoc", r"pydoc|tinyshakespeare|file|hf|file:.+|hf:.+",
                            "pydoc, tinyshakespeare, file:<path> or hf:<name>[:<config>]")
    path: str | None = None  # local file/folder for dataset="file"
    tokenizer: str | None = None  # None: train (and cache) a BPE tokenizer on the corpus
    # Of the tokenizer trained when tokenizer is None: 256 bytes + 3 special tokens at least.
    vocab_size: int = ranged(4096, "[259, inf)")
    val_fraction: float = ranged(0.05, "(0, 1)")
    data_dir: str | None = None  # caches; None: <repo>/data or ~/.cache/titanlite/data
    max_chars: int | None = ranged(None, "[1, inf)")  # cap on the corpus size (for hf: datasets)


@dataclass
class TrainingSection:
    steps: int = ranged(200, "[1, inf)")  # optimizer steps
    batch_size: int = ranged(8, "[1, inf)")  # micro-batch: sequences per forward/backward (per process)
    grad_accum_steps: int = ranged(1, "[1, inf)")  # micro-batches per optimizer step
    # alternative: micro × accum × dp; accum is derived
    global_batch_size: int | None = ranged(None, "[1, inf)")
    seq_len: int = ranged(128, "[1, inf)")
    grad_clip: float = ranged(1.0, "[0, inf)")  # max global grad norm; 0 disables clipping
    seed: int = ranged(0, "[0, 4294967295]")  # numpy and the data pipeline take 32-bit seeds
    deterministic: bool = False  # torch.use_deterministic_algorithms + fixed seeds everywhere
    device: str = matching("auto", r"auto|cpu|mps|cuda(:\d+)?", "auto, cuda, cuda:N, mps or cpu")
    # parameter (and optimizer state) dtype
    dtype: str = one_of("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
    # autocast dtype: auto (cuda: bf16, fp16 before SM 8.0; cpu/mps: fp32) | fp32 | bf16 | fp16 (+ GradScaler)
    mixed_precision: str = one_of("auto", "fp32", "bf16", "fp16")
    threads: int | None = ranged(None, "[1, inf)")  # CPU intra-op threads; None keeps torch's default


@dataclass
class OptimizerSection:
    lr: float = ranged(3e-3, "(0, inf)")
    weight_decay: float = ranged(0.1, "[0, inf)")
    beta1: float = ranged(0.9, "[0, 1)")  # AdamW's moment decays: 1 would never forget
    beta2: float = ranged(0.95, "[0, 1)")
    eps: float = ranged(1e-8, "(0, inf)")


@dataclass
class SchedulerSection:
    warmup_steps: int = ranged(20, "[0, inf)")
    decay: str = one_of("cosine", "linear", "constant")  # after warm-up
    min_lr_ratio: float = ranged(0.1, "[0, 1]")  # final lr as a fraction of the peak lr


@dataclass
class ParallelSection:
    # Degrees multiply to the number of processes (torchrun --nproc-per-node × nodes).
    # full model copies averaging gradients (DDP; HSDP with dp_shard > 1)
    dp_replicate: int = ranged(1, "[1, inf)")
    # ranks sharding params/grads/optimizer (FSDP); -1: all ranks left over
    dp_shard: int = ranged(-1, "[1, inf)", also=(-1,))
    backend: str = one_of("auto", "gloo", "nccl")  # auto: nccl on CUDA, gloo otherwise
    # a collective waiting longer than this fails the job (hung peer)
    timeout_s: float = ranged(300.0, "(0, inf)")
    bucket_cap_mb: float = ranged(25.0, "(0, inf)")  # DDP gradient bucket size
    reshard_after_forward: str = one_of("default", "always", "never")  # FSDP; never: ZeRO-2-like
    param_dtype: str = one_of("float32", "bfloat16")  # FSDP all-gather/compute dtype
    reduce_dtype: str = one_of("float32", "bfloat16")  # FSDP gradient reduce-scatter dtype
    cpu_offload: bool = False  # FSDP: sharded params, grads and optimizer step on the CPU
    tp: int = ranged(1, "[1, inf)")  # tensor-parallel degree: every matmul split over this many ranks
    sequence_parallel: bool = True  # TP: norms and residual stream split over the sequence (not with pp > 1)
    loss_parallel: bool = True  # TP: cross-entropy on vocabulary-sharded logits (not with pp > 1)
    pp: int = ranged(1, "[1, inf)")  # pipeline-parallel degree: the layers split into stages over this many ranks
    pp_schedule: str = one_of("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv")
    pp_microbatches: int | None = ranged(None, "[1, inf)")  # micro-batches per pipeline step; None: 2 × stages
    pp_stages_per_rank: int | None = ranged(None, "[1, inf)")  # interleaved schedules: stages per rank (None: 2)


@dataclass
class ActivationCheckpointSection:
    # none | full | selective (every N-th block) | op (save matmuls only)
    mode: str = one_of("none", "full", "selective", "op")
    every: int = ranged(2, "[1, inf)")  # selective: checkpoint blocks 0, N, 2N, ...


@dataclass
class CompileSection:
    enable: bool = False
    scope: str = one_of("regional", "model")  # regional: each transformer block
    fallback: bool = True  # if compiling fails here, warn once and train eagerly
    # torch.compile backend (aot_eager: no code generation, e.g. on MPS); a registered name
    backend: str = matching("inductor", r"[A-Za-z_][A-Za-z0-9_.]*",
                            "a torch.compile backend name such as inductor, aot_eager or eager")


@dataclass
class Float8Section:
    enable: bool = False
    recipe: str = one_of("tensorwise", "rowwise")  # torchao recipe names
    # skip Linear layers with a side below this: too small to gain from FP8
    min_dim: int = ranged(64, "[1, inf)")
    # auto: real on CUDA SM >= 8.9, emulated elsewhere
    emulate: str = one_of("auto", "true", "false")
    fsdp_all_gather: bool = False  # FSDP all-gathers FP8 weights (tensorwise recipe only)


@dataclass
class EvalSection:
    every: int = ranged(50, "[0, inf)")  # validation loss every N steps (and at the end); 0 disables
    batches: int = ranged(8, "[1, inf)")  # validation batches per evaluation (the same ones each time)
    sample_every: int = ranged(0, "[0, inf)")  # print a text sample every N steps; 0: only before and after
    sample_tokens: int = ranged(48, "[1, inf)")
    prompt: str = matching("The ", r"(?s).+", "some text to continue")


@dataclass
class MetricsSection:
    log_dir: str = matching("runs", r"(?s).+", "a folder, e.g. runs")
    # None: <preset>-<timestamp>; a plain name: it becomes a folder in log_dir
    run_name: str | None = matching(None, r"(?!\.\.?$)[^/\\]+", "a name without / (a folder in log_dir)")
    log_every: int = ranged(1, "[1, inf)")
    tensorboard: bool = False
    progress: bool = True  # tqdm bar in terminals
    peak: str = one_of("auto", "measured", "datasheet")  # the MFU denominator


@dataclass
class FaultSection:
    kind: str = one_of("none", "exception", "kill", "hang", "slow")  # titanlite.resilience.faults
    rank: int = ranged(0, "[0, inf)")  # which rank fails
    step: int = ranged(1, "[1, inf)")  # at the start of this step (1-based); slow: from this step on
    slow_s: float = ranged(0.5, "[0, inf)")  # slow: extra seconds per step
    once: bool = True  # only in the first `attempts` attempts, so a restarted job can finish
    attempts: int = ranged(1, "[1, inf)")  # with once: how many attempts fail (attempt k at step + k*step_gap)
    step_gap: int = ranged(0, "[0, inf)")
    # step: as the step begins | save: while a checkpoint is being saved
    during: str = one_of("step", "save")


@dataclass
class CheckpointSection:
    enable: bool = False
    folder: str | None = None  # None: <run dir>/checkpoints
    every: int = ranged(0, "[0, inf)")  # save every N steps, and after the last step; 0: only after the last
    # sync | async (background thread) | async_process (background process)
    mode: str = one_of("sync", "async", "async_process")
    keep_latest_k: int = ranged(2, "[0, inf)")  # committed checkpoints kept; 0 keeps all
    resume: bool = True  # start from the newest committed checkpoint in `folder`, if any
    load: str | None = None  # or from this checkpoint (e.g. another run's; resharded on load)
    # Start from a Hugging Face Llama directory (config.json + *.safetensors + tokenizer.json):
    # its shape and tokenizer, fresh optimizer, step 0. A titanlite checkpoint found by resume
    # (or given as `load`) takes precedence. See titanlite/resilience/initial_load.py.
    initial_load_path: str | None = None
    # before loading, check every file's size and CRC-32 | only "size"
    verify: str = one_of("crc", "size")


@dataclass
class ProfileSection:
    # Steps run under torch.profiler (1-based, inclusive), e.g. "5-8"; empty: off. Leave the
    # first steps out: they include one-off costs (allocator warm-up, compilation).
    steps: str = matching("", r"(\d+(\s*-\s*\d+)?)?", "a step range like 5-8 within training.steps (empty: off)",
                          example="5-8")
    memory: bool = True  # also record memory: a CUDA snapshot, or the allocation timeline
    trace_dir: str | None = None  # None: <run dir>/trace


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    compile: CompileSection = field(default_factory=CompileSection)
    float8: Float8Section = field(default_factory=Float8Section)
    eval: EvalSection = field(default_factory=EvalSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    fault: FaultSection = field(default_factory=FaultSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    profile: ProfileSection = field(default_factory=ProfileSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: dict, source: str = "override") -> "Config":
        """A copy with `overrides` ({"section.key": value}) applied by `set_value`; this config
        is left as it was."""
        copy = Config(**{k: type(v)(**vars(v)) for k, v in vars(self).items()})
        for key, value in overrides.items():
            set_value(copy, key, value, source=source)
        return copy

    def validate(self) -> "Config":
        """Every key against its declared type and range (see `ranged`, `one_of`, `matching`),
        then the few rules that span keys. Raises one line naming the key and the fix."""
        for section in dataclasses.fields(self):
            for f in dataclasses.fields(getattr(self, section.name)):
                _check_field(f"{section.name}.{f.name}", getattr(getattr(self, section.name), f.name), f)
        parse_steps(self.profile.steps, self.training.steps)  # inside the run, first <= last
        return self


def parse_steps(text: str, total_steps: int) -> tuple[int, int] | None:
    """'5-8' → (5, 8); '6' → (6, 6); '' → None (off). One line naming the fix otherwise."""
    text = (text or "").strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    first, last = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not m or not 1 <= first <= last <= total_steps:
        raise TitanliteError(f"profile.steps must look like 5-8 within training.steps (1-{total_steps}), "
                             f"got {text!r}: e.g. --profile.steps {min(2, total_steps)}-{min(3, total_steps)}")
    return first, last



def _check_field(key: str, value, f: dataclasses.Field) -> None:
    tp = _field_type(Config(), key)
    optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    if value is None and optional:
        return
    ok = {bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}[base](value)
    if not ok:
        raise TitanliteError(f"{key} must be {_TYPE_NAMES[base]}, got {value!r} "
                             f"({type(value).__name__}): e.g. {key} = {_example(key, f)!r}")
    meta = f.metadata
    if "range" in meta and not meta["range"].admits(value):
        finite = "" if math.isfinite(value) or value in meta["range"].also else "a finite number "
        raise TitanliteError(f"{key} must be {finite}{meta['range'].describe()}, got {value!r}: "
                             f"e.g. --{key} {_example(key, f)}")
    if "choices" in meta and value not in meta["choices"]:
        raise TitanliteError(f"{key}='{value}' is not one of {', '.join(meta['choices'])}"
                             f"{closest(value, meta['choices'])}: e.g. --{key} {meta['choices'][0]}")
    if "pattern" in meta and not re.fullmatch(meta["pattern"][0], value):
        raise TitanliteError(f"{key} must be {meta['pattern'][1]}, got {value!r}: "
                             f"e.g. --{key} {_example(key, f)!r}")


def _example(key: str, f: dataclasses.Field):
    """The default, or a sensible value where the default is None (keep the preset's)."""
    if "example" in f.metadata:
        return f.metadata["example"]
    if f.default is not None:
        return f.default
    r = f.metadata.get("range")
    return _num(r.lo + (1 if r.lo_open else 0)) if r is not None else "none"


# ----- loading -------------------------------------------------------------------------------

def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """A Config from defaults ← TOML file ← overrides (['--a.b', 'v', ...] or {'a.b': v})."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise TitanliteError(f"config file '{p}' does not exist: pass a TOML file, "
                                 f"e.g. --config configs/debug.toml")
        try:
            doc = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TitanliteError(f"config file '{p}' is not valid TOML ({e}): fix the syntax")
        for section, values in doc.items():
            if not isinstance(values, dict):
                raise TitanliteError(f"'{section}' in {p} must be a [section] table, not a value")
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value, source=str(p))
    for key, value in _pairs(overrides):
        set_value(cfg, key, value, source="command line")
    return cfg.validate()


def _pairs(overrides) -> list[tuple[str, object]]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs, args = [], list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise TitanliteError(f"unexpected argument '{arg}': overrides look like "
                                 f"--section.key value (e.g. --training.steps 50)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif args and not args[0].startswith("--"):
            value = args.pop(0)
        elif _field_type(Config(), key) is bool:
            value = "true"  # a bare boolean flag switches it on
        else:
            raise TitanliteError(f"option --{key} needs a value, e.g. --{key} <value>")
        pairs.append((key, value))
    return pairs


def set_value(cfg: Config, dotted: str, value, source: str = "override") -> None:
    """Set cfg.<section>.<key> = value after checking the key exists and converting the type."""
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections or not key:
        all_keys = [f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(cfg, s))]
        raise TitanliteError(f"unknown config key '{dotted}' ({source}){closest(dotted, all_keys)}; "
                             f"sections are {', '.join(sections)}")
    section = getattr(cfg, section_name)
    names = [f.name for f in dataclasses.fields(section)]
    if key not in names:
        # Near misses in this section, and the same key name in another section
        # (--training.lr → optimizer.lr).
        same_name = [f"{s}.{key}" for s in sections
                     if key in [f.name for f in dataclasses.fields(getattr(cfg, s))]]
        near = difflib.get_close_matches(dotted, [f"{section_name}.{n}" for n in names], 3, 0.6)
        # A typo in this section (training.step) beats the same name elsewhere (fault.step),
        # which beats a vaguer near miss (training.lr is optimizer.lr, not training.seed).
        ratio = lambda h: difflib.SequenceMatcher(None, dotted, h).ratio()  # noqa: E731
        close = [h for h in near if ratio(h) >= 0.85]
        hits = close + [h for h in same_name + near if h not in close]
        hits = list(dict.fromkeys(hits))
        hint = f" (did you mean: {', '.join(hits[:3])}?)" if hits else ""
        raise TitanliteError(f"unknown config key '{dotted}' ({source}){hint}; "
                             f"valid keys in [{section_name}]: {', '.join(names)}")
    setattr(section, key, _convert(value, _field_type(cfg, dotted), dotted))


def _field_type(cfg: Config, dotted: str):
    section_name, _, key = dotted.partition(".")
    section = getattr(cfg, section_name, None)
    if section is None:
        return None
    hints = typing.get_type_hints(type(section))
    return hints.get(key)


def _convert(value, tp, dotted: str):
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.replace("_", ""))
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise TitanliteError(f"{dotted} must be {_TYPE_NAMES.get(tp, tp)}"
                         f"{' or none' if optional else ''}, got {value!r}")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
