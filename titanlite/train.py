"""The training loop: one readable function per concern, one loop that ties them together.

    from titanlite import Trainer, load_config
    history = Trainer(load_config("configs/debug.toml")).fit(callbacks=[LivePlot()])

The loop in `fit` is the whole algorithm: take a batch, forward, cross-entropy, backward,
clip, AdamW step, advance the learning-rate schedule; everything else (timing, MFU,
validation, samples, logging) watches from the side. Later techniques (accumulation, mixed
precision, compile, parallelism) plug into the marked places instead of branching the loop.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hardware
from .config import Config
from .data import build_data
from .efficiency import apply_efficiency  # noqa: F401  (re-exported: titanlite.train.apply_efficiency)
from .efficiency.accumulation import count_targets, loss_sum, resolve_batch
from .efficiency.mixed_precision import Precision
from ._ui import eager, progress_bar, say
from .distributed.ddp import grad_sync
from .distributed.env import all_reduce_sum, destroy_distributed, init_distributed
from .distributed.fsdp import precompute_fp8_scales
from .distributed.mesh import ParallelDims
from .distributed.parallelize import loss_parallel_enabled, parallelize
from .distributed.pipeline import clip_grad_norm_ as pipeline_clip_grad_norm_
from .errors import TitanliteError
from .metrics import MetricsLogger
from .models.from_config import model_args_for
from .models.llama import Transformer, build_model
from .resilience.faults import attempt, check_fault, inject_fault
from .resilience.goodput import GoodputLog
from .resilience.resume import open_checkpoint, run_name_for
from .resilience.stragglers import StragglerDetector, gather_ready_times
from .resilience.train_state import TrainState
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
    o = cfg.optimizer
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


class Trainer:
    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg = (cfg or Config()).validate()
        t = cfg.training
        if t.threads:
            torch.set_num_threads(t.threads)
        # Under torchrun each process joins the job and takes its own device; alone it is a
        # world of one and nothing below changes.
        self.dist = init_distributed(t.device, cfg.parallel.backend, cfg.parallel.timeout_s)
        self.device = self.dist.device
        p = cfg.parallel
        self.dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, self.dist.world_size,
                                         tp=p.tp, pp=p.pp)
        self.mesh = self.dims.build_mesh(self.device.type)
        check_fault(cfg.fault, t.steps, self.dist.world_size)
        self.dtype = hardware.resolve_dtype(t.dtype, self.device)
        seed_everything(t.seed, t.deterministic)

        self.micro_batch, self.grad_accum_steps, self.global_batch = resolve_batch(
            t.batch_size, t.grad_accum_steps, t.global_batch_size, dp_degree=self.dims.dp)
        self.precision = Precision(t.mixed_precision, self.device)

        # Each data-parallel rank reads its own slice of every global batch.
        d = cfg.data
        self.data = build_data(d.dataset, path=d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                               seq_len=t.seq_len, batch_size=t.batch_size, val_fraction=d.val_fraction,
                               seed=t.seed, data_dir=d.data_dir, max_chars=d.max_chars,
                               rank=self.dims.dp_rank(self.dist.rank), world_size=self.dims.dp)
        self.tokenizer = self.data.tokenizer
        self.model_args = model_args_for(cfg, self.data.vocab_size)
        with torch.device("meta"):  # a weightless copy, just to count
            counting = Transformer(self.model_args)
        self.flops_per_token = counting.flops_per_token(t.seq_len)
        self.num_params = counting.num_params()
        # The techniques modify the model in place (swap Linears, wrap or compile blocks), so
        # state-dict names stay those of the plain model; DDP/FSDP come last (parallelize.py).
        # One part, or one per pipeline stage this rank holds (then `self.pipe` runs them).
        self.model_parts, self.pipe = parallelize(self.model_args, cfg, self.dist, self.dims,
                                                  self.mesh, self.dtype)
        self.model = self.model_parts[0]
        self.loss_parallel = loss_parallel_enabled(cfg, self.dims)
        self.optimizer = build_optimizer(torch.nn.ModuleList(self.model_parts), cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # MFU against the peak of the dtype the matmuls actually run in.
        self.compute_dtype = hardware.matmul_dtype(self.dtype, self.precision.dtype, cfg.parallel.param_dtype if self.dims.strategy in ("fsdp", "hsdp") else None, getattr(self.model, "fp8_info", None))
        self.peak = self._get_peak()
        self.step = 0
        self.checkpointer = None  # fit() opens one when [checkpoint] asks
        self._step_start = time.perf_counter()  # fit() resets both as each step begins
        self._staging_wait_s = 0.0

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
    def loss_on(self, x: torch.Tensor, y: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """Summed cross-entropy over the real target tokens of one batch, divided by
        `num_tokens` (default: this batch's own count, i.e. the mean)."""
        with self.precision.autocast():
            loss = loss_sum(self.model(x), y)
            loss = loss.to_local() if hasattr(loss, "to_local") else loss  # TP: a replicated DTensor
            return loss / (num_tokens or max(1, count_targets(y)))

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Each micro-batch's summed token loss is divided by the token count of the *whole*
        global batch, so the accumulated gradient is exactly the big batch's gradient.
        """
        dp, d = self.dims.dp, self.dims
        # How long this rank took to get here, its first collective of the step: a straggler
        # shows up here (afterwards everyone waits for everyone).
        ready_s = time.perf_counter() - self._step_start
        local = torch.tensor(float(sum(count_targets(y) for _, y in micro_batches)), device=self.device)
        # Every TP and PP rank of a data-parallel slice holds the same batch: count it once.
        global_tokens = all_reduce_sum(local).item() / (d.tp * d.pp)
        # DDP and FSDP *average* gradients over the dp ranks, so each rank divides by the
        # global count / dp: the average of those gradients is the global batch's gradient.
        total = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            # DDP: all-reduce only after the last micro-batch (no_sync); the others just
            # accumulate into .grad. FSDP reduce-scatters every micro-batch to keep
            # gradients sharded (memory is what FSDP is for).
            with grad_sync(self.model, sync=i == last or d.strategy != "ddp"), \
                    loss_context(self.loss_parallel):  # TP: the sharded softmax, and its backward
                if self.pipe is not None:  # forward and backward, micro-batch by micro-batch
                    with self.precision.autocast():
                        total += self.pipe.step(x, y, num_tokens=global_tokens / dp)
                    continue
                loss = self.loss_on(x, y, num_tokens=global_tokens / dp)
                self.precision.backward(loss)
            total += loss.detach()
        params = [q for part in self.model_parts for q in part.parameters()]
        if self.checkpointer is not None:  # async save: its copy of the weights must be done
            self._staging_wait_s += self.checkpointer.wait_for_staging()
        if self.pipe is not None:  # the norm of all stages' gradients, summed over the pipeline
            grad_norm = float(pipeline_clip_grad_norm_(params, self.cfg.training.grad_clip or float("inf"),
                                                       pp_group=self.mesh["pp"]))
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
        # .item() waits for the device, so the step time measured around this is honest.
        # Each rank holds its slice's loss (TP ranks and PP stages alike): average the slices.
        return {"loss": all_reduce_sum(total).item() / (dp * d.tp * d.pp), "grad_norm": grad_norm,
                "skipped": skipped, "ready_s": ready_s}

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(t.to(self.device, non_blocking=True) for t in self.data.train.next_batch())
                for _ in range(self.grad_accum_steps)]

    @torch.no_grad()
    def evaluate(self) -> float:
        batches = [(x.to(self.device), y.to(self.device))
                   for x, y in self.data.val.eval_batches(self.cfg.eval.batches)]
        for part in self.model_parts:
            part.eval()
        with loss_context(self.loss_parallel):
            if self.pipe is not None:
                losses = [self.pipe.eval_loss(x, y) for x, y in batches]
            else:
                losses = [self.loss_on(x, y).item() for x, y in batches]
        for part in self.model_parts:
            part.train()
        return sum(losses) / len(losses)

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
        e = self.cfg.eval
        prompt = e.prompt if prompt is None else prompt
        ids = self.tokenizer.encode(prompt) or [self.tokenizer.eos_token_id or 0]
        x = torch.tensor([ids], device=next(model.parameters()).device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        model.eval()
        for _ in range(max_new_tokens or e.sample_tokens):
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
        cfg, t, m = self.cfg, self.cfg.training, self.cfg.metrics
        run_name = self._same_on_all_ranks(run_name_for(cfg))
        history = History(run_dir=Path(m.log_dir) / run_name)
        main, rank = self.dist.is_main, self.dist.rank
        # Rank 0 writes metrics.jsonl; the others metrics.rank<r>.jsonl (their step times and
        # memory differ; a straggler shows there). The notebook launcher tails them all.
        # A restarted attempt appends to the same files.
        logger = MetricsLogger(history.run_dir, tensorboard=m.tensorboard and main,
                               filename="metrics.jsonl" if main else f"metrics.rank{rank}.jsonl")
        if main:
            self._write_run_info(history.run_dir)
        goodput = GoodputLog(history.run_dir, enabled=main)
        history.resumed_from = open_checkpoint(self, history.run_dir, goodput)
        stragglers = StragglerDetector()

        def emit(record: dict) -> None:
            if self.dist.distributed:
                record["rank"] = rank
            if attempt():
                record["attempt"] = attempt()
            logger.log(record)
            {"train": history.train, "val": history.val}.get(record["kind"], history.checkpoints).append(record)
            for cb in callbacks:
                cb(record)

        history.samples[self.step] = self.sample()
        bar = progress_bar(t.steps, enabled=m.progress and main, initial=self.step)
        tokens_per_step = self.global_batch * t.seq_len
        start = time.perf_counter()
        try:
            while self.step < t.steps:
                self._step_start = step_start = time.perf_counter()
                self._staging_wait_s = 0.0
                inject_fault(cfg.fault, self.step + 1, self.dist.rank)  # off unless [fault] asks
                hardware.reset_peak_memory(self.device)
                lr = self.scheduler.get_last_lr()[0]
                out = self.train_step(self.next_micro_batches())
                self.step += 1
                dt = time.perf_counter() - step_start
                goodput.step(self.step, dt - self._staging_wait_s)
                if self._staging_wait_s:
                    goodput.checkpoint(self.step, self._staging_wait_s)
                loss = out["loss"]
                if not math.isfinite(loss) and not out["skipped"]:
                    raise TitanliteError(f"loss became {loss} at step {self.step}: lower "
                                         f"--optimizer.lr (now {cfg.optimizer.lr}) or enable clipping")
                ready = gather_ready_times(out["ready_s"], self.device)
                slow = stragglers.update(ready) if len(ready) > 1 else []
                if slow and main:
                    say(f"[step {self.step}] straggler rank(s) {slow}: ready after "
                        f"{', '.join(f'{ready[r]:.2f}s' for r in slow)} vs median "
                        f"{sorted(ready)[len(ready) // 2]:.2f}s", bar)
                tps = tokens_per_step / dt
                if self.step % m.log_every == 0 or self.step == t.steps:
                    achieved = self.flops_per_token * tps / self.dist.world_size  # per device, as the peak is
                    if not self.dist.distributed:  # ranks sharing a machine would disturb a re-measurement
                        self.peak = hardware.recheck_peak(achieved, self.peak, self.device,
                                                          self.compute_dtype, say=lambda s: say(s, bar))
                    record = {"kind": "train", "step": self.step, "loss": loss, "lr": lr,
                              "grad_norm": out["grad_norm"], "tokens_per_sec": tps,
                              "mfu": hardware.mfu(achieved, self.peak),
                              "mfu_datasheet": hardware.datasheet_mfu(achieved, self.device, self.compute_dtype),
                              "peak_memory_bytes": hardware.peak_memory_bytes(self.device),
                              **hardware.allocator_readings(self.device),
                              "step_time_s": dt, "elapsed_s": time.perf_counter() - start,
                              "tokens": self.step * tokens_per_step, "peak_label": self.peak.label,
                              "ready_s": out["ready_s"]}
                    if self.dist.distributed:  # MFU is per device: the job's FLOPs over all peaks
                        record.update(world_size=self.dist.world_size)
                        if main:
                            record.update(ready_s_by_rank=ready, stragglers=slow)
                    if self.precision.scaler.is_enabled():
                        record.update(loss_scale=self.precision.scale, skipped=out["skipped"],
                                      skipped_steps=self.precision.skipped_steps)
                    emit(record)
                if self._checkpoint_due():
                    saved = self.checkpointer.save(
                        TrainState(self), self.step,
                        before_commit=lambda: inject_fault(cfg.fault, self.step, rank, phase="save"))
                    goodput.checkpoint(self.step, saved.blocked_s)
                    emit({"kind": "checkpoint", "step": self.step, "blocked_s": saved.blocked_s,
                          "mode": saved.mode})
                if cfg.eval.every and (self.step % cfg.eval.every == 0 or self.step == t.steps):
                    emit({"kind": "val", "step": self.step, "val_loss": self.evaluate(),
                          "elapsed_s": time.perf_counter() - start})
                if cfg.eval.sample_every and self.step % cfg.eval.sample_every == 0:
                    history.samples[self.step] = self.sample()
                    if main:
                        say(f"[step {self.step}] {history.samples[self.step]!r}", bar)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        finally:
            if bar is not None:
                bar.close()
            logger.close()
        if self.checkpointer is not None:  # the last async save commits before we say done
            blocked = self.checkpointer.wait()
            self.checkpointer.close()
            self.checkpointer = None
            goodput.checkpoint(self.step, blocked)
        history.samples[self.step] = self.sample()
        goodput.end()
        for cb in callbacks:
            if hasattr(cb, "on_train_end"):
                cb.on_train_end()
        return history

    # ----- checkpoints, restarts, stragglers -----------------------------------------------
    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return self.checkpointer is not None and (
            self.step == self.cfg.training.steps or (every > 0 and self.step % every == 0))

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


if __name__ == "__main__":  # torchrun ... -m titanlite.train --config ...
    # `record` writes an unexpected exception's traceback to the file torchrun names, so the
    # launcher can show the failing rank's traceback (TitanliteErrors stay one line).
    from torch.distributed.elastic.multiprocessing.errors import record

    from titanlite.cli import main as _cli_main
    from titanlite.distributed.env import exit_worker
    exit_worker(record(_cli_main)(["train", *sys.argv[1:]]) or 0)  # see exit_worker
