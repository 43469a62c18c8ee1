"""Elastic regrow: ranks dropped after a failure come back once their new processes are up,
without stopping training while they start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from failbench_ray.records import FailureRecord


@dataclass
class Growth:
    starting: dict[int, Any] = field(default_factory=dict)  # dropped rank -> (handle, ready ref)
    failures: list[FailureRecord] = field(default_factory=list)  # waiting for them to grow back

    def begin(self, starting: dict[int, Any], failures: list[FailureRecord]) -> None:
        self.starting.update(starting)
        self.failures += failures

    def ready(self) -> bool:
        """Every replacement is up (then training stops at a step boundary to take them)."""
        if not self.starting:
            return False
        refs = [ref for _, ref in self.starting.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def take(self) -> dict[int, Any]:
        grown, self.starting = self.starting, {}
        return grown

    def regrowing(self, t: float) -> None:
        """Training stops to take the grown ranks in: the pause the failures cost a second
        time (`ettr` counts it as downtime, `grown` minus this)."""
        for f in self.failures:
            f.phases.setdefault("regrowing", t - f.t_injected)

    def grown(self, t: float) -> None:
        """The grown ranks hold the group's state: the failures that dropped them end here."""
        for f in self.failures:
            f.phases["grown"] = t - f.t_injected
        self.failures = []
