"""The progress heartbeat: finds a rank that lives but answers nothing (a hang).

A dead process is found by Ray (its actor's calls fail); a stopped one, or one whose GIL a
thread holds, keeps its actor and its sockets, and its peers wait in a collective for as long
as the process group's timeout (30 minutes by default). The driver pings every rank's cheap
`progress()` a few times a second; a rank that leaves a ping unanswered for `timeout_s` while
the others answer is hung.

Pure (tested without Ray): it is told when pings go out and come back, and reads the clock it is
given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection


class Heartbeat:
    def __init__(
        self, timeout_s: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_s = timeout_s  # None: off
        self._clock = clock
        self._waiting: dict[int, float] = {}  # rank -> when its oldest unanswered ping went out

    def restart(self) -> None:
        """Training (re)starts: no ping is out."""
        self._waiting = {}

    def sent(self, rank: int) -> None:
        self._waiting.setdefault(rank, self._clock())

    def answered(self, rank: int) -> None:
        """`rank` answered (or is known dead: that is the death detector's to report)."""
        self._waiting.pop(rank, None)

    def silent_s(self, rank: int) -> float:
        """How long `rank` has left a ping unanswered (0: none is out)."""
        since = self._waiting.get(rank)
        return 0.0 if since is None else self._clock() - since

    def hung(self, live: Collection[int]) -> set[int]:
        """The live ranks silent for longer than the timeout. None when every live rank is
        silent: then the driver (or the whole machine) stalled, and no rank can be blamed."""
        if self.timeout_s is None or not live:
            return set()
        silent = {r for r in live if self.silent_s(r) > self.timeout_s}
        return set() if silent >= set(live) else silent
