"""Every error a user can cause, and errors of a run: one tree. Each message says what to
change; each class says the CLI's exit code and the API's HTTP status for it, so the CLI and
the API answer the same error the same way.

    FailBenchError                 exit 1  HTTP 500
    +-- UsageError                 exit 2  HTTP 422  a bad option, query or setting
    |   +-- SpecError              exit 2  HTTP 422  the experiment spec (or a sweep's)
    |       +-- NotApplicableError                   the mechanism does not apply there
    +-- NotFoundError              exit 2  HTTP 404
    |   +-- ExperimentNotFound
    |   +-- SweepNotFound
    +-- ConflictError              exit 1  HTTP 409  the state does not allow it now
    |   +-- IdempotencyConflict
    |   +-- InvalidTransition
    +-- DatabaseError              exit 2  HTTP 503  the database cannot be used as configured
    +-- RecoveryError              exit 1            a recovery could not complete
    +-- TrialInterrupted           exit 130          Ctrl-C or a cancel during a trial
    +-- LeaseLost                                    a dispatcher lost its experiment
"""

from __future__ import annotations

from typing import Any, ClassVar


class FailBenchError(Exception):
    """Base class. Pickles cleanly across actors (its constructor's arguments)."""

    exit_code: ClassVar[int] = 1
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class UsageError(FailBenchError):
    """A command-line option, query parameter or setting is invalid (not a spec)."""

    exit_code = 2
    http_status = 422


class SpecError(UsageError):
    """The experiment spec is invalid; refused before any actor starts (CLI exit code 2).
    `loc`: the spec field at fault, where one is (the API reports it as the error's path)."""

    def __init__(self, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.loc = loc

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.loc))


class NotApplicableError(SpecError):
    """The mechanism does not apply to this architecture or trace; the message says why."""


class NotFoundError(FailBenchError, LookupError):
    """What was asked for is not in this database."""

    exit_code = 2
    http_status = 404


class ExperimentNotFound(NotFoundError):
    """An unknown (or ambiguous) experiment id: a user typo, usually."""

    def __init__(self, experiment_id: str, *, ambiguous: bool = False) -> None:
        message = f"no experiment with id {experiment_id} in this database"
        if ambiguous:
            message = f"several experiments have an id starting {experiment_id}; give more of it"
        super().__init__(message)
        self.experiment_id = experiment_id
        self.ambiguous = ambiguous

    def __reduce__(self) -> tuple[Any, ...]:
        return (_experiment_not_found, (self.experiment_id, self.ambiguous))


def _experiment_not_found(experiment_id: str, ambiguous: bool) -> ExperimentNotFound:
    return ExperimentNotFound(experiment_id, ambiguous=ambiguous)


class SweepNotFound(NotFoundError):
    def __init__(self, sweep_id: str, message: str | None = None) -> None:
        super().__init__(message or f"no sweep with id {sweep_id} in this database")
        self.sweep_id = sweep_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.sweep_id, self.message))


class ConflictError(FailBenchError):
    """The request does not fit the current state (answered 409)."""

    http_status = 409


class IdempotencyConflict(ConflictError):
    """An Idempotency-Key already names an experiment with another spec."""


class InvalidTransition(ConflictError):
    """The experiment is not in a state that allows this (e.g. cancel a finished one)."""


class DatabaseError(FailBenchError):
    """The database cannot be used as configured; the message says what to change."""

    exit_code = 2
    http_status = 503


class ClusterError(FailBenchError):
    """The Ray cluster cannot be used as started or configured; the message says what to
    change (e.g. a local cluster that would listen beyond loopback)."""

    exit_code = 2
    http_status = 503


class Overloaded(FailBenchError):
    """The service cannot answer this request now (every worker busy past the deadline, or
    the request ran past it); retrying later may succeed. No state changed on our side."""

    exit_code = 2
    http_status = 503


class RecoveryError(FailBenchError):
    """Recovery could not complete (e.g. every holder of the needed state is gone)."""


class TrialInterrupted(FailBenchError):
    """The run was stopped (Ctrl-C or a cancel) while a trial was in progress."""

    exit_code = 130


class LeaseLost(FailBenchError):
    """A dispatcher no longer holds the experiment it was running; it must write nothing."""
