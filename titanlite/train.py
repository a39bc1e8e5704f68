"""The training loop: one readable function per concern, one loop that ties them together.

    history = Trainer(load_config("configs/debug.toml")).fit()

`fit` is the whole algorithm: micro-batches, forward, cross-entropy, backward, clip, AdamW step,
learning-rate schedule. `forward_backward` is one step's forward and backward (through the
pipeline's stages when there is one, as in torchtitan). Timing, MFU, goodput, checkpoints,
validation, samples and logging watch from the side (watchers.py); tools are handed to `fit`."""

import json
import math
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import record_function

from . import hardware
from .config import Config
from .data import data_for
from .data.transfer import MicroBatches, micro_batches_to
from .device_policy import matmul_dtype, resolve_for_device, use_fused_adamw
from .distributed import env
from .distributed.ddp import grad_sync, unwrap
from .distributed.parallelize import Techniques, loss_context_for, parallelize
from .efficiency.accumulation import count_targets, global_tokens_per_rank, loss_sum
from .efficiency.mixed_precision import Precision
from .errors import TitanliteError, writing
from .evaluate import generate, validation_loss
from .metrics import History
from .models.llama import count
from .optimizer import build_optimizer, lr_lambda
from .paths import claim_run_dir
from .peaks import peak_for
from .preflight import model_args_for, preflight, prepare_process, tokenizer_for, tokenizer_size
from .resilience.resume import open_checkpoint, run_name_for
from .run_record import built, run_record
from .watchers import Run, StepEnd, build_watchers, notify


