"""titanlite.hardware / datasheet / memory / roofline: devices, dtypes, peaks, MFU, memory, roofline."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from titanlite import TitanliteError, hardware, memory, peaks
from titanlite.peaks import Peak
from titanlite.tools.probe import datasheet, matmul_peak, roofline
from titanlite.tools.probe.roofline import measure_memory_bandwidth

HAS_CUDA = torch.cuda.is_available()
HAS_MPS = torch.backends.mps.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
needs_mps = pytest.mark.skipif(
    not HAS_MPS, reason="needs Apple MPS (torch.backends.mps.is_available() is False)"
)


# ---- devices -------------------------------------------------------------------------------
def test_auto_picks_cuda_then_mps_then_cpu():
    expected = "cuda" if HAS_CUDA else "mps" if HAS_MPS else "cpu"
    assert hardware.detect_device("auto").type == expected
    assert hardware.detect_device().type == expected
    assert hardware.detect_device(" CPU ") == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA GPU is visible, so requesting cuda succeeds")
def test_requesting_missing_cuda_is_a_one_line_error():
    with pytest.raises(TitanliteError) as e:
        hardware.detect_device("cuda")
    msg = str(e.value)
    assert "\n" not in msg
    assert "torch.cuda.is_available() is False" in msg and "auto or cpu" in msg
    with pytest.raises(TitanliteError, match="no CUDA GPU"):
        hardware.detect_device("cuda:1")


@pytest.mark.skipif(HAS_MPS, reason="MPS is available, so requesting mps succeeds")
def test_requesting_missing_mps_is_a_one_line_error():
    with pytest.raises(TitanliteError, match="MPS is not available") as e:
        hardware.detect_device("mps")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "bad, hint", [("cdua", "cuda"), ("cpuu", "cpu"), ("mpss", "mps"), ("atuo", "auto")]
)
def test_unknown_device_suggests_the_nearest(bad, hint):
    with pytest.raises(TitanliteError, match=f"did you mean: {hint}"):
        hardware.detect_device(bad)


def test_malformed_index_is_rejected():
    with pytest.raises(TitanliteError, match="unknown device"):
        hardware.detect_device("cuda:x")


def test_cpu_name_says_cpu_and_threads():
    name = hardware.device_name("cpu")
    n = torch.get_num_threads()
    assert name.endswith(f"(CPU, {n} thread{'s' * (n != 1)})") and len(name) > len(
        "(CPU, 1 thread)"
    )
    assert hardware.device_name("cpu", 1).endswith("(CPU, 1 thread)")  # not "1 threads"
    # The threads a run will use, where they differ from this process's (notebook 16's smoke
    # rows run one thread each on a 2-thread machine: it once said "2 threads").
    assert hardware.device_name("cpu", torch.get_num_threads() + 3).endswith(
        f"(CPU, {torch.get_num_threads() + 3} threads)"
    )


# ---- dtypes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_aliases(name, dtype):
    assert hardware.resolve_dtype(name, "cpu") is dtype


def test_unknown_dtype_suggests_the_nearest():
    with pytest.raises(TitanliteError, match="did you mean: bfloat16"):
        hardware.resolve_dtype("bfloat61", "cpu")
    with pytest.raises(TitanliteError, match="unknown dtype"):
        hardware.resolve_dtype("int8", "cpu")


def test_bf16_on_a_pre_ampere_gpu_is_refused(monkeypatch):
    # Fake a V100 (sm_70): the capability check must run without a real GPU.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(hardware, "device_name", lambda device: "Tesla V100-SXM2-16GB")
    with pytest.raises(TitanliteError, match="sm_70.*--training.mixed_precision fp16") as e:
        hardware.resolve_dtype("bf16", torch.device("cuda"))
    assert "\n" not in str(e.value)
    assert hardware.resolve_dtype("fp16", torch.device("cuda")) is torch.float16


# ---- timing and peaks ----------------------------------------------------------------------
def test_time_fn_warms_up_and_returns_a_positive_time():
    calls = []
    seconds = matmul_peak.time_fn(lambda: calls.append(1), "cpu", budget_s=0.01)
    assert seconds > 0 and len(calls) >= 2  # warm-up call + at least one timed call


def test_measured_peak_is_positive_and_labelled():
    peak = matmul_peak.measure_matmul_peak("cpu", torch.float32, budget_s=0.2)
    assert peak.flops > 1e6 and peak.source == "measured"
    assert peak.label.startswith("measured float32 matmul peak") and "CPU" in peak.label


def test_measure_rejects_a_format_without_a_matmul():
    # e5m2 is FP8's gradient format: real FP8 matmuls take e4m3 inputs, so there is no e5m2 peak.
    for measure in (matmul_peak.measure_matmul_peak, datasheet.measure_matmul_peak):
        with pytest.raises(
            TitanliteError, match="or float16 .float8_e4m3fn: tools.probe.datasheet"
        ):
            measure("cpu", torch.float8_e5m2, budget_s=0.1)
    with pytest.raises(TitanliteError, match="cannot measure a matmul peak in torch.float8_e4m3fn"):
        matmul_peak.measure_matmul_peak(
            "cpu", torch.float8_e4m3fn, budget_s=0.1
        )  # the core has no FP8


@pytest.fixture
def counted_measure(monkeypatch, tmp_path):
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(device, dtypes, rounds=3, budget_s=2.0):  # each measurement 10% above the last
        out = {}
        for dtype in dtypes:
            calls.append(dtype)
            out[dtype] = (Peak(100e9 * (1 + 0.1 * len(calls)), "measured", f"fake {dtype}"), 0.01)
        return out

    monkeypatch.setattr(matmul_peak, "measure_peaks", fake)
    return calls


def test_matmul_peak_is_cached_on_disk(counted_measure, tmp_path):
    first = matmul_peak.matmul_peak("cpu", torch.float32)
    second = matmul_peak.matmul_peak("cpu", torch.float32)
    assert len(counted_measure) == 1, "second call must read the cache, not measure"
    assert second.flops == first.flops and "[cached" in second.label
    stored = json.loads((tmp_path / "matmul_peaks.json").read_text())
    assert len(stored) == 1 and torch.__version__ in next(iter(stored))
    assert [p.name for p in tmp_path.iterdir()] == ["matmul_peaks.json"]  # no temp file left over
    matmul_peak.matmul_peak("cpu", torch.bfloat16)  # another dtype is another key
    refreshed = matmul_peak.matmul_peak("cpu", torch.float32, refresh=True)
    assert len(counted_measure) == 3 and refreshed.flops != first.flops


def test_cache_key_includes_threads(counted_measure):
    matmul_peak.matmul_peak("cpu", torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        matmul_peak.matmul_peak("cpu", torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert len(counted_measure) == 2


def test_corrupt_cache_is_remeasured_not_fatal(counted_measure, tmp_path):
    (tmp_path / "matmul_peaks.json").write_text("{not json")
    assert matmul_peak.matmul_peak("cpu", torch.float32).flops > 0
    assert len(counted_measure) == 1


def test_unwritable_cache_warns_but_returns_the_peak(counted_measure, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(blocker / "cache"))  # a folder inside a file
    with pytest.warns(RuntimeWarning, match="TITANLITE_CACHE_DIR"):
        assert matmul_peak.matmul_peak("cpu", torch.float32).flops > 0


def test_cache_dir_defaults_to_home(monkeypatch):
    monkeypatch.delenv("TITANLITE_CACHE_DIR", raising=False)
    assert matmul_peak.cache_dir() == Path.home() / ".cache" / "titanlite"


FRESH = {
    "flops": 1e11,
    "label": "measured",
    "measured_at": 1_000_000.0,
    "threads": 4,
    "torch": "2.13.0",
    "device": "Some CPU (CPU, 4 threads)",
}


def _stale(
    entry=FRESH,
    now=1_000_000.0 + 3600,
    threads=4,
    torch_version="2.13.0",
    device_name="Some CPU (CPU, 4 threads)",
):
    return matmul_peak.peak_is_stale(entry, now, threads, torch_version, device_name)


def test_a_fresh_peak_of_the_same_machine_is_not_stale():
    assert _stale() is None
    assert _stale(now=FRESH["measured_at"] + matmul_peak.PEAK_MAX_AGE_S) is None


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"now": 1_000_000.0 + 8 * 86400}, "8.0 days ago"),
        ({"now": 1_000_000.0 - 60}, "days ago"),  # the clock went backwards: trust nothing
        ({"threads": 16}, "threads=4, now 16"),
        ({"torch_version": "2.11.0"}, "torch='2.13.0', now '2.11.0'"),
        ({"device_name": "NVIDIA H100 80GB HBM3"}, "device="),
        (
            {"entry": {k: v for k, v in FRESH.items() if k != "measured_at"}},
            "no usable",
        ),  # old format
        ({"entry": None}, "no usable"),
    ],
)
def test_a_peak_is_stale_when_old_or_measured_elsewhere(change, reason):
    assert reason in _stale(**change)


def test_an_expired_cache_entry_is_measured_again(counted_measure, tmp_path, monkeypatch):
    first = matmul_peak.matmul_peak("cpu", torch.float32)
    real_time = time.time
    monkeypatch.setattr(
        matmul_peak.time, "time", lambda: real_time() + matmul_peak.PEAK_MAX_AGE_S + 60
    )
    again = matmul_peak.matmul_peak("cpu", torch.float32)
    assert len(counted_measure) == 2 and again.flops != first.flops  # measured, and kept
    entry = next(iter(json.loads((tmp_path / "matmul_peaks.json").read_text()).values()))
    assert entry["measured_at"] > real_time() + matmul_peak.PEAK_MAX_AGE_S
    assert entry["threads"] == torch.get_num_threads() and entry["torch"] == torch.__version__
    assert entry["device"] == hardware.device_name("cpu")


def test_a_peak_is_replaced_only_by_one_that_beats_it_beyond_its_spread(tmp_path, monkeypatch):
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(tmp_path))
    low = Peak(50e9, "measured", "measured float32 matmul peak (planted, busy machine)")
    planted = matmul_peak.record_peak("cpu", torch.float32, low, spread=0.10)
    assert planted.flops == 50e9 and "spread 10%" in planted.label and "load" in planted.label
    # Within the planted peak's 10% spread, above or below it: noise, the cached peak stays.
    for flops in (54e9, 30e9):
        kept = matmul_peak.record_peak("cpu", torch.float32, Peak(flops, "measured", "x"), 0.02)
        assert kept.flops == 50e9
    # Beyond it: the quieter measurement wins, and everything that reads the cache sees it.
    won = matmul_peak.record_peak(
        "cpu", torch.float32, Peak(80e9, "measured", "quiet"), spread=0.03
    )
    assert won.flops == 80e9 and "spread 3%" in won.label
    monkeypatch.setattr(
        matmul_peak, "measure_peaks", lambda *a, **k: pytest.fail("must read the cache")
    )
    assert matmul_peak.matmul_peak("cpu", torch.float32).flops == 80e9  # what the trainer reads
    assert matmul_peak.get_peak("cpu", torch.float32, "measured").flops == 80e9
    stored = json.loads((tmp_path / "matmul_peaks.json").read_text())
    assert [e["flops"] for e in stored.values()] == [80e9]


def test_a_noisy_measurement_never_becomes_the_peak_and_a_beaten_one_is_replaced(
    tmp_path, monkeypatch
):
    """Seen in the doctor: a peak measured at 100% spread (a busy moment) was cached and kept,
    although later runs beat it and a quiet re-measurement gave 1.8x: every MFU after it read
    ~100%. A measurement noisier than MAX_SPREAD is used, labelled, and never cached; once a run
    has beaten the cached peak, any higher measurement replaces it, within its spread or not."""
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_peak, "_RECHECKED", set())
    noisy = matmul_peak.record_peak("cpu", torch.float32, Peak(177.6e9, "measured", "busy"), 1.0)
    assert noisy.flops == 177.6e9 and "too noisy to keep" in noisy.label
    assert not (tmp_path / "matmul_peaks.json").exists()
    planted = matmul_peak.record_peak("cpu", torch.float32, Peak(200e9, "measured", "ok"), 0.20)
    assert planted.flops == 200e9
    again = matmul_peak.record_peak("cpu", torch.float32, Peak(300e9, "measured", "x"), 0.9)
    assert again.flops == 200e9  # too noisy to replace it either
    within = Peak(230e9, "measured", "quiet")  # inside the cached one's 20% spread
    assert matmul_peak.record_peak("cpu", torch.float32, within, 0.02).flops == 200e9
    assert matmul_peak.record_peak("cpu", torch.float32, within, 0.02, beaten=True).flops == 230e9
    said = []
    monkeypatch.setattr(
        matmul_peak,
        "measure_peaks",
        lambda device, dtypes: {dtypes[0]: (Peak(322e9, "measured", "now"), 0.05)},
    )
    cached = matmul_peak.matmul_peak("cpu", torch.float32)
    fresh = matmul_peak.recheck_peak(260e9, cached, "cpu", torch.float32, say=said.append)
    assert fresh.flops == 322e9 and matmul_peak.matmul_peak("cpu", torch.float32).flops == 322e9
    assert "in force now" in said[0]


def test_a_run_beating_its_peak_re_measures_it_once(counted_measure, monkeypatch):
    monkeypatch.setattr(matmul_peak, "_RECHECKED", set())
    cached = matmul_peak.matmul_peak("cpu", torch.float32)
    said = []
    assert (
        matmul_peak.recheck_peak(cached.flops / 2, cached, "cpu", torch.float32, say=said.append)
        is cached
    )
    fresh = matmul_peak.recheck_peak(
        cached.flops * 2, cached, "cpu", torch.float32, say=said.append
    )
    assert len(counted_measure) == 2 and fresh.flops > cached.flops
    assert len(said) == 1 and "above the peak" in said[0] and "re-measured" in said[0]
    # Still beaten: no third measurement (mfu() warns instead), and datasheet peaks are left alone.
    assert (
        matmul_peak.recheck_peak(fresh.flops * 2, fresh, "cpu", torch.float32, say=said.append)
        is fresh
    )
    sheet = Peak(1.0, "datasheet", "datasheet: test")
    assert matmul_peak.recheck_peak(10.0, sheet, "cpu", torch.float16, say=said.append) is sheet
    assert len(counted_measure) == 2 and len(said) == 1


def test_an_mfu_above_one_is_measured_against_a_peak_taken_again_with_its_noise(
    counted_measure, monkeypatch
):
    """notebook 01's claim, MFU <= 1: below its peak a run is measured against it (no noise
    allowed); beyond it, against the peak in force now (the cache, which a re-check during the run
    may have raised), and beyond that too the peak is measured again and the run compared with
    the better of the two, allowing the new measurement's spread, never more than MAX_SPREAD; a
    datasheet peak is never re-measured."""
    cached = matmul_peak.matmul_peak("cpu", torch.float32)  # 110 GFLOP/s (the fake's first)
    mfu, noise, label = matmul_peak.mfu_within_noise(55e9, cached, "cpu", torch.float32)
    assert mfu == pytest.approx(0.5) and (noise, label) == (0.0, cached.label)
    # the peak the run started with was lower than the one now cached: no new measurement
    started = Peak(50e9, "measured", "before the run's re-check")
    mfu, noise, label = matmul_peak.mfu_within_noise(88e9, started, "cpu", torch.float32)
    assert mfu == pytest.approx(0.8) and (noise, label) == (0.0, cached.label)
    assert len(counted_measure) == 1
    mfu, noise, label = matmul_peak.mfu_within_noise(240e9, cached, "cpu", torch.float32)
    assert mfu == pytest.approx(240 / 120) and noise == 0.01 and len(counted_measure) == 2
    assert label.startswith("0.12 TFLOP/s (measured again now;") and "beat 0.11," in label
    # a noisy machine: measured three times at most, the noise allowed capped, the better peak used
    tries = []
    monkeypatch.setattr(
        matmul_peak,
        "measure_peaks",
        lambda device, dtypes: tries.append(1) or {dtypes[0]: (Peak(90e9, "measured", "x"), 0.6)},
    )
    mfu, noise, label = matmul_peak.mfu_within_noise(240e9, cached, "cpu", torch.float32)
    assert len(tries) == 3 and noise == matmul_peak.MAX_SPREAD and "cached, above" in label
    assert mfu == pytest.approx(240 / 110)
    sheet = Peak(1e9, "datasheet", "datasheet: test")
    assert matmul_peak.mfu_within_noise(2e9, sheet, "cpu", torch.float32)[:2] == (2.0, 0.0)
    assert len(tries) == 3 and len(counted_measure) == 2


# ---- datasheet -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gpu, dtype, tf32, tflops, product",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.5, "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, False, 1979, "H100 SXM"),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756, "H100 PCIe"),
        ("NVIDIA H100 NVL", torch.float16, False, 835.5, "H100 NVL"),
        ("NVIDIA H200", torch.bfloat16, False, 989.5, "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5, "A100"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156, "A100"),
        ("NVIDIA L40S", torch.bfloat16, False, 362.05, "L40S"),
        ("NVIDIA L40", torch.bfloat16, False, 181.05, "L40"),
        ("NVIDIA L4", torch.bfloat16, False, 121, "L4"),
        ("NVIDIA A10G", torch.bfloat16, False, 70, "A10G"),
        ("NVIDIA A10", torch.bfloat16, False, 125, "A10"),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, False, 165.2, "GeForce RTX 4090"),
        ("Tesla V100-SXM2-16GB", torch.float16, False, 125, "V100 SXM2"),
        ("Tesla V100-SXM2-16GB", torch.float32, True, 15.7, "V100 SXM2"),  # no TF32 on Volta
        ("Tesla T4", torch.float16, False, 65, "T4"),
        # torch.cuda.get_device_name() strings of the newer rows
        ("NVIDIA B200", torch.bfloat16, False, 2250, "B200"),
        ("NVIDIA B200", torch.float8_e4m3fn, False, 4500, "B200"),
        ("NVIDIA B200", torch.float32, False, 75, "B200"),  # HGX B200: 600 TFLOPS / 8 GPUs
        ("NVIDIA B200", torch.float32, True, 1125, "B200"),  # 18 PFLOPS sparse / 8 / 2
        ("NVIDIA H800", torch.bfloat16, False, 989.5, "H800 SXM"),
        ("NVIDIA H800 PCIe", torch.bfloat16, False, 756, "H800 PCIe"),
        ("NVIDIA H20", torch.bfloat16, False, 148, "H20"),
        ("NVIDIA A800-SXM4-80GB", torch.bfloat16, False, 312, "A800"),
        ("NVIDIA A800 80GB PCIe", torch.float32, True, 156, "A800"),
        ("NVIDIA GeForce RTX 3090", torch.bfloat16, False, 71, "GeForce RTX 3090"),
        ("NVIDIA GeForce RTX 5090", torch.bfloat16, False, 209.5, "GeForce RTX 5090"),
        ("NVIDIA RTX 6000 Ada Generation", torch.bfloat16, False, 364.2, "RTX 6000 Ada"),
        ("NVIDIA RTX A6000", torch.float32, True, 77.4, "RTX A6000"),
    ],
)
def test_datasheet_lookup_by_name(gpu, dtype, tf32, tflops, product):
    peak = datasheet.lookup_datasheet(gpu, dtype, tf32=tf32)
    assert peak is not None and peak.flops == pytest.approx(tflops * 1e12)
    assert peak.source == "datasheet" and peak.label.startswith("datasheet: ")
    assert f"NVIDIA {product} dense" in peak.label


@pytest.mark.parametrize(
    "gpu, dtype",
    [
        ("Tesla V100-SXM2-16GB", torch.bfloat16),  # no bf16 units
        ("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn),
        ("Some Future GPU", torch.bfloat16),
    ],
)
def test_datasheet_lookup_misses_return_none(gpu, dtype):
    assert datasheet.lookup_datasheet(gpu, dtype) is None


@pytest.mark.parametrize(
    "gpu",
    [
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 4080 Laptop GPU",
        "NVIDIA GB200",
    ],
)
def test_variants_with_other_peaks_are_not_matched_to_the_desktop_part(gpu):
    # "RTX 4090" inside "RTX 4090 Laptop GPU" must not quote the desktop card's 165 TFLOP/s.
    assert datasheet.lookup_datasheet(gpu, torch.bfloat16) is None


def test_amd_rows_and_their_fp8_format():
    from titanlite.tools.probe.datasheet import fp8_dtypes_for

    for gpu in ("AMD Instinct MI300X", "AMD Instinct MI325X"):
        assert datasheet.lookup_datasheet(gpu, torch.bfloat16).flops == pytest.approx(1307.4e12)
        assert fp8_dtypes_for(gpu) == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
        fp8 = datasheet.lookup_datasheet(gpu, torch.float8_e4m3fnuz)
        assert fp8 is not None and fp8.flops == pytest.approx(2614.9e12)
    assert fp8_dtypes_for("NVIDIA H100 80GB HBM3") == (torch.float8_e4m3fn, torch.float8_e5m2)


def test_datasheet_mfu_beside_the_measured_one(monkeypatch):
    assert datasheet.datasheet_mfu(1e12, "cpu", torch.float32) is None  # no CPU datasheet
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert datasheet.datasheet_mfu(
        494.75e12, torch.device("cuda"), torch.bfloat16
    ) == pytest.approx(0.5)
    assert datasheet.datasheet_mfu(
        989.5e12, torch.device("cuda"), torch.float8_e4m3fn
    ) == pytest.approx(0.5)


def test_fp8_matmul_peak_is_measured_through_scaled_mm():
    peak = datasheet.measure_matmul_peak("cpu", torch.float8_e4m3fn, budget_s=0.3)
    assert peak.flops > 0 and "float8_e4m3fn" in peak.label


def test_datasheet_peak_for_a_faked_cuda_device(monkeypatch):
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(matmul_peak, "_tf32_enabled", lambda: False)
    peak = datasheet.datasheet_peak(torch.device("cuda"), torch.bfloat16)
    assert peak.label == "datasheet: NVIDIA H100 SXM dense bf16 989.5 TFLOP/s"
    assert datasheet.datasheet_peak("cpu", torch.float32) is None


def test_get_peak_sources(counted_measure, monkeypatch):
    with pytest.raises(TitanliteError, match="no datasheet peak.*source='measured'"):
        matmul_peak.get_peak("cpu", torch.float32, source="datasheet")
    with pytest.raises(TitanliteError, match="did you mean: measured"):
        matmul_peak.get_peak("cpu", torch.float32, source="measure")
    assert matmul_peak.get_peak("cpu", torch.float32, "measured").source == "measured"
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    auto = matmul_peak.get_peak(
        torch.device("cuda"), torch.bfloat16, datasheet=datasheet.datasheet_peak
    )
    assert auto.source == "measured" and "datasheet: NVIDIA A100 dense bf16 312" in auto.label
    # Without the tool handed in, the core knows no datasheet: measured only, and one line for
    # source="datasheet" that says how to hand it in.
    assert "datasheet" not in matmul_peak.get_peak(torch.device("cuda"), torch.bfloat16).label
    with pytest.raises(TitanliteError, match="hand in tools.probe.datasheet.datasheet_peak"):
        matmul_peak.get_peak(torch.device("cuda"), torch.bfloat16, source="datasheet")


# ---- MFU -----------------------------------------------------------------------------------
def test_mfu_is_a_plain_ratio_below_one():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peaks.mfu(25.0, Peak(100.0, "measured", "test peak below")) == 0.25


def test_mfu_above_one_warns_once_and_is_not_clamped():
    peak = Peak(100.0, "measured", "test peak too low")
    with pytest.warns(RuntimeWarning, match="test peak too low.*refresh=True"):
        assert peaks.mfu(150.0, peak) == 1.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert peaks.mfu(160.0, peak) == 1.6
    assert not caught


def test_mfu_rejects_a_zero_peak():
    with pytest.raises(TitanliteError, match="refresh=True"):
        peaks.mfu(1.0, Peak(0.0, "measured", "broken"))


# ---- bandwidth and memory ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["copy", "read", "best"])
def test_memory_bandwidth_is_positive(kind):
    assert measure_memory_bandwidth("cpu", nbytes=4 * 2**20, budget_s=0.05, kind=kind) > 1e6


def test_memory_bandwidth_in_another_dtype():
    assert measure_memory_bandwidth("cpu", 2 * 2**20, 0.05, kind="read", dtype=torch.bfloat16) > 1e6


def test_memory_bandwidth_kind_typo():
    with pytest.raises(TitanliteError, match="did you mean: copy"):
        measure_memory_bandwidth("cpu", nbytes=2**20, kind="cpoy")


def test_cpu_peak_memory_is_positive_and_never_falls_without_reset():
    before = memory.peak_memory_bytes("cpu")
    assert before > 0 and set(memory.MEMORY_METRIC_DOC) == {"cuda", "mps", "cpu"}
    big = torch.ones(16 * 2**20)
    del big
    assert memory.peak_memory_bytes("cpu") >= before  # a high-water mark, not current use


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak-RSS reset needs Linux clear_refs"
)
def test_cpu_peak_memory_sees_a_big_tensor_and_resets_on_linux():
    memory.reset_peak_memory("cpu")
    start = memory.peak_memory_bytes("cpu")
    big = torch.ones(64 * 2**20)  # 256 MiB, written so every page is resident
    high = memory.peak_memory_bytes("cpu")
    del big
    memory.reset_peak_memory("cpu")
    after = memory.peak_memory_bytes("cpu")
    if after == high:
        pytest.skip("/proc/self/clear_refs is not writable here; the peak is lifetime-only")
    assert high >= start + 250 * 2**20
    assert after <= high - 200 * 2**20


# ---- roofline ------------------------------------------------------------------------------
def test_roofline_math():
    assert roofline.matmul_cost(2, 3, 4, torch.float32) == (48.0, (8 + 12 + 6) * 4.0)
    assert roofline.matmul_cost(2, 3, 4, torch.bfloat16)[1] == (8 + 12 + 6) * 2.0
    assert roofline.ridge_point(100.0, 10.0) == 10.0
    assert roofline.roofline_bound(1.0, 100.0, 10.0) == 10.0  # memory-bound: intensity x bandwidth
    assert roofline.roofline_bound(50.0, 100.0, 10.0) == 100.0  # compute-bound: the peak
    assert roofline.is_memory_bound(5.0, 100.0, 10.0) and not roofline.is_memory_bound(
        20.0, 100.0, 10.0
    )


def test_roofline_table_rows():
    points = [
        roofline.OpPoint("low", flops=10.0, bytes=10.0, seconds=2.0),  # I=1, 5 FLOP/s
        roofline.OpPoint("high", flops=1000.0, bytes=10.0, seconds=20.0),
    ]  # I=100, 50 FLOP/s
    low, high = roofline.roofline_table(
        points, Peak(100.0, "measured", "table peak"), bandwidth=10.0
    )
    assert (
        low["memory_bound"]
        and low["bound"] == 10.0
        and low["of_roof"] == 0.5
        and low["mfu"] == 0.05
    )
    assert not high["memory_bound"] and high["bound"] == 100.0 and high["mfu"] == 0.5


def test_measured_points_and_plot():
    mm = roofline.measure_matmul(64, 32, 16, torch.float32, "cpu", budget_s=0.01)
    add = roofline.measure_add(1024, torch.float32, "cpu", budget_s=0.01)
    assert mm.flops == 2 * 64 * 32 * 16 and mm.achieved > 0 and mm.name == "matmul 64x16@16x32"
    assert add.intensity == pytest.approx(1 / 12)  # 1 FLOP per 3 fp32 elements moved
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = roofline.plot_roofline([mm, add], Peak(1e12, "measured", "plot peak"), bandwidth=1e10)
    assert ax.get_xscale() == "log" and len(ax.lines) >= 4  # roof, ridge, two points
    plt.close(ax.figure)


@pytest.mark.parametrize("seed", range(30))
def test_every_roofline_label_stays_inside_the_plot(seed):
    """Notebook 00's roofline on machines from 10 GFLOP/s to 1 PFLOP/s and 3 GB/s to 3 TB/s, in
    float32 or bfloat16, its sweep in smoke (to 1024³) or full scale (to 8192³), each point
    somewhere under its roof: no label runs outside the axes (a student once saw "add 134,217,728
    0.1%" cut off)."""
    import random

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    itemsize = torch.empty((), dtype=dtype).element_size()
    peak, bandwidth = Peak(10 ** rng.uniform(10, 15), "measured", "p"), 10 ** rng.uniform(9.5, 12.5)

    def under_roof(name, flops, nbytes, efficiency):
        attainable = min(peak.flops, bandwidth * flops / nbytes)
        return roofline.OpPoint(name, flops, nbytes, flops / (efficiency * attainable))

    largest = rng.choice([1024, 8192])
    points = [
        under_roof(f"{n}^3", *roofline.matmul_cost(n, n, n, dtype), rng.uniform(0.001, 1.0))
        for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
        if n <= largest
    ]
    buffer = rng.choice([64, 256]) * 2**20
    side, numel = int((buffer / itemsize) ** 0.5), buffer // itemsize
    points += [
        under_roof(
            f"mat-vec {side}", *roofline.matmul_cost(side, 1, side, dtype), rng.uniform(0.05, 1.1)
        ),
        under_roof(f"add {numel:,}", numel, 3 * itemsize * numel, rng.uniform(0.05, 1.1)),
    ]
    ax = roofline.plot_roofline(points, peak, bandwidth, title="roofline")
    ax.figure.canvas.draw()
    renderer, box = ax.figure.canvas.get_renderer(), ax.get_window_extent()
    outside = [
        t.get_text()
        for t in ax.texts
        if not (
            box.x0 <= t.get_window_extent(renderer).x0
            and t.get_window_extent(renderer).x1 <= box.x1
            and box.y0 <= t.get_window_extent(renderer).y0
            and t.get_window_extent(renderer).y1 <= box.y1
        )
    ]
    plt.close(ax.figure)
    assert not outside, f"labels outside the axes: {outside}"


# ---- accelerators (skipped cleanly without one) ----------------------------------------------
@needs_cuda
def test_cuda_device_index_out_of_range():
    with pytest.raises(TitanliteError, match="torch sees"):
        hardware.detect_device(f"cuda:{torch.cuda.device_count()}")


@needs_cuda
def test_cuda_peak_bandwidth_and_memory():
    dev = torch.device("cuda")
    assert matmul_peak.measure_matmul_peak(dev, torch.float32, budget_s=0.3).flops > 1e9
    assert measure_memory_bandwidth(dev, nbytes=64 * 2**20, budget_s=0.1) > 1e9
    memory.reset_peak_memory(dev)
    x = torch.empty(2**20, device=dev)
    assert memory.peak_memory_bytes(dev) >= x.numel() * 4


@needs_mps
def test_mps_peak_and_memory():
    dev = torch.device("mps")
    assert hardware.device_name(dev).startswith("Apple MPS")
    assert matmul_peak.measure_matmul_peak(dev, torch.float32, budget_s=0.3).flops > 1e9
    x = torch.ones(2**20, device=dev)
    assert memory.peak_memory_bytes(dev) >= x.numel() * 4


# ---- memory readings beside the peak --------------------------------------------------------
def test_allocator_readings_are_none_off_cuda():
    assert memory.allocator_readings("cpu") == {
        "reserved_memory_bytes": None,
        "alloc_retries": None,
    }


def test_allocator_readings_from_cuda_memory_stats():
    from titanlite.memory import readings_from_stats

    stats = {
        "reserved_bytes.all.peak": 3 * 2**30,
        "reserved_bytes.all.current": 2**30,
        "allocated_bytes.all.peak": 2**30,
        "num_alloc_retries": 2,
    }
    assert readings_from_stats(stats) == {"reserved_memory_bytes": 3 * 2**30, "alloc_retries": 2}
    assert readings_from_stats({}) == {"reserved_memory_bytes": 0, "alloc_retries": 0}


def test_mps_peak_is_a_running_maximum_that_never_falls(monkeypatch):
    # Metal's allocation can shrink under memory pressure; the reported peak must not.
    readings = iter([100, 300, 200, 50, 400])
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: next(readings))
    monkeypatch.setattr(memory, "_mps_peak", 0)
    assert [memory.peak_memory_bytes("mps") for _ in range(5)] == [100, 300, 300, 300, 400]


def test_bf16_refusal_on_pre_ampere_advises_fp16_autocast_not_fp16_weights():
    msg = hardware.bf16_refusal("Tesla T4", (7, 5))
    assert "\n" not in msg and "sm_75" in msg
    assert "--training.mixed_precision fp16" in msg and "--training.dtype float16" not in msg
