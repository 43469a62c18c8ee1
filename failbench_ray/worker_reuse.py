"""What lets the pool reuse a worker process between trials: shed a trial so the process is
as a fresh one, say what of a trial it still holds, and report its resources (the `Worker`
actor mixes this in)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch.distributed as dist

from failbench_ray.comm import AbortHandle, Generations
from failbench_ray.pool import ResetOutcome, process_resources
from failbench_ray.spec import ExperimentSpec
from mechanisms.base import Hooks

_PARKED_MARGIN_S = 2.0  # after a parked collective's timeout, before its thread is surely free


class Reusable:
    # Set by the worker.
    spec: ExperimentSpec
    hooks: Hooks  # the mechanism's worker side (absent between trials)
    generations: Generations
    _handles: list[AbortHandle]  # every generation's, to see stale collectives
    _running: bool  # the training thread is inside run()
    _log: Any  # the record log file
    targets: list[Any]
    chaos: Any
    me: Any
    trial: str

    def reset(self) -> ResetOutcome:
        """Shed the trial: its process groups, state, copies and files, so that this process
        is as a fresh one. It cannot while its training thread still runs, nor while a thread
        is parked in a collective on a dead peer: nothing but that group's timeout frees it
        (DESIGN.md); the outcome then says when that timeout will have passed."""
        if self._running:
            return ResetOutcome("its training thread is still running")
        oldest = [t for h in self._handles if (t := h.oldest_in_flight()) is not None]
        if oldest:
            stale = sum(h.in_flight() for h in self._handles)
            timeout = self.spec.pg_timeout_s
            return ResetOutcome(
                f"{stale} collective(s) parked on a dead peer",
                retry_in_s=max(0.0, min(oldest) + timeout - time.monotonic()) + _PARKED_MARGIN_S,
            )
        if getattr(self, "hooks", None) is not None:
            self.hooks.close()  # e.g. a background checkpoint write still running
        self.generations.close()
        self._handles = []
        if self._log is not None:
            self._log.close()
            self._log = None
        for name in ("trainer", "previous", "replicas", "snapshots", "hooks", "_peers", "holders"):
            self.__dict__.pop(name, None)
        self.targets, self.chaos, self.me, self.trial = [], None, None, ""
        gc.collect()  # between trials, off every hot path: modules and optimizers go now
        return ResetOutcome(None)

    def leftovers(self) -> dict[str, Any]:
        """What of a trial this process still holds (empty after a clean `reset`)."""
        held: dict[str, Any] = {
            name: True
            for name in ("trainer", "previous", "replicas", "snapshots", "hooks", "holders")
            if self.__dict__.get(name)
        }
        if dist.is_initialized():
            held["process_group"] = True
        if self.generations.held():
            held["old_groups"] = self.generations.held()
        if self._log is not None:
            held["record_log"] = self._log.name
        return held

    def resources(self) -> dict[str, int]:
        """This process's resident memory (bytes), threads and open files (a leak check)."""
        return process_resources(os.getpid())
