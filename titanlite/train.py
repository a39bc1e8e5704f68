"""The training loop: one readable function per concern, one loop that ties them together.

    history = Trainer(load_config("configs/debug.toml")).fit()

`fit` is the whole algorithm: micro-batches, forward, cross-entropy, backward, clip, optimizer step,
learning-rate schedule. `forward_backward` is one step's forward and backward (through the
pipeline's stages when there is one, as in torchtitan). Timing, MFU, goodput, checkpoints,
validation, samples and logging watch from the side (watchers.py); tools are handed to `fit`."""

import json
import math
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from . import hardware
from .config import Config
from .data import data_for
from .data.transfer import MicroBatches, micro_batches_to
from .device_policy import matmul_dtype, resolve_for_device
from .distributed import env
from .distributed.ddp import grad_sync, unwrap
from .distributed.parallelize import Techniques, loss_context_for, parallelize
from .efficiency.accumulation import count_targets, global_tokens_per_rank, loss_sum
from .efficiency.mixed_precision import Precision
from .errors import TitanliteError, writing
from .evaluate import generate, validation_loss
from .metrics import History
from .models.llama import count
from .optimizer import build_optimizer, build_schedule
from .preflight import preflight, prepare_process, tokenizer_for, tokenizer_size
from .resilience.resume import claim_run_dir, open_checkpoint, run_name_for
from .run_record import built, run_record
from .watchers import Run, StepEnd, build_watchers, notify


