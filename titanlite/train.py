"""The training loop: one readable function per concern, one loop that ties them together.

    from titanlite import Trainer, load_config
    history = Trainer(load_config("configs/debug.toml")).fit(callbacks=[LivePlot()])

The loop in `fit` is the whole algorithm: take a batch, forward, cross-entropy, backward,
clip, AdamW step, advance the learning-rate schedule. `forward_backward` is one step's forward
and backward, `pipeline_forward_backward` the same through pipeline stages (torchtitan
separates the two the same way). Everything else (timing, MFU, goodput, stragglers,
checkpoints, validation, samples, logging) watches from the side: watchers.py. Later
techniques (accumulation, mixed precision, compile, parallelism) plug into the marked places
instead of branching the loop.
"""
from __future__ import annotations

import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function

from . import hardware
from .config import Config
from .data import build_data
from .data.transfer import to_device
from .efficiency import apply_efficiency  # noqa: F401  (re-exported: titanlite.train.apply_efficiency)
from .efficiency.accumulation import count_targets, loss_sum, resolve_batch
from .efficiency.mixed_precision import Precision
from ._ui import eager, say
from .distributed.ddp import grad_sync
from .distributed.env import all_reduce_sum, destroy_distributed, init_distributed
from .distributed.fsdp import precompute_fp8_scales
from .distributed.mesh import ParallelDims
from .distributed.parallelize import loss_parallel_enabled, parallelize
from .distributed.pipeline import clip_grad_norm_ as pipeline_clip_grad_norm_
from .errors import TitanliteError
from .models.from_config import model_args_for
from .models.llama import Transformer, build_model
from .resilience.faults import check_fault
from .resilience.initial_load import load_initial_weights, tokenizer_for
from .resilience.resume import open_checkpoint, run_name_for
from .watchers import StepEnd, build_watchers
from .weights import load_weights  # noqa: F401  (re-exported: titanlite.train.load_weights)

@dataclass
class History:
    """What `fit()` returns: the records it logged, plus text samples before and after."""
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    samples: dict[int, str] = field(default_factory=dict)
    run_dir: Path | None = None
    checkpoints: list[dict] = field(default_factory=list)  # what each save cost
    resumed_from: Path | None = None

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.train]

    @property
    def val_losses(self) -> list[float]:
        return [r["val_loss"] for r in self.val]


class MicroBatches(list):
    """One optimizer step's (x, y) micro-batches on the device, and their target tokens,
    counted on the host before the copy (counting on the device would wait for it)."""
    num_targets: int | None = None


def loss_context(enabled: bool):
    """TP's loss parallel (cross-entropy on vocabulary-sharded logits), imported only if used."""
    if not enabled:
        import contextlib
        return contextlib.nullcontext()
    from .distributed.tensor_parallel import loss_context as tp_loss_context
    return tp_loss_context(True)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def lr_lambda(cfg: Config):
    """Linear warm-up to the peak lr, then cosine/linear decay to min_lr_ratio·peak."""
    warmup, total = cfg.scheduler.warmup_steps, cfg.training.steps
    floor, decay = cfg.scheduler.min_lr_ratio, cfg.scheduler.decay

    def factor(step: int) -> float:  # step counts completed optimizer steps (0-based)
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    # Decay matrices only: shrinking norm gains towards zero hurts and regularises nothing.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2), eps=cfg.optimizer.eps)