class Trainer:
    def __init__(self, cfg: Config | None = None, datasheet=None, start_from=None):
        """Tools handed in (`titanlite train` hands in both): `datasheet(device, dtype)`, vendor
        peaks for MFU against the datasheet (tools.datasheet.datasheet_peak); `start_from`, a
        published model to start from (tools.hf_start.HuggingFaceStart)."""
        self.cfg = cfg = cfg or Config()
        self.start_from = start_from
        # Every check the config can fail, once, before a process group, data or model exists:
        # the batch (micro-batch, accumulation, global), the rank grid and the model's shape.
        world = (env.torchrun_env() or env.ONE_PROCESS).world_size
        plan = preflight(cfg, world, tokenizer_size(cfg, start_from), start_from)
        self.dims, self.micro_batch = plan.dims, plan.micro_batch
        self.grad_accum_steps, self.global_batch = plan.grad_accum_steps, plan.global_batch
        prepare_process(plan, cfg)  # threads, allocator settings, memory: before any allocation
        # Under torchrun each process joins the job and takes its own device; alone, a world of one.
        self.dist = env.init_distributed(
            cfg.training.device, cfg.parallel.backend, cfg.parallel.timeout_s
        )
        self.device = self.dist.device
        # The config's "auto"s, decided by this device's facts (CUDA gets torchtitan's defaults).
        fsdp = self.dims.strategy in ("fsdp", "hsdp")
        self.cfg = cfg = resolve_for_device(cfg, self.device, fsdp)
        p = cfg.parallel
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dtype = hardware.resolve_dtype(cfg.training.dtype, self.device)
        hardware.seed_everything(cfg.training.seed, cfg.training.deterministic)
        # FSDP/TP/PP ranks each see only their shard's overflow: "auto" never picks fp16 there.
        sharded = fsdp or self.dims.tp > 1 or self.dims.pp > 1
        self.precision = Precision(
            cfg.training.mixed_precision, self.device, scaler_ok=not sharded, param_dtype=self.dtype
        )
        # Each data-parallel rank reads its own slice of every global batch.
        self.data = data_for(
            cfg.data,
            cfg.training,
            tokenizer_for(cfg, start_from),
            micro_batch=self.micro_batch,
            rank=self.dims.dp_rank(self.dist.rank),
            world_size=self.dims.batch_ranks,
            sequence_part=self.dims.sequence_part(self.dist.rank, p.cp_layout),  # CP: its part
        )
        self.tokenizer = self.data.tokenizer
        # The plan's shape once more, now that the tokenizer exists: the small presets take its
        # vocabulary exactly (preflight knew only the size asked for, data.vocab_size).
        self.model_args = model_args_for(cfg, self.data.vocab_size, start_from)
        self.flops_per_token, self.num_params = count(self.model_args, cfg.training.seq_len)
        # The techniques modify the model in place (swap Linears, wrap or compile blocks): state-dict
        # names stay the plain model's; DDP/FSDP come last. One part, or one per pipeline stage (self.pipe).
        self.model_parts, self.pipe = parallelize(
            self.model_args,
            self.dims,
            self.mesh,
            self.device,
            self.dtype,
            p,
            Techniques.of(cfg),
            example_shape=(self.micro_batch, cfg.training.seq_len // self.dims.cp),
            autocast_dtype=self.precision.dtype,
        )
        self.model = self.model_parts[0]
        self.loss_context = loss_context_for(p, self.dims)  # TP's sharded softmax, or nothing
        self.optimizer = build_optimizer(
            self.model_parts, cfg.optimizer, fused=use_fused_adamw(self.device.type)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.scheduler, cfg.training.steps)
        )
        # MFU against the peak of the dtype the matmuls actually run in.
        fp8 = getattr(unwrap(self.model), "fp8_info", None)
        self.compute_dtype = matmul_dtype(
            self.dtype, self.precision.dtype, p.param_dtype if fsdp else None, fp8
        )
        self.datasheet_peak = datasheet(self.device, self.compute_dtype) if datasheet else None
        self.peak = peak_for(
            self.device, self.compute_dtype, cfg.metrics.peak, self.dist, datasheet
        )
        self.step = 0
        self.checkpointer = None  # fit() opens one when [checkpoint] asks
        self._step_start = time.perf_counter()  # fit() resets it as each step begins

    def loss_on(self, x: torch.Tensor, y: torch.Tensor, num_tokens=None) -> torch.Tensor:
        """Summed cross-entropy over one batch's real target tokens / `num_tokens` (default: their count)."""
        with self.precision.autocast():
            loss = loss_sum(self.model(x), y)
            # TP: a replicated DTensor
            loss = loss.to_local() if hasattr(loss, "to_local") else loss
            return loss / (num_tokens if num_tokens is not None else max(1, count_targets(y)))

    def forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """Forward and backward of each micro-batch; the gradients add up in `.grad`. Returns
        the summed loss, on the device and unread (reading it would wait for the device). Under
        pipeline parallelism the schedule cuts each batch again and interleaves the stages'
        forwards and backwards (distributed/pipeline.py); the loss is on every stage."""
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            # DDP all-reduces only after the last micro-batch (no_sync; the others add into .grad);
            # FSDP reduce-scatters each one, to keep gradients sharded (memory is what FSDP is for).
            last = i == len(micro_batches) - 1
            with (
                grad_sync(self.model, sync=last or self.dims.strategy != "ddp"),
                self.loss_context(),  # TP: the sharded softmax, and its backward
            ):
                if self.pipe is not None:
                    with self.precision.autocast(), record_function("forward_backward"):
                        total += self.pipe.step(x, y, num_tokens=num_tokens)
                else:
                    # record_function: labels a profiler trace shows; nearly free when off
                    with record_function("forward"):
                        loss = self.loss_on(x, y, num_tokens=num_tokens)
                    with record_function("backward"):
                        self.precision.backward(loss)
                    total += loss.detach()
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
        total = self.forward_backward(micro_batches, num_tokens)
        # An async save's copy of the weights must be done before the weights change.
        staging_wait_s = self.checkpointer.wait_for_staging() if self.checkpointer else 0.0
        with record_function("optimizer"):  # clip, step, schedule, zero_grad
            grad_norm, skipped = self.precision.step(
                self.optimizer,
                [q for part in self.model_parts for q in part.parameters()],
                self.cfg.training.grad_clip,
                # A pipeline clips by the norm of all stages' gradients, summed over its ranks.
                clip=self.pipe.clip_grad_norm_ if self.pipe is not None else None,
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
        out = {"loss": None, "grad_norm": None, "skipped": skipped}
        out.update(ready_s=ready_s, staging_wait_s=staging_wait_s)
        if read:
            out.update(
                # Each rank holds its slice's loss (TP ranks, PP stages, CP ranks): average the slices.
                loss=env.all_reduce_sum(total).item() / self.dims.world_size,
                grad_norm=float(grad_norm),
            )
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

    def evaluate(self) -> float:
        """Mean validation loss per target token over every data-parallel rank's batches."""
        with self.loss_context():
            return validation_loss(
                self.pipe.eval_loss if self.pipe is not None else self.loss_on,
                self.data.val.eval_batches(self.cfg.eval.batches),
                self.device,
                self.dist.distributed,
                parts=self.model_parts,
            )

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, **kwargs) -> str:
        """Continue `prompt` (default: eval.prompt) with the model (evaluate.py). A pipeline's
        stages are gathered into one model on rank 0, which samples alone ("" elsewhere)."""
        model, args = self.model, self.model_args
        if self.pipe is not None:
            model = self.pipe.whole_model(self.model_parts, args, self.dtype, self.dist.is_main)
        if model is None:  # a pipeline's rank other than 0
            return ""
        prompt = self.cfg.eval.prompt if prompt is None else prompt
        tokens = max_new_tokens or self.cfg.eval.sample_tokens
        return generate(model, self.tokenizer, prompt, tokens, args.max_seq_len, **kwargs)

    def train_state(self):
        """Everything a checkpoint holds, as of now (resilience/train_state.py)."""
        from .resilience.train_state import TrainState  # DCP: runs that checkpoint only

        return TrainState.of(self)

    def fit(self, callbacks=(), watchers=()) -> History:
        """Until `training.steps`. `callbacks`: functions called with every record (e.g. a LivePlot);
        `watchers`: more watchers, each made by `make(run)` (e.g. tools.profiling.StepProfiler)."""
        cfg = self.cfg
        run_dir = Path(cfg.metrics.log_dir) / env.broadcast_from_rank0(run_name_for(cfg))
        # Everything that can refuse this start has run (config, data and layout in __init__,
        # another run in the folder and the checkpoint here) before anything in the run folder changes.
        record = run_record(self, env.gather_from_ranks(built(self)))
        mine = self.dist.is_main and claim_run_dir(
            run_dir, record, cfg.checkpoint, cfg.metrics.overwrite
        )
        if refusal := env.broadcast_from_rank0(mine):  # every rank refuses, or none
            raise TitanliteError(refusal)
        opened = open_checkpoint(cfg.checkpoint, run_dir, self)
        self.checkpointer, self.step = opened.checkpointer, opened.step
        history = History(run_dir=run_dir, resumed_from=opened.source)
        chain = build_watchers(
            Run.of(self, run_dir, restore_s=opened.seconds),
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
                (run_dir / "run.json").write_text(json.dumps(record, indent=2))
        try:
            notify(chain, "on_train_start")
            while self.step < cfg.training.steps:
                self._step_start = time.perf_counter()
                notify(chain, "on_step_start", self.step + 1)
                # the last step is always logged
                logged = (self.step + 1) % cfg.metrics.log_every == 0 or (
                    self.step + 1 == cfg.training.steps
                )
                out = self.train_step(self.next_micro_batches(), read=logged)
                self.step += 1
                seconds = time.perf_counter() - self._step_start
                notify(chain, "on_step_end", StepEnd(self.step, seconds, out, logged))
        finally:
            notify(chain, "close")
        notify(chain, "on_train_end")
        self.checkpointer = None  # closed by its watcher once the last save committed
        return history

    def close(self, barrier: bool = False) -> None:
        """Leave the process group (a no-op for a single process); barrier=True after a
        successful run, so no rank tears down while another still talks to it."""
        env.destroy_distributed(barrier)


if __name__ == "__main__":  # `python -m titanlite.train` (torchtitan's spelling) is not the entry
    raise SystemExit(
        "titanlite.train is a module, not a program: run `python -m titanlite train "
        "--config ...` (or `torchrun ... -m titanlite train --config ...`)"
    )
