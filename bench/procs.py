"""Processes, read from /proc: what this bench started, and what else used the CPUs meanwhile.

Timings on a 2-core machine shift when anything else runs. The bench never stops processes it
did not start; it measures how much CPU they took during each measurement and reports it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    ppid: int
    zombie: bool
    cpu_ticks: int  # utime + stime
    start_ticks: int  # start time, clock ticks after boot


def proc_table() -> dict[int, Proc]:
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        f = stat[stat.rfind(")") + 2 :].split()  # f[0] is field 3 of proc(5): the state
        table[int(entry.name)] = Proc(int(f[1]), f[0] == "Z", int(f[11]) + int(f[12]), int(f[19]))
    return table


def descendants(table: dict[int, Proc] | None = None, root: int | None = None) -> set[int]:
    """Live (non-zombie) descendants of `root` (default: this process)."""
    table = proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, p in table.items():
        if not p.zombie:
            children.setdefault(p.ppid, []).append(pid)
    found: set[int] = set()
    frontier = [os.getpid() if root is None else root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.update(kids)
        frontier += kids
    return found


def _helpers() -> set[int]:
    """multiprocessing's resource tracker: started with the first spawn, lives as long as we do."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def wait_for_no_children(timeout_s: float = 60.0) -> list[int]:
    """Wait until every process this one started has exited; return those still alive."""
    deadline = time.monotonic() + timeout_s
    left = descendants() - _helpers()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = descendants() - _helpers()
    return sorted(left)


def _uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * _TICK


class ForeignCpu:
    """CPU seconds that processes this bench did not start used while the block ran.

    Sampled every `period_s`: a process that starts and ends between two samples is missed, so
    this is a lower bound.
    """

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._mine: set[int] = {os.getpid()}  # once ours, always ours (even when orphaned)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="foreign-cpu", daemon=True)

    def __enter__(self) -> ForeignCpu:
        self._t0 = time.monotonic()
        self._start_ticks = _uptime_ticks()
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall_s = time.monotonic() - self._t0
        used = sum(self._last[pid] - self._first[pid] for pid in self._last)
        self.cpu_s = used / _TICK

    def share(self, cpus: int | None = None) -> float:
        """Foreign CPU time as a share of all the CPU time the machine had during the block."""
        n = cpus or os.cpu_count() or 1
        return self.cpu_s / (self.wall_s * n) if self.wall_s else 0.0

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        table = proc_table()
        self._mine |= descendants(table)
        for pid, p in table.items():
            if pid in self._mine or pid in self._first and p.cpu_ticks < self._first[pid]:
                continue
            if pid not in self._first:
                # Started during the block: all of its CPU time counts; before: only the rest.
                self._first[pid] = 0 if p.start_ticks >= self._start_ticks else p.cpu_ticks
            self._last[pid] = p.cpu_ticks
