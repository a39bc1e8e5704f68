"""Per-step metrics: one JSON object per line (JSON Lines), optionally mirrored to TensorBoard.

JSONL because it is append-only (a crash loses at most the line being written), streams
(a live plot can tail it while another process trains) and needs no library to read.
Record kinds: "train" (one per logged step) and "val" (one per evaluation).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import TitanliteError
from .paths import check_output_dir


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = False, filename: str = "metrics.jsonl"):
        self.run_dir = check_output_dir(run_dir, "run folder (metrics.log_dir / metrics.run_name)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        self._file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is a declared dependency, but be clear
                raise TitanliteError(f"metrics.tensorboard=true needs the tensorboard package "
                                     f"({e}): pip install tensorboard") from None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            prefix = record.get("kind", "train")
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path, kind: str | None = None) -> list[dict]:
    """Records of a metrics file (optionally only one kind); a torn last line is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise TitanliteError(f"metrics file '{p}' does not exist: pass a run directory "
                             f"(runs/<name>) or its metrics.jsonl")
    records = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written while we read
        if kind is None or rec.get("kind") == kind:
            records.append(rec)
    return records


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)
