"""An opt-in log of every step's shape and start time, one JSON line each.

With ``NEURON_SCHEDULER_STEP_LOG=PATH`` in the engine's environment the
scheduler appends a line per ``schedule()`` call: ``t`` (monotonic seconds
when it began), ``kind``, the request ids, and the padded shape the worker
runs, and ``running`` / ``waiting`` (the requests in the scheduler when it
began): a prefill's ``chunks`` (``[padded tokens, tokens computed before]``
per request) and ``scheduled`` (each chunk's real tokens), a decode's
``rows`` / ``context`` (padded) and ``rows_actual`` / ``context_actual``
(real rows, their mean context). The
time from one line to the next is what a step costs where the engine
serves (its worker, the engine core, the hand-off between them), which
``sim.calibration`` fits a profile to. Lines are written as they happen
(line-buffered), so a log read while the engine runs is whole up to its
last line.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from neuron_scheduler.step import ScheduledRequest, StepKind, StepRecord

#: The environment variable that names the log file.
STEP_LOG_ENV = "NEURON_SCHEDULER_STEP_LOG"


class StepLog:
    """Appends one line per step to ``path``."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_environment(cls) -> StepLog | None:
        path = os.environ.get(STEP_LOG_ENV)
        return cls(path) if path else None

    def write(
        self,
        started: float,
        counts: tuple[int, int],
        record: StepRecord,
        step: list[ScheduledRequest],
    ) -> None:
        """The line of a step that began at ``started`` with ``counts``
        (running, waiting) requests; ``step``: its requests
        (``scheduled_requests``)."""
        line: dict[str, Any] = {
            "t": started,
            "running": counts[0],
            "waiting": counts[1],
            "kind": record.kind.value,
            "ids": list(record.request_ids),
        }
        if record.kind is StepKind.PREFILL:
            line["chunks"] = [
                [record.padded_tokens[r.request_id], r.num_computed_before]
                for r in step
            ]
            line["scheduled"] = [r.num_scheduled for r in step]
        elif record.kind is StepKind.DECODE:
            ends = [r.num_computed_before + r.num_scheduled for r in step]
            line.update(
                rows=record.num_seqs_padded,
                context=record.context_len_padded,
                rows_actual=record.num_seqs,
                context_actual=sum(ends) / len(ends),
            )
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
