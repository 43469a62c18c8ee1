"""Failure trace kinds: the shapes a failure schedule may take, each checked before a run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from failbench_ray.errors import SpecError
from failbench_ray.registry import Registry
from failbench_ray.spec import WORKER_TRIGGERS, FailureTrace


@dataclass(frozen=True)
class TraceKind:
    name: str
    summary: str
    check: Callable[[FailureTrace], None]


TRACE_KINDS: Registry[TraceKind] = Registry("trace kind")

# Recovery phases that start before the dead ranks' replacements exist.
_BEFORE_REPLACEMENT = ("quiescing", "reforming")


def _check_none(trace: FailureTrace) -> None:
    if trace.events:
        raise SpecError("failures.kind=none takes no events; use single, concurrent or cascading")


def _first_is_scheduled(trace: FailureTrace, what: str) -> None:
    first = trace.events[0]
    if first.during is not None and first.during not in WORKER_TRIGGERS:
        raise SpecError(
            f"failures: the first {what} event needs at_step or at_seconds; "
            f"`during` only triggers a later event of a cascading trace"
        )


def _check_single(trace: FailureTrace) -> None:
    if len(trace.events) != 1 or len(trace.events[0].ranks) != 1:
        raise SpecError(
            "failures.kind=single needs exactly one event with one rank; "
            "use concurrent for several ranks at once, cascading for a chain"
        )
    _first_is_scheduled(trace, "single")


def _check_concurrent(trace: FailureTrace) -> None:
    if len(trace.events) != 1 or len(trace.events[0].ranks) < 2:
        raise SpecError(
            "failures.kind=concurrent needs one event with at least 2 ranks (killed at the "
            "same instant), e.g. {kind: concurrent, ranks: [1, 2], at_step: 25}"
        )
    _first_is_scheduled(trace, "concurrent")


def _check_cascading(trace: FailureTrace) -> None:
    if len(trace.events) < 2:
        raise SpecError(
            "failures.kind=cascading needs at least 2 events: one scheduled, then each later one "
            "with `during: <phase>` of the previous recovery"
        )
    _first_is_scheduled(trace, "cascading")
    for i, e in enumerate(trace.events[1:], start=1):
        if e.at_seconds is not None:
            raise SpecError(
                f"failures.events[{i}] of a cascading trace needs `during` (quiescing, reforming, "
                "restoring, resuming, regrowing: it fires while recovering from the previous "
                "failure) or at_step (a later step, a checkpoint_write or replica_transfer), "
                "not at_seconds"
            )
        still_dead = set(e.ranks) & set(trace.events[i - 1].ranks)
        if e.during in _BEFORE_REPLACEMENT and still_dead:
            raise SpecError(
                f"failures.events[{i}] fires during {e.during}, when rank(s) {sorted(still_dead)} "
                "of the previous failure are still dead; kill other ranks, or use during: "
                "restoring or resuming to kill their replacements"
            )


def _check_timed(trace: FailureTrace) -> None:
    if not trace.events:
        raise SpecError(
            "failures.kind=timed needs at least one event, each with at_seconds, e.g. "
            "{kind: timed, events: [{rank: 1, at_seconds: 20}, {rank: 3, at_seconds: 75}]}"
        )
    times = []
    for i, e in enumerate(trace.events):
        if e.at_seconds is None:
            raise SpecError(
                f"failures.events[{i}] of a timed trace needs at_seconds (timed failures "
                "strike at wall times, whatever the run is doing); use cascading for at_step "
                "or during"
            )
        times.append(e.at_seconds)
    if times != sorted(times):
        raise SpecError(f"failures.events of a timed trace must come in time order: {times}")


TRACE_KINDS.add("none", TraceKind("none", "no failures", _check_none))
TRACE_KINDS.add("single", TraceKind("single", "one rank, at a step or a time", _check_single))
TRACE_KINDS.add(
    "concurrent", TraceKind("concurrent", "k ranks at the same instant", _check_concurrent)
)
TRACE_KINDS.add(
    "cascading",
    TraceKind(
        "cascading", "a further failure during a phase of the last recovery", _check_cascading
    ),
)


TRACE_KINDS.add(
    "timed",
    TraceKind(
        "timed",
        "failures at given wall times, any number (`failbench validate` draws them as a "
        "Poisson process); one that strikes a dead rank strikes the next live one",
        _check_timed,
    ),
)


def check_trace(trace: FailureTrace) -> None:
    TRACE_KINDS.get(trace.kind).check(trace)
