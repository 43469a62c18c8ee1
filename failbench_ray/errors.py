"""Errors a user can cause, and errors of a run. Each message says what to change."""

from __future__ import annotations


class FailBenchError(Exception):
    """Base class. Pickles cleanly across actors (one message argument)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class SpecError(FailBenchError):
    """The experiment spec is invalid; refused before any actor starts (CLI exit code 2).
    `loc`: the spec field at fault, where one is (the API reports it as the error's path)."""

    def __init__(self, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.loc = loc

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str | int, ...]]]:  # type: ignore[override]
        return (type(self), (self.message, self.loc))


class NotApplicableError(SpecError):
    """The mechanism does not apply to this architecture or trace; the message says why."""


class RecoveryError(FailBenchError):
    """Recovery could not complete (e.g. every holder of the needed state is gone)."""


class TrialInterrupted(FailBenchError):
    """The run was stopped (Ctrl-C or a cancel) while a trial was in progress."""


class LeaseLost(FailBenchError):
    """A dispatcher no longer holds the experiment it was running; it must write nothing."""
