"""Run configuration: dataclasses, TOML files, dotted overrides.

    cfg = load_config("configs/debug.toml", ["--training.steps", "50"])
    cfg = Config(); cfg.training.steps = 50          # the same from Python

Every key is checked: an unknown key names the closest valid ones, a wrong type says which
type was expected, and impossible values are refused before any work starts - sizes are bounded
by what is meaningful, not by what a number can hold: a million-sequence batch or a 16M-token
vocabulary is a typo (a size this machine cannot hold is preflight's memory check's to refuse).
Sections mirror torchtitan's job config, trimmed to what titanlite teaches."""

from dataclasses import dataclass, field, fields
from pathlib import Path

from .config_fields import (
    check_field,
    matching,
    one_of,
    parse_overrides,
    parse_steps,
    ranged,
    read_toml,
    set_value,
)
from .resilience.fault_tolerance_config import FaultToleranceSection


@dataclass
class ModelSection:
    preset: str = one_of("debug", "small", "125M", "1B", "8B")  # titanlite.models.llama.PRESETS
    # Overrides of the preset; None keeps the preset's value.
    dim: int | None = ranged(None, "[1, 65536]")
    n_layers: int | None = ranged(None, "[1, 1024]")
    n_heads: int | None = ranged(None, "[1, 1024]")
    n_kv_heads: int | None = ranged(None, "[1, 1024]")
    # None: tokenizer's (debug, small), else the preset's
    vocab_size: int | None = ranged(None, "[1, 16777216]")
    max_seq_len: int | None = ranged(None, "[1, 1048576]")
    tie_embeddings: bool | None = None
    n_experts: int = ranged(0, "[0, 4096]")  # mixture of experts (notebook 18); 0: dense
    experts_per_token: int = ranged(2, "[1, 4096]")  # k: the experts each token goes to
    n_shared_experts: int = ranged(0, "[0, 64]")  # experts every token goes through as well
    moe_every: int = ranged(1, "[1, 1024]")  # every N-th block is MoE, the others dense
    expert_hidden_dim: int | None = ranged(None, "[1, 1048576]")  # None: the dense FFN's width
    moe_router: str = one_of("softmax", "sigmoid")  # scores; top-k weights normalised to 1
    # aux_free: DeepSeek-V3's bias; aux_loss: Switch's balance loss; none
    moe_balance: str = one_of("aux_free", "aux_loss", "none")
    moe_aux_loss_coef: float = ranged(0.01, "[0, inf)")
    moe_bias_update: float = ranged(1e-3, "[0, inf)")  # aux_free: bias step per optimizer step
    moe_capacity_factor: float | None = ranged(None, "(0, inf)")  # None: dropless
    attention: str = one_of("auto", "sdpa", "flex")  # under a document mask; auto: flex on CUDA


@dataclass
class DataSection:
    # pydoc (offline) | tinyshakespeare | file:<path> | hf:<name>[:<config>] | file / hf with path
    dataset: str = matching(
        "pydoc",
        r"pydoc|tinyshakespeare|file|hf|file:.+|hf:.+",
        "pydoc, tinyshakespeare, file:<path> or hf:<name>[:<config>]",
    )
    path: str | None = None  # local file/folder for dataset="file"
    tokenizer: str | None = None  # None: train (and cache) a BPE tokenizer on the corpus
    vocab_size: int = ranged(4096, "[259, 1048576]")  # ours: 256 bytes + 3 specials at least
    val_fraction: float = ranged(0.05, "(0, 1)")
    data_dir: str | None = None  # caches; None: <repo>/data or ~/.cache/titanlite/data
    max_chars: int | None = ranged(None, "[1, inf)")  # cap on the corpus size (for hf: datasets)
    document_mask: bool = False  # a token attends only within its own document (block-causal)


