"""Live training curves in JupyterLab; one static figure everywhere else.

    plot = LivePlot(steps=200)         # in JupyterLab: shows itself in this cell's output
    for record in trainer:  plot(record)
    plot.on_train_end()                # final draw: a static PNG replaces the live widget

    LivePlot.from_jsonl(["runs/fp32", "runs/bf16"])   # overlay finished runs (metrics.jsonl)

Why it looks like this:
- One `matplotlib.figure.Figure` on the Agg canvas, never pyplot. pyplot keeps every figure
  alive in a global registry and the inline backend would print a new figure per update;
  a private Figure is redrawn in place, so nothing piles up and nothing leaks.
- In widget mode that figure is rendered to PNG bytes and pushed into ONE `ipywidgets.Image`.
  Widget messages go out on the kernel's IOPub channel while the training cell is still
  running, so the frontend swaps the picture in place: no flicker, no output clearing.
- Redraws are throttled. A draw costs tens of milliseconds of CPU that the training loop
  does not get, so we draw at most every `min_interval_s` and never more often than keeps
  plotting under ~10% of wall time (`draw_seconds` reports the total, for honest tokens/s).
- A widget lives only as long as its kernel: a saved notebook reopened later (or rendered by
  nbconvert or GitHub) would show "Error displaying widget: model not found" and no curves.
  So when training ends, the live outputs are replaced in place (display_id) by a static PNG
  and a plain status line, which every viewer keeps.
- Outside a live frontend (nbclient, CI, a terminal) widgets would be saved as dead
  placeholders, so we only collect data and show/save the final figure once at the end.
- The status line is the notebook's progress bar: step/total, elapsed and remaining time
  (pass `steps=`, the run's total; the trainer's records do not carry it). Between records,
  `phase("compiling +compile")` names what runs, with its seconds counting, so a minute-long
  compile does not look like a hung cell.
- Sized for a 1280-px laptop screen: at most two panels side by side, one legend for the
  whole figure outside every panel, short panel titles with the peaks' full names below.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
import textwrap
import threading
import time
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, MaxNLocator
from matplotlib.transforms import ScaledTranslation

from ...errors import TitanliteError, closest

MODES = ("widget", "static", "off")
# metric -> (axis label, scale applied to the raw value). MFU arrives as a fraction.
AXES = {
    "loss": ("loss", 1.0),
    "tokens_per_sec": ("tokens/s", 1.0),
    "mfu": ("MFU (%)", 100.0),
    "lr": ("learning rate", 1.0),
    "peak_memory_bytes": ("peak memory (MiB)", 1.0 / 2**20),
    "elapsed_s": ("elapsed (s)", 1.0),
    "step_time_s": ("step time (s)", 1.0),
    "grad_norm": ("gradient norm", 1.0),
    "tokens": ("tokens seen", 1.0),
}
# Metrics drawn with a smoothed line on top: per-step throughput jitters with the OS scheduler.
SMOOTHED = {"tokens_per_sec", "step_time_s"}
EMA_ALPHA = 0.2  # weight of the newest point: ~5 steps of memory
COLORS = [
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
# Sized for a laptop (1280 px wide: JupyterLab with its file browser open leaves ~850 px for outputs):
# panels in inches at 90 dpi, at most two side by side; the legend never covers a curve.
DPI, PANEL = 90, {1: (6.2, 2.8), 2: (3.7, 2.5)}  # columns -> (width, height) of one panel
LEFT, RIGHT, GAP_W, FONT = 0.8, 0.25, 0.95, 8
MAX_RUNS_LISTED = 12  # legend entries for runs; more are summed up in one entry


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def resolve_mode(mode: str | None = None) -> str:
    """Explicit `mode`, else env TITANLITE_LIVE_PLOT, else "widget" only for a kernel that a
    Jupyter server started for a live frontend, else "static".

    jupyter_server puts JPY_SESSION_NAME (the notebook's path) into the environment of each
    kernel it starts for a frontend session (JupyterLab, Notebook 7); nbclient, papermill and
    `jupyter console` do not (they set only JPY_PARENT_PID), and a terminal has no kernel.
    Other live frontends, or nbclient run from inside a Lab kernel (it inherits the variable):
    set TITANLITE_LIVE_PLOT.
    """
    mode = mode or os.environ.get("TITANLITE_LIVE_PLOT", "").strip().lower() or None
    if mode is not None:
        if mode not in MODES:
            raise TitanliteError(
                f"LivePlot mode {mode!r} is not one of {', '.join(MODES)}"
                f"{closest(mode, MODES)}; pass mode= or set TITANLITE_LIVE_PLOT"
            )
        return mode
    ip = _ipython()
    in_kernel = ip is not None and getattr(ip, "kernel", None) is not None
    return "widget" if in_kernel and os.environ.get("JPY_SESSION_NAME") else "static"


def ema(ys, alpha: float = EMA_ALPHA) -> list[float]:
    """Exponential moving average; NaN (a diverged step) is skipped, not propagated."""
    out, avg = [], math.nan
    for y in ys:
        if not math.isnan(y):
            avg = y if math.isnan(avg) else alpha * y + (1 - alpha) * avg
        out.append(avg)
    return out


def _short_peak(label: str) -> str:
    """A peak's name without cache date and matrix size (the figure's footnote)."""
    label = label.split(" [cached")[0]
    return re.sub(r" \(best at n=\d+\)", "", label)


def _peak_title(labels: list[str]) -> str:
    """The MFU panel's short title: which kind of peak, in which dtypes ("% of measured float32,
    bfloat16 peak"); the peaks' full names go to the footnote, once each."""
    kinds = [k for k in ("measured", "datasheet") if any(k in label for label in labels)]
    dtypes = list(
        dict.fromkeys(
            d
            for label in labels
            for d in re.findall(
                r"\b(?:b?float(?:16|32)|bf16|fp(?:8|16|32)|tf32|float8\w*)\b", label
            )
        )
    )
    return " ".join(
        [
            "% of",
            *(["/".join(kinds)] if kinds else []),
            *([", ".join(dtypes)] if dtypes else []),
            "peak",
        ]
    )


