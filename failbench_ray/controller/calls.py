"""Calling the live ranks of a group and reading what came back: a dead rank is data."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

_PROBE_S = 10.0  # how long a live rank gets to answer a liveness probe


@dataclass
class Gathered:
    values: dict[int, Any] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)
    peer_lost: set[int] = field(default_factory=set)  # alive, but an actor it called died

    def first_error(self) -> tuple[int, str]:
        return next(iter(self.errors.items()))


def one_line(err: BaseException) -> str:
    """A rank's error in one line: for an error raised inside the actor, its last line (the
    exception itself, not Ray's traceback header)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if isinstance(err, RayTaskError) and lines:
        return lines[-1].strip()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def gather(calls: dict[int, Any]) -> Gathered:
    """Results of finished calls, by rank: a dead actor's call lands in `dead`, an error in
    `errors`. A live rank whose call raised because an actor *it* called died is alive: it
    lands in `errors` and `peer_lost`, never in `dead`."""
    got = Gathered()
    for rank, ref in calls.items():
        try:
            got.values[rank] = ray.get(ref)
        except RayActorError as err:
            if isinstance(err, RayTaskError):  # raised inside the live rank: not its death
                got.peer_lost.add(rank)
                got.errors[rank] = f"an actor it called died: {one_line(err)}"
            else:
                got.dead.add(rank)
        except Exception as err:  # noqa: BLE001  (a rank's error is data, not a crash)
            got.errors[rank] = one_line(err)
    return got


class RankCalls:
    """The calls in flight to the live ranks (`live()`: handle by rank). A call stays pending
    until it is collected, so a quiesce can wait for the `run()`s a failure interrupted."""

    def __init__(self, live: Callable[[], dict[int, Any]]) -> None:
        self._live = live
        self.pending: dict[int, Any] = {}  # rank -> ObjectRef

    def start(self, call: Callable[[Any, int], Any]) -> None:
        """Call every live rank without waiting: `call(handle, rank)` returns the call's ref,
        or None to skip that rank."""
        refs = {r: call(h, r) for r, h in self._live().items()}
        self.pending = {r: ref for r, ref in refs.items() if ref is not None}

    def on_all(self, call: Callable[[Any, int], Any]) -> Gathered:
        """Call every live rank (as `start`) and wait for every answer."""
        self.start(call)
        return self.finish()

    def finish(self) -> Gathered:
        """Wait for every pending call."""
        return self.collect(list(self.pending.values()), wait_all=True)

    def next_done(self, timeout: float) -> Gathered:
        """Whichever pending call finishes first, waiting at most `timeout` (maybe none)."""
        ready, _ = ray.wait(list(self.pending.values()), num_returns=1, timeout=timeout)
        return self.collect(ready)

    def collect(self, refs: list[Any], wait_all: bool = False) -> Gathered:
        """Results of finished calls (see `gather`); they are no longer pending."""
        by_ref = {ref: r for r, ref in self.pending.items()}
        if wait_all and refs:
            ray.wait(refs, num_returns=len(refs))
        for ref in refs:
            self.pending.pop(by_ref[ref], None)
        return gather({by_ref[ref]: ref for ref in refs})

    def probe_dead(self) -> set[int]:
        """Ranks whose actor no longer answers (when a live rank saw some actor die)."""
        refs = {r: h.ready.remote() for r, h in self._live().items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_PROBE_S)
        dead = set()
        for r, ref in refs.items():
            with contextlib.suppress(GetTimeoutError):
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    dead.add(r)
        return dead
