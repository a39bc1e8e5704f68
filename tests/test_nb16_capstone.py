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
    with pytest.raises(TitanliteError, match=r"does not split over \[1, 2\] ranks: use a multiple of 2"):
        lab.run_ladder(cfg, lab.ladder(2, 2), warmup=1)


def test_drill_band_grows_with_what_mean_step_charging_misses():
    measured = {"wall_s": 100.0, "lost_s": 1.0, "goodput": 0.4}
    tight = lab.DrillCheck(measured, {"goodput": 0.4}, [2], 1, step_s=1.0)
    assert tight.band == pytest.approx(0.03) and tight.error == 0
    compiled = lab.DrillCheck(measured, {"goodput": 0.38}, [2], 1, step_s=7.0)  # a long compile step in the mean
    assert compiled.band == pytest.approx(0.09) and abs(compiled.error) < compiled.band


@pytest.mark.parametrize("device, fresh_process, own", [
    ("cpu", True, True), ("cuda", True, True), ("mps", True, True),   # the first row its process trained
    ("cpu", False, False),    # the process's resident set: every row before it
    ("mps", False, False),    # a lifetime peak
    ("cuda", False, True)])   # the allocator's peak is reset every step and counts tensors only
def test_memory_is_own_from_device_facts(device, fresh_process, own):
    assert lab.memory_is_own(device, fresh_process) is own


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


def test_rows_on_the_same_ranks_train_in_one_job_with_the_same_micro_batches(tmp_path):
    """Smoke scale's multi-process path, for real: two FSDP rows in one 2-rank job, each its own
    run folder and records; the one-process rows accumulate the micro-batches FSDP's ranks take
    one each, so every row saw the same tokens and learned alike."""
    from titanlite.config import Config
    cfg = Config()
    cfg.model.preset, cfg.training.device, cfg.training.threads = "debug", "cpu", 1
    cfg.training.steps, cfg.training.batch_size, cfg.training.seq_len = 3, 4, 32
    cfg.training.deterministic = True
    cfg.eval.every, cfg.eval.sample_tokens = 0, 4
    cfg.metrics.log_dir, cfg.metrics.run_name = str(tmp_path), "g"
    seen = {}
    rungs = [lab.Rung("baseline", {}), lab.Rung("FSDP ×2", {"parallel.dp_shard": 2}, nproc=2),
             lab.Rung("+bf16", {"training.mixed_precision": "bf16"}, nproc=2)]
    rows = lab.run_ladder(cfg, rungs, warmup=1, in_process=True,
                          callbacks_for=lambda n: [seen.setdefault(n, []).append])
    assert [r["row"] for r in rows] == ["baseline", "FSDP ×2", "+bf16", "baseline (again)"]
    assert not any("error" in r for r in rows), rows
    by = lab.by_name(rows)
    assert [by[n]["overrides"]["training.grad_accum_steps"] for n in ("baseline", "FSDP ×2", "+bf16")] == [2, 1, 1]
    assert {r["overrides"]["training.batch_size"] for r in rows} == {2}
    assert len({(r["steps"], r["tokens"]) for r in rows}) == 1      # the same tokens for everyone
    assert [r["fresh_process"] for r in rows] == [False, True, False, False]
    assert by["FSDP ×2"]["peak_memory_bytes"] > 0 and by["+bf16"]["peak_memory_bytes"] is None
    assert by["+bf16"]["compute_dtype"] == "bfloat16" and by["FSDP ×2"]["compute_dtype"] == "float32"
    for name in ("FSDP ×2", "+bf16"):  # each row its own folder, and its steps reached its callbacks
        info = json.loads((tmp_path / f"g-{lab._slug(name)}" / "run.json").read_text())
        assert info["world_size"] == 2 and info["grad_accum_steps"] == 1
        assert sorted(r["step"] for r in seen[name] if r.get("kind") == "train" and r["rank"] == 0) == [1, 2, 3]
    # FSDP on 2 ranks computes what one process accumulating 2 micro-batches does
    assert by["FSDP ×2"]["loss"] == pytest.approx(by["baseline"]["loss"], rel=1e-4)


def test_a_row_leaves_no_compile_state_to_the_next_one_in_its_process():
    """Compiled rowwise FP8 turns Inductor's emulate_precision_casts on; a row trained after it
    in the same process (this kernel, or a shared job) must compile as a fresh process would."""
    import torch
    import torch._inductor.config as inductor_config
    from titanlite.efficiency.fp8 import set_precision_casts_for
    before = inductor_config.emulate_precision_casts
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(lambda x: x + 1, backend=backend)
    compiled(torch.ones(2))
    compiled(torch.ones(2))
    assert len(graphs) == 1
    with lab.as_a_fresh_process():
        compiled(torch.ones(2))
        assert len(graphs) == 2  # no graphs of the row before: it compiles again
        assert set_precision_casts_for("rowwise", compiled=True)
    assert inductor_config.emulate_precision_casts == before