class Trainer:
    """A run, built in the order its parts need each other (each step one method below):

    1. preflight  - every check the config can fail, before a process group, data or model exists
    2. process    - this process's threads and allocator, the job joined, its device
    3. config     - the config's "auto"s decided by this device's facts (`self.cfg`)
    4. data       - the tokenizer and this rank's slice of every batch
    5. model      - built and parallelized: parallelize's chain of apply_* (distributed/)
    6. optimizer  - [optimizer]'s (AdamW, 8/4-bit, Adafactor, Muon) and its schedule
    7. MFU        - the peak the run's matmuls are measured against, from the tools handed in

    Tools handed in (`titanlite train` hands in all three): `peaks`, the peak finder MFU divides
    by (tools.probe.matmul_peak.MatmulPeaks; none, no MFU); `datasheet(device, dtype)`, vendor
    peaks (tools.probe.datasheet); `start_from`, a published model (tools.formats.hf_start)."""

    def __init__(self, cfg: Config | None = None, datasheet=None, start_from=None, peaks=None):
        asked = cfg or Config()  # as given; self.cfg is it with this device's "auto"s decided
        self.start_from, self.peaks = start_from, peaks
        self.plan = self._preflight(asked)
        self._join(asked)
        self.cfg = resolve_for_device(asked, self.device, self.dims.sharded)
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._find_peak(datasheet)
        self.step, self.checkpointer, self.replicas = 0, None, None  # fit() opens a checkpointer
        self._step_start = time.perf_counter()  # fit() resets it as each step begins
        if self.cfg.fault_tolerance.enable:  # one replica group of several (torchft, notebook 22)
            from .resilience.fault_tolerance import apply_ft

            self.replicas = apply_ft(self)

    def _preflight(self, asked: Config):
        # the batch (micro-batch, accumulation, global), the rank grid, the model's shape
        world = (env.torchrun_env() or env.ONE_PROCESS).world_size
        plan = preflight(asked, world, tokenizer_size(asked, self.start_from), self.start_from)
        self.dims, self.micro_batch = plan.dims, plan.micro_batch
        self.grad_accum_steps, self.global_batch = plan.grad_accum_steps, plan.global_batch
        self.model_args = plan.model_args  # worked out once, for the tokenizer's vocabulary
        return plan

    def _join(self, asked: Config) -> None:
        prepare_process(self.plan, asked)  # threads, allocator, memory: before any allocation
        # Under torchrun each process joins the job and takes its own device; alone, a world of one.
        p = asked.parallel
        self.dist = env.init_distributed(asked.training.device, p.backend, p.timeout_s)
        self.device = self.dist.device

    def _build_data(self) -> None:
        # Each data-parallel rank reads its own slice of every global batch (CP: of every sequence).
        tokenizer = tokenizer_for(self.cfg, self.start_from)
        self.data = data_for(self.cfg, tokenizer, self.micro_batch, self.dims, self.dist.rank)
        self.tokenizer = self.data.tokenizer

    def _build_model(self) -> None:
        # The techniques modify the model in place (swap Linears, wrap or compile blocks): state-dict
        # names stay the plain model's; DDP/FSDP come last. One part, or one per pipeline stage.
        cfg, dims = self.cfg, self.dims
        self.dtype = hardware.resolve_dtype(cfg.training.dtype, self.device)
        hardware.seed_everything(cfg.training.seed, cfg.training.deterministic)
        # FSDP/TP/PP ranks each see only their shard's overflow, and a replica group that rejoins
        # would start from a fresh loss scale: "auto" never picks fp16 (with a scaler) there.
        one_copy = not (dims.sharded or dims.tp > 1 or dims.pp > 1 or cfg.fault_tolerance.enable)
        self.precision = Precision(
            cfg.training.mixed_precision, self.device, scaler_ok=one_copy, param_dtype=self.dtype
        )
        self.flops_per_token, self.num_params = count(self.model_args, cfg.training.seq_len)
        self.mesh = dims.build_mesh(self.device.type)
        built = parallelize(
            self.model_args,
            dims,
            self.mesh,
            self.device,
            self.dtype,
            cfg.parallel,
            Techniques.of(cfg),
            example_shape=(self.micro_batch, cfg.training.seq_len // dims.cp),
            autocast_dtype=self.precision.dtype,
        )
        self.model_parts, self.pipe = built.parts, built.pipeline
        self.model = self.model_parts[0]
        self.loss_context = loss_context_for(cfg.parallel, dims)  # TP's sharded softmax, or nothing

    def _build_optimizer(self) -> None:
        # [optimizer]'s name over this rank's parts (optimizer.py: what each takes, fused or not)
        self.optimizer = build_optimizer(self.model_parts, self.cfg.optimizer, self.device)
        self.scheduler = build_schedule(self.optimizer, self.cfg.scheduler, self.cfg.training.steps)

    def _find_peak(self, datasheet) -> None:
        # MFU against the peak of the dtype the matmuls actually run in
        fp8 = getattr(unwrap(self.model), "fp8_info", None)
        gathered = self.cfg.parallel.param_dtype if self.dims.sharded else None
        self.compute_dtype = matmul_dtype(self.dtype, self.precision.dtype, gathered, fp8)
        self.datasheet_peak = datasheet(self.device, self.compute_dtype) if datasheet else None
        self.peak = self.peaks and self.peaks.find(
            self.device, self.compute_dtype, self.cfg.metrics.peak, self.datasheet_peak, self.dist
        )

    def loss_on(self, x, y, documents=None, num_tokens=None) -> torch.Tensor:
        """Summed cross-entropy over real targets / `num_tokens` (default: their count), each within its `documents`."""
        with self.precision.autocast():
            loss = loss_sum(self.model(x, documents), y)  # under TP, a replicated DTensor
            loss = loss.to_local() if hasattr(loss, "to_local") else loss
            return loss / (num_tokens if num_tokens is not None else max(1, count_targets(y)))

    def forward_backward(self, micro_batches: list, num_tokens) -> torch.Tensor:
        """Forward and backward of each micro-batch; the gradients add up in `.grad`. Returns
        the summed loss, on the device and unread (reading it would wait for the device). Under
        pipeline parallelism the schedule cuts each batch again and interleaves the stages'
        forwards and backwards (distributed/pipeline.py); the loss is on every stage."""
        total = torch.zeros((), device=self.device)
        for i, (x, y, *documents) in enumerate(micro_batches):
            # DDP all-reduces only after the last micro-batch (no_sync; the others add into .grad);
            # FSDP reduce-scatters each one, to keep gradients sharded (memory is what FSDP is for).
            last = i == len(micro_batches) - 1
            with (
                grad_sync(self.model, sync=last or self.dims.strategy != "ddp"),
                self.loss_context(),  # TP: the sharded softmax, and its backward
            ):
                if self.pipe is not None:
                    with self.precision.autocast(), record_function("forward_backward"):
                        total += self.pipe.step(x, y, *documents, num_tokens=num_tokens)
                else:
                    # record_function: labels a profiler trace shows; nearly free when off
                    with record_function("forward"):
                        loss = self.loss_on(x, y, *documents, num_tokens=num_tokens)
                    with record_function("backward"):
                        self.precision.backward(loss)
                    total += loss.detach()
        return total

    def train_step(self, micro_batches: list, read: bool = True) -> dict:
        """One optimizer step over `grad_accum_steps` micro-batches, each micro-batch's summed
        token loss divided by the whole global batch's token count (accumulation.py).
        `read=False` leaves loss and grad_norm unread (None): reading waits for the device."""
        # Until this rank's first collective of the step: where a straggler shows (then all wait).
        ready_s = time.perf_counter() - self._step_start
        num_tokens = global_tokens_per_rank(
            micro_batches, self.dims, self.device, self.dist.distributed
        )
        total = self.forward_backward(micro_batches, num_tokens)
        if self.replicas:  # fault tolerance: averaged over the replica groups in this step's quorum
            self.replicas.average_gradients(self.model_parts)
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
            self.precision.advance(self.scheduler)  # a step the fp16 scaler skipped too
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
        batches = [self.data.train.next_batch() for _ in range(self.grad_accum_steps)]
        return micro_batches_to(batches, self.device)

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
        `watchers`: more watchers, each made by `make(run)` (e.g. tools.measure.profiling.StepProfiler)."""
        cfg = self.cfg
        run_dir = Path(cfg.metrics.log_dir) / env.broadcast_from_rank0(run_name_for(cfg))
        # Everything that can refuse this start has run (config, data and layout in __init__,
        # another run in the folder and the checkpoint here) before anything in the run folder changes.
        record = run_record(self, env.gather_from_ranks(built(self)))
        claim_run_dir(run_dir, record, cfg, self.dist.is_main)  # or every rank refuses
        opened = open_checkpoint(cfg.checkpoint, run_dir, self)
        self.checkpointer, self.step = opened.checkpointer, opened.step
        history = History(run_dir=run_dir, resumed_from=opened.source)
        chain = build_watchers(
            Run.of(self, run_dir, restore_s=opened.seconds),
            history,
            callbacks=callbacks,
            extra=[*watchers, *([self.replicas.watcher] if self.replicas else [])],
            lr=lambda: self.scheduler.get_last_lr()[0],
            precision=self.precision,
            sample=self.sample,
            evaluate=self.evaluate,
            checkpointer=self.checkpointer,
            train_state=self.train_state,
            peaks=self.peaks,
        )
        if self.dist.is_main:
            with writing(run_dir / "run.json", "the run's record"):
                (run_dir / "run.json").write_text(json.dumps(record, indent=2))
        try:
            notify(chain, "on_train_start")
            while self.step < cfg.training.steps:
                self._step_start = time.perf_counter()
                notify(chain, "on_step_start", self.step + 1)  # [fault_tolerance]: may heal
                step = self.step + 1  # after a heal, the peer's; the last step is always logged
                logged = step % cfg.metrics.log_every == 0 or step == cfg.training.steps
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