class Trainer:
    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg = (cfg or Config()).validate()
        if cfg.training.threads:
            torch.set_num_threads(cfg.training.threads)
        # Under torchrun each process joins the job and takes its own device; alone it is a
        # world of one and nothing below changes.
        self.dist = init_distributed(cfg.training.device, cfg.parallel.backend, cfg.parallel.timeout_s)
        self.device = self.dist.device
        self.dims = ParallelDims.resolve(cfg.parallel.dp_replicate, cfg.parallel.dp_shard,
                                         self.dist.world_size, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
        self.mesh = self.dims.build_mesh(self.device.type)
        check_fault(cfg.fault, cfg.training.steps, self.dist.world_size)
        self.dtype = hardware.resolve_dtype(cfg.training.dtype, self.device)
        seed_everything(cfg.training.seed, cfg.training.deterministic)

        self.micro_batch, self.grad_accum_steps, self.global_batch = resolve_batch(
            cfg.training.batch_size, cfg.training.grad_accum_steps, cfg.training.global_batch_size,
            dp_degree=self.dims.dp)
        # FSDP/TP/PP ranks each see only their shard's overflow: "auto" never picks fp16 there.
        sharded = self.dims.strategy in ("fsdp", "hsdp") or self.dims.tp > 1 or self.dims.pp > 1
        self.precision = Precision(cfg.training.mixed_precision, self.device, scaler_ok=not sharded,
                                   param_dtype=self.dtype)

        # Each data-parallel rank reads its own slice of every global batch.
        self.data = build_data(cfg.data.dataset, path=cfg.data.path, tokenizer=tokenizer_for(cfg),
                               vocab_size=cfg.data.vocab_size, seq_len=cfg.training.seq_len,
                               batch_size=cfg.training.batch_size, val_fraction=cfg.data.val_fraction,
                               seed=cfg.training.seed, data_dir=cfg.data.data_dir,
                               max_chars=cfg.data.max_chars,
                               rank=self.dims.dp_rank(self.dist.rank), world_size=self.dims.dp)
        self.tokenizer = self.data.tokenizer
        self.model_args = model_args_for(cfg, self.data.vocab_size)
        with torch.device("meta"):  # a weightless copy, just to count
            counting = Transformer(self.model_args)
        self.flops_per_token = counting.flops_per_token(cfg.training.seq_len)
        self.num_params = counting.num_params()
        # The techniques modify the model in place (swap Linears, wrap or compile blocks), so
        # state-dict names stay those of the plain model; DDP/FSDP come last (parallelize.py).
        # One part, or one per pipeline stage this rank holds (then `self.pipe` runs them).
        self.model_parts, self.pipe = parallelize(self.model_args, cfg, self.dist, self.dims,
                                                  self.mesh, self.dtype, self.precision.dtype)
        self.model = self.model_parts[0]
        self.loss_parallel = loss_parallel_enabled(cfg, self.dims)
        self.optimizer = build_optimizer(torch.nn.ModuleList(self.model_parts), cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # MFU against the peak of the dtype the matmuls actually run in.
        fsdp_param_dtype = cfg.parallel.param_dtype if self.dims.strategy in ("fsdp", "hsdp") else None
        self.compute_dtype = hardware.matmul_dtype(self.dtype, self.precision.dtype, fsdp_param_dtype,
                                                   getattr(self.model, "fp8_info", None))
        self.peak = self._get_peak()
        self.step = 0
        self.checkpointer = None  # fit() opens one when [checkpoint] asks
        self._step_start = time.perf_counter()  # fit() resets it as each step begins

    def _get_peak(self) -> hardware.Peak:
        """The MFU denominator of one device. Ranks sharing a machine would disturb each
        other's measurement, so local rank 0 measures (and caches) it first."""
        source = self.cfg.metrics.peak
        if self.dist.distributed and self.dist.local_rank != 0:
            torch.distributed.barrier()
            return hardware.get_peak(self.device, self.compute_dtype, source=source)
        peak = hardware.get_peak(self.device, self.compute_dtype, source=source)
        if self.dist.distributed:
            torch.distributed.barrier()
        return peak

    # ----- the pieces the loop calls --------------------------------------------------------
    def loss_on(self, x: torch.Tensor, y: torch.Tensor, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
        """Summed cross-entropy over the real target tokens of one batch, divided by
        `num_tokens` (default: this batch's own count, i.e. the mean)."""
        with self.precision.autocast():
            loss = loss_sum(self.model(x), y)
            loss = loss.to_local() if hasattr(loss, "to_local") else loss  # TP: a replicated DTensor
            return loss / (num_tokens if num_tokens is not None else max(1, count_targets(y)))

    def forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """Forward and backward of each micro-batch; the gradients add up in `.grad`. Returns
        the summed loss, on the device and unread (reading it would wait for the device)."""
        total = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            # DDP: all-reduce only after the last micro-batch (no_sync); the others just
            # accumulate into .grad. FSDP reduce-scatters every micro-batch to keep
            # gradients sharded (memory is what FSDP is for).
            with grad_sync(self.model, sync=i == last or self.dims.strategy != "ddp"), \
                    loss_context(self.loss_parallel):  # TP: the sharded softmax, and its backward
                # The labels a profiler trace shows (profiling/); nearly free when it is off.
                with record_function("forward"):
                    loss = self.loss_on(x, y, num_tokens=num_tokens)
                with record_function("backward"):
                    self.precision.backward(loss)
            total += loss.detach()
        return total

    def pipeline_forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """The same through the pipeline: the schedule cuts each batch into its own micro-batches
        and runs them forward and backward through every stage (distributed/pipeline.py).
        Returns the summed loss, known on every stage."""
        total = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            with grad_sync(self.model, sync=i == last or self.dims.strategy != "ddp"), \
                    loss_context(self.loss_parallel), self.precision.autocast(), \
                    record_function("forward_backward"):  # the schedule interleaves the two
                total += self.pipe.step(x, y, num_tokens=num_tokens)
        return total

    def global_tokens_per_rank(self, micro_batches: list) -> float | torch.Tensor:
        """The divisor of every micro-batch's summed loss: the target tokens of the whole global
        batch / dp. DDP and FSDP *average* gradients over the dp ranks, so the average of
        those gradients is then exactly the global batch's gradient. Counted on the host (the
        labels' CPU copy, see next_micro_batches) where it can be: no wait for the device."""
        local = getattr(micro_batches, "num_targets", None)
        if local is None:  # micro-batches from elsewhere: count them where they are
            local = sum(count_targets(y) for _, y in micro_batches)
        if not self.dist.distributed:
            return float(local)
        # Every TP and PP rank of a data-parallel slice holds the same batch: count it once. The
        # sum stays on the device (a tensor divisor, as torchtitan): .item() would wait for it.
        counts = all_reduce_sum(torch.tensor(float(local), device=self.device))
        return counts / (self.dims.tp * self.dims.pp * self.dims.dp)

    def train_step(self, micro_batches: list, read: bool = True) -> dict:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Each micro-batch's summed token loss is divided by the token count of the *whole*
        global batch, so the accumulated gradient is exactly the big batch's gradient.
        `read=False` leaves loss and grad_norm unread (None): reading waits for the device, so
        the loop reads them only on the steps it logs.
        """
        # How long this rank took to get here, its first collective of the step: a straggler
        # shows up here (afterwards everyone waits for everyone).
        ready_s = time.perf_counter() - self._step_start
        num_tokens = self.global_tokens_per_rank(micro_batches)
        if self.pipe is not None:
            total = self.pipeline_forward_backward(micro_batches, num_tokens)
        else:
            total = self.forward_backward(micro_batches, num_tokens)
        params = [q for part in self.model_parts for q in part.parameters()]
        # An async save's copy of the weights must be done before the weights change.
        staging_wait_s = self.checkpointer.wait_for_staging() if self.checkpointer is not None else 0.0
        with record_function("optimizer"):  # clip, step, schedule, zero_grad
            if self.pipe is not None:  # the norm of all stages' gradients, summed over the pipeline
                grad_norm = pipeline_clip_grad_norm_(params, self.cfg.training.grad_clip or float("inf"),
                                                     pp_group=self.mesh["pp"])
                self.optimizer.step()
                skipped = False
            else:
                grad_norm, skipped = self.precision.step(self.optimizer, params, self.cfg.training.grad_clip)
            for part in self.model_parts:
                precompute_fp8_scales(part)
            with warnings.catch_warnings():
                # A step the fp16 scaler skipped still advances the schedule (torchtitan does the
                # same); torch would warn that the scheduler stepped before the optimizer.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {"loss": None, "grad_norm": None, "skipped": skipped, "ready_s": ready_s,
               "staging_wait_s": staging_wait_s}
        if read:
            out.update(loss=self.read_loss(total), grad_norm=float(grad_norm))
            # Checked where the loss is read: a non-finite loss poisons the weights, so every
            # later loss is non-finite too and the next logged step (the last one always is)
            # catches it. (An fp16 step the scaler skipped left the weights untouched.)
            if not math.isfinite(out["loss"]) and not skipped:
                raise TitanliteError(f"loss became {out['loss']} by step {self.step + 1}: lower "
                                     f"--optimizer.lr (now {self.cfg.optimizer.lr}) or enable clipping")
        return out

    def read_loss(self, total: torch.Tensor) -> float:
        """The global batch's mean loss from this rank's summed loss: each rank holds its
        slice's loss (TP ranks and PP stages alike), so average the slices. .item() waits for
        the device, so the step time measured around it is honest."""
        return all_reduce_sum(total).item() / (self.dims.dp * self.dims.tp * self.dims.pp)

    def next_micro_batches(self) -> MicroBatches:
        """The next step's micro-batches on the device, with their target count taken on the
        host before the copy (data/transfer.py says how each copy is made)."""
        batches = [self.data.train.next_batch() for _ in range(self.grad_accum_steps)]
        on_device = MicroBatches(to_device(batch, self.device) for batch in batches)
        on_device.num_targets = sum(count_targets(y) for _, y in batches)
        return on_device

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per target token over the batches of *every* data-parallel rank
        (each reads its own shard of the validation set)."""
        batches = self.data.val.eval_batches(self.cfg.eval.batches)
        for part in self.model_parts:
            part.eval()
        loss_total, tokens = 0.0, 0
        with loss_context(self.loss_parallel):
            for batch in batches:
                x, y = to_device(batch, self.device)
                mean = self.pipe.eval_loss(x, y) if self.pipe is not None else self.loss_on(x, y).item()
                n = max(1, count_targets(batch[1]))  # counted on the host copy
                loss_total, tokens = loss_total + mean * n, tokens + n
        for part in self.model_parts:
            part.train()
        if self.dist.distributed:
            # TP and PP ranks of one slice add the same pair twice over: the ratio is unchanged.
            both = torch.tensor([loss_total, float(tokens)], dtype=torch.float64, device=self.device)
            loss_total, tokens = all_reduce_sum(both).tolist()
        return loss_total / tokens

    @torch.no_grad()
    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None,
               temperature: float = 0.8, top_k: int = 40, seed: int = 1234) -> str:
        """Continue `prompt` with top-k sampling (own generator: does not disturb training RNG)."""
        model = self.model
        if self.pipe is not None:
            # A token at a time through every stage would be slow: gather the stages' weights
            # (all ranks take part) and let rank 0 sample from the whole model on its own.
            from .distributed.pipeline import gather_state_dict
            state = gather_state_dict(self.model_parts, self.mesh["pp"])
            if not self.dist.is_main:
                return ""
            model = build_model(self.model_args, "cpu").to(self.dtype)
            model.load_state_dict(state)
        prompt = self.cfg.eval.prompt if prompt is None else prompt
        ids = self.tokenizer.encode(prompt) or [self.tokenizer.eos_token_id or 0]
        x = torch.tensor([ids], device=next(model.parameters()).device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        model.eval()
        for _ in range(max_new_tokens or self.cfg.eval.sample_tokens):
            with eager():  # prompts of every length would each trigger a recompile
                logits = model(x[:, -self.model_args.max_seq_len:])
            if hasattr(logits, "full_tensor"):  # TP: vocabulary-sharded logits
                logits = logits.full_tensor()
            logits = logits[0, -1].float().cpu()
            logits = logits / max(temperature, 1e-5)
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            probs = torch.softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).to(x.device)
            x = torch.cat([x, nxt.view(1, 1)], dim=1)
        model.train()
        return self.tokenizer.decode(x[0].tolist())

    # ----- the loop -------------------------------------------------------------------------
    def fit(self, callbacks=()) -> History:
        """Until `training.steps`: take the micro-batches, forward and backward, step. The
        watchers (watchers.py) log, time, checkpoint, evaluate and sample from the side."""
        run_dir = Path(self.cfg.metrics.log_dir) / self._same_on_all_ranks(run_name_for(self.cfg))
        history = History(run_dir=run_dir)
        # Everything that can refuse this start has run (config, data and layout in __init__,
        # the checkpoint here) before anything in the run folder changes.
        history.resumed_from, restore_s = open_checkpoint(self, run_dir)
        if history.resumed_from is None and self.cfg.checkpoint.initial_load_path:
            # A published model's weights, only when no titanlite checkpoint took precedence.
            seconds = load_initial_weights(self.model_parts, self.cfg.checkpoint.initial_load_path,
                                           self.model_args.tie_embeddings)
            if self.dist.is_main:
                say(f"started from {self.cfg.checkpoint.initial_load_path} ({seconds:.1f}s to load)", None)
        watchers = build_watchers(self, history, callbacks, restore_s)
        if self.dist.is_main:
            self._write_run_info(run_dir)
        try:
            watchers.on_train_start()
            while self.step < self.cfg.training.steps:
                self._step_start = time.perf_counter()
                watchers.on_step_start(self.step + 1)
                logged = self._logs_at(self.step + 1)
                out = self.train_step(self.next_micro_batches(), read=logged)
                self.step += 1
                watchers.on_step_end(StepEnd(self.step, time.perf_counter() - self._step_start,
                                             out, logged))
        finally:
            watchers.close()
        watchers.on_train_end()
        return history

    def _logs_at(self, step: int) -> bool:
        return step % self.cfg.metrics.log_every == 0 or step == self.cfg.training.steps

    # ----- weights, run info, leaving -------------------------------------------------------
    def save_weights(self, run_dir: str | Path) -> Path:
        """Final weights (safetensors) and tokenizer beside run.json, for `titanlite export-hf`.
        Collective under FSDP: call it on every rank; rank 0 writes."""
        from .weights import save_weights
        return save_weights(self, run_dir)

    def _same_on_all_ranks(self, value):
        """Rank 0's value, everywhere (e.g. a run name that contains the time)."""
        if not self.dist.distributed:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, barrier: bool = False) -> None:
        """Leave the process group (a no-op for a single process); barrier=True after a
        successful run, so no rank tears down while another still talks to it."""
        destroy_distributed(barrier)

    def _write_run_info(self, run_dir: Path) -> None:
        import json
        info = {"config": self.cfg.to_dict(), "model_args": self.model_args.to_dict(),
                "num_params": self.num_params,
                "micro_batch": self.micro_batch, "grad_accum_steps": self.grad_accum_steps,
                "global_batch": self.global_batch, "flops_per_token": self.flops_per_token,
                "device": hardware.device_name(self.device), "dtype": str(self.dtype), "compute_dtype": str(self.compute_dtype),
                "peak_flops": self.peak.flops, "peak_label": self.peak.label,
                "world_size": self.dist.world_size, "parallel": self.dims.strategy,
                "tp": self.dims.tp, "pp": self.dims.pp, "layout": self.dims.describe(),
                "dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                "float8": getattr(self.model, "fp8_info", None),
                "torch": torch.__version__}
        (run_dir / "run.json").write_text(json.dumps(info, indent=2))

