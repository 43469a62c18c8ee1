"""What watches a trial from outside: metrics, logs, progress. The controller calls these
hooks; none of them changes what the trial does. A new observer is a subclass that overrides
the hooks it needs (every hook is a no-op by default)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from failbench_ray.records import FailureRecord
from failbench_ray.telemetry import LIVE_PHASES, WORLD_SIZE, Recorder
from mechanisms.base import RecoveryPlan

if TYPE_CHECKING:
    from failbench_ray.controller.states import TrialState

log = logging.getLogger("failbench.controller")


class TrialCallback:
    def before_state(self, state: TrialState) -> None:
        """`state` is about to run."""

    def after_state(self, state: TrialState, next_state: TrialState, seconds: float) -> None:
        """`state` ran for `seconds` and chose `next_state`."""

    def after_start(self, members: list[int]) -> None:
        """Every rank is up and training starts."""

    def after_progress(self, step: int) -> None:
        """Training got to `step` (the lowest live rank's, polled; the last step at the end)."""

    def after_failure(self, failure: FailureRecord) -> None:
        """A failure was detected."""

    def after_live_ranks(self, live: int) -> None:
        """The number of live ranks changed (a failure, a recovery, a regrow)."""

    def before_phase(self, phase: str, recovering: bool) -> None:
        """A recovery phase starts (`recovering`: some failure's recovery is open)."""

    def after_reform(self, members: list[int], plan: RecoveryPlan) -> None:
        """The process group is up again with `members`."""

    def after_restore(self, failures: list[FailureRecord], plan: RecoveryPlan) -> None:
        """`failures` are recovered: every rank holds the state of `plan.restore_step`."""

    def after_regrow(self, members: list[int]) -> None:
        """Elastic: the group grew back to `members`."""


class Callbacks(TrialCallback):
    """Calls every callback in order."""

    def __init__(self, callbacks: Sequence[TrialCallback]) -> None:
        self.callbacks = list(callbacks)

    def before_state(self, state: TrialState) -> None:
        for c in self.callbacks:
            c.before_state(state)

    def after_state(self, state: TrialState, next_state: TrialState, seconds: float) -> None:
        for c in self.callbacks:
            c.after_state(state, next_state, seconds)

    def after_start(self, members: list[int]) -> None:
        for c in self.callbacks:
            c.after_start(members)

    def after_progress(self, step: int) -> None:
        for c in self.callbacks:
            c.after_progress(step)

    def after_failure(self, failure: FailureRecord) -> None:
        for c in self.callbacks:
            c.after_failure(failure)

    def after_live_ranks(self, live: int) -> None:
        for c in self.callbacks:
            c.after_live_ranks(live)

    def before_phase(self, phase: str, recovering: bool) -> None:
        for c in self.callbacks:
            c.before_phase(phase, recovering)

    def after_reform(self, members: list[int], plan: RecoveryPlan) -> None:
        for c in self.callbacks:
            c.after_reform(members, plan)

    def after_restore(self, failures: list[FailureRecord], plan: RecoveryPlan) -> None:
        for c in self.callbacks:
            c.after_restore(failures, plan)

    def after_regrow(self, members: list[int]) -> None:
        for c in self.callbacks:
            c.after_regrow(members)


class MetricsCallback(TrialCallback):
    """Live metrics through Ray (`failbench_ray.telemetry`)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def after_live_ranks(self, live: int) -> None:
        self.recorder.set(WORLD_SIZE, live)

    def after_failure(self, failure: FailureRecord) -> None:
        self.recorder.failure(failure.kill_kind, len(failure.ranks))

    def after_restore(self, failures: list[FailureRecord], plan: RecoveryPlan) -> None:
        for f in failures:
            self.recorder.recovery(f.phases, LIVE_PHASES)  # the rest: when the trial ends


class LogCallback(TrialCallback):
    """The `failbench.controller` log: each failure and recovery phase."""

    def __init__(self, label: str) -> None:
        self.label = label

    def after_state(self, state: TrialState, next_state: TrialState, seconds: float) -> None:
        log.debug("%s: %s took %.3f s", self.label, state.name, seconds)

    def after_start(self, members: list[int]) -> None:
        log.info("%s: %d ranks started", self.label, len(members))

    def after_failure(self, failure: FailureRecord) -> None:
        log.warning(
            "%s: injected failure %d detected after %.2f s: rank(s) %s (%s, %s)",
            self.label,
            failure.index,
            failure.phases["detected"],
            failure.ranks,
            failure.kill_kind,
            failure.trigger,
        )

    def before_phase(self, phase: str, recovering: bool) -> None:
        if recovering:
            log.info("%s: %s", self.label, phase)

    def after_reform(self, members: list[int], plan: RecoveryPlan) -> None:
        log.info("%s: reformed with ranks %s (plan: %s)", self.label, members, plan.source)

    def after_restore(self, failures: list[FailureRecord], plan: RecoveryPlan) -> None:
        for f in failures:
            log.info(
                "%s: failure %d restored from step %d (%s) in %.2f s",
                self.label,
                f.index,
                plan.restore_step,
                f.restore_source,
                f.phases["restored"] or 0.0,
            )

    def after_regrow(self, members: list[int]) -> None:
        log.info("%s: grew back to ranks %s", self.label, members)


class ProgressCallback(TrialCallback):
    """Reports the step every live rank completed (the CLI's progress, the queue's lease)."""

    def __init__(self, on_progress: Callable[[int], None]) -> None:
        self.on_progress = on_progress

    def after_progress(self, step: int) -> None:
        self.on_progress(step)
