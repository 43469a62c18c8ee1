"""Every status the database stores, as enums, and the one place that maps one kind to another.

They are `str` enums: the stored value is the same word as before (no migration), a member
compares equal to its word, and it prints as that word. Read a stored word back with
`parse(ExperimentStatus, word)`.

- An experiment is `queued` (the service's queue), then `running`, then one of FINISHED.
- A trial (the baseline or a trial of an experiment) is `running`, then finished.
- A sweep's cell is `pending` until its experiment starts, or `skipped` (not applicable).
- A sweep's status follows from its cells' (`sweep_status_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeVar


class _Status(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class ExperimentStatus(_Status):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C or a signal; its trials so far are kept
    CANCELLED = "cancelled"  # by a user, through the API


class TrialStatus(_Status):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class SweepStatus(_Status):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # a CLI sweep stopped with cells left: `failbench sweep` resumes


class CellStatus(_Status):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"  # the mechanism does not apply to the architecture, or the trace


FINISHED = frozenset(
    {
        ExperimentStatus.COMPLETED,
        ExperimentStatus.FAILED,
        ExperimentStatus.CANCELLED,
        ExperimentStatus.INTERRUPTED,
    }
)

S = TypeVar("S", bound=_Status)


def parse(kind: type[S], word: str, what: str | None = None) -> S:
    """The member for a stored or given word; a ValueError that lists the words otherwise."""
    try:
        return kind(word)
    except ValueError:
        words = ", ".join(m.value for m in kind)
        label = what or kind.__name__
        raise ValueError(f"unknown {label} {word!r}; expected one of: {words}") from None


def cell_status_of(experiment: ExperimentStatus | str) -> CellStatus:
    """A cell's status from its experiment's: a cancelled or interrupted experiment is a failed
    cell (it has no result); the CLI's sweep, which resumes interrupted cells, says so itself."""
    return _CELL_OF.get(parse(ExperimentStatus, experiment), CellStatus.FAILED)


_CELL_OF = {
    ExperimentStatus.QUEUED: CellStatus.PENDING,
    ExperimentStatus.RUNNING: CellStatus.RUNNING,
    ExperimentStatus.COMPLETED: CellStatus.COMPLETED,
}


def sweep_status_of(cells: Mapping[str, int], *, active: bool) -> SweepStatus:
    """A sweep's status from how many of its cells have each status. `active`: something still
    works on it (the service's queue); otherwise cells left over mean it was interrupted."""
    if cells.get(CellStatus.PENDING, 0) or cells.get(CellStatus.RUNNING, 0):
        return SweepStatus.RUNNING if active else SweepStatus.INTERRUPTED
    return SweepStatus.FAILED if cells.get(CellStatus.FAILED, 0) else SweepStatus.COMPLETED


def cell_counts() -> dict[str, int]:
    """Zero cells of each status, keyed by the status word (a sweep's progress starts here)."""
    return {s.value: 0 for s in CellStatus}
