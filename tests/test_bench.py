"""The benchmarks run end to end (smoke scale). Their numbers are printed, never asserted:
speed targets live in the benchmarks' output, not in tests on a shared machine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, tmp_path):
    env = {**os.environ, "TITANLITE_SMOKE": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_ablation_table_has_every_requested_row(tmp_path):
    r = run(
        "ablation.py",
        "--variants",
        "baseline,accum-2,ac-full",
        "--log-dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split()[0] for line in r.stdout.splitlines()[3:] if line.strip()]
    assert rows == ["baseline", "accum-2", "ac-full", "baseline"], r.stdout
    assert "failed" not in r.stdout and "x " in r.stdout


def test_ablation_rejects_unknown_variants(tmp_path):
    r = run("ablation.py", "--variants", "baseline,turbo", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown variant" in r.stderr


def test_checkpoint_bench_reports_every_mode_and_the_targets(tmp_path):
    r = run(
        "checkpoint.py",
        "--folder",
        str(tmp_path / "ckpt"),
        "--json",
        str(tmp_path / "out.json"),
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for row in (
        "torch.save + fsync",
        "DCP sync",
        "DCP async (thread)",
        "DCP async (process)",
        "disk write bandwidth",
        "target <= 5%",
        "throughput / disk bandwidth",
        "checkpoint formats, DCP sync saves",
        "dcp  (torch's own: dcp.load reads it",
        "raw  (ByteCheckpoint-style",
        "beside a host-idle step",
        "beside the CPU step (both cores busy)",
    ):
        assert row in r.stdout, (row, r.stdout)
    if sys.platform.startswith("linux"):  # the CPU a save adds, read from /proc
        assert "CPU s beside the save / the same steps alone" in r.stdout, r.stdout
    import json

    result = json.loads((tmp_path / "out.json").read_text())  # the measurements, for plots
    sync = result["modes"]["sync"]  # each sync save held against the disk written around it
    assert (
        len(sync["disk_bytes_per_s"]) == len(sync["blocked_s"])
        and min(sync["disk_bytes_per_s"]) > 0
    )
    assert "each save against the disk just before and after it" in r.stdout, r.stdout
    for mode in ("async", "async_process"):  # each save's steps beside it, then as many alone
        r = result["modes"][mode]
        assert (
            len(r["write_steps_s"])
            == len(r["alone_steps_s"])
            == len(r["cpu_beside_s"])
            == len(r["overlapped_s"])
        )
        assert all(
            len(alone) == 1 + len(beside)
            for beside, alone in zip(r["write_steps_s"], r["alone_steps_s"])
        )
