"""The stall watchdog: a hang is not a failure, but it must not hold a sweep forever."""

from __future__ import annotations

import time
from collections.abc import Callable

from failbench_ray.errors import RecoveryError


class StallWatchdog:
    """Fails the trial when no live rank completes a step for `limit_s` while training (a lost
    message, a collective stuck on a hung rank). Pure: it is told the ranks' steps and reads
    the clock it is given."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._steps: dict[int, int] = {}
        self._since = clock()

    def restart(self) -> None:
        """Training (re)starts: nothing seen yet, and the clock starts now."""
        self._steps, self._since = {}, self._clock()

    def observe(self, steps: dict[int, int]) -> None:
        """The ranks that answered a progress poll, and their last completed steps (a rank
        that did not answer counts as not progressing)."""
        now = self._clock()
        if steps != self._steps:
            self._steps, self._since = steps, now
        elif now - self._since > self.limit_s:
            raise RecoveryError(
                f"no rank completed a step for {now - self._since:.0f} s while "
                f"training (ranks at steps {steps}, unanswered ranks left out): a hang, not a "
                "failure; raise stall_timeout_s if steps really take this long"
            )
