"""Progress in a terminal is a bar; in a log file (stderr not a TTY) it is plain lines."""

import io
import re
import subprocess
import sys
from pathlib import Path

from conftest import tiny_overrides

from titanlite import _ui

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"^step (\d+)/(\d+) · loss \d+\.\d{3} · [\d,]+ tok/s · (\d\d):(\d\d) elapsed, (\d\d):(\d\d) left$"
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def drive(total, step_s, initial=0, every_s=30.0):
    out, clock = io.StringIO(), Clock()
    bar = _ui.PlainProgress(total, initial, every_s=every_s, stream=out, clock=clock)
    for step in range(initial + 1, total + 1):
        clock.now += step_s
        bar.update(1)  # the trainer's order: update, then the postfix of the same step
        bar.set_postfix(loss=f"{10 - step / total:.3f}", tok_s=f"{1234:,.0f}")
    bar.close()
    return out.getvalue().splitlines()


def test_two_hundred_steps_give_ten_whole_lines_with_elapsed_and_left():
    lines = drive(200, step_s=0.1)
    assert len(lines) == 10 and all(LINE.match(line) for line in lines), lines
    assert [int(LINE.match(line).group(1)) for line in lines] == list(range(20, 201, 20))
    assert lines[3] == "step 80/200 · loss 9.600 · 1,234 tok/s · 00:08 elapsed, 00:12 left"
    assert lines[-1].endswith("00:20 elapsed, 00:00 left") and "\r" not in "".join(lines)


def test_slow_steps_also_print_every_thirty_seconds_and_a_resumed_run_counts_from_its_start():
    lines = drive(100, step_s=12.0)  # 10% = 10 steps = 120 s: too long to stay silent
    steps = [int(LINE.match(line).group(1)) for line in lines]
    assert steps[:4] == [3, 6, 9, 10] and steps[-1] == 100
    resumed = drive(50, step_s=0.1, initial=40)  # ten steps left: a line each
    assert [int(LINE.match(line).group(1)) for line in resumed] == list(range(41, 51))
    assert resumed[0].endswith("00:00 elapsed, 00:01 left")


def test_progress_bar_is_a_bar_on_a_terminal_and_lines_in_a_file(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(_ui.progress_bar(10, enabled=True), _ui.PlainProgress)
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = _ui.progress_bar(10, enabled=True)
    assert type(bar).__name__ == "tqdm"
    bar.close()
    assert _ui.progress_bar(10, enabled=False) is None


def test_a_training_run_logged_to_a_file_writes_plain_progress_lines(data_dir, tmp_path):
    overrides = tiny_overrides(
        data_dir, tmp_path, **{"training.steps": 20, "metrics.progress": True}
    )
    log = tmp_path / "train.log"
    with log.open("w") as err:  # a file, as in `titanlite train ... 2> train.log`
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "titanlite",
                "train",
                "--config",
                "configs/debug.toml",
                *[a for k, v in overrides.items() for a in (f"--{k}", str(v))],
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=300,
        )
    text = log.read_text()
    assert r.returncode == 0, text
    progress = [line for line in text.splitlines() if line.startswith("step ")]
    assert "\r" not in text and [int(LINE.match(line).group(1)) for line in progress] == list(
        range(2, 21, 2)
    ), text
