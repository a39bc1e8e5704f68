"""Live training curves in JupyterLab; one static figure everywhere else.

    plot = LivePlot()                  # in JupyterLab: shows itself in this cell's output
    for record in trainer:  plot(record)
    plot.on_train_end()                # final draw (static mode: show once / save PNG)

    LivePlot.from_jsonl(["runs/fp32.jsonl", "runs/bf16.jsonl"])   # overlay finished runs

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
- Outside a live frontend (nbclient, CI, a terminal) widgets would be saved as dead
  placeholders, so we only collect data and show/save the final figure once at the end.
"""
from __future__ import annotations

import io
import json
import math
import os
import time
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .errors import TitanliteError, closest

MODES = ("widget", "static", "off")
# metric -> (axis label, scale applied to the raw value). MFU arrives as a fraction.
AXES = {
    "loss": ("loss", 1.0),
    "tokens_per_sec": ("tokens/s", 1.0),
    "mfu": ("MFU (%)", 100.0),
    "lr": ("learning rate", 1.0),
    "peak_memory_bytes": ("peak memory (MiB)", 1.0 / 2**20),
    "elapsed_s": ("elapsed (s)", 1.0),
}
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

    jupyter_server puts JPY_SESSION_NAME (the notebook's path) into the environment of every
    kernel it starts for JupyterLab / Notebook 7 / VS Code-on-a-server; nbclient, papermill
    and plain `jupyter console` do not, and a terminal has no kernel at all.
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


def _num(value) -> float | None:
    """A plottable float, NaN for non-finite (a gap in the line), None for missing/non-numeric."""
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
                 min_interval_s=0.5, save_path=None, label=None, x="step", show=True):
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
        self._fig = Figure(figsize=(3.7 * len(self.metrics), 3.0), dpi=90, layout="constrained")
        FigureCanvasAgg(self._fig)  # attaches itself to the figure
        self._axes = self._fig.subplots(1, len(self.metrics), squeeze=False)[0]
        self._lines: dict[tuple, object] = {}
        self._box = self._image = self._status = None
        if self.mode == "widget":
            self._build_widget(show)

    # --- feeding data -------------------------------------------------------------------
    def __call__(self, record: dict) -> None:
        self._add(record, run=record.get("run", self.label))
        if self.mode != "widget":
            return  # static/off: collect only; drawing waits for the end
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
        """Overlay finished runs from JSONL metric files (one record per line); draws at once."""
        paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if labels is None:  # file stems, or parent/stem when stems collide (rank0/metrics.jsonl)
            stems = [p.stem for p in paths]
            labels = [f"{p.parent.name}/{p.stem}" if stems.count(p.stem) > 1 else p.stem
                      for p in paths]
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
        self._last = {**self._last, **record, "run": run}
        self._dirty = True

    # --- drawing ------------------------------------------------------------------------
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
        for metric, ax in zip(self.metrics, self._axes):
            label = AXES.get(metric, (metric, 1.0))[0]
            if metric == "mfu" and self._peak_labels:
                label = f"MFU (% of {', '.join(self._peak_labels)})"
            ax.set_ylabel(label)
            ax.set_xlabel(self.x)
            ax.grid(True, alpha=0.3)
            ax.relim()
            ax.autoscale_view()
        if len(self._axes[0].get_lines()) > 1:
            self._axes[0].legend(fontsize=8, loc="best")
        if self.title:
            self._fig.suptitle(self.title)

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

    def _status_html(self) -> str:
        r, parts = self._last, []
        if r.get("run") is not None or r.get("rank") is not None:
            parts.append(" ".join(str(v) for v in (r.get("run"), r.get("rank")) if v is not None))
        if "step" in r:
            parts.append(f"step {r['step']}")
        for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"),
                         ("tokens_per_sec", "{:,.0f} tok/s"), ("mfu", "MFU {:.2%}")):
            if _num(r.get(key)) is not None:
                parts.append(fmt.format(r[key]))
        return f"<code>{' · '.join(parts) or 'waiting for the first step…'}</code>"

    # --- showing ------------------------------------------------------------------------
    def _build_widget(self, show: bool) -> None:
        import ipywidgets as widgets

        self._status = widgets.HTML(self._status_html())
        self._image = widgets.Image(value=self.png(), format="png",
                                    layout=widgets.Layout(max_width="100%"))
        self._image.add_class("titanlite-live-plot")
        self._box = widgets.VBox([self._status, self._image])
        if show:
            self._show()

    def _show(self) -> None:
        ip = _ipython()
        if ip is None:
            return
        from IPython.display import Image, display

        display(self._box if self.mode == "widget" else Image(data=self.png(), format="png"))
        self._shown_at = (ip.execution_count, self._n_points())

    def _n_points(self) -> int:
        return sum(len(xs) for s in self._series.values() for xs, _ in s["data"].values())

    def on_train_end(self) -> None:
        """Final draw. Widget: the last points; static: show the figure once; then save."""
        self._ended = True
        if self.mode == "widget":
            self._refresh()
        elif self.mode == "static":
            self._show()
        if self.save_path:
            self.savefig(self.save_path)

    def close(self) -> None:
        """Finish (same as on_train_end, once). The widget stays on screen with its last frame."""
        if not self._ended:
            self.on_train_end()

    def savefig(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._draw()
        self._fig.savefig(path)

    def _ipython_display_(self) -> None:
        # `plot` as a cell's last line right after the plot showed itself would show it twice.
        ip = _ipython()
        if ip is not None and self._shown_at == (ip.execution_count, self._n_points()):
            return
        self._show()

    def _repr_png_(self) -> bytes:
        return self.png()

    def __repr__(self) -> str:
        return (f"LivePlot(mode={self.mode!r}, metrics={self.metrics}, "
                f"series={len(self._series)}, points={self._n_points()})")


def read_jsonl(path) -> list[dict]:
    """Records from a JSONL metrics file; a bad line is reported with its line number."""
    path = Path(path)
    if not path.is_file():
        raise TitanliteError(f"metrics file {path} does not exist; pass the JSONL the trainer wrote")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TitanliteError(f"{path}:{n} is not JSON ({e.msg}); "
                                     "a metrics file holds one JSON object per line") from None
    return records
