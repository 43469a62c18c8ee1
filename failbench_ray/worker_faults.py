"""What the worker does for the failures injected into it (the `Worker` actor mixes this in):
stop at a failpoint and do a kind to itself (end, or corrupt its parameters and train on),
hold the GIL (`gil_hang`), save off the mechanism's schedule when the driver asks on a
preemption notice, and keep the checks that find silent corruption (`Audit`)."""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from typing import Any

import ray

from injector.kill_kinds import KILL_KINDS, CorruptParams, corrupt, worker_side

_FAILPOINT_WAIT_S = 120.0
_AUDITS_KEPT = 8  # checksums a rank keeps until the driver has compared them
_COMPUTE_KEPT = 32  # computation times a rank keeps until the driver has read them
log = logging.getLogger("failbench.worker")


class TakesFaults:
    # Set by the worker.
    armed: dict[tuple[str, int], int]  # (where, step) -> event index
    chaos: Any
    rank: int
    step: int
    _lock: threading.Lock
    _save_steps: set[int]  # steps to save off the schedule (`save_at`)
    trainer: Any
    spec: Any
    _audits: dict[int, str]  # step -> parameter checksum (`progress` hands them over)
    _clean_step: int
    _compute: dict[int, float]  # step -> seconds of own computation (`progress` hands them over)

    def _reset_faults(self) -> None:
        """A new trial: nothing armed, asked for or checked yet."""
        self.armed = {}
        self._save_steps = set()
        self._audits = {}
        self._clean_step = 0  # the last step whose parameters passed the checks
        self._compute = {}

    def _failpoint(self, where: str, step: int) -> None:
        """Stop here if an event is armed here: the chaos actor says when every victim has
        arrived, and whether this process must do the kind to itself."""
        index = self.armed.pop((where, step), None)
        if index is None:
            return
        action = ray.get(
            self.chaos.reached.remote(index, self.rank, step), timeout=_FAILPOINT_WAIT_S
        )
        if action == "go":
            return
        kind = KILL_KINDS.get(action)
        if not kind.corrupts:
            worker_side(action)
        params = kind.params.model_validate(ray.get(self.chaos.kill_params.remote(index)))
        assert isinstance(params, CorruptParams)
        hit = corrupt(action, params, list(self.trainer.module.parameters()))
        log.warning("rank %d: %s at step %d: %s", self.rank, action, step, hit)

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

    @ray.method(concurrency_group="beat")
    def progress(self) -> tuple[int, dict[int, str], dict[int, float]]:
        """The heartbeat's ping: a thread of its own, so a busy `serve_peer` (a parameter
        server's pushes) never delays it and only a hung process leaves it unanswered.
        Returns the last completed step, the latest parameter checksums (step -> sum) and the
        latest steps' own computation times (step -> seconds, for the straggler detector)."""
        with self._lock:
            return self.step, dict(self._audits), dict(self._compute)

    def _computed(self, step: int, seconds: float) -> None:
        with self._lock:
            self._compute[step] = seconds
            for old in sorted(self._compute)[:-_COMPUTE_KEPT]:
                del self._compute[old]

    def _audit(self, step: int) -> str | None:
        """The silent-corruption checks due after `step` (`spec.detectors`): records the
        parameter checksum for the driver's cross-replica comparison; returns why this rank is
        corrupt if its parameters are not finite."""
        d = self.spec.detectors
        finite = d.nonfinite_every is not None and step % d.nonfinite_every == 0
        checksum = d.digest_every is not None and step % d.digest_every == 0
        if not (finite or checksum):
            return None
        ok, digest = self.trainer.audit(finite=finite, checksum=checksum)
        if not ok:
            return (
                f"rank {self.rank}: parameters not finite after step {step} "
                f"(finite after step {self._clean_step})"
            )
        if finite:
            self._clean_step = step
        if digest is not None:
            with self._lock:
                self._audits[step] = digest
                for old in sorted(self._audits)[:-_AUDITS_KEPT]:
                    del self._audits[old]
        return None
