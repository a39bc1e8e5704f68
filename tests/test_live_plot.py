"""LivePlot without a browser: what it draws, when it redraws, and which mode it picks.

tests/test_browser.py checks the same widget in a real JupyterLab; these are the fast checks.
"""

from __future__ import annotations

import gc
import json
import math
import time
import types

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from titanlite import TitanliteError
from titanlite.tools.course.editions import kernel_on_unix_sockets
from titanlite.tools.display import live_plot
from titanlite.tools.display.live_plot import LivePlot, resolve_mode

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train(step, loss=None, **extra):
    return {
        "kind": "train",
        "step": step,
        "loss": 4.0 - 0.05 * step if loss is None else loss,
        "tokens_per_sec": 1000.0 + step,
        "mfu": 0.02,
        "lr": 1e-3,
        "peak_memory_bytes": 2**27,
        "elapsed_s": 0.1 * step,
        **extra,
    }


def lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("TITANLITE_LIVE_PLOT", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)


@pytest.fixture
def clock(monkeypatch):
    """Fake time for the throttle: `clock.t` is what time.monotonic() returns inside live_plot;
    each perf_counter() call advances by `clock.draw_cost`, so a draw (timed between two
    calls) "costs" draw_cost. Steps of 0.125 s are exact in binary floating point."""
    c = types.SimpleNamespace(t=0.0, draw_cost=0.0, perf=0.0)

    def perf_counter():
        c.perf += c.draw_cost
        return c.perf

    monkeypatch.setattr(
        live_plot, "time", types.SimpleNamespace(monotonic=lambda: c.t, perf_counter=perf_counter)
    )
    return c


def test_static_mode_saves_a_png_that_changes_with_more_data(tmp_path):
    path = tmp_path / "plots" / "loss.png"  # parent folder does not exist yet
    plot = LivePlot(mode="static", save_path=path)
    for step in range(10):
        plot(train(step))
    plot.on_train_end()
    first = path.read_bytes()
    assert first.startswith(PNG_MAGIC)
    assert len(lines_by_label(plot._axes[0])["train"].get_xdata()) == 10

    for step in range(10, 40):
        plot(train(step, loss=3.0 + math.sin(step)))
    plot.savefig(path)
    assert path.read_bytes() != first
    assert len(lines_by_label(plot._axes[0])["train"].get_xdata()) == 40
    assert plot._repr_png_().startswith(PNG_MAGIC)


def test_from_jsonl_overlays_finished_runs(tmp_path):
    paths = []
    for name, offset in (("fp32", 0.0), ("bf16", 0.1)):
        path = tmp_path / f"{name}.jsonl"
        records = [train(s, loss=3.0 - 0.01 * s + offset) for s in range(20)]
        records.append({"kind": "val", "step": 19, "val_loss": 3.2 + offset})
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")  # blank line is fine
        paths.append(path)
    plot = LivePlot.from_jsonl(paths, mode="static")
    loss = lines_by_label(plot._axes[0])
    assert set(loss) == {"fp32", "bf16", "fp32 val", "bf16 val"}
    assert loss["fp32"].get_color() != loss["bf16"].get_color()
    assert list(loss["bf16"].get_ydata())[:2] == pytest.approx([3.1, 3.09])
    legend = plot.legend_labels()  # one legend for the figure, outside every panel
    assert "fp32" in legend and "bf16" in legend and "validation (dashed)" in legend
    assert all(ax.get_legend() is None for ax in plot._axes)
    # every panel gets both runs, not only the loss
    assert {"fp32", "bf16"} <= set(lines_by_label(plot._axes[2]))

    relabelled = LivePlot.from_jsonl(paths, labels=["a", "b"], metrics="loss", mode="off")
    assert {"a", "b"} <= set(lines_by_label(relabelled._axes[0]))
    with pytest.raises(TitanliteError, match="labels"):
        LivePlot.from_jsonl(paths, labels=["only one"], mode="off")


