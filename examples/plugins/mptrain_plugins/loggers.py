"""A user's metrics logger: every logged number as one CSV row, `<run_dir>/metrics.csv`.

    torchrun --nproc_per_node=4 train.py experiment=shakespeare_cpu \\
        +logger.loggers.csv._target_=mptrain_plugins.loggers.CSVLogger
    # beside wandb:  logger=wandb +logger.loggers.csv._target_=mptrain_plugins.loggers.CSVLogger +logger.loggers.csv.filename=m.csv

The interface is `mptrain.training.loggers.MetricsLogger` (`log_metrics(metrics, step)`,
`finish()`); the trainer passes the runtime keywords this constructor names (`run_dir`,
`start_iteration`) and the node's own keys (`filename`). It needs no mptrain import.

Long format (`step,name,value`), because the train / valid / test rows carry different names.
On resume (`start_iteration` > 0) the rows after the checkpoint's iteration are dropped, as
metrics.jsonl does, so the file holds each step once.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Mapping


class CSVLogger:
    """Appends ``step,name,value`` rows to ``<run_dir>/<filename>``, flushed per call.

    Args:
        run_dir: the run folder (runtime keyword).
        start_iteration: 0, or the checkpoint's iteration on resume (runtime keyword).
        filename: the CSV file's name inside the run folder.
    """

    def __init__(self, *, run_dir: Path, start_iteration: int = 0, filename: str = "metrics.csv") -> None:
        self.path = Path(run_dir) / filename
        kept = []
        if start_iteration > 0 and self.path.exists():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= start_iteration]
        self._file = open(self.path, "w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(["step", "name", "value"])
        self._csv.writerows([r["step"], r["name"], r["value"]] for r in kept)
        self._file.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        # repr: the shortest text that reads back as the same float
        self._csv.writerows([step, name, repr(float(value))] for name, value in metrics.items())
        self._file.flush()

    def finish(self) -> None:
        self._file.close()
