"""`titanlite doctor`: which checks apply is a function of the device's facts (tested here for
GPUs and Macs this machine does not have), and the whole self-check runs on this CPU in smoke
scale, passes, and leaves a report that parses."""

from __future__ import annotations

import json

import pytest
import torch

from titanlite.tools.cli.commands import main
from titanlite.tools.cli.doctor import DeviceFacts, plan
from titanlite.tools.probe import matmul_peak

H100_PAIR = DeviceFacts("cuda", gpus=2, capability=(9, 0), name="NVIDIA H100 80GB HBM3")
A100 = DeviceFacts("cuda", gpus=1, capability=(8, 0), name="NVIDIA A100-SXM4-40GB")
T4 = DeviceFacts("cuda", gpus=1, capability=(7, 5), name="Tesla T4")
MAC = DeviceFacts("mps", name="Apple M2 (MPS)")
CPU = DeviceFacts("cpu", name="a CPU")


def by_name(facts):
    return {p.name: p for p in plan(facts)}


def test_two_gpus_run_the_two_process_items_on_nccl_and_fp8_for_real():
    steps = by_name(H100_PAIR)
    assert (
        steps["2 processes"].args["backend"] == "nccl" and steps["2 processes"].args["on"] == "cuda"
    )
    assert "fp8 (real)" in steps and steps["fp8 (real)"].args == {"real": True}
    assert all(steps[f"train {m}"].skip is None for m in ("fp32", "bf16", "fp16"))
    assert "bf16 autocast probe" not in steps


def test_one_gpu_falls_back_to_gloo_on_the_cpu_and_emulates_fp8_below_sm_89():
    steps = by_name(A100)
    two = steps["2 processes"].args
    assert (two["on"], two["backend"]) == ("cpu", "gloo") and "one GPU" in two["why"]
    assert "fp8 (emulated)" in steps and steps["fp8 (emulated)"].args == {"real": False}
    assert steps["train bf16"].skip is None


def test_a_gpu_without_bf16_skips_it_with_the_reason():
    skip = by_name(T4)["train bf16"].skip
    assert skip and "SM 8.0" in skip and "7.5" in skip
    assert by_name(T4)["train fp16"].skip is None


def test_a_mac_probes_bf16_autocast_emulates_fp8_and_uses_gloo():
    steps = by_name(MAC)
    assert "bf16 autocast probe" in steps and "fp8 (emulated)" in steps
    assert (
        steps["2 processes"].args["backend"] == "gloo" and "MPS" in steps["2 processes"].args["why"]
    )


def test_a_cpu_gets_every_check_with_gloo():
    names = [p.name for p in plan(CPU)]
    assert names == [
        "device",
        "matmul peaks",
        "attention kernel",
        "train fp32",
        "train bf16",
        "train fp16",
        "compile",
        "fp8 (emulated)",
        "2 processes",
    ]
    assert by_name(CPU)["2 processes"].args["backend"] == "gloo"


