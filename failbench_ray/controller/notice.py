"""Acting on a failure's notice (spot preemption): every rank saves the same step before the
failure strikes, when the mechanism can (`Mechanism.saves_on_notice`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("failbench.notice")


_TRIES = 6  # each with twice the margin of the last


def next_save_step(steps: Mapping[int, int], end: int, margin: int = 2) -> int | None:
    """The step every rank saves on a notice: `margin` past the last step the most advanced
    rank said it completed (by the time a rank hears, it may be further), or None when that is
    past the trial's end. Pure."""
    step = max(steps.values(), default=0) + margin
    return step if step <= end else None


class NoticeResponder:
    """Reads the notices the chaos actor gave (once each) and asks every live rank to save."""

    def __init__(self, saves: bool) -> None:
        self.saves = saves
        self._seen: set[int] = set()
        self.asked: dict[int, int] = {}  # notice index -> the step every rank was asked to save

    def poll(
        self,
        noticed: Mapping[int, tuple[list[int], float]],
        steps: Mapping[int, int],
        end: int,
        handles: Mapping[int, Any],
    ) -> None:
        for index, (ranks, _) in noticed.items():
            if index in self._seen:
                continue
            self._seen.add(index)
            step = self._ask(dict(steps), end, handles) if self.saves else None
            if step is None:
                log.info("notice %d for rank(s) %s: nothing saved on it", index, ranks)
                continue
            self.asked[index] = step

    @staticmethod
    def _ask(steps: dict[int, int], end: int, handles: Mapping[int, Any]) -> int | None:
        """Ask every rank to save one step ahead of all of them; where a rank is past it
        already (short steps), ask again further ahead. Returns the step, or None."""
        import ray

        margin = 2
        for _ in range(_TRIES):
            step = next_save_step(steps, end, margin)
            if step is None:
                return None
            refs = {r: h.save_at.remote(step) for r, h in handles.items()}
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=2)
            late = {}
            for r, ref in refs.items():
                try:
                    got = ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001  (a dead or slow rank: the others still save)
                    continue
                if got is not None:
                    late[r] = int(got)
            if not late:
                return step
            steps.update(late)
            margin *= 2
        return None
