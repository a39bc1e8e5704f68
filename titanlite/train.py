"""The training loop: one readable function per concern, one loop that ties them together.

    history = Trainer(load_config("configs/debug.toml")).fit()

`fit` is the whole algorithm: micro-batches, forward, cross-entropy, backward, clip, AdamW step,
learning-rate schedule. `forward_backward` is one step's forward and backward (through pipeline
stages: `pipeline_forward_backward`, as in torchtitan). Timing, MFU, goodput, checkpoints,
validation, samples and logging watch from the side (watchers.py); tools are handed to `fit`."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import record_function

from . import hardware, peaks
from .config import Config
from .data import build_data
from .data.transfer import MicroBatches, micro_batches_to
from .device_policy import allocator_settings, matmul_dtype, resolve_for_device, use_fused_adamw
from .distributed.ddp import grad_sync, unwrap
from .distributed.env import (
    all_reduce_sum,
    broadcast_from_rank0,
    destroy_distributed,
    init_distributed,
    torchrun_env,
)
from .distributed.parallelize import loss_context_for, parallelize
from .efficiency.accumulation import count_targets, global_tokens_per_rank, loss_sum
from .efficiency.mixed_precision import Precision
from .errors import TitanliteError, writing
from .evaluate import generate, validation_loss
from .memory import memory_limit_bytes
from .metrics import History
from .models.llama import Transformer, build_model
from .optimizer import build_optimizer, lr_lambda
from .paths import claim_run_dir
from .preflight import (
    VOCAB_FROM_TOKENIZER,
    check_memory_fits,
    preflight,
    tokenizer_for,
    tokenizer_size,
)
from .resilience.resume import open_checkpoint, run_name_for
from .watchers import Run, StepEnd, build_watchers


class Trainer:
    def __init__(self, cfg: Config | None = None, datasheet=None, start_from=None):
        """Tools handed in (`titanlite train` hands in both): `datasheet(device, dtype)`, vendor
        peaks for MFU against the datasheet (tools.datasheet.datasheet_peak); `start_from`, a
        published model to start from (tools.hf_start.HuggingFaceStart)."""
        self.cfg = cfg = cfg or Config()
        # Every check the config can fail, once, before a process group, data or model exists.
        self.start_from = start_from
        plan = preflight(
            cfg, (torchrun_env() or (0, 0, 1))[2], tokenizer_size(cfg, start_from), start_from
        )
        self.dims, self.model_args = plan.dims, plan.model_args
        self.micro_batch, self.grad_accum_steps, self.global_batch = (
            plan.micro_batch,
            plan.grad_accum_steps,
            plan.global_batch,
        )
        if cfg.training.threads:
            torch.set_num_threads(cfg.training.threads)
        device = hardware.detect_device(cfg.training.device)
        # CUDA's allocator reads its settings at its first allocation: before anything allocates.
        hardware.use_allocator_settings(allocator_settings(device.type))
        # Sizes no memory here could hold, refused before anything is allocated. Ranks on one CPU
        # share its RAM; each GPU rank has its own device.
        sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
        limit = memory_limit_bytes(device)
        where = f"{hardware.device_name(device)}" + (f" (÷ {sharing} ranks)" if sharing > 1 else "")
        check_memory_fits(plan, cfg, limit and limit // sharing, where)
        # Under torchrun each process joins the job and takes its own device; alone, a world of one.
        self.dist = init_distributed(
            cfg.training.device, cfg.parallel.backend, cfg.parallel.timeout_s
        )
        self.device = self.dist.device
        # The config's "auto"s, decided by this device's facts (CUDA gets torchtitan's defaults).
        self.cfg = cfg = resolve_for_device(
            cfg, self.device, self.dims.strategy in ("fsdp", "hsdp")
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dtype = hardware.resolve_dtype(cfg.training.dtype, self.device)
        hardware.seed_everything(cfg.training.seed, cfg.training.deterministic)
        # FSDP/TP/PP ranks each see only their shard's overflow: "auto" never picks fp16 there.
        sharded = self.dims.strategy in ("fsdp", "hsdp") or self.dims.tp > 1 or self.dims.pp > 1
        self.precision = Precision(
            cfg.training.mixed_precision, self.device, scaler_ok=not sharded, param_dtype=self.dtype
        )
        # Each data-parallel rank reads its own slice of every global batch.
        d, t = cfg.data, cfg.training
        self.data = build_data(
            d.dataset,
            path=d.path,
            tokenizer=tokenizer_for(cfg, start_from),
            seed=t.seed,
            vocab_size=d.vocab_size,
            seq_len=t.seq_len,
            batch_size=t.batch_size,
            val_fraction=d.val_fraction,
            data_dir=d.data_dir,
            max_chars=d.max_chars,
            rank=self.dims.dp_rank(self.dist.rank),
            world_size=self.dims.dp,
        )
        self.tokenizer = self.data.tokenizer
        if (
            cfg.model.preset in VOCAB_FROM_TOKENIZER
            and cfg.model.vocab_size is None
            and not start_from
        ):
            self.model_args = replace(self.model_args, vocab_size=self.data.vocab_size)
        with torch.device("meta"):  # a weightless copy, just to count
            counting = Transformer(self.model_args)
        self.flops_per_token, self.num_params = (
            counting.flops_per_token(t.seq_len),
            counting.num_params(),
        )
        # The techniques modify the model in place (swap Linears, wrap or compile blocks): state-dict
        # names stay the plain model's; DDP/FSDP come last. One part, or one per pipeline stage (self.pipe).
        self.model_parts, self.pipe = parallelize(
            self.model_args, cfg, self.dist, self.dims, self.mesh, self.dtype, self.precision.dtype
        )
        self.model = self.model_parts[0]
        self.loss_context = loss_context_for(cfg, self.dims)  # TP's sharded softmax, or nothing
        self.optimizer = build_optimizer(
            self.model_parts, cfg, fused=use_fused_adamw(self.device.type)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # MFU against the peak of the dtype the matmuls actually run in.
        fsdp_param_dtype = (
            cfg.parallel.param_dtype if self.dims.strategy in ("fsdp", "hsdp") else None
        )
        self.compute_dtype = matmul_dtype(
            self.dtype,
            self.precision.dtype,
            fsdp_param_dtype,
            getattr(unwrap(self.model), "fp8_info", None),
        )
        self.datasheet_peak = datasheet(self.device, self.compute_dtype) if datasheet else None
        self.peak = peaks.peak_for(
            self.device, self.compute_dtype, cfg.metrics.peak, self.dist, datasheet
        )
        self.step = 0
        self.checkpointer = None  # fit() opens one when [checkpoint] asks
        self._step_start = time.perf_counter()  # fit() resets it as each step begins

    # ----- the pieces the loop calls --------------------------------------------------------
    def loss_on(self, x: torch.Tensor, y: torch.Tensor, num_tokens=None) -> torch.Tensor:
        """Summed cross-entropy over one batch's real target tokens / `num_tokens` (default: their count)."""
        with self.precision.autocast():
            loss = loss_sum(self.model(x), y)
            # TP: a replicated DTensor
            loss = loss.to_local() if hasattr(loss, "to_local") else loss
            return loss / (num_tokens if num_tokens is not None else max(1, count_targets(y)))

    def forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """Forward and backward of each micro-batch; the gradients add up in `.grad`. Returns
        the summed loss, on the device and unread (reading it would wait for the device)."""
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            # DDP all-reduces only after the last micro-batch (no_sync; the others add into .grad);
            # FSDP reduce-scatters each one, to keep gradients sharded (memory is what FSDP is for).
            with (
                grad_sync(
                    self.model, sync=i == len(micro_batches) - 1 or self.dims.strategy != "ddp"
                ),
                self.loss_context(),
            ):  # TP: the sharded softmax, and its backward
                with record_function(
                    "forward"
                ):  # labels a profiler trace shows; nearly free when off
                    loss = self.loss_on(x, y, num_tokens=num_tokens)
                with record_function("backward"):
                    self.precision.backward(loss)
            total += loss.detach()
        return total

    def pipeline_forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """The same through the pipeline: the schedule cuts each batch into its own micro-batches
        and runs them through every stage (distributed/pipeline.py). The loss is on every stage."""
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            with (
                grad_sync(
                    self.model, sync=i == len(micro_batches) - 1 or self.dims.strategy != "ddp"
                ),
                self.loss_context(),
                self.precision.autocast(),
                record_function("forward_backward"),
            ):  # the schedule interleaves the two
                total += self.pipe.step(x, y, num_tokens=num_tokens)
        return total

    def train_step(self, micro_batches: list, read: bool = True) -> dict:
        """One optimizer step over `grad_accum_steps` micro-batches, each micro-batch's summed
        token loss divided by the whole global batch's token count (accumulation.py).
        `read=False` leaves loss and grad_norm unread (None): reading waits for the device."""
        # How long this rank took to get here, its first collective of the step: a straggler
        # shows up here (afterwards everyone waits for everyone).
        ready_s = time.perf_counter() - self._step_start
        num_tokens = global_tokens_per_rank(
            micro_batches, self.dims, self.device, self.dist.distributed
        )
        if self.pipe is not None:
            total = self.pipeline_forward_backward(micro_batches, num_tokens)
        else:
            total = self.forward_backward(micro_batches, num_tokens)
        params = [q for part in self.model_parts for q in part.parameters()]
        # An async save's copy of the weights must be done before the weights change.
        staging_wait_s = (
            self.checkpointer.wait_for_staging() if self.checkpointer is not None else 0.0
        )
        with record_function("optimizer"):  # clip, step, schedule, zero_grad
            if self.pipe is not None:  # the norm of all stages' gradients, summed over the pipeline
                grad_norm = self.pipe.clip_grad_norm_(
                    params, self.cfg.training.grad_clip or float("inf")
                )
                self.optimizer.step()
                skipped = False
            else:
                grad_norm, skipped = self.precision.step(
                    self.optimizer, params, self.cfg.training.grad_clip
                )
            if self.cfg.float8.fsdp_all_gather:  # FP8 weights are gathered: their scales, once
                from .efficiency.fp8 import precompute_fp8_scales  # torchao: FP8 runs only

                for part in self.model_parts:
                    precompute_fp8_scales(part)
            with warnings.catch_warnings():
                # A step the fp16 scaler skipped still advances the schedule (torchtitan does the
                # same); torch would warn that the scheduler stepped before the optimizer.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {
            "loss": None,
            "grad_norm": None,
            "skipped": skipped,
            "ready_s": ready_s,
            "staging_wait_s": staging_wait_s,
        }
        if read:
            # Each rank holds its slice's loss (TP ranks and PP stages alike): average the slices.
            loss = all_reduce_sum(total).item() / (self.dims.dp * self.dims.tp * self.dims.pp)
            out.update(loss=loss, grad_norm=float(grad_norm))
            # A non-finite loss poisons the weights, so every later loss is non-finite too and
            # the next logged step (the last one always is) catches it.
            if not math.isfinite(out["loss"]) and not skipped:
                raise TitanliteError(
                    f"loss became {out['loss']} by step {self.step + 1}: lower "
                    f"--optimizer.lr (now {self.cfg.optimizer.lr}) or enable clipping"
                )
        return out

    def next_micro_batches(self) -> MicroBatches:
        """The next step's micro-batches on the device (data/transfer.py: how each is copied)."""
        return micro_batches_to(
            [self.data.train.next_batch() for _ in range(self.grad_accum_steps)], self.device
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per target token over every data-parallel rank's batches."""
        for part in self.model_parts:
            part.eval()
        loss_on = (
            self.pipe.eval_loss if self.pipe is not None else lambda x, y: self.loss_on(x, y).item()
        )
        with self.loss_context():
            loss = validation_loss(
                loss_on,
                self.data.val.eval_batches(self.cfg.eval.batches),
                self.device,
                self.dist.distributed,
            )
        for part in self.model_parts:
            part.train()
        return loss

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, **kwargs) -> str:
        """Continue `prompt` (default: eval.prompt) with the model (generate.py)."""
        model = self.model
        if self.pipe is not None:
            # A token at a time through every stage would be slow: gather the stages' weights
            # (all ranks take part) and let rank 0 sample from the whole model on its own.
            state = self.pipe.whole_state_dict(self.model_parts)
            if not self.dist.is_main:
                return ""
            model = build_model(self.model_args, "cpu").to(self.dtype)
            model.load_state_dict(state)
        return generate(
            model,
            self.tokenizer,
            self.cfg.eval.prompt if prompt is None else prompt,
            max_new_tokens or self.cfg.eval.sample_tokens,
            self.model_args.max_seq_len,
            **kwargs,
        )

    def train_state(self):
        """Everything a checkpoint holds, as of now (resilience/train_state.py)."""
        from .resilience.train_state import TrainState  # DCP: runs that checkpoint only

        describe = {
            "model_args": self.model_args.to_dict(),
            "layout": self.dims.describe(),
            "world_size": self.dist.world_size,
            "global_batch": self.global_batch,
        }
        return TrainState(
            self.model_parts,
            self.optimizer,
            self.scheduler,
            self.data.train.sampler,
            step=self.step,
            describe=describe,
        )

    # ----- the loop -------------------------------------------------------------------------
    def fit(self, callbacks=(), watchers=()) -> History:
        """Until `training.steps`. `callbacks`: functions called with every record (e.g. a LivePlot);
        `watchers`: more watchers, each made by `make(run)` (e.g. tools.profiling.StepProfiler)."""
        cfg = self.cfg
        run_dir = Path(cfg.metrics.log_dir) / broadcast_from_rank0(run_name_for(cfg))
        history = History(run_dir=run_dir)
        # Everything that can refuse this start has run (config, data and layout in __init__,
        # another run in the folder and the checkpoint here) before anything in the run folder changes.
        if refusal := broadcast_from_rank0(
            self.dist.is_main
            and claim_run_dir(  # every rank refuses, or none
                run_dir, self._run_info(), cfg.checkpoint, cfg.metrics.overwrite
            )
        ):
            raise TitanliteError(refusal)
        self.checkpointer, history.resumed_from, restore_s, self.step = open_checkpoint(
            cfg.checkpoint,
            run_dir,
            self.train_state,
            self.model_parts,
            self.tokenizer,
            self.dist.is_main,
            self.start_from,
            self.model_args.tie_embeddings,
        )
        run = Run(
            cfg,
            run_dir,
            self.dist.rank,
            self.dist.world_size,
            self.device,
            self.global_batch * cfg.training.seq_len,
            self.flops_per_token,
            self.compute_dtype,
            self.peak,
            self.datasheet_peak,
            self.step,
            restore_s,
        )
        chain = build_watchers(
            run,
            history,
            callbacks=callbacks,
            extra=watchers,
            lr=lambda: self.scheduler.get_last_lr()[0],
            precision=self.precision,
            sample=self.sample,
            evaluate=self.evaluate,
            checkpointer=self.checkpointer,
            train_state=self.train_state,
        )
        if self.dist.is_main:
            with writing(run_dir / "run.json", "the run's record"):
                (run_dir / "run.json").write_text(json.dumps(self._run_info(), indent=2))
        try:
            chain.on_train_start()
            while self.step < cfg.training.steps:
                self._step_start = time.perf_counter()
                chain.on_step_start(self.step + 1)
                logged = (
                    self.step + 1
                ) % cfg.metrics.log_every == 0 or self.step + 1 == cfg.training.steps
                out = self.train_step(self.next_micro_batches(), read=logged)
                self.step += 1
                chain.on_step_end(
                    StepEnd(self.step, time.perf_counter() - self._step_start, out, logged)
                )
        finally:
            chain.close()
        chain.on_train_end()
        self.checkpointer = None  # closed by its watcher once the last save committed
        return history

    def close(self, barrier: bool = False) -> None:
        """Leave the process group (a no-op for a single process); barrier=True after a
        successful run, so no rank tears down while another still talks to it."""
        destroy_distributed(barrier)

    def _run_info(self) -> dict:
        # a torchrun job's attempts share it and their agent
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        return {
            "job": job and f"{job}:{os.getppid()}",
            "config": self.cfg.to_dict(),
            "model_args": self.model_args.to_dict(),
            "num_params": self.num_params,
            "micro_batch": self.micro_batch,
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch": self.global_batch,
            "flops_per_token": self.flops_per_token,
            "device": hardware.device_name(self.device),
            "dtype": str(self.dtype),
            "compute_dtype": str(self.compute_dtype),
            "peak_flops": self.peak.flops,
            "peak_label": self.peak.label,
            "world_size": self.dist.world_size,
            "parallel": self.dims.strategy,
            "tp": self.dims.tp,
            "pp": self.dims.pp,
            "layout": self.dims.describe(),
            "dp_replicate": self.dims.dp_replicate,
            "dp_shard": self.dims.dp_shard,
            "float8": getattr(unwrap(self.model), "fp8_info", None),
            "torch": torch.__version__,
        }


if __name__ == "__main__":  # `python -m titanlite.train` (torchtitan's spelling) is not the entry
    raise SystemExit(
        "titanlite.train is a module, not a program: run `python -m titanlite train "
        "--config ...` (or `torchrun ... -m titanlite train --config ...`)"
    )
