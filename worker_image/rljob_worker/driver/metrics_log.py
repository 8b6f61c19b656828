"""The job's driver keeps every finished iteration's metrics in <checkpoint.path>/metrics.jsonl.

The file is the history of the weights the checkpoints hold: a run that resumes from the
checkpoint of iteration k keeps the lines before k, replaces the lines from k on with its own
(an earlier attempt may have finished iterations after its last checkpoint: they are redone),
and a run that starts at iteration 0 starts the file anew. Iteration k's own line keeps what the
earlier run measured that the resumed one does not redo (its train stage is in the checkpoint:
policy loss, KL, entropy... of that update). Every write replaces the whole file atomically
(rljob.metrics_file.write_atomically), so a killed driver leaves a whole file and a failed
write is made good by the next one. A write that fails is logged, never the job's failure:
status.metrics still has the newest iterations.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rljob.api import RLJobSpec
from rljob.metrics_file import (
    METRICS_FILE,
    MetricsFileError,
    entry_of,
    read_entries,
    text_of,
    write_atomically,
)
from rljob.report import IterationMetrics, IterationReport

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, directory: Path) -> None:
        self.path = directory / METRICS_FILE
        # Read at the first record, when the run knows where it started.
        self._earlier: list[dict[str, Any]] | None = None
        self._carried: dict[str, Any] | None = None  # the earlier line of the resumed iteration
        self._ours: dict[int, dict[str, Any]] = {}

    @classmethod
    def of(cls, spec: RLJobSpec) -> MetricsLog | None:
        """The job's log: beside its checkpoints, or none when the job keeps none."""
        return cls(Path(spec.checkpoint.path)) if spec.checkpoint is not None else None

    def record(self, report: IterationReport, resumed_from: int | None) -> None:
        """Write the file with `report`'s iteration (every rank finished it) added.
        `resumed_from`: the checkpoint's iteration this run continued from (None: it began at
        iteration 0)."""
        if self._earlier is None:
            self._earlier, self._carried = self._continued(resumed_from)
        entry = entry_of(IterationMetrics.of(report))
        if self._carried is not None and self._carried["iteration"] == entry["iteration"]:
            entry = {**self._carried, **entry}
        self._ours[entry["iteration"]] = entry
        ours = [self._ours[i] for i in sorted(self._ours)]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, text_of([*self._earlier, *ours]))
        except OSError as error:
            log.error(
                "%s: iteration %d's metrics not written (the next iteration tries again): %s",
                self.path, entry["iteration"], error,
            )  # fmt: skip

    def _continued(
        self, resumed_from: int | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """(the earlier lines this run continues, the earlier line of the iteration it resumed
        at). An unreadable file is moved aside, named in the log, and not continued."""
        if resumed_from is None:
            return [], None
        try:
            entries = read_entries(self.path)
        except FileNotFoundError:
            return [], None
        except (OSError, UnicodeDecodeError, MetricsFileError) as error:
            aside = self.path.with_name(f"{METRICS_FILE}.unreadable")
            log.error("%s cannot be continued (%s); moved to %s", self.path, error, aside)
            try:
                self.path.rename(aside)
            except OSError as move_error:
                log.error("%s not moved: %s", self.path, move_error)
            return [], None
        before = [e for e in entries if e["iteration"] < resumed_from]
        carried = [e for e in entries if e["iteration"] == resumed_from]
        by_iteration = {e["iteration"]: e for e in before}  # a later line replaces an earlier
        return [by_iteration[i] for i in sorted(by_iteration)], (carried[-1] if carried else None)
