"""The effective training time ratio (ETTR, Kokolis et al., HPCA 2025) of one trial, measured
from its step and failure records, with where the rest of the wall time went.

Definitions (the README's, exactly):
- the wall time W runs from the start of the first step to the end of the last;
- a step *counts* in its final execution (its records in the last generation that ran it, as
  in `results.sample_accounting`); its useful time is the shortest of those records' times
  with the after-step hook's blocking (`blocked_s`: a checkpoint or copy the step waited for)
  taken off: ranks that train side by side count once, and a rank that spent the step waiting
  for another's save (in the next collective) was not training;
- ETTR = the counted steps' useful time / W.

The rest of W, in `breakdown` (seconds): `checkpoint_stall_s` (the counted steps' blocking),
`replayed_s` (executions a rollback threw away, each its longest record), `lost_in_flight_s`
(from the end of the last step done before a failure to the failure: work that died with it),
`down_<phase>_s` (each recovery phase, from the failure records: to detection, quiesce,
re-formation, restore, resume), and `other_s` (what none of these explain: the first steps after
a recovery catching up, a smaller group training, gaps between steps; overlaps make it negative).
`steady`: the median step's useful time, the median gap between two consecutive steps beyond
it (the driver's and the collectives' share), and the stall per step: what a calibration run
gives the model, robust to the first steps' warm-up.
Pure; tested without Ray.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from failbench_ray.records import FailureRecord, StepRecord

# (phase, the earlier mark it is measured from); None: the injection itself
DOWN_PHASES = (
    ("detect", None, "detected"),
    ("quiesce", "detected", "quiesced"),
    ("reform", "quiesced", "reformed"),
    ("restore", "reformed", "restored"),
    ("resume", "restored", "resumed"),
)


def measure(records: Sequence[StepRecord], failures: Sequence[FailureRecord]) -> dict[str, Any]:
    """{"ettr": ..., "wall_s": ..., "useful_s": ..., "breakdown": {...}}; ettr None with no
    records."""
    if not records:
        return {"ettr": None, "wall_s": None, "useful_s": None, "breakdown": {}, "steady": {}}
    t0 = min(r.t_start for r in records)
    t1 = max(r.t_end for r in records)
    final_gen: dict[int, int] = {}
    for r in records:
        final_gen[r.step] = max(final_gen.get(r.step, r.generation), r.generation)
    useful: dict[int, float] = {}
    stall: dict[int, float] = {}
    replayed: dict[tuple[int, int], float] = defaultdict(float)
    for r in records:
        took = r.t_end - r.t_start
        if r.generation == final_gen[r.step]:
            useful[r.step] = min(useful.get(r.step, took), took - r.blocked_s)
            stall[r.step] = max(stall.get(r.step, 0.0), r.blocked_s)
        else:
            key = (r.step, r.generation)
            replayed[key] = max(replayed[key], took)
    ends = sorted(r.t_end for r in records)
    in_flight = 0.0
    down: dict[str, float] = {name: 0.0 for name, _, _ in DOWN_PHASES}
    injected_at = {f.index: f.t_injected for f in failures}
    recovered_at = t0  # when the last recovery before this failure was through
    for f in sorted(failures, key=lambda f: f.t_injected):
        before = [t for t in ends if t <= f.t_injected]
        if before:
            in_flight += max(0.0, f.t_injected - max(before[-1], recovered_at))
        reached = 0.0
        for name, start, end in DOWN_PHASES:
            t_end = f.phases.get(end)
            t_start = 0.0 if start is None else f.phases.get(start)
            if t_end is not None and t_start is not None:
                down[name] += max(0.0, t_end - t_start)
                reached = max(reached, t_end)
            elif t_start is not None and f.interrupted_by in injected_at:
                # cut short in this phase: it lasted until the failure that cut it
                cut = injected_at[f.interrupted_by] - f.t_injected
                down[name] += max(0.0, cut - t_start)
                reached = max(reached, cut)
        recovered_at = max(recovered_at, f.t_injected + reached)
    wall = t1 - t0
    useful_s = sum(useful.values())
    # steady state, robust to the first steps' warm-up: the median step, and the median wall
    # time between two consecutive counted steps of one generation beyond the later's own
    done: dict[int, float] = {}  # step -> when its final execution ended on every rank
    for r in records:
        if r.generation == final_gen[r.step]:
            done[r.step] = max(done.get(r.step, r.t_end), r.t_end)
    gaps = [
        done[s] - done[s - 1] - useful[s] - stall[s]
        for s in sorted(done)
        if s - 1 in done and final_gen[s - 1] == final_gen[s]
    ]
    breakdown = {
        "checkpoint_stall_s": sum(stall.values()),
        "replayed_s": sum(replayed.values()),
        "lost_in_flight_s": in_flight,
        **{f"down_{name}_s": s for name, s in down.items()},
    }
    breakdown["other_s"] = wall - useful_s - sum(breakdown.values())
    return {
        "ettr": useful_s / wall if wall > 0 else None,
        "wall_s": wall,
        "useful_s": useful_s,
        "breakdown": breakdown,
        "steady": {
            "step_s": statistics.median(useful.values()),
            "gap_s": statistics.median(gaps) if gaps else 0.0,
            "stall_s_per_step": sum(stall.values()) / len(stall),
        },
    }