def test_doctor_runs_here_in_smoke_scale_passes_and_writes_a_report(tmp_path, capsys):
    out = tmp_path / "doctor"
    assert main(["doctor", "--smoke", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["failed"] == [] and report["smoke"]
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    # warn: only a run whose MFU came out above 100% (its peak measured on a busy moment)
    warned = [c for c in report["checks"] if c["status"] == "warn"]
    assert all(c["data"]["mfu"] > 1 and "MFU over 100% is no pass" in c["detail"] for c in warned)
    assert set(statuses.values()) <= {"pass", "warn", "skipped"}
    for name in (
        "device",
        "matmul float32",
        "attention kernel",
        "train fp32",
        "compile",
        "fp8 (emulated)",
        "2-process DDP",
        "2-process FSDP, bf16 params",
        "async checkpoint save",
        "kill-and-resume drill",
    ):
        assert statuses.get(name) in ("pass", "warn"), (name, statuses)
    assert (
        report["checks"][[c["name"] for c in report["checks"]].index("train fp32")]["data"][
            "tokens_per_sec"
        ]
        > 0
    )
    fp8 = report["checks"][[c["name"] for c in report["checks"]].index("fp8 (emulated)")]
    assert "the fp32 run's tokens/s" in fp8["detail"] and "slower than fp32" not in fp8["detail"]
    # The doctor's peak is the one a run's MFU reads: offered to the same cache, best one kept.
    matmul = report["checks"][[c["name"] for c in report["checks"]].index("matmul float32")]
    assert 0 <= matmul["data"]["spread"] < 1
    assert matmul["data"]["measured_flops"] > 0 and matmul["data"]["measured_now_flops"] > 0
    if matmul["data"]["cached"]:  # not when the machine was too busy for a peak to be kept
        assert (
            matmul_peak.matmul_peak("cpu", torch.float32).flops == matmul["data"]["measured_flops"]
        )
    md = (out / "report.md").read_text()
    assert md.startswith("# titanlite doctor") and md.count("| pass |") == list(
        statuses.values()
    ).count("pass")
    assert "nothing failed" in capsys.readouterr().out
    # A second doctor into the same folder: its own earlier runs are not resumed into (the kill
    # drill would find a finished run and train nothing), and it passes again.
    assert main(["doctor", "--smoke", "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["passed"] and set({c["name"] for c in again["checks"]}) == set(statuses)


def test_the_fp8_row_says_its_speed_from_the_numbers():
    """Against the fp32 run of the same doctor, beyond the wider of the two runs' ranges: a fixed
    "slower than fp32" was once printed beside an FP8 run that measured 2.3x faster."""
    from titanlite.tools.cli.doctor import Check, _compare_fp8

    def row(name, rate, low, high):
        data = {"tokens_per_sec": rate, "tokens_per_sec_range": [low, high]}
        return Check(name, "pass", "emulated" if name.startswith("fp8") else "", data)

    def reading(fp8_rate, fp32_range=(950, 1050)):
        checks = [row("train fp32", 1000, *fp32_range), row("fp8 (emulated)", fp8_rate, 0, 0)]
        checks[1].data["tokens_per_sec_range"] = [fp8_rate * 0.95, fp8_rate * 1.05]
        _compare_fp8(checks)
        return checks[1]

    fast, slow, level = reading(2300), reading(500), reading(1050)
    assert "2.30× the fp32 run's tokens/s (faster" in fast.detail
    assert "0.50× the fp32 run's tokens/s (slower" in slow.detail
    assert "(level, within noise" in level.detail and level.data["vs_fp32"]["band"] == 0.1
    # A noisy reference widens the band: the same 2.3x then says nothing.
    assert "(level, within noise" in reading(2300, fp32_range=(400, 1800)).detail
    skipped = [row("train fp32", 1000, 950, 1050), Check("fp8 (emulated)", "skipped", "no")]
    _compare_fp8(skipped)
    assert skipped[1].detail == "no"


def test_the_doctor_never_deletes_a_folder_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "doctor"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "precious.txt").write_text("mine")
    assert main(["doctor", "--smoke", "--out", str(out)]) == 2
    assert (out / "runs" / "precious.txt").read_text() == "mine"
    assert "the doctor did not make it" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["doctor", "--devise", "cpu"], ["doctor", "extra"]])
def test_doctor_refuses_unknown_arguments(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_throughput_leaves_out_the_warm_up_and_says_the_spread():
    from titanlite.tools.cli.doctor import throughput, timing_plan

    records = [
        {"step": s, "tokens_per_sec": r}
        for s, r in enumerate([100, 9000, 15000, 14000, 16000, 15500], 1)
    ]
    t = throughput(records, warmup=2, log_every=1)
    assert (
        t["tokens_per_sec"] == 15250
        and t["tokens_per_sec_range"] == [14000, 16000]
        and t["timed_records"] == 4
    )
    # On CUDA a record covers log_every steps: the first interval holds warm-up steps and is left out.
    cuda = timing_plan("cuda", smoke=True)
    steps = cuda["warmup"] + cuda["timed"]
    assert steps % cuda["log_every"] == 0 and cuda["log_every"] == 10
    logged = [
        {"step": s, "tokens_per_sec": 1.0 if s == 10 else 5.0} for s in range(10, steps + 1, 10)
    ]
    assert throughput(logged, cuda["warmup"], cuda["log_every"])["tokens_per_sec_range"] == [
        5.0,
        5.0,
    ]
    assert timing_plan("cpu", smoke=True)["warmup"] >= 2
    # MFU is the median of the same intervals (not the last step's), as tokens/s is
    with_mfu = [dict(r, mfu=r["tokens_per_sec"] / 1e5) for r in records]
    assert throughput(with_mfu, warmup=2, log_every=1)["mfu"] == pytest.approx(0.1525)
    assert "mfu" not in throughput(records, warmup=2, log_every=1)


def test_on_a_gpu_unlogged_steps_run_under_torchs_sync_detector(data_dir, tmp_path, monkeypatch):
    """Mocked on the CPU: the detector is set to "error" for each unlogged step and off after it."""
    from conftest import tiny_overrides

    from titanlite.config import load_config
    from titanlite.tools.measure.host_syncs import CudaSyncDebug
    from titanlite.train import Trainer

    modes, made = [], []
    monkeypatch.setattr("torch.cuda.set_sync_debug_mode", modes.append)
    trainer = Trainer(
        load_config(
            None,
            tiny_overrides(
                data_dir, tmp_path, **{"training.steps": 6, "metrics.log_every": 3, "eval.every": 0}
            ),
        )
    )
    trainer.fit(watchers=[lambda run: made.append(CudaSyncDebug(run)) or made[-1]])
    assert made[0].checked == 4  # steps 1, 2, 4, 5
    assert modes[:6] == ["error", 0, "error", 0, 0, "error"] and modes[-1] == 0


# ----- other accelerators, on faked devices (tools/probe/vendors.py) --------------------------------

# `nvidia-smi topo -m` as an 8×H100 SXM node prints it (NVSwitch: 18 NVLinks between every pair),
# trimmed to its GPU rows and legend's first line.
H100_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t0-55\t0
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t0-55\t0
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\t0-55\t0
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\t0-55\t0
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\t56-111\t1
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\t56-111\t1
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\t56-111\t1
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \t56-111\t1

Legend:
"""

# Two PCIe GPUs under different CPU sockets (a workstation): no NVLink.
PCIE_TOPO = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tSYS\t0-15\t0
GPU1\tSYS\t X \t16-31\t1
"""


def _a_gpu(monkeypatch, name, hip=None, cuda="12.8"):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_an_nvidia_node_reports_its_stack_and_its_nvlink_topology(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from titanlite.tools.cli import doctor
    from titanlite.tools.probe import vendors

    _a_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    ran = []

    def run(command, **kwargs):
        ran.append(command)
        return SimpleNamespace(returncode=0, stdout=H100_TOPO)

    monkeypatch.setattr(
        vendors,
        "topology",
        lambda real=vendors.topology: real(lambda tool: "/usr/bin/" + tool, run),
    )
    facts = doctor.device_facts(torch.device("cuda", 0))
    (check,) = doctor._device(torch.device("cuda", 0), facts, True, tmp_path)
    assert ran == [["nvidia-smi", "topo", "-m"]]
    assert "NVIDIA GPU NVIDIA H100 80GB HBM3 through CUDA 12.8" in check.detail
    assert "NCCL" in check.detail and "float8_e4m3fn" in check.detail
    assert "8 GPUs; GPU pairs by link: NV18 × 28" in check.detail  # 8·7/2 pairs, all NVLink
    doctor._write(tmp_path, facts, [check], True, 1.0)
    report = (tmp_path / "report.md").read_text()
    assert "## GPU topology" in report and "GPU7\tNV18" in report
    assert vendors.links_summary(PCIE_TOPO) == "2 GPUs; GPU pairs by link: SYS × 1"


def test_an_amd_gpu_is_named_with_rocm_rccl_and_fnuz_fp8_and_said_untested(monkeypatch, tmp_path):
    from titanlite.tools.cli import doctor
    from titanlite.tools.probe import vendors

    _a_gpu(monkeypatch, "AMD Instinct MI300X", hip="6.2.41133", cuda=None)
    monkeypatch.setattr(vendors, "topology", lambda: None)  # no rocm-smi here
    (check,) = doctor._device(
        torch.device("cuda", 0), doctor.device_facts(torch.device("cuda", 0)), True, tmp_path
    )
    line = vendors.gpu_line("AMD Instinct MI300X")
    assert line in check.detail and "\n" not in line
    for fact in ("ROCm (HIP 6.2.41133)", "RCCL", "float8_e4m3fnuz", "no cuDNN", "untested"):
        assert fact in line, fact
    assert vendors.gpu_stack()["vendor"] == "AMD"
    # an MI355X (CDNA4) has OCP FP8, as NVIDIA does
    assert "float8_e4m3fn," in vendors.gpu_line("AMD Instinct MI355X")


def test_an_intel_gpu_is_recognised_and_said_to_train_on_the_cpu(monkeypatch):
    from types import SimpleNamespace

    from titanlite.tools.probe import vendors

    fake = SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        get_device_name=lambda index=0: "Intel(R) Data Center GPU Max 1550",
    )
    monkeypatch.setattr(torch, "xpu", fake, raising=False)
    line = vendors.xpu_line()
    assert line.startswith("Intel GPU Intel(R) Data Center GPU Max 1550 (2 visible, torch.xpu)")
    assert "use the CPU" in line and "untested" in line and "\n" not in line
    monkeypatch.setattr(fake, "is_available", lambda: False)
    assert vendors.xpu_line() is None


def test_an_mfu_above_100_percent_is_a_warning_never_a_pass():
    """Seen on a busy machine: train fp32 at MFU 99.7% and compile at 116.8% reported "pass",
    beside a raw RuntimeWarning. Above 100% the peak is wrong, not the run: warn, said in the
    check's own line; a finite run below it passes, a non-finite loss fails."""
    from titanlite.tools.cli.doctor import _describe_run, _finite

    run = {
        "loss": 2.5,
        "step": 8,
        "tokens_per_sec": 1000.0,
        "tokens_per_sec_range": [950.0, 1050.0],
        "timed_records": 6,
        "warmup_steps": 2,
        "memory": {"peak_rss": 2**30},
    }
    assert _finite({**run, "mfu": 0.997}) == "pass"
    assert _finite({**run, "mfu": 1.168}) == "warn"
    assert "MFU over 100% is no pass" in _describe_run({**run, "mfu": 1.168})
    assert _finite({**run, "mfu": 0.5, "loss": float("nan")}) == "fail"
