"""The step-time outlier detector (pure): finds a rank that computes slower than it did.

Each rank reports how long it computed in each step, without its waits on peers
(`compute_time.ComputeTimer`). A rank is a straggler when its recent computation time is
`factor` times its own earlier time *and* `factor` times what the other ranks' ratios are: its
own earlier time makes ranks with different work comparable (pipeline stages), and the others'
ratios keep a machine that slows down as a whole (a busy host) from flagging every rank.

A window's statistic is its mean: a throttled process runs in bursts (a CPU quota, a duty
cycle), so only some of its steps are slow, and a median can miss it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Outlier:
    rank: int
    step: int  # the last step of the window that showed it
    ratio: float  # its computation time over its own earlier time
    others: float  # the median of the other ranks' ratios

    def describe(self) -> str:
        return (
            f"rank {self.rank} computes {self.ratio:.1f}x its earlier time by step {self.step} "
            f"(other ranks {self.others:.1f}x)"
        )


@dataclass
class _Rank:
    last: int = 0  # the last step taken in
    seen: int = 0  # samples taken in this generation
    base: list[float] = field(default_factory=list)
    recent: deque[float] = field(default_factory=deque)


class StepTimeOutliers:
    def __init__(
        self, factor: float | None, window: int, skip: int = 5, base_windows: int = 2
    ) -> None:
        self.factor = factor  # None: off
        self.window = window
        self.skip = skip  # first steps of a generation: warm-up, not the rank's usual time
        self.base_steps = base_windows * window  # a longer earlier mean: a steadier yardstick
        self.flagged: set[int] = set()
        self._ranks: dict[int, _Rank] = {}

    @classmethod
    def of(cls, detectors: Any, waits_known: bool) -> StepTimeOutliers:
        """The spec's detector (`spec.DetectorSpec`); off unless every wait of a step passes
        through the worker (`Architecture.abortable`): only then can waits be told from work."""
        factor = detectors.straggler_factor if waits_known else None
        return cls(factor, detectors.straggler_window)

    def restart(self) -> None:
        """Training (re)starts on a new group: every rank's time is learnt again."""
        self._ranks = {}

    def add(self, rank: int, times: Mapping[int, float]) -> None:
        """`rank`'s computation seconds by step (steps already taken in are ignored)."""
        if self.factor is None:
            return
        r = self._ranks.setdefault(rank, _Rank(recent=deque(maxlen=self.window)))
        for step in sorted(times):
            if step <= r.last or times[step] <= 0:  # 0: a rank that computes nothing (a server)
                continue
            r.last, r.seen = step, r.seen + 1
            if r.seen <= self.skip:
                continue
            if len(r.base) < self.base_steps:
                r.base.append(times[step])
            else:
                r.recent.append(times[step])

    def ratio(self, rank: int) -> float | None:
        """`rank`'s recent mean over its earlier mean; None until it has both."""
        r = self._ranks.get(rank)
        if r is None or len(r.recent) < self.window:
            return None
        base = statistics.fmean(r.base)
        return statistics.fmean(r.recent) / base if base > 0 else None

    def check(self, live: Collection[int]) -> list[Outlier]:
        """Live ranks that became stragglers since the last check (each is flagged once)."""
        if self.factor is None:
            return []
        ratios = {r: x for r in live if (x := self.ratio(r)) is not None}
        found = []
        for rank, x in ratios.items():
            others = [y for q, y in ratios.items() if q != rank]
            if rank in self.flagged or not others:
                continue
            typical = statistics.median(others)
            if x >= self.factor and x >= self.factor * typical:
                self.flagged.add(rank)
                found.append(Outlier(rank, self._ranks[rank].last, x, typical))
        return found


def flag_records(
    found: Sequence[Outlier], injections: Sequence[Any], now: float, action: str
) -> list[dict[str, Any]]:
    """What the result records of each flagged rank: the injection that made it slow (none: a
    false alarm) and how long after it the rank was found (`now`, wall clock)."""
    hits = {r: inj for inj in injections for r in inj.ranks}
    out = []
    for o in found:
        inj = hits.get(o.rank)
        out.append(
            {
                "rank": o.rank,
                "step": o.step,
                "ratio": round(o.ratio, 3),
                "others_ratio": round(o.others, 3),
                "kind": inj.kill_kind if inj is not None else None,
                "detected_s": now - inj.t_injected if inj is not None else None,
                "action": action,
            }
        )
    return out
