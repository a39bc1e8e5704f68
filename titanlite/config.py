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
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TitanliteError, closest


@dataclass
class ModelSection:
    preset: str = "debug"  # debug | small | 125M | 1B | 8B (titanlite.models.PRESETS)
    # Overrides of the preset; None keeps the preset's value.
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    # None: the tokenizer's vocabulary size (debug/small), or the preset's (125M/1B/8B).
    vocab_size: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None


@dataclass
class DataSection:
    dataset: str = "pydoc"  # pydoc (offline) | tinyshakespeare | file:<path> | hf:<name>[:<config>]
    path: str | None = None  # local file/folder for dataset="file"
    tokenizer: str | None = None  # None: train (and cache) a BPE tokenizer on the corpus
    vocab_size: int = 4096  # of the tokenizer trained when tokenizer is None
    val_fraction: float = 0.05
    data_dir: str | None = None  # caches; None: <repo>/data or ~/.cache/titanlite/data
    max_chars: int | None = None  # cap on the corpus size (for hf: datasets)


@dataclass
class TrainingSection:
    steps: int = 200  # optimizer steps
    batch_size: int = 8  # micro-batch: sequences per forward/backward (per process)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    global_batch_size: int | None = None  # alternative: micro × accum × dp; accum is derived
    seq_len: int = 128
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms + fixed seeds everywhere
    device: str = "auto"  # auto (cuda → mps → cpu) | cuda | cuda:N | mps | cpu
    dtype: str = "float32"  # parameter (and optimizer state) dtype
    mixed_precision: str = "fp32"  # autocast compute dtype: fp32 | bf16 | fp16 (+ GradScaler)
    threads: int | None = None  # CPU intra-op threads; None keeps torch's default


@dataclass
class OptimizerSection:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class SchedulerSection:
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | linear | constant (after warm-up)
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak lr


@dataclass
class ParallelSection:
    # Degrees multiply to the number of processes (torchrun --nproc-per-node × nodes).
    dp_replicate: int = 1  # full model copies averaging gradients (DDP; HSDP with dp_shard > 1)
    dp_shard: int = -1  # ranks sharding params/grads/optimizer (FSDP); -1: all ranks left over
    backend: str = "auto"  # auto (nccl on CUDA, gloo otherwise) | gloo | nccl
    timeout_s: float = 300.0  # a collective waiting longer than this fails the job (hung peer)
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    reshard_after_forward: str = "default"  # FSDP: default | always | never (ZeRO-2-like)
    param_dtype: str = "float32"  # FSDP all-gather/compute dtype: float32 | bfloat16
    reduce_dtype: str = "float32"  # FSDP gradient reduce-scatter dtype: float32 | bfloat16
    cpu_offload: bool = False  # FSDP: sharded params, grads and optimizer step on the CPU
    tp: int = 1  # tensor-parallel degree: every matmul split over this many ranks
    sequence_parallel: bool = True  # TP: norms and residual stream split over the sequence (not with pp > 1)
    loss_parallel: bool = True  # TP: cross-entropy on vocabulary-sharded logits (not with pp > 1)
    pp: int = 1  # pipeline-parallel degree: the layers split into stages over this many ranks
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | interleaved_zb | zbv
    pp_microbatches: int | None = None  # micro-batches per pipeline step; None: 2 × stages
    pp_stages_per_rank: int | None = None  # interleaved schedules: stages per rank (None: 2)


@dataclass
class ActivationCheckpointSection:
    mode: str = "none"  # none | full | selective (every N-th block) | op (save matmuls only)
    every: int = 2  # selective: checkpoint blocks 0, N, 2N, ...


@dataclass
class CompileSection:
    enable: bool = False
    scope: str = "regional"  # regional (each transformer block) | model (the whole model)
    fallback: bool = True  # if compiling fails here, warn once and train eagerly
    backend: str = "inductor"  # torch.compile backend (aot_eager: no code generation, e.g. on MPS)


@dataclass
class Float8Section:
    enable: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise (torchao recipe names)
    min_dim: int = 64  # skip Linear layers with a side below this: too small to gain from FP8
    emulate: str = "auto"  # auto (real on CUDA SM >= 8.9, emulated elsewhere) | true | false
    fsdp_all_gather: bool = False  # FSDP all-gathers FP8 weights (tensorwise recipe only)


@dataclass
class EvalSection:
    every: int = 50  # validation loss every N steps (and at the end); 0 disables
    batches: int = 8  # validation batches per evaluation (the same ones each time)
    sample_every: int = 0  # print a text sample every N steps; 0: only before and after
    sample_tokens: int = 48
    prompt: str = "The "


@dataclass
class MetricsSection:
    log_dir: str = "runs"
    run_name: str | None = None  # None: <preset>-<timestamp>
    log_every: int = 1
    tensorboard: bool = False
    progress: bool = True  # tqdm bar in terminals
    peak: str = "auto"  # MFU denominator: auto | measured | datasheet