def test_from_jsonl_takes_run_directories_and_a_file_being_written(tmp_path):
    for name in ("fp32", "bf16"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    (tmp_path / "runs" / "fp32" / "metrics.jsonl").write_text(json.dumps(train(0)) + "\n")
    # a run still training: its last line is only half written
    (tmp_path / "runs" / "bf16" / "metrics.jsonl").write_text(
        json.dumps(train(0)) + '\n{"kind": "tr'
    )
    plot = LivePlot.from_jsonl(
        [tmp_path / "runs" / "fp32", tmp_path / "runs" / "bf16" / "metrics.jsonl"],
        mode="off",
        metrics=("loss",),
    )
    assert set(lines_by_label(plot._axes[0])) == {"fp32", "bf16"}
    with pytest.raises(TitanliteError, match="does not exist"):
        LivePlot.from_jsonl([tmp_path / "missing.jsonl"], mode="off")


def test_same_file_names_get_labels_that_tell_them_apart(tmp_path):
    paths = []
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        paths.append(tmp_path / f"rank{rank}" / "log.jsonl")
        paths[-1].write_text(json.dumps(train(0)) + "\n")
    labels = set(lines_by_label(LivePlot.from_jsonl(paths, mode="off")._axes[0]))
    assert len(labels) == 2 and all("rank0" in line or "rank1" in line for line in labels)


def test_ranks_of_one_run_get_separate_lines(tmp_path):
    plot = LivePlot(mode="off", metrics=("loss",), label="ddp")
    for rank in range(2):
        for step in range(5):
            plot(train(step, loss=2.0 + rank, rank=rank))
    plot.savefig(tmp_path / "ranks.png")
    assert set(lines_by_label(plot._axes[0])) == {"ddp rank 0", "ddp rank 1"}


def test_validation_records_appear_dashed_on_the_loss_panel(tmp_path):
    plot = LivePlot(mode="static")
    for step in range(30):
        plot(train(step))
        if step % 10 == 9:
            plot({"kind": "val", "step": step, "val_loss": 3.5})
    plot.savefig(tmp_path / "val.png")
    val = lines_by_label(plot._axes[0])["val"]
    assert list(val.get_xdata()) == [9, 19, 29]
    assert val.get_linestyle() == "--"
    # validation records carry no throughput, so they add no point to the other panels
    assert set(lines_by_label(plot._axes[1])) == {"train", "EMA, α=0.2"}  # raw + its smoothing


def test_mfu_in_percent_labelled_with_its_peak(tmp_path):
    plot = LivePlot(mode="off", metrics=("mfu",))
    plot(train(0, mfu=0.25, peak_label="fp32 matmul peak"))
    plot.savefig(tmp_path / "mfu.png")
    assert list(plot._axes[0].get_lines()[0].get_ydata()) == [25.0]
    assert "%" in plot._axes[0].get_ylabel()
    assert plot._axes[0].get_title() == "% of fp32 peak"
    assert [n.get_text() for n in plot._notes] == [
        "MFU: % of fp32 matmul peak"
    ]  # the full name, below


def test_missing_keys_and_nan_do_not_break_the_plot(tmp_path):
    plot = LivePlot(mode="static", save_path=tmp_path / "nan.png")
    plot(train(0))
    plot({"kind": "train", "step": 1, "loss": float("nan"), "mfu": "n/a"})  # diverged, odd mfu
    plot({"kind": "train", "loss": 1.0})  # no step: cannot be placed, skipped
    plot({"kind": "train", "step": 2, "loss": float("inf"), "tokens_per_sec": None})
    plot({"kind": "val", "step": 2})  # val record without val_loss
    plot({"kind": "train", "step": np.int64(3), "loss": torch.tensor(2.5), "mfu": np.float32(0.5)})
    plot.on_train_end()
    loss = lines_by_label(plot._axes[0])["train"].get_ydata()
    assert len(loss) == 4 and math.isnan(loss[1]) and math.isnan(loss[2])  # gaps, not crashes
    assert loss[3] == 2.5  # tensor and numpy scalars are numbers too
    assert list(plot._axes[2].get_lines()[0].get_ydata()) == [2.0, 50.0]  # "n/a" skipped
    assert (tmp_path / "nan.png").read_bytes().startswith(PNG_MAGIC)


def test_widget_mode_reuses_one_image_and_makes_no_new_figures(clock):
    gc.collect()
    figures_before = sum(type(o) is Figure for o in gc.get_objects())
    pyplot_before = plt.get_fignums()
    plot = LivePlot(mode="widget", min_interval_s=0.5)
    image, box = plot._image, plot._box
    assert "titanlite-live-plot" in image._dom_classes
    assert image.format == "png" and bytes(image.value).startswith(PNG_MAGIC)
    assert box.children[1] is image and plot._status in box.children[0].children

    frames = [bytes(image.value)]
    for step in range(5):
        clock.t += 1.0  # longer than min_interval_s: every record redraws
        plot(train(step, loss=4.0 - step))
        assert plot._image is image  # the same widget is updated in place...
        frames.append(bytes(image.value))
    assert len(set(frames)) == len(frames)  # ...and every frame differs
    assert "step 4" in plot._status.value and "tok/s" in plot._status.value

    gc.collect()
    assert sum(type(o) is Figure for o in gc.get_objects()) == figures_before + 1
    assert plt.get_fignums() == pyplot_before  # pyplot never saw it


def test_redraws_are_throttled_and_the_last_record_is_drawn_at_the_end(clock):
    plot = LivePlot(mode="widget", min_interval_s=0.5)
    assert plot.n_draws == 1  # the empty axes, shown at once
    for step in range(17):  # one record every 0.125 s for 2 s
        plot(train(step))
        clock.t += 0.125
    assert plot.n_draws - 1 == 5  # frames at t = 0, 0.5, 1.0, 1.5, 2.0
    drawn_steps = list(lines_by_label(plot._axes[0])["train"].get_xdata())
    assert drawn_steps == list(range(17))
    plot(train(17))  # 0.125 s after the last frame: throttled
    assert plot.n_draws - 1 == 5
    plot.on_train_end()  # but the end always draws what is left
    assert plot.n_draws - 1 == 6
    assert list(lines_by_label(plot._axes[0])["train"].get_xdata()) == drawn_steps + [17]
    plot.on_train_end()  # nothing new: no extra frame
    assert plot.n_draws - 1 == 6


def test_slow_draws_stretch_the_interval(clock):
    """A draw that costs 0.2 s may run at most every 2 s (≤10% of wall time)."""
    plot = LivePlot(mode="widget", min_interval_s=0.5)
    clock.draw_cost = 0.2
    for step in range(31):  # 0.125 s apart, to t = 3.75
        plot(train(step))
        clock.t += 0.125
    assert plot.n_draws - 1 == 2  # t = 0 (cost measured), then t = 2.0; not every 0.5 s
    assert plot.draw_seconds == pytest.approx(2 * 0.2)


def test_mode_choice(monkeypatch):
    # A terminal (or pytest) has no IPython kernel: static, even if the env var leaked in.
    monkeypatch.setenv("JPY_SESSION_NAME", "/somewhere/nb.ipynb")
    assert resolve_mode() == "static"
    assert LivePlot().mode == "static"

    kernel = types.SimpleNamespace(kernel=object(), execution_count=1)
    monkeypatch.setattr(live_plot, "_ipython", lambda: kernel)
    assert resolve_mode() == "widget"  # kernel started by a Jupyter server for a frontend
    monkeypatch.delenv("JPY_SESSION_NAME")
    assert resolve_mode() == "static"  # kernel started by nbclient / papermill

    monkeypatch.setenv("TITANLITE_LIVE_PLOT", "off")
    assert resolve_mode() == "off"
    assert resolve_mode("widget") == "widget"  # an explicit argument wins over the env
    monkeypatch.setenv("TITANLITE_LIVE_PLOT", "widgets")
    with pytest.raises(TitanliteError, match="did you mean: widget"):
        resolve_mode()


def test_shows_itself_once_per_cell(monkeypatch):
    shown = []
    ip = types.SimpleNamespace(kernel=object(), execution_count=7)
    monkeypatch.setattr(live_plot, "_ipython", lambda: ip)
    handles = []

    def display(obj, display_id=None):
        shown.append(obj)
        if display_id:
            handles.append(types.SimpleNamespace(updates=[]))
            handles[-1].update = handles[-1].updates.append
            return handles[-1]

    monkeypatch.setattr("IPython.display.display", display)

    plot = LivePlot(mode="widget")
    assert shown == [plot._box]  # displayed on construction
    plot(train(0))
    plot._ipython_display_()  # `plot` as the cell's last line: already on screen
    assert len(shown) == 1
    ip.execution_count = 8
    plot._ipython_display_()  # a later cell asks for it: another live view
    assert shown[-1] is plot._box and len(shown) == 2
    plot.on_train_end()  # the live view is swapped in place for a picture that outlives the kernel
    for handle in handles:  # both views, this cell's and the earlier one
        (final,) = handle.updates
        assert final.data["image/png"] and "step 0" in final.data["text/plain"]
    plot(train(1))  # another run into the same plot: the same outputs go live again
    assert all(h.updates[-1] is plot._box for h in handles) and len(shown) == 2
    ip.execution_count, shown[:] = 9, shown[:2]

    static = LivePlot(mode="static")
    assert len(shown) == 2  # static shows nothing until the end
    static(train(0))
    static.on_train_end()
    static._ipython_display_()
    assert len(shown) == 3 and type(shown[-1]).__name__ == "Image"
    static.close()  # already ended: nothing more
    assert len(shown) == 3
    static(train(1))
    static._ipython_display_()  # same cell, but the picture shown is out of date now
    assert len(shown) == 4


def test_off_mode_draws_nothing_but_can_still_save(tmp_path, clock):
    plot = LivePlot(mode="off", save_path=tmp_path / "off.png")
    for step in range(5):
        plot(train(step))
        clock.t += 10
    assert plot.n_draws == 0 and plot._image is None
    plot.close()
    assert (tmp_path / "off.png").read_bytes().startswith(PNG_MAGIC)


def test_nbclient_run_gets_one_static_figure(tmp_path, monkeypatch):
    """The non-interactive path for real: a kernel started by nbclient picks static mode and
    leaves exactly one PNG in the saved notebook, no dead widget placeholder."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import os\n"
            "from titanlite.tools.display.live_plot import LivePlot\n"
            "plot = LivePlot()\n"
            "for step in range(30):\n"
            "    plot({'kind': 'train', 'step': step, 'loss': 3 - step / 30, 'mfu': 0.01})\n"
            "plot.on_train_end()\n"
            "print(plot.mode, 'JPY_SESSION_NAME' in os.environ)\n"
            "plot"
        )
    ]
    start = time.monotonic()
    NotebookClient(
        nb,
        timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        **kernel_on_unix_sockets(tmp_path),
    ).execute()
    outputs = nb.cells[0].outputs
    texts = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    assert texts.strip() == "static False", texts
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1  # shown by on_train_end; the trailing `plot` did not repeat it
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert time.monotonic() - start < 60


def test_progress_counts_steps_elapsed_and_remaining():
    plot = LivePlot(mode="off", metrics=("loss",), steps=100)
    plot(train(0, elapsed_s=0.0))
    assert "step 0/100 (0%)" in plot._status_text()
    plot(train(20, elapsed_s=10.0))  # 0.5 s per step: 80 steps = 40 s to go
    text = plot._status_text()
    assert "step 20/100 (20%)" in text and "10 s elapsed" in text and "~40 s left" in text, text
    plot(train(100, elapsed_s=50.0))
    assert "done" in plot._status_text()
    plot(train(10, elapsed_s=400.0, run="second"))  # a second run starts over, its own clock
    text = plot._status_text()
    assert text.startswith("second · step 10/100") and "left" not in text, text
    plot(train(40, elapsed_s=430.0, run="second"))
    assert "7:10 elapsed" in plot._status_text() and "~1:00 left" in plot._status_text()
    assert "/" not in LivePlot(mode="off")._status_text()  # no total given: no fraction


def test_lines_that_are_not_runs_leave_the_status_to_the_run_in_progress():
    """Notebook 18 draws each expert's token choices in the run now training: a line per expert
    ("line"), one panel per run. The status names the run and its progress, never the line that
    happened to arrive last ("expert 7 · step 40/40"), and the experts do not restart its clock."""
    plot = LivePlot(mode="off", metrics=("none", "aux_free"), steps=40)
    for run in ("none", "aux_free"):
        for step in range(1, 41):
            for expert in range(8):
                record = {"step": step, run: 10.0 * expert, "elapsed_s": 0.5 * step}
                plot({**record, "run": run, "line": f"expert {expert}"})
    text = plot._status_text()
    assert text.startswith("aux_free · step 40/40 (100%) · 20 s elapsed · done"), text
    assert "expert" not in text
    plot.png()
    assert plot.legend_labels() == [f"expert {e}" for e in range(8)]  # a colour per expert
    for ax, run in zip(plot._axes, ("none", "aux_free")):
        lines = lines_by_label(ax)
        assert sorted(lines) == sorted(f"expert {e}" for e in range(8)), run
        assert list(lines["expert 3"].get_ydata()) == [30.0] * 40


def test_the_status_is_two_short_lines_beside_the_progress_bar():
    """Where the run is, then what it measures: one line of both wrapped on a 1366-px screen
    (the bar takes 240 px of a ~1,000-px output area, leaving room for about 85 characters)."""
    import re

    plot = LivePlot(mode="off", metrics=("loss",), steps=1000)
    plot(train(1, elapsed_s=1.0, run="16-+FP8 tensorwise", rank=0))
    record = train(999, 3.95, elapsed_s=3599.0, run="16-+FP8 tensorwise", rank=0, val_loss=3.25)
    plot({**record, "tokens_per_sec": 123456.0, "mfu": 0.4567})
    where, measured = re.findall(r"<code>(.*?)</code>", plot._status_html())
    assert where.startswith("16-+FP8 tensorwise rank 0 · step 999/1000") and "left" in where
    assert measured == "loss 3.9500 · val 3.2500 · 123,456 tok/s · MFU 45.67%", measured
    assert max(len(where), len(measured)) <= 85
    assert plot._status_text() == f"{where} · {measured}"  # the text copy: one line, as before


def test_short_runs_get_integer_steps_and_smoothed_throughput(tmp_path):
    plot = LivePlot(mode="off", metrics=("loss", "tokens_per_sec", "mfu"))
    for step in range(1, 11):
        plot(
            train(
                step,
                tokens_per_sec=1000.0 + 300 * (step % 2),
                peak_label="measured float32 matmul peak, Some CPU (CPU, 2 threads) (best at n=512) "
                "[cached 2026-01-01 00:00]",
            )
        )
    plot.savefig(tmp_path / "p.png")
    ticks = plot._axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    lines = lines_by_label(plot._axes[1])
    smooth = next(line for label, line in lines.items() if label.startswith("EMA"))
    raw = np.array(lines["train"].get_ydata())
    assert np.std(np.diff(smooth.get_ydata())) < 0.5 * np.std(np.diff(raw))  # it does smooth
    assert plot.legend_labels()[-2:] == [
        "per step",
        smooth.get_label(),
    ]  # the styles, once, in the legend
    title = plot._axes[2].get_title()
    assert title == "% of measured float32 peak"  # short: the device and threads go to the footnote
    notes = [n.get_text() for n in plot._notes]
    assert notes == ["MFU: % of measured float32 matmul peak, Some CPU (CPU, 2 threads)"]


PEAKS = {
    "float32": "measured float32 matmul peak, Intel(R) Xeon(R) Processor (CPU, 1 thread) (best at n=2048) "
    "[cached 2026-11-25 04:44]",
    "bfloat16": "measured bfloat16 matmul peak, Intel(R) Xeon(R) Processor (CPU, 1 thread) (best at n=1024) "
    "[cached 2026-11-25 04:44]",
}


def test_ten_runs_fit_a_laptop_screen_with_the_legend_outside_every_panel(tmp_path):
    """Notebook 16's ladder: ten runs on three panels. At most two panels side by side, in ~950 px
    (a 1280-px laptop with JupyterLab's side bar open), each big enough to read; one short MFU title
    naming each peak kind once, however many rows used it; MFU above 100% flagged, not shown as fact."""
    plot = LivePlot(
        metrics=("loss", "tokens_per_sec", "mfu"),
        mode="off",
        title="16 · the ladder, one-process rows in this kernel, FSDP rows in one job",
    )
    for i in range(10):
        for step in range(1, 5):
            plot(
                train(
                    step,
                    run=f"row {i}",
                    mfu=0.4 + 0.2 * i,
                    peak_label=PEAKS["float32" if i in (0, 9) else "bfloat16"],
                )
            )
    plot.savefig(tmp_path / "ladder.png")
    from PIL import Image

    width, height = Image.open(tmp_path / "ladder.png").size
    assert 800 <= width <= 1000, width
    for ax in plot._axes:  # every panel at least ~330 × 200 px
        box = ax.get_window_extent()
        assert box.width >= 330 and box.height >= 200, (ax.get_ylabel(), box)
        assert ax.get_legend() is None
        assert len(ax.get_xticklabels()) <= 6
    assert plot.legend_labels()[:10] == [f"row {i}" for i in range(10)]
    legend_box = plot._legend.get_window_extent()
    assert not any(legend_box.overlaps(ax.get_window_extent()) for ax in plot._axes)
    title = plot._axes[2].get_title()
    assert title == "% of measured float32, bfloat16 peak" and title.count("measured") == 1
    notes = [n.get_text() for n in plot._notes]
    assert sum("bfloat16 matmul peak" in n for n in notes) == 1 and any(
        "above 100%" in n for n in notes
    )
    assert any(line.get_label() == "_peak" for line in plot._axes[2].get_lines())  # the 100% line


def test_many_trials_list_a_dozen_and_count_the_rest(tmp_path):
    plot = LivePlot(metrics=("loss",), x="tokens", mode="off")
    for trial in range(30):
        plot(
            {
                "kind": "val",
                "step": 1,
                "tokens": 3 * 12_288,
                "val_loss": 7.0,
                "run": f"trial {trial}",
            }
        )
        plot(
            {
                "kind": "val",
                "step": 2,
                "tokens": 6 * 12_288,
                "val_loss": 6.0,
                "run": f"trial {trial}",
            }
        )
    plot.savefig(tmp_path / "trials.png")
    labels = plot.legend_labels()
    assert labels[:12] == [f"trial {i}" for i in range(12)] and "… 18 more runs" in labels
    ticks = [t.get_text() for t in plot._axes[0].get_xticklabels() if t.get_text()]
    assert ticks and all(len(t) <= 5 for t in ticks), ticks  # "37k", not "36,864"
    # below the panel
    assert plot._legend.get_window_extent().y1 < plot._axes[0].get_window_extent().y0


def test_the_status_names_the_phase_until_a_record_arrives(clock):
    plot = LivePlot(mode="off")
    plot.phase("compiling +compile")
    clock.t = 35.0
    assert plot._status_text() == "compiling +compile · 35 s elapsed"
    plot(train(1, run="+compile"))
    assert plot._status_text().startswith("+compile · step 1")


def test_saved_notebook_keeps_the_final_curves(tmp_path, data_dir):
    """The student's round trip: train in a notebook whose LivePlot is a live widget (what
    JupyterLab gets), save, reload. The training cell must hold a PNG of the final curves and
    no widget, which a reopened notebook could only show as "model not found"."""
    from conftest import tiny_overrides
    from nbclient import NotebookClient

    overrides = tiny_overrides(data_dir, tmp_path, **{"training.steps": 8, "eval.every": 4})
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import os\n"
            "os.environ['TITANLITE_LIVE_PLOT'] = 'widget'  # as in a JupyterLab kernel\n"
            "from titanlite.config import load_config\n"
            "from titanlite.tools.display.live_plot import LivePlot\n"
            "from titanlite.train import Trainer\n"
            f"trainer = Trainer(load_config(None, {overrides!r}))\n"
            "plot = LivePlot(steps=8, min_interval_s=0)\n"
            "history = trainer.fit(callbacks=[plot])\n"
            "print(plot.mode, plot.n_draws)"
        )
    ]
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        **kernel_on_unix_sockets(tmp_path),
    ).execute()
    path = tmp_path / "trained.ipynb"
    nbformat.write(nb, path)

    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    mode, draws = text.split()[-2:]
    assert mode == "widget" and int(draws) > 2, text  # it was live while training
    assert not [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    (picture,) = [o for o in outputs if "image/png" in o.get("data", {})]
    import base64

    assert base64.b64decode(picture["data"]["image/png"]).startswith(PNG_MAGIC)
    assert (
        "step 8/8 (100%)" in picture["data"]["text/plain"]
        and "done" in picture["data"]["text/plain"]
    )
    assert 'class="titanlite-live-plot"' in picture["data"]["text/html"]
