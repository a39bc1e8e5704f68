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
  (pass `steps=`, the run's total; the trainer's records do not carry it).
"""
from __future__ import annotations

import io
import math
import os
import re
import textwrap
import time
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ._ui import Progress

from .errors import TitanliteError, closest
from .metrics import read_jsonl

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
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


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
            raise TitanliteError(f"LivePlot mode {mode!r} is not one of {', '.join(MODES)}"
                                 f"{closest(mode, MODES)}; pass mode= or set TITANLITE_LIVE_PLOT")
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
    """The MFU panel's title: the peak's name without cache date and matrix size."""
    label = label.split(" [cached")[0]
    return re.sub(r" \(best at n=\d+\)", "", label)


def _num(value) -> float | None:
    """A plottable float, NaN for non-finite (a gap in the line), None for missing/non-numeric."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else math.nan


class LivePlot:
    """Callback that plots trainer records (see module docstring). Records always have "step";
    train records ("kind": "train") carry the metrics, validation records ("kind": "val")
    carry "val_<metric>" (e.g. "val_loss"), drawn dashed on that metric's panel. Optional
    "run" and "rank" keys split records into separate lines; "peak_label" names MFU's peak.

    Widget mode displays the plot in the current cell as soon as it is constructed, so build
    it in the cell that trains (or set `show=False` and `display(plot)` yourself)."""

    def __init__(self, metrics=("loss", "tokens_per_sec", "mfu"), title=None, mode=None,
                 min_interval_s=0.5, save_path=None, label=None, x="step", show=True,
                 steps=None):
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
        self._fig = Figure(figsize=(3.9 * len(self.metrics), 3.0), dpi=90)
        FigureCanvasAgg(self._fig)  # attaches itself to the figure
        self._axes = self._fig.subplots(1, len(self.metrics), squeeze=False)[0]
        self._fix_margins()
        self._lines: dict[tuple, object] = {}
        self._box = self._image = self._status = self._bar = None
        if self.mode == "widget":
            self._build_widget(show)

    # --- feeding data -------------------------------------------------------------------
    def __call__(self, record: dict) -> None:
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
            labels = [p.name if p.is_dir() else p.parent.name if p.stem == "metrics" else p.stem
                      for p in paths]
            if len(set(labels)) < len(labels):  # e.g. rank0/x.jsonl and rank1/x.jsonl
                labels = [str(p.with_suffix("")) for p in paths]
        if len(labels) != len(paths):
            raise TitanliteError(f"from_jsonl got {len(paths)} paths but {len(labels)} labels; "
                                 "pass one label per file")
        plot = cls(metrics=metrics, **kw)
        for path, label in zip(paths, labels):
            plot.add_run(label, read_jsonl(path))
        plot.on_train_end()
        return plot

    def _add(self, record: dict, run) -> None:
        step = _num(record.get(self.x))
        if step is None or math.isnan(step):
            return  # a record without x cannot be placed; say nothing, keep training
        rank = record.get("rank")
        series = self._series.setdefault(
            (run, rank), {"color": COLORS[len(self._series) % len(COLORS)], "data": {}})
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
        if run != self._progress_run or (self._progress.step is not None and step < self._progress.step):
            self._progress, self._progress_run, self._t0 = Progress(self.steps), run, now
        elapsed = _num(elapsed)
        self._progress.update(step, now - self._t0 if elapsed is None or math.isnan(elapsed) else elapsed)

    # --- drawing ------------------------------------------------------------------------
    def _fix_margins(self, title_lines: int = 0) -> None:
        """Margins fixed in inches. A layout engine (constrained/tight) would re-measure every
        label on every redraw and double the cost of a frame for no visible gain here."""
        (w, h), n = self._fig.get_size_inches(), len(self.metrics)
        left, right, gap, bottom = 0.8, 0.15, 1.0, 0.5
        suptitle_lines = self.title.count("\n") + 1 if self.title else 0
        top = 0.15 + 0.3 * suptitle_lines + 0.15 * title_lines + 0.1 * bool(title_lines)
        axis_w = (w - left - right - (n - 1) * gap) / n
        self._fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h,
                                  top=1 - top / h, wspace=gap / axis_w)

    def _draw(self) -> None:
        """Update the persistent Line2D objects in place (cheaper than clearing axes)."""
        for (run, rank), series in self._series.items():
            name = " ".join(str(p) for p in (run, None if rank is None else f"rank {rank}")
                            if p is not None)
            for (kind, metric), (xs, ys) in series["data"].items():
                ax = self._axes[self.metrics.index(metric)]
                line = self._lines.get((run, rank, kind, metric))
                if line is None:
                    val = kind == "val"
                    text = f"{name} val".strip() if val else (name or "train")
                    (line,) = ax.plot([], [], color=series["color"], label=text,
                                      linestyle="--" if val else "-", marker="o" if val else None,
                                      markersize=3, linewidth=1.4)
                    self._lines[(run, rank, kind, metric)] = line
                line.set_data(xs, ys)
                if kind == "train" and metric in SMOOTHED and len(xs) > 2:
                    key = (run, rank, "ema", metric)
                    if key not in self._lines:
                        line.set_alpha(0.35)  # the raw jitter stays visible, behind the trend
                        self._lines[key] = ax.plot([], [], color=series["color"], linewidth=1.8,
                                                   label=f"EMA, α={EMA_ALPHA}")[0]
                    self._lines[key].set_data(xs, ema(ys))
        for metric, ax in zip(self.metrics, self._axes):
            label = AXES.get(metric, (metric, 1.0))[0]
            ax.set_ylabel(label)
            if metric == "mfu" and self._peak_labels:  # MFU means nothing without its peak
                # Wrapped to the panel's width (~40 characters of 8.5 pt in 3 inches), never cut.
                peak = textwrap.wrap(f"MFU: % of {'; '.join(map(_short_peak, self._peak_labels))}", 40)
                if ax.get_title() != "\n".join(peak):
                    ax.set_title("\n".join(peak), fontsize=8.5)
                    self._fix_margins(title_lines=len(peak))
            ax.set_xlabel(AXES.get(self.x, (self.x,))[0])
            if self.x != "elapsed_s":  # steps, tokens, repetitions: no 2.5 steps on a short run's axis
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, alpha=0.3)
            ax.relim()
            ax.autoscale_view()
        if len(self._axes[0].get_lines()) > 1:
            # "upper right": a falling loss leaves it empty, and "best" costs a search per frame.
            self._axes[0].legend(fontsize=8, loc="upper right")
        for metric, ax in zip(self.metrics[1:], self._axes[1:]):
            emas = [l for k, l in self._lines.items() if k[2] == "ema" and k[3] == metric]
            if emas:  # colours name the runs on the loss panel; here only raw vs smoothed
                raw = self._lines[(*next(k for k in self._lines if k[2] == "ema" and k[3] == metric)[:2], "train", metric)]
                ax.legend([raw, emas[0]], ["per step", emas[0].get_label()], fontsize=7, loc="lower right")
        suptitle = self._fig._suptitle.get_text() if self._fig._suptitle else ""
        if self.title and self.title != suptitle:  # a title may be set after the runs, with their result
            self._fig.suptitle(self.title)
            mfu_title = next((ax.get_title() for m, ax in zip(self.metrics, self._axes) if m == "mfu"), "")
            self._fix_margins(title_lines=len(mfu_title.splitlines()))

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

    def _status_text(self) -> str:
        r = self._last
        rank = None if r.get("rank") is None else f"rank {r['rank']}"
        parts = [" ".join(str(v) for v in (r.get("run"), rank) if v is not None), self._progress.text()]
        for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"),
                         ("tokens_per_sec", "{:,.0f} tok/s"), ("mfu", "MFU {:.2%}")):
            if (value := _num(r.get(key))) is not None:
                parts.append(fmt.format(value))
        parts = [p for p in parts if p]
        return " · ".join(parts) or "waiting for the first step…"

    def _status_html(self) -> str:
        return f"<code>{self._status_text()}</code>"

    # --- showing ------------------------------------------------------------------------
    def _build_widget(self, show: bool) -> None:
        import ipywidgets as widgets

        self._status = widgets.HTML(self._status_html())
        if self.steps:
            self._bar = widgets.IntProgress(value=0, min=0, max=int(self.steps),
                                            layout=widgets.Layout(width="240px"))
        self._image = widgets.Image(value=self.png(), format="png",
                                    layout=widgets.Layout(max_width="100%"))
        self._image.add_class("titanlite-live-plot")
        top = [self._bar, self._status] if self._bar is not None else [self._status]
        self._box = widgets.VBox([widgets.HBox(top), self._image])
        if show:
            self._show()

    def _final_output(self) -> "_Bundle":
        """What a saved notebook keeps of the live plot: an image/png output (nbconvert, GitHub)
        whose HTML twin adds the status line and keeps the live image's class."""
        import base64

        b64 = base64.b64encode(self.png()).decode()
        return _Bundle({"image/png": b64, "text/plain": self._status_text(),
                        "text/html": f'{self._status_html()}<br/>'
                                     f'<img class="titanlite-live-plot" src="data:image/png;base64,{b64}"/>'})

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
        self._ended = True
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
            if count == ip.execution_count and (self.mode == "widget" or points == self._n_points()):
                return
        self._show()

    def _repr_png_(self) -> bytes:
        return self.png()

    def __repr__(self) -> str:
        return (f"LivePlot(mode={self.mode!r}, metrics={self.metrics}, "
                f"series={len(self._series)}, points={self._n_points()})")



class _Bundle:
    """A ready-made MIME bundle for IPython's display machinery."""

    def __init__(self, data: dict):
        self.data = data

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data