def _num(value) -> float | None:
    """A plottable float, NaN for non-finite (a gap in the line), None for missing/non-numeric."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else math.nan


def _short_clock(seconds: float) -> str:  # "7 s", "1:05": a notebook status line
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


class Progress:
    """Steps done, elapsed and remaining time, for a notebook's status line (LivePlot's).

    The rate is measured from the first step seen, not from step 0: a resumed run starts at
    its checkpoint's step, and its first records carry no start-up cost of the skipped steps."""

    def __init__(self, total: int | None = None):
        self.total = total
        self.step = self.elapsed_s = None
        self._first = None  # (step, elapsed_s) of the first record

    def update(self, step: float, elapsed_s: float) -> None:
        if self._first is None:
            self._first = (step, elapsed_s)
        self.step, self.elapsed_s = step, elapsed_s

    @property
    def fraction(self) -> float | None:
        if not self.total or self.step is None:
            return None
        return min(1.0, self.step / self.total)

    @property
    def remaining_s(self) -> float | None:
        if not self.total or self._first is None or self.step <= self._first[0]:
            return None
        rate = (self.elapsed_s - self._first[1]) / (self.step - self._first[0])  # s per step
        return max(0.0, (self.total - self.step) * rate)

    def text(self) -> str:
        if self.step is None:
            return ""
        parts = [
            f"step {self.step:.0f}" + (f"/{self.total} ({self.fraction:.0%})" if self.total else "")
        ]
        parts.append(f"{_short_clock(self.elapsed_s)} elapsed")
        if self.remaining_s is not None:
            parts.append(
                "done" if self.step >= self.total else f"~{_short_clock(self.remaining_s)} left"
            )
        return " · ".join(parts)


