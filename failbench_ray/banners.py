"""Ray's "A worker died or was killed ..." banner, shown only for deaths we did not cause.

Every injected kill made Ray print, into the user's terminal, a banner meant for real crashes
("... unexpected system error ... OOM killer ..."): a user could not tell an injected failure
from a real one. The driver prints the banners Ray publishes through
`ray._private.worker.print_to_stdstream`; this filter sits in front of it. A banner names the
dead worker's PID: one the controller recorded as killed by an injection is dropped (the
controller logs its own line, "injected failure N ..."); any other is printed as before. The
banner can arrive before the controller has matched the death to its injection, so a banner
for an unknown PID waits `grace_s` and is printed only if it is still unknown then.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

_DIED = "A worker died or was killed"
_PID = re.compile(r"Worker PID: (\d+)")

Printer = Callable[[dict[str, Any], bool], None]


class BannerFilter:
    def __init__(self, printer: Printer, grace_s: float = 3.0, keep_s: float = 600.0) -> None:
        self.printer = printer
        self.grace_s = grace_s
        self.keep_s = keep_s  # how long a killed PID is remembered (PIDs are reused, slowly)
        self._lock = threading.Lock()
        self._injected: dict[int, float] = {}  # pid -> when it was recorded
        self.dropped = 0

    def injected(self, pids: Iterable[int]) -> None:
        """These worker processes were killed by an injection (or quiesce): not news."""
        now = time.monotonic()
        with self._lock:
            for pid in pids:
                self._injected[pid] = now
            for pid, t in list(self._injected.items()):
                if now - t > self.keep_s:
                    del self._injected[pid]

    def _ours(self, pid: int) -> bool:
        with self._lock:
            return pid in self._injected

    def __call__(self, data: dict[str, Any], ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        kept: list[str] = []
        for line in lines:
            pid = _dead_pid(line)
            if pid is None:
                kept.append(line)
            elif self._ours(pid):
                self.dropped += 1
            else:
                timer = threading.Timer(self.grace_s, self._late, (data, line, pid, ignore_prefix))
                timer.daemon = True
                timer.start()
        if kept or not lines:
            self.printer({**data, "lines": kept}, ignore_prefix)

    def _late(self, data: dict[str, Any], line: str, pid: int, ignore_prefix: bool) -> None:
        if self._ours(pid):
            self.dropped += 1
        else:
            self.printer({**data, "lines": [line]}, ignore_prefix)


def _dead_pid(line: str) -> int | None:
    """The PID a "worker died" banner is about, or None for any other line."""
    if _DIED not in line:
        return None
    m = _PID.search(line)
    return int(m.group(1)) if m else None


_installed: BannerFilter | None = None


def install() -> BannerFilter:
    """Put the filter in front of Ray's driver-side printer (once per process)."""
    global _installed
    from ray._private import worker

    if _installed is None:
        _installed = BannerFilter(worker.print_to_stdstream)
        worker.print_to_stdstream = _installed
    return _installed


def injected(pids: Iterable[int]) -> None:
    """Record killed worker PIDs, if the filter is installed (a driver that connected)."""
    if _installed is not None:
        _installed.injected(pids)
