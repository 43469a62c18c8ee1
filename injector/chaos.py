"""The chaos actor: executes a failure trace and records when each kill really happened.

Three kinds of trigger:
- a worker failpoint (`at_step`, or `during: checkpoint_write`): the victim calls `reached()`
  and waits; once every victim of the event has arrived, all are killed at the same instant;
- time (`at_seconds` after `start()`): a timer thread kills;
- a recovery phase (`during`): the controller calls `on_phase()` as each phase starts, and the
  next cascading event fires there, before the phase does any work.
A kind with a notice (`preempt`) is noticed at its trigger (`noticed()` says so to the driver,
which may save state) and strikes `notice_s` later; its injection is recorded when it strikes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from failbench_ray.spec import FailureEvent
from injector import throttle
from injector.kill_kinds import KILL_KINDS, Target

log = logging.getLogger("failbench.chaos")

_ARRIVAL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Injection:
    index: int
    ranks: list[int]
    kill_kind: str
    trigger: str
    t_injected: float
    step: int | None  # the step in flight, when the trigger knows it
    lasts_s: float | None = None  # a fault that ends by itself (a straggler's duration_s)


class Chaos:
    """Plain class (wrapped by `ChaosActor`) so the logic is readable apart from Ray."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._cond = threading.Condition()
        self._timers: list[threading.Timer] = []
        self.rearm(events)

    def rearm(self, events: list[dict[str, Any]]) -> None:
        """Forget the last trial (a pooled chaos actor serves the next one with `events`)."""
        self.stop()
        self.events = [FailureEvent.model_validate(e) for e in events]
        self._fired: dict[int, Injection] = {}
        self._noticed: dict[int, float] = {}  # noticed, not struck yet: index -> when it strikes
        self._arrived: dict[int, set[int]] = {}
        self._targets: dict[int, Target] = {}
        self._down: set[int] = set()  # ranks this actor struck, until a new worker takes them
        self._timers = []

    def set_targets(self, targets: dict[int, tuple[Any, ...]]) -> None:
        """rank -> (pid, actor handle, node id) of the current worker of that rank."""
        with self._cond:
            for r, t in targets.items():
                target = Target(*t)
                if r in self._targets and self._targets[r].pid != target.pid:
                    self._down.discard(r)
                self._targets[r] = target

    def start(self) -> None:
        """Start the clock of time-triggered events."""
        for i, e in enumerate(self.events):
            if e.at_seconds is not None and i not in self._fired:
                t = threading.Timer(e.at_seconds, self._fire, args=(i, None))
                t.daemon = True
                t.start()
                self._timers.append(t)

    def reached(self, index: int, rank: int, step: int) -> str:
        """A victim reached its failpoint. Returns the kind's name if it must do the kind to
        itself (`kill_kinds.worker_side`), else "go"."""
        event = self.events[index]
        with self._cond:
            self._arrived.setdefault(index, set()).add(rank)
            if self._arrived[index] >= set(event.ranks) and index not in self._fired:
                self._fire_locked(index, step)
            else:
                self._cond.wait_for(lambda: index in self._fired, timeout=_ARRIVAL_TIMEOUT_S)
        return event.kill if KILL_KINDS.get(event.kill).by_worker and index in self._fired else "go"

    def kill_params(self, index: int) -> dict[str, Any]:
        """Event `index`'s validated kill parameters (a corrupting victim needs them)."""
        event = self.events[index]
        kind = KILL_KINDS.get(event.kill)
        return kind.params.model_validate(event.kill_params).model_dump()

    def on_phase(self, phase: str, committed_step: int) -> list[Injection]:
        """A recovery phase starts: fire the next cascading event that waits for it."""
        with self._cond:
            for i, e in enumerate(self.events):
                if i in self._fired:
                    continue
                if e.during == phase and (i == 0 or i - 1 in self._fired):
                    return [self._fire_locked(i, committed_step)]
                break  # events fire in order
        return []

    def injections(self) -> list[Injection]:
        """The failures that struck (a noticed one only once it has)."""
        with self._cond:
            return [self._fired[i] for i in sorted(self._fired) if i not in self._noticed]

    def noticed(self) -> dict[int, tuple[list[int], float]]:
        """Notices given whose failure has not struck yet: index -> (ranks, when it strikes)."""
        with self._cond:
            return {i: (self.events[i].ranks, t) for i, t in self._noticed.items()}

    def fired(self) -> list[int]:
        with self._cond:
            return sorted(self._fired)

    def stop(self) -> None:
        """Cancel what has not struck, and end every throttle (its ranks run on)."""
        for t in self._timers:
            t.cancel()
        throttle.stop_all()

    def _fire(self, index: int, step: int | None) -> None:
        with self._cond:
            if index not in self._fired:
                self._fire_locked(index, step)

    def _fire_locked(self, index: int, step: int | None) -> Injection:
        event = self.events[index]
        kind = KILL_KINDS.get(event.kill)
        params = kind.params.model_validate(event.kill_params)
        if kind.notice_s is not None:
            delay = kind.notice_s(params)
            self._noticed[index] = time.time() + delay
            log.warning(
                "failure %d: %s noticed to rank(s) %s, strikes in %gs",
                index,
                event.kill,
                event.ranks,
                delay,
            )
            timer = threading.Timer(
                delay, self._strike, args=(index, None)
            )  # step: unknown by then
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
            inj = Injection(index, list(event.ranks), event.kill, event.trigger, time.time(), step)
            self._fired[index] = inj  # fired: the victims go on training until it strikes
            self._cond.notify_all()
            return inj
        return self._kill_locked(index, step)

    def _strike(self, index: int, step: int | None) -> None:
        with self._cond:
            if self._noticed.pop(index, None) is not None:
                self._kill_locked(index, step)

    def _kill_locked(self, index: int, step: int | None) -> Injection:
        event = self.events[index]
        kind = KILL_KINDS.get(event.kill)
        params = kind.params.model_validate(event.kill_params)
        t = time.time()
        ranks = list(event.ranks)
        if event.at_seconds is not None:
            ranks = self._live(ranks)
        if kind.kill is not None:
            ranks = kind.kill(ranks, self._targets, params)
        where = sorted({self._targets[r].node_id[:8] for r in ranks if r in self._targets})
        log.warning(
            "failure %d: %s %s rank(s) %s (pid %s, node %s) at %s, step %s",
            index,
            event.kill,
            "corrupted" if kind.corrupts else "killed",
            ranks,
            [self._targets[r].pid for r in ranks if r in self._targets],
            ",".join(where),
            event.trigger,
            step,
        )
        lasts = kind.lasts_s(params) if kind.lasts_s is not None else None
        self._down |= set(ranks)
        inj = Injection(index, ranks, event.kill, event.trigger, t, step, lasts)
        self._fired[index] = inj
        self._cond.notify_all()
        return inj

    def _live(self, ranks: list[int]) -> list[int]:
        """A failure at a wall time strikes whatever runs then: a victim this actor already
        struck (dead, or not yet replaced) gives way to the next rank still up."""
        world = sorted(self._targets)
        taken = [r for r in ranks if r not in self._down]
        for r in ranks:
            if r not in self._down or not world:
                continue
            start = world.index(r) if r in world else 0
            for k in range(1, len(world) + 1):
                other = world[(start + k) % len(world)]
                if other not in self._down and other not in taken:
                    taken.append(other)
                    break
        return sorted(taken)


class _LoggingChaos(Chaos):
    def __init__(self, events: list[dict[str, Any]]) -> None:
        # Its log is the actor's log on the Ray dashboard: one line per kill.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        super().__init__(events)


# Threaded: victims block in `reached` while others arrive. num_cpus=0: it only waits.
ChaosActor = ray.remote(num_cpus=0, max_concurrency=64)(_LoggingChaos)