def read_jsonl(path: str | Path, kind: str | None = None) -> list[dict]:
    """Records of a metrics file (optionally only one kind); a torn last line is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise TitanliteError(
            f"metrics file '{p}' does not exist: pass a run directory "
            f"(runs/<name>) or its metrics.jsonl"
        )
    records = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written while we read
        if kind is None or rec.get("kind") == kind:
            records.append(rec)
    return records


class LivePlot:
    """Callback that plots trainer records (see module docstring). Records always have "step";
    train records ("kind": "train") carry the metrics, validation records ("kind": "val")
    carry "val_<metric>" (e.g. "val_loss"), drawn dashed on that metric's panel. Optional
    "run" and "rank" keys split records into separate lines; "peak_label" names MFU's peak.
    A "line" key names a line that is not a run (one expert's load in the run now training):
    it gets its own line in place of the run's, while the status line and the progress keep
    following the run, so they never name whichever line happened to arrive last.

    Widget mode displays the plot in the current cell as soon as it is constructed, so build
    it in the cell that trains (or set `show=False` and `display(plot)` yourself)."""

    def __init__(
        self,
        metrics=("loss", "tokens_per_sec", "mfu"),
        title=None,
        mode=None,
        min_interval_s=0.5,
        save_path=None,
        label=None,
        x="step",
        show=True,
        steps=None,
    ):
        self.metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        if not self.metrics:
            raise TitanliteError("LivePlot needs at least one metric, e.g. metrics=('loss',)")
        self.title, self.label, self.x = title, label, x
        self.mode = resolve_mode(mode)
        self.min_interval_s = float(min_interval_s)
        self.save_path = save_path
        self.draw_seconds = 0.0  # total time spent rendering: subtract it from training time
        self.n_draws = 0
        self._series: dict[tuple, dict] = {}  # (run, rank) -> color, {(kind, metric): (xs, ys)}
        self._peak_labels: list[str] = []
        self._last: dict = {}
        self._last_draw = -math.inf
        self._draw_cost = 0.0
        self._dirty = False
        self._shown_at = None  # (IPython execution_count, points) when we last showed ourselves
        self._ended = False
        self.steps = steps
        self._progress, self._progress_run, self._t0 = Progress(steps), None, None
        self._handles = []  # the live outputs' display handles, swapped for static ones at the end
        self._phase = None  # (what happens before the next record, since when): the status says it
        self._ticker = None  # the thread that keeps the phase's seconds counting
        n = len(self.metrics)
        self._cols = min(2, n)
        self._rows = -(-n // self._cols)
        self._fig = Figure(dpi=DPI)
        FigureCanvasAgg(self._fig)  # attaches itself to the figure
        cells = list(self._fig.subplots(self._rows, self._cols, squeeze=False).flat)
        self._axes = cells[:n]
        # an empty grid cell: the legend goes there
        self._spare = cells[n] if len(cells) > n else None
        if self._spare is not None:
            self._spare.axis("off")
        self._legend, self._legend_key, self._legend_rows, self._notes = None, None, 0, []
        self._layout()
        self._lines: dict[tuple, object] = {}
        self._box = self._image = self._status = self._bar = None
        if self.mode == "widget":
            self._build_widget(show)

    # --- feeding data -------------------------------------------------------------------
    def __call__(self, record: dict) -> None:
        self._phase = None  # a record: the phase before it is over
        self._add(record, run=record.get("run", self.label))
        if self.mode != "widget":
            return  # static/off: collect only; drawing waits for the end
        if self._ended and self._handles:  # another run into an ended plot: live again
            self._ended = False
            for handle in self._handles:
                handle.update(self._box)
        now = time.monotonic()
        # Keep plotting below ~10% of wall time even when a draw is slow (big figures, slow CPU).
        if now - self._last_draw >= max(self.min_interval_s, 10 * self._draw_cost):
            self._refresh()

    def add_run(self, label: str, records: list[dict]) -> None:
        """Overlay a finished run; `label` replaces any "run" key in its records."""
        for record in records:
            self._add(record, run=label)
        if self.mode == "widget":
            self._refresh()

    @classmethod
    def from_jsonl(cls, paths, labels=None, metrics=("loss", "tokens_per_sec", "mfu"), **kw):
        """Overlay finished runs, each a metrics.jsonl or its run directory; draws at once.
        Labels default to the run's name (runs/<name>/metrics.jsonl) or the file's stem."""
        paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if labels is None:
            labels = [
                p.name if p.is_dir() else p.parent.name if p.stem == "metrics" else p.stem
                for p in paths
            ]
            if len(set(labels)) < len(labels):  # e.g. rank0/x.jsonl and rank1/x.jsonl
                labels = [str(p.with_suffix("")) for p in paths]
        if len(labels) != len(paths):
            raise TitanliteError(
                f"from_jsonl got {len(paths)} paths but {len(labels)} labels; "
                "pass one label per file"
            )
        plot = cls(metrics=metrics, **kw)
        for path, label in zip(paths, labels):
            plot.add_run(label, read_jsonl(path))
        plot.on_train_end()
        return plot

    def _add(self, record: dict, run) -> None:
        step = _num(record.get(self.x))
        if step is None or math.isnan(step):
            return  # a record without x cannot be placed; say nothing, keep training
        rank, line = record.get("rank"), record.get("line")
        series = self._series.setdefault(
            (run if line is None else line, rank),
            {"color": COLORS[len(self._series) % len(COLORS)], "data": {}},
        )
        is_val = record.get("kind") == "val"
        for metric in self.metrics:
            # A val record carries val_<metric>; a train record may carry both.
            pairs = [("val", record.get(f"val_{metric}"))]
            if not is_val:
                pairs.append(("train", record.get(metric)))
            for kind, raw in pairs:
                value = _num(raw)
                if value is not None:
                    xs, ys = series["data"].setdefault((kind, metric), ([], []))
                    xs.append(step)
                    ys.append(value * AXES.get(metric, ("", 1.0))[1])
        peak = record.get("peak_label")
        if peak and peak not in self._peak_labels:
            self._peak_labels.append(str(peak))
        if not is_val:
            self._track_progress(run, step, record.get("elapsed_s"))
        self._last = {**self._last, **record, "run": run}
        self._dirty = True

    def _track_progress(self, run, step: float, elapsed) -> None:
        now = time.monotonic()
        self._t0 = now if self._t0 is None else self._t0
        # One plot may show several runs in turn (a comparison cell): progress is the latest run's.
        if run != self._progress_run or (
            self._progress.step is not None and step < self._progress.step
        ):
            self._progress, self._progress_run, self._t0 = Progress(self.steps), run, now
        elapsed = _num(elapsed)
        self._progress.update(
            step, now - self._t0 if elapsed is None or math.isnan(elapsed) else elapsed
        )

    # --- drawing ------------------------------------------------------------------------
    def _layout(self) -> None:
        """Figure size and margins in inches, fixed: a layout engine (constrained/tight) would
        re-measure every label on every redraw and double the cost of a frame for no gain here.
        Room above for the title and the panels' titles, below for the legend and footnotes."""
        panel_w, panel_h = PANEL[self._cols]
        titled = any(ax.get_title() for ax in self._axes)
        gap_h = 0.65 + 0.25 * titled  # the x label of the row above, this row's titles
        top = 0.15 + 0.3 * self._title_text().count("\n") + 0.3 * bool(self.title) + 0.25 * titled
        bottom = 0.5 + 0.22 * self._legend_rows + 0.17 * len(self._notes)
        w = LEFT + self._cols * panel_w + (self._cols - 1) * GAP_W + RIGHT
        h = top + self._rows * panel_h + (self._rows - 1) * gap_h + bottom
        self._fig.set_size_inches(w, h)
        self._fig.subplots_adjust(
            left=LEFT / w,
            right=1 - RIGHT / w,
            bottom=bottom / h,
            top=1 - top / h,
            wspace=GAP_W / panel_w,
            hspace=gap_h / panel_h,
        )
        for i, note in enumerate(self._notes):  # the footnotes sit at fixed inches from the bottom
            note.set_position((0.1 / w, (0.08 + 0.17 * (len(self._notes) - 1 - i)) / h))

    def _draw(self) -> None:
        """Update the persistent Line2D objects in place (cheaper than clearing axes)."""
        for (run, rank), series in self._series.items():
            name = " ".join(
                str(p) for p in (run, None if rank is None else f"rank {rank}") if p is not None
            )
            for (kind, metric), (xs, ys) in series["data"].items():
                ax = self._axes[self.metrics.index(metric)]
                line = self._lines.get((run, rank, kind, metric))
                if line is None:
                    val = kind == "val"
                    text = f"{name} val".strip() if val else (name or "train")
                    (line,) = ax.plot(
                        [],
                        [],
                        color=series["color"],
                        label=text,
                        linestyle="--" if val else "-",
                        marker="o" if val else None,
                        markersize=3,
                        linewidth=1.4,
                    )
                    self._lines[(run, rank, kind, metric)] = line
                line.set_data(xs, ys)
                if kind == "train" and metric in SMOOTHED and len(xs) > 2:
                    key = (run, rank, "ema", metric)
                    if key not in self._lines:
                        line.set_alpha(0.35)  # the raw jitter stays visible, behind the trend
                        self._lines[key] = ax.plot(
                            [],
                            [],
                            color=series["color"],
                            linewidth=1.8,
                            label=f"EMA, α={EMA_ALPHA}",
                        )[0]
                    self._lines[key].set_data(xs, ema(ys))
        relayout = False
        for metric, ax in zip(self.metrics, self._axes):
            ax.set_ylabel(AXES.get(metric, (metric, 1.0))[0], fontsize=FONT + 1)
            if metric == "mfu" and self._peak_labels:  # MFU means nothing without its peak
                over = (
                    max(
                        (y for line in ax.get_lines() for y in line.get_ydata() if y == y),
                        default=0,
                    )
                    > 100
                )
                notes = list(
                    dict.fromkeys(f"MFU: % of {_short_peak(p)}" for p in self._peak_labels)
                ) + (
                    [
                        "MFU above 100% is no real MFU: that peak is too low here (measured while the machine "
                        "was busier, or with other threads): `titanlite peaks --refresh`"
                    ]
                    if over
                    else []
                )
                if [n.get_text() for n in self._notes] != notes:
                    ax.set_title(_peak_title(self._peak_labels), fontsize=FONT + 0.5)
                    if over and not any(line.get_label() == "_peak" for line in ax.get_lines()):
                        ax.axhline(100, color="0.3", linestyle=":", linewidth=1, label="_peak")
                    for old in self._notes:
                        old.remove()
                    self._notes = [
                        self._fig.text(0, 0, n, fontsize=FONT - 1, color="0.35") for n in notes
                    ]
                    relayout = True
            ax.set_xlabel(AXES.get(self.x, (self.x,))[0], fontsize=FONT + 1)
            ax.tick_params(labelsize=FONT)
            if (
                self.x != "elapsed_s"
            ):  # steps, tokens, repetitions: no 2.5 steps on a short run's axis
                ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            if self.x == "tokens":  # 1,048,576 tokens as "1M": labels that never run together
                ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            if metric == "tokens_per_sec":
                ax.yaxis.set_major_formatter(EngFormatter(sep=""))
            ax.grid(True, alpha=0.3)
            ax.relim()
            ax.autoscale_view()
        relayout |= self._draw_legend()
        suptitle = self._fig._suptitle.get_text() if self._fig._suptitle else ""
        if (
            self.title and self._title_text() != suptitle
        ):  # a title may be set after the runs, with their result
            self._fig.suptitle(self._title_text(), fontsize=FONT + 3)
            relayout = True
        if relayout:
            self._layout()

    def _title_text(self) -> str:
        """The title, wrapped to the figure's width (about 8 characters of 11 pt per inch)."""
        width = LEFT + self._cols * PANEL[self._cols][0] + (self._cols - 1) * GAP_W + RIGHT
        return "\n".join(textwrap.wrap(self.title or "", int(8 * width)))

    def _draw_legend(self) -> bool:
        """One legend for the whole figure, outside every panel: in the spare grid cell, else below
        the panels. A colour per run; the line styles (validation, smoothed) once each. Returns
        whether the figure's layout must change (more legend rows)."""
        runs = {}  # (run, rank) -> its colour, in the order they arrived
        for (run, rank, _kind, _metric), line in self._lines.items():
            runs.setdefault((run, rank), line.get_color())
        handles = [Line2D([], [], color=color, linewidth=1.8) for color in runs.values()][
            :MAX_RUNS_LISTED
        ]
        labels = [
            " ".join(
                str(p) for p in (run, None if rank is None else f"rank {rank}") if p is not None
            )
            or "train"
            for run, rank in runs
        ][:MAX_RUNS_LISTED]
        if len(runs) > MAX_RUNS_LISTED:  # a search's sixty trials: the colours repeat anyway
            handles.append(Line2D([], [], color="none"))
            labels.append(f"… {len(runs) - MAX_RUNS_LISTED} more runs")
        kinds = {key[2] for key in self._lines}
        if "val" in kinds:
            handles.append(Line2D([], [], color="0.4", linestyle="--", marker="o", markersize=3))
            labels.append("validation (dashed)")
        if "ema" in kinds:
            handles += [
                Line2D([], [], color="0.4", alpha=0.35),
                Line2D([], [], color="0.4", linewidth=1.8),
            ]
            labels += ["per step", f"EMA, α={EMA_ALPHA}"]
        key = (tuple(labels), len(self._notes))
        if len(handles) < 2 or key == self._legend_key:
            return False
        self._legend_key = key
        if self._legend is not None:
            self._legend.remove()
        rows = 0
        if self._spare is not None:
            self._legend = self._spare.legend(
                handles, labels, loc="upper left", fontsize=FONT, frameon=False
            )
        else:  # under the x labels, above the footnotes: anchored in inches from the bottom edge
            ncol = 4 if self._cols > 1 else 3
            rows = -(-len(labels) // ncol)
            lift = ScaledTranslation(0, 0.05 + 0.17 * len(self._notes), self._fig.dpi_scale_trans)
            self._legend = self._fig.legend(
                handles,
                labels,
                loc="lower center",
                ncol=ncol,
                fontsize=FONT,
                frameon=False,
                bbox_to_anchor=(0.5, 0.0),
                bbox_transform=self._fig.transFigure + lift,
            )
        changed, self._legend_rows = rows != self._legend_rows, rows
        return changed

    def legend_labels(self) -> list[str]:
        """The figure legend's entries (runs, then line styles): what a reader can tell apart."""
        return [t.get_text() for t in self._legend.get_texts()] if self._legend is not None else []

    def phase(self, text: str | None) -> None:
        """What happens before the next record ("compiling +compile", "starting 2 processes"): the
        status line says it, with the seconds since it began, counting, until a record arrives.
        Without it a long compile looks like a hung cell. None clears it."""
        self._phase = (text, time.monotonic()) if text else None
        if self.mode != "widget" or self._status is None:
            return
        self._status.value = self._status_html()
        if self._phase is not None and self._ticker is None:
            self._ticker = threading.Thread(
                target=self._tick, name="titanlite-live-plot", daemon=True
            )
            self._ticker.start()

    def _tick(self) -> None:
        # A thread may set a widget's value: ipykernel sends the comm message on its IOPub thread.
        wake = threading.Event()
        while not self._ended:
            if self._phase is not None:
                self._status.value = self._status_html()
            wake.wait(1.0)
        self._ticker = None

    def png(self) -> bytes:
        """The current figure as PNG bytes (draws everything collected so far)."""
        start = time.perf_counter()
        self._draw()
        buf = io.BytesIO()
        self._fig.savefig(buf, format="png")
        self._draw_cost = time.perf_counter() - start
        self.draw_seconds += self._draw_cost
        self.n_draws += 1
        return buf.getvalue()

    def _refresh(self) -> None:
        self._last_draw = time.monotonic()
        self._dirty = False
        if self.mode == "widget":
            self._image.value = self.png()  # one comm message; the browser swaps the picture
            self._status.value = self._status_html()
            if self._bar is not None and self._progress.step is not None:
                self._bar.value = int(min(self._progress.step, self.steps))

    def _status_lines(self) -> list[str]:
        """The status, in two lines that each fit beside the progress bar on a laptop screen:
        where the run is (run, rank, step, elapsed, left), then what it measures."""
        if self._phase is not None:  # between records: what is happening, and for how long
            text, since = self._phase
            return [f"{text} · {_short_clock(time.monotonic() - since)} elapsed"]
        r = self._last
        rank = None if r.get("rank") is None else f"rank {r['rank']}"
        where = [
            " ".join(str(v) for v in (r.get("run"), rank) if v is not None),
            self._progress.text(),
        ]
        measured = []
        for key, fmt in (
            ("loss", "loss {:.4f}"),
            ("val_loss", "val {:.4f}"),
            ("tokens_per_sec", "{:,.0f} tok/s"),
            ("mfu", "MFU {:.2%}"),
        ):
            if (value := _num(r.get(key))) is not None:
                measured.append(fmt.format(value))
        lines = [" · ".join(p for p in part if p) for part in (where, measured)]
        return [line for line in lines if line] or ["waiting for the first step…"]

    def _status_text(self) -> str:
        return " · ".join(self._status_lines())

    def _status_html(self) -> str:
        # A block of its own: a message printed while training (a stream output) never reads as
        # part of the status line, in the page or in a copy of its text.
        lines = "".join(f"<div><code>{html.escape(t)}</code></div>" for t in self._status_lines())
        return f"<div>{lines}</div>"

    # --- showing ------------------------------------------------------------------------
    def _build_widget(self, show: bool) -> None:
        import ipywidgets as widgets

        self._status = widgets.HTML(self._status_html())
        if self.steps:
            self._bar = widgets.IntProgress(
                value=0, min=0, max=int(self.steps), layout=widgets.Layout(width="240px")
            )
        self._image = widgets.Image(
            value=self.png(), format="png", layout=widgets.Layout(max_width="100%")
        )
        self._image.add_class("titanlite-live-plot")
        top = [self._bar, self._status] if self._bar is not None else [self._status]
        self._box = widgets.VBox([widgets.HBox(top), self._image])
        if show:
            self._show()

    def _final_output(self) -> _Bundle:
        """What a saved notebook keeps of the live plot: an image/png output (nbconvert, GitHub)
        whose HTML twin adds the status line and keeps the live image's class."""
        import base64

        b64 = base64.b64encode(self.png()).decode()
        return _Bundle(
            {
                "image/png": b64,
                "text/plain": self._status_text() + "\n",
                "text/html": f"{self._status_html()}"
                f'<img class="titanlite-live-plot" src="data:image/png;base64,{b64}"/>',
            }
        )

    def _show(self) -> None:
        ip = _ipython()
        if ip is None:
            return
        from IPython.display import Image, display

        if self.mode == "widget" and not self._ended:
            self._handles.append(display(self._box, display_id=True))  # the end swaps it in place
        elif self.mode == "widget":
            display(self._final_output())
        else:
            display(Image(data=self.png(), format="png"))
        self._shown_at = (ip.execution_count, self._n_points())

    def _n_points(self) -> int:
        return sum(len(xs) for s in self._series.values() for xs, _ in s["data"].values())

    def on_train_end(self) -> None:
        """Final draw. Widget: the last frame, then a static PNG replaces the live widget (a saved
        notebook keeps it); static: show the figure once; then save."""
        self._ended, self._phase = True, None
        self._draw()  # cheap: updates the artists; rendering to pixels happens on demand
        if self.mode == "widget":
            if self._dirty:  # points arrived since the last throttled frame
                self._refresh()
            final = self._final_output() if self._handles else None
            for handle in self._handles:
                handle.update(final)
        elif self.mode == "static":
            self._show()
        if self.save_path:
            self.savefig(self.save_path)

    def close(self) -> None:
        """Finish (same as on_train_end, once): the static picture replaces the widget."""
        if not self._ended:
            self.on_train_end()

    def savefig(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._draw()
        self._fig.savefig(path)

    def _ipython_display_(self) -> None:
        # `plot` as the last line of the cell where the plot already showed itself would show
        # it twice: a second live view of the widget, or the same static picture again.
        ip = _ipython()
        if ip is not None and self._shown_at is not None:
            count, points = self._shown_at
            if count == ip.execution_count and (
                self.mode == "widget" or points == self._n_points()
            ):
                return
        self._show()

    def _repr_png_(self) -> bytes:
        return self.png()

    def __repr__(self) -> str:
        return (
            f"LivePlot(mode={self.mode!r}, metrics={self.metrics}, "
            f"series={len(self._series)}, points={self._n_points()})"
        )


class _Bundle:
    """A ready-made MIME bundle for IPython's display machinery."""

    def __init__(self, data: dict):
        self.data = data

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data
