"""Notebook 16's lab: the ladder's rows, how a row is measured from a job's records, the drift."""
import json

import pytest

from titanlite.distributed.launcher import LaunchResult
from titanlite.errors import TitanliteError
from titanlite.labs import nb16_capstone as lab
from titanlite.models.llama import ModelArgs


def test_each_row_carries_the_ones_before_except_siblings():
    rows = dict((r.name, o) for r, o in lab.row_overrides(lab.ladder(nproc=2, every=3)))
    assert rows["baseline"] == {}
    assert rows["+FP8 rowwise"]["float8.recipe"] == "rowwise"
    # rowwise is measured instead of tensorwise: what follows carries tensorwise
    assert rows["+FP8 tensorwise"]["float8.recipe"] == "tensorwise"
    fsdp = rows["FSDP ×2"]
    assert fsdp["parallel.dp_shard"] == 2 and fsdp["compile.enable"] and fsdp["float8.recipe"] == "tensorwise"
    assert fsdp["training.mixed_precision"] == "bf16" and fsdp["activation_checkpoint.mode"] == "full"
    assert "float8.fsdp_all_gather" not in fsdp and rows["+FP8 all-gather"]["float8.fsdp_all_gather"]
    last = rows["+async checkpoint"]
    assert last["checkpoint.mode"] == "async" and last["checkpoint.every"] == 3 and last["float8.fsdp_all_gather"]


def test_ladder_order_and_ranks():
    rungs = lab.ladder(nproc=4, every=2)
    names = [r.name for r in rungs]
    # FP8 all-gathers are FSDP's: they come after the sharding, never on one process
    assert names.index("+FP8 all-gather") > names.index("FSDP ×4")
    assert all(r.nproc == (4 if i >= names.index("FSDP ×4") else 1) for i, r in enumerate(rungs))
    assert "5,762" in rungs[2].published and "10.67%" in rungs[2].published  # labelled figures


@pytest.mark.parametrize("gpus, cores, smoke, expected", [
    (8, 64, False, ("cuda", 8)), (6, 64, False, ("cuda", 4)), (2, 8, True, ("cuda", 2)),
    (1, 16, False, ("cpu", 4)),   # one GPU cannot hold FSDP's ranks
    (0, 2, False, ("cpu", 2)), (0, 16, True, ("cpu", 2))])
def test_ladder_layout_from_device_facts(gpus, cores, smoke, expected):
    assert lab.ladder_layout(gpus, cores, smoke) == expected


def test_drift_and_verdict():
    rows = [{"tokens_per_sec": 1000.0}, {"tokens_per_sec": 500.0}, {"tokens_per_sec": 900.0}]
    band = lab.drift(rows)
    assert band == pytest.approx(100 / 950)
    assert lab.verdict(1.05, band) == "within drift"
    assert lab.verdict(1.2, band) == "faster (beyond drift)" and lab.verdict(0.5, band) == "slower (beyond drift)"


def _record(step, rank, tps, mem, loss, attempt=0):
    return {"kind": "train", "step": step, "rank": rank, "tokens_per_sec": tps, "mfu": tps / 1e4,
            "peak_memory_bytes": mem, "loss": loss, "step_time_s": 1000 / tps, "tokens": step * 256,
            "attempt": attempt, "peak_label": "measured"}


def test_measure_row_reads_medians_after_warmup_and_the_largest_rank(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"compute_dtype": "torch.bfloat16", "peak_flops": 1e12,
                                                   "float8": {"recipe": "tensorwise", "emulated": True}}))
    records = [_record(1, 0, 10.0, 100, 9.0), _record(1, 1, 10.0, 120, 9.0),   # warm-up: compile
               _record(2, 0, 400.0, 100, 8.0), _record(2, 1, 400.0, 130, 8.0),
               _record(3, 0, 500.0, 110, 7.5), _record(3, 1, 500.0, 125, 7.5),
               _record(3, 0, 450.0, 105, 7.4, attempt=1),                      # step 3 again after a restart
               _record(4, 0, 600.0, 100, 7.0), _record(4, 1, 600.0, 120, 7.0)]
    result = LaunchResult(run_dir=tmp_path, command="torchrun ...", wall_s=12.0, job_id="x", records=records)
    row = lab.measure_row("+FP8 tensorwise", result, warmup=1, nproc=2)
    assert row["tokens_per_sec"] == 450.0            # median of steps 2-4, step 3's last attempt
    assert row["first_step_s"] == 100.0 and row["steps"] == 4 and row["tokens"] == 4 * 256
    assert row["peak_memory_bytes"] == 130           # the largest rank's
    assert (row["loss"], row["first_loss"]) == (7.0, 9.0)
    assert row["compute_dtype"] == "bfloat16" and row["fp8"] == "FP8 tensorwise, emulated"
    assert row["mfu_datasheet"] is None

    class Sheet:
        flops = 4e12
    assert lab.measure_row("x", result, warmup=1, nproc=2, datasheet_peak=Sheet())["mfu_datasheet"] == \
        pytest.approx(0.045 / 4)


