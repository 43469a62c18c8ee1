"""What the worker does for the failures injected into it (the `Worker` actor mixes this in):
stop at a failpoint and do a kind to itself, hold the GIL (`gil_hang`), and save off the
mechanism's schedule when the driver asks on a preemption notice."""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any

import ray

from injector.kill_kinds import worker_side

_FAILPOINT_WAIT_S = 120.0


class TakesFaults:
    # Set by the worker.
    armed: dict[tuple[str, int], int]  # (where, step) -> event index
    chaos: Any
    rank: int
    step: int
    _lock: threading.Lock
    _save_steps: set[int]  # steps to save off the schedule (`save_at`)

    def _failpoint(self, where: str, step: int) -> None:
        """Stop here if an event is armed here: the chaos actor says when every victim has
        arrived, and whether this process must do the kind to itself."""
        index = self.armed.pop((where, step), None)
        if index is None:
            return
        action = ray.get(
            self.chaos.reached.remote(index, self.rank, step), timeout=_FAILPOINT_WAIT_S
        )
        if action != "go":
            worker_side(action)

    def save_at(self, step: int) -> int | None:
        """Save the state of `step` once it is done, off the mechanism's schedule (the driver
        asks every rank for the same step on a preemption notice). None if it will; this
        rank's last completed step if it is past `step` already (the driver asks again)."""
        with self._lock:
            if self.step >= step:
                return self.step
            self._save_steps.add(step)
            return None

    def _save_due(self, step: int) -> bool:
        """Whether the driver asked for a save at `step` (asked once: it is forgotten now)."""
        with self._lock:
            due = step in self._save_steps
            self._save_steps.discard(step)
            return due

    def hold_gil(self, hold_s: float) -> None:
        """The `gil_hang` kind: this thread holds the GIL for `hold_s`. A C function called
        through `ctypes.PyDLL` keeps the GIL, so no Python thread of this process runs (the
        actor answers nothing) while the process and its sockets live on."""
        ctypes.PyDLL(None).sleep(ctypes.c_uint(math.ceil(hold_s)))