@dataclass
class TrainingSection:
    steps: int = ranged(200, "[1, inf)")  # optimizer steps
    batch_size: int = ranged(8, "[1, 1048576]")  # micro-batch: sequences a process runs at once
    grad_accum_steps: int = ranged(1, "[1, 1048576]")  # micro-batches per optimizer step
    # alternative: micro × accum × dp; accum derived
    global_batch_size: int | None = ranged(None, "[1, 16777216]")
    seq_len: int = ranged(128, "[1, 1048576]")
    grad_clip: float = ranged(1.0, "[0, inf)")  # max global grad norm; 0 disables clipping
    seed: int = ranged(0, "[0, 4294967295]")  # numpy and the data pipeline take 32-bit seeds
    deterministic: bool = False  # torch.use_deterministic_algorithms + fixed seeds everywhere
    device: str = matching("auto", r"auto|cpu|mps|cuda(:\d+)?", "auto, cuda, cuda:N, mps or cpu")
    # parameter (and optimizer state) dtype
    dtype: str = one_of("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
    # autocast dtype: auto (cuda: bf16, fp16 before SM 8.0; cpu/mps: fp32) | fp32 | bf16 | fp16 (+ GradScaler)
    mixed_precision: str = one_of("auto", "fp32", "bf16", "fp16")
    threads: int | None = ranged(None, "[1, 4096]")  # CPU intra-op threads; None: torch's default


@dataclass
class OptimizerSection:
    # torch's AdamW | torchao's 8-/4-bit AdamW | torch's Adafactor | Muon + AdamW (optimizer.py)
    name: str = one_of("adamw", "adamw8bit", "adamw4bit", "adafactor", "muon")
    lr: float = ranged(3e-3, "(0, inf)")  # the peak; adafactor: its largest relative step
    weight_decay: float = ranged(0.1, "[0, inf)")
    beta1: float = ranged(0.9, "[0, 1)")  # AdamW's moment decays: 1 would never forget
    beta2: float = ranged(0.95, "[0, 1)")
    eps: float = ranged(1e-8, "(0, inf)")
    muon_momentum: float = ranged(0.95, "[0, 1)")  # muon: its (Nesterov) momentum, torch's default
    muon_ns_steps: int = ranged(5, "[1, 99]")  # muon: Newton-Schulz iterations (torch's < 100)


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
    # a collective waiting longer fails the job (hung peer)
    timeout_s: float = ranged(300.0, "(0, inf)")
    bucket_cap_mb: float = ranged(25.0, "(0, inf)")  # DDP gradient bucket size
    reshard_after_forward: str = one_of("default", "always", "never")  # FSDP; never: ZeRO-2-like
    # FSDP all-gather/compute dtype; auto: bfloat16 on CUDA SM 8.0+ (then no autocast), else float32
    param_dtype: str = one_of("auto", "float32", "bfloat16")
    reduce_dtype: str = one_of("float32", "bfloat16")  # FSDP gradient reduce-scatter dtype
    cpu_offload: bool = False  # FSDP: sharded params, grads and optimizer step on the CPU
    # tensor-parallel degree: every matmul split over this many ranks
    tp: int = ranged(1, "[1, inf)")
    # TP: norms and residual stream split over the sequence (not with pp > 1)
    sequence_parallel: bool = True
    loss_parallel: bool = True  # TP: cross-entropy on vocabulary-sharded logits (not with pp > 1)
    # pipeline-parallel degree: the layers split into stages over this many ranks
    pp: int = ranged(1, "[1, inf)")
    pp_schedule: str = one_of("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv")
    # micro-batches per pipeline step; None: 2 × stages
    pp_microbatches: int | None = ranged(None, "[1, inf)")
    # interleaved schedules: stages per rank (None: 2)
    pp_stages_per_rank: int | None = ranged(None, "[1, inf)")
    # context-parallel degree: every sequence split over this many ranks, attention across them
    cp: int = ranged(1, "[1, inf)")
    cp_layout: str = one_of("zigzag", "contiguous")  # zigzag: chunks i and 2cp-1-i (balanced)
    cp_method: str = one_of("ring", "allgather")  # how keys and values reach every rank
    # expert-parallel degree: the MoE experts split over this many ranks (each reads its own data)
    ep: int = ranged(1, "[1, inf)")


@dataclass
class ActivationCheckpointSection:
    # selective: every N-th block; op: saves matmuls
    mode: str = one_of("none", "full", "selective", "op")
    every: int = ranged(2, "[1, inf)")  # selective: checkpoint blocks 0, N, 2N, ...


@dataclass
class CompileSection:
    enable: bool | None = None  # None: on for CUDA (where the trial compile works), off elsewhere
    scope: str = one_of("regional", "model")  # regional: each transformer block
    fallback: bool = True  # if compiling fails here, warn once and train eagerly
    # torch.compile backend (aot_eager: no code generation, e.g. on MPS); a registered name
    backend: str = matching(
        "inductor",
        r"[A-Za-z_][A-Za-z0-9_.]*",
        "a torch.compile backend name such as inductor, aot_eager or eager",
    )


@dataclass
class Float8Section:
    enable: bool = False
    recipe: str = one_of("tensorwise", "rowwise")  # torchao recipe names
    # skip Linears with a side below this: too small to gain from FP8
    min_dim: int = ranged(64, "[1, inf)")
    # auto: real on CUDA SM >= 8.9, emulated elsewhere
    emulate: str = one_of("auto", "true", "false")
    fsdp_all_gather: bool = False  # FSDP all-gathers FP8 weights (tensorwise recipe only)


@dataclass
class EvalSection:
    # validation loss every N steps (and at the end); 0 disables
    every: int = ranged(50, "[0, inf)")
    # validation batches per evaluation (the same ones each time)
    batches: int = ranged(8, "[1, 65536]")
    # print a text sample every N steps; 0: only before and after
    sample_every: int = ranged(0, "[0, inf)")
    sample_tokens: int = ranged(48, "[1, 65536]")
    prompt: str = matching("The ", r"(?s).+", "some text to continue")


@dataclass
class MetricsSection:
    log_dir: str = matching("runs", r"(?s).+", "a folder, e.g. runs")
    # None: <preset>-<timestamp>; a plain name: it becomes a folder in log_dir
    run_name: str | None = matching(
        None, r"(?!\.\.?$)[^/\\]+", "a name without / (a folder in log_dir)"
    )
    # a run_name whose folder holds another run: delete that run first (else refused)
    overwrite: bool = False
    # None: 10 on CUDA (logging waits for the GPU), else 1
    log_every: int | None = ranged(None, "[1, inf)")
    tensorboard: bool = False
    progress: bool = True  # tqdm bar in terminals
    peak: str = one_of("auto", "measured", "datasheet")  # the MFU denominator


@dataclass
class FaultSection:
    kind: str = one_of("none", "exception", "kill", "hang", "slow")  # titanlite.resilience.faults
    rank: int = ranged(0, "[0, inf)")  # which rank fails
    # at the start of this step (1-based); slow: from this step on
    step: int = ranged(1, "[1, inf)")
    slow_s: float = ranged(0.5, "[0, inf)")  # slow: extra seconds per step
    once: bool = True  # only in the first `attempts` attempts, so a restarted job can finish
    # with once: how many attempts fail (attempt k at step + k*step_gap)
    attempts: int = ranged(1, "[1, inf)")
    step_gap: int = ranged(0, "[0, inf)")
    # step: as the step begins | save: while a checkpoint is being saved
    during: str = one_of("step", "save")


@dataclass
class CheckpointSection:
    enable: bool = False
    folder: str | None = None  # None: <run dir>/checkpoints
    # save every N steps, and after the last step; 0: only after the last
    every: int = ranged(0, "[0, inf)")
    # sync, or in a background thread / process
    mode: str = one_of("sync", "async", "async_process")
    # dcp: torch's own format, which torch.distributed.checkpoint.load (and torchtitan) read
    # without titanlite; raw: each tensor's bare bytes (ByteCheckpoint-style, measured in
    # bench/checkpoint.py), which only titanlite reads
    format: str = one_of("dcp", "raw")
    keep_latest_k: int = ranged(2, "[0, inf)")  # committed checkpoints kept; 0 keeps all
    resume: bool = True  # start from the newest committed checkpoint in `folder`, if any
    load: str | None = None  # or from this checkpoint (e.g. another run's; resharded on load)
    # Start from a Hugging Face Llama or Mixtral folder (config.json, *.safetensors, tokenizer.json): its shape
    # and tokenizer, fresh optimizer, step 0; a checkpoint found by resume or `load` wins (tools/formats/hf_start.py).
    initial_load_path: str | None = None
    # before loading, check every file's size and CRC-32 | only "size"
    verify: str = one_of("crc", "size")
    # data-parallel ranks read each replicated tensor once per job, then broadcast it
    read_once: bool = True


@dataclass
class ProfileSection:
    # Steps run under torch.profiler (1-based, inclusive), e.g. "5-8"; empty: off. Leave the
    # first steps out: they include one-off costs (allocator warm-up, compilation).
    steps: str = matching(
        "",
        r"(\d+(\s*-\s*\d+)?)?",
        "a step range like 5-8 within training.steps (empty: off)",
        example="5-8",
    )
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
    activation_checkpoint: ActivationCheckpointSection = field(
        default_factory=ActivationCheckpointSection
    )
    compile: CompileSection = field(default_factory=CompileSection)
    float8: Float8Section = field(default_factory=Float8Section)
    eval: EvalSection = field(default_factory=EvalSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    fault: FaultSection = field(default_factory=FaultSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    profile: ProfileSection = field(default_factory=ProfileSection)

    def with_overrides(self, overrides: dict, source: str = "override") -> "Config":
        """A copy with `overrides` ({"section.key": value}) applied by `set_value`; self is unchanged."""
        copy = Config(**{k: type(v)(**vars(v)) for k, v in vars(self).items()})
        for key, value in overrides.items():
            set_value(copy, key, value, source=source)
        return copy

    def validate(self) -> "Config":
        """Every key against its declaration (`ranged`, `one_of`, `matching`), then rules spanning
        keys: the profiled steps within the run's (and first <= last)."""
        for name, section in vars(self).items():
            for f in fields(section):
                check_field(self, f"{name}.{f.name}", getattr(section, f.name), f)
        parse_steps(self.profile.steps, self.training.steps)
        return self


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict | None = None
) -> Config:
    """A Config from defaults ← TOML file ← overrides (['--a.b', 'v', ...] or {'a.b': v})."""
    cfg = Config().with_overrides(read_toml(path) if path is not None else {}, source=str(path))
    return cfg.with_overrides(parse_overrides(cfg, overrides), source="command line").validate()