def test_table_has_every_row_and_labels_failures():
    ok = {"tokens_per_sec": 1000.0, "mfu": 0.1, "mfu_datasheet": None, "peak_memory_bytes": 2**30, "loss": 7.0,
          "first_step_s": 1.0, "compute_dtype": "float32", "fp8": "", "nproc": 1}
    rows = [{**ok, "row": "baseline"}, {"row": "+compile", "nproc": 1, "error": "no C++ compiler"},
            {**ok, "row": "+FP8 tensorwise", "fp8": "FP8 tensorwise, emulated", "published": "torchtitan 1.48×",
             "tokens_per_sec": 500.0},
            {**ok, "row": "baseline (again)", "tokens_per_sec": 1100.0}]
    text = lab.table(rows)
    for r in rows:
        assert r["row"] in text
    assert "failed: no C++ compiler" in text and "torchtitan 1.48×" in text and "emulated" in text
    assert "slower (beyond drift)" in text and "drift of the baseline" in text


def test_uneven_batch_is_refused_before_any_job_starts():
    from titanlite.config import Config
    cfg = Config()
    cfg.training.batch_size = 3
    with pytest.raises(TitanliteError, match="does not split over 2 ranks"):
        lab.run_ladder(cfg, lab.ladder(2, 2), warmup=1)


def test_drill_band_grows_with_what_mean_step_charging_misses():
    measured = {"wall_s": 100.0, "lost_s": 1.0, "goodput": 0.4}
    tight = lab.DrillCheck(measured, {"goodput": 0.4}, [2], 1, step_s=1.0)
    assert tight.band == pytest.approx(0.03) and tight.error == 0
    compiled = lab.DrillCheck(measured, {"goodput": 0.38}, [2], 1, step_s=7.0)  # a long compile step in the mean
    assert compiled.band == pytest.approx(0.09) and abs(compiled.error) < compiled.band


@pytest.mark.parametrize("device, in_process, own", [
    ("cpu", False, True), ("cuda", False, True), ("mps", False, True),   # a fresh job's is its own
    ("cpu", True, False),    # the kernel's resident set: every row before it
    ("mps", True, False),    # a lifetime peak
    ("cuda", True, True)])   # the allocator's peak is reset every step and counts tensors only
def test_memory_is_own_from_device_facts(device, in_process, own):
    assert lab.memory_is_own(device, in_process) is own


def test_table_and_recipe_show_memory_that_is_not_a_rows_own_as_not_comparable():
    ok = {"tokens_per_sec": 1000.0, "mfu": 0.1, "mfu_datasheet": None, "peak_memory_bytes": None, "loss": 7.0,
          "first_step_s": 1.0, "compute_dtype": "float32", "fp8": "", "nproc": 1}
    rows = [{**ok, "row": "baseline"}, {**ok, "row": "FSDP ×2", "nproc": 2, "peak_memory_bytes": 2**30},
            {**ok, "row": "baseline (again)"}]
    text = lab.table(rows)
    assert "—*" in text and "not the row's own" in text
    assert "—*" not in lab.table([{**r, "peak_memory_bytes": 2**30} for r in rows])  # no footnote needed
    lines = [ln for ln in lab.choose_recipe(ModelArgs.preset("small", vocab_size=4096), 2, 80e9, rows, seq_len=64)
             .splitlines() if "FSDP ×2" in ln and "speed" in ln]
    assert lines and "memory per rank not comparable" in lines[0]


def test_in_process_rows_train_here_and_are_measured_like_jobs(tmp_path):
    """Smoke scale's path, for real: the one-process rows through `Trainer.fit` in this process."""
    import torch
    from titanlite.config import Config
    cfg = Config()
    cfg.model.preset, cfg.training.device, cfg.training.threads = "debug", "cpu", 1
    cfg.training.steps, cfg.training.batch_size, cfg.training.seq_len = 3, 2, 32
    cfg.eval.every, cfg.eval.sample_tokens = 0, 4
    cfg.metrics.log_dir, cfg.metrics.run_name = str(tmp_path), "t"
    threads = torch.get_num_threads()
    seen = []
    rungs = [lab.Rung("baseline", {}), lab.Rung("+bf16", {"training.mixed_precision": "bf16"})]
    rows = lab.run_ladder(cfg, rungs, warmup=1, in_process=True, callbacks_for=lambda n: [seen.append])
    assert [r["row"] for r in rows] == ["baseline", "+bf16", "baseline (again)"]
    assert all(r["in_process"] and r["steps"] == 3 and r["tokens_per_sec"] > 0 for r in rows)
    assert all(r["peak_memory_bytes"] is None for r in rows)   # CPU, in this process: not its own
    assert rows[1]["overrides"]["training.mixed_precision"] == "bf16" and rows[1]["compute_dtype"] != "float32"
    assert (tmp_path / "t-bf16" / "run.json").is_file()        # each row its own run folder
    assert len([r for r in seen if r.get("kind") == "train"]) == 9   # the callbacks saw every step
    assert rows[0]["loss"] == rows[2]["loss"]                  # the same computation twice
    assert torch.get_num_threads() == threads                  # the kernel's threads are given back
