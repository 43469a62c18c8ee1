"""The trial controller: runs the states of `states.py` one after the other until one ends the
trial, with the callbacks told of each; whatever happens, every actor of the trial is closed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from failbench_ray.checks import Resolved
from failbench_ray.controller.callbacks import (
    Callbacks,
    LogCallback,
    MetricsCallback,
    ProgressCallback,
    TrialCallback,
)
from failbench_ray.controller.states import Failed, Finished, Starting, TrialState
from failbench_ray.controller.trial import Trial, TrialOutcome, TrialSetup
from failbench_ray.errors import RecoveryError
from failbench_ray.pool import WorkerPool
from failbench_ray.telemetry import Recorder
from failbench_ray.worker_group import Placement


class TrialController:
    def __init__(
        self,
        resolved: Resolved,
        *,
        run_dir: Path,
        placement: Placement,
        label: str,
        inject: bool,
        store_host: str = "127.0.0.1",
        on_progress: Callable[[int], None] = lambda step: None,
        should_stop: Callable[[], str | None] = lambda: None,
        tags: dict[str, str] | None = None,
        pool: WorkerPool | None = None,
        callbacks: Sequence[TrialCallback] = (),
    ) -> None:
        spec = resolved.spec
        setup = TrialSetup(
            run_dir=run_dir,
            placement=placement,
            label=label,
            events=list(spec.failures.events) if inject else [],
            store_host=store_host,
            tags=dict(tags or {}),
            pool=pool,
            should_stop=should_stop,
        )
        watchers = Callbacks(
            [
                MetricsCallback(Recorder(setup.tags, enabled=spec.metrics)),
                LogCallback(label),
                ProgressCallback(on_progress),
                *callbacks,
            ]
        )
        self.trial = Trial(resolved, setup, watchers)
        self.state: TrialState = Starting()

    @property
    def outcome(self) -> TrialOutcome:
        """What the trial did so far (all of it once `run` returns)."""
        return self.trial.outcome

    def run(self) -> TrialOutcome:
        t = self.trial
        try:
            while not self.state.terminal:
                t.check_stop()  # a cancel: `TrialInterrupted`, after which every actor closes
                t.cb.before_state(self.state)
                t0 = time.monotonic()
                after = self.state.run(t)
                t.cb.after_state(self.state, after, time.monotonic() - t0)
                self.state = after
        except RecoveryError as err:
            self.state = Failed(str(err))
            t.outcome.error = str(err)
        finally:
            t.close()
        t.outcome.status = "completed" if isinstance(self.state, Finished) else "failed"
        return t.outcome