@dataclass
class FaultSection:
    kind: str = "none"  # none | exception | kill | hang | slow (titanlite.resilience.faults)
    rank: int = 0  # which rank fails
    step: int = 1  # at the start of this step (1-based); slow: from this step on
    slow_s: float = 0.5  # slow: extra seconds per step
    once: bool = True  # only in the first `attempts` attempts, so a restarted job can finish
    attempts: int = 1  # with once: how many attempts fail (attempt k at step + k*step_gap)
    step_gap: int = 0
    during: str = "step"  # step: as the step begins | save: while a checkpoint is being saved


@dataclass
class CheckpointSection:
    enable: bool = False
    folder: str | None = None  # None: <run dir>/checkpoints
    every: int = 0  # save every N steps, and after the last step; 0: only after the last
    mode: str = "sync"  # sync | async (background thread) | async_process (background process)
    keep_latest_k: int = 2  # committed checkpoints kept; 0 keeps all
    resume: bool = True  # start from the newest committed checkpoint in `folder`, if any
    load: str | None = None  # or from this checkpoint (e.g. another run's; resharded on load)
    verify: str = "crc"  # before loading, check every file's size and CRC-32 | only "size"


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        _check_positive(self, "training.steps", "training.batch_size", "training.seq_len",
                        "training.grad_accum_steps", "data.vocab_size", "optimizer.lr",
                        "eval.batches", "metrics.log_every", "activation_checkpoint.every",
                        "float8.min_dim")
        _check_nonnegative(self, "training.grad_clip", "scheduler.warmup_steps", "eval.every",
                           "eval.sample_every", "optimizer.weight_decay")
        if not 0 < self.data.val_fraction < 1:
            raise TitanliteError(f"data.val_fraction must be between 0 and 1, got "
                                 f"{self.data.val_fraction}: e.g. --data.val_fraction 0.05")
        _check_choice("scheduler.decay", self.scheduler.decay, ("cosine", "linear", "constant"))
        _check_choice("metrics.peak", self.metrics.peak, ("auto", "measured", "datasheet"))
        _check_choice("training.mixed_precision", self.training.mixed_precision, ("fp32", "bf16", "fp16"))
        _check_choice("activation_checkpoint.mode", self.activation_checkpoint.mode,
                      ("none", "full", "selective", "op"))
        _check_choice("compile.scope", self.compile.scope, ("regional", "model"))
        _check_choice("float8.recipe", self.float8.recipe, ("tensorwise", "rowwise"))
        _check_choice("float8.emulate", self.float8.emulate, ("auto", "true", "false"))
        _check_choice("fault.kind", self.fault.kind, ("none", "exception", "kill", "hang", "slow"))
        _check_choice("fault.during", self.fault.during, ("step", "save"))
        _check_choice("checkpoint.mode", self.checkpoint.mode, ("sync", "async", "async_process"))
        _check_choice("checkpoint.verify", self.checkpoint.verify, ("crc", "size"))
        _check_nonnegative(self, "checkpoint.every", "checkpoint.keep_latest_k", "fault.step_gap")
        _check_positive(self, "fault.attempts")
        p = self.parallel
        _check_choice("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
        _check_choice("parallel.reshard_after_forward", p.reshard_after_forward, ("default", "always", "never"))
        _check_choice("parallel.param_dtype", p.param_dtype, ("float32", "bfloat16"))
        _check_choice("parallel.reduce_dtype", p.reduce_dtype, ("float32", "bfloat16"))
        _check_positive(self, "parallel.dp_replicate", "parallel.timeout_s", "parallel.bucket_cap_mb",
                        "parallel.tp", "parallel.pp")
        _check_choice("parallel.pp_schedule", p.pp_schedule,
                      ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"))
        if p.dp_shard == 0 or p.dp_shard < -1:
            raise TitanliteError(f"parallel.dp_shard must be positive or -1 (all ranks left over), "
                                 f"got {p.dp_shard}")
        return self


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
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    raise TitanliteError(f"{dotted} must be {names.get(tp, tp)}"
                         f"{' or none' if optional else ''}, got {value!r}")


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _check_positive(cfg: Config, *keys: str) -> None:
    for k in keys:
        if _get(cfg, k) <= 0:
            raise TitanliteError(f"{k} must be positive, got {_get(cfg, k)}: e.g. --{k} "
                                 f"{_get(Config(), k)}")


def _check_nonnegative(cfg: Config, *keys: str) -> None:
    for k in keys:
        if _get(cfg, k) < 0:
            raise TitanliteError(f"{k} must be zero or positive, got {_get(cfg, k)}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TitanliteError(f"{key}='{value}' is not one of {', '.join(choices)}{closest(value, choices)}")
