"""The result JSON (a contract other tools read) and the pure analysis that produces it.

Everything here is a pure function of step records and failure records, so it is tested without
Ray. `step_time_s` is the steady-state median; `overhead_pct` compares *mean* steady-state step
times, because a periodic cost (a checkpoint every K steps) is invisible to a median.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from failbench_ray.records import PHASES, FailureRecord, StepRecord


class PhaseTimes(BaseModel):
    """Seconds after the injection at which each recovery phase ended (None: not reached)."""

    detected_s: float | None = None
    quiesced_s: float | None = None
    reformed_s: float | None = None
    restored_s: float | None = None
    resumed_s: float | None = None
    caught_up_s: float | None = None


class ReformParts(BaseModel):
    """Seconds after the injection at which each part of re-formation ended (None: not
    reached, or not measured): between `quiesced` and `reformed`, in this order."""

    replaced_s: float | None = None  # the replacements were up (none: at once)
    rendezvous_s: float | None = None  # every member had reached the store
    connected_s: float | None = None  # every member's process group was connected
    collective_s: float | None = None  # the first collective was done on every rank
    # Not in the order above: every survivor had left the dead group and reached the new one's
    # store (with `reform: fast`, while the replacements started; None without replacements).
    survivors_s: float | None = None
    # When the driver asked for the cold replacements' new processes (None: none were made);
    # `replaced_s` minus this is their start-up inside the recovery.
    spawned_s: float | None = None


class FailureResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    ranks: list[int]
    kill_kind: str
    trigger: str
    injected_at_step: int
    restored_from_step: int | None
    lost_steps: int | None
    quiesce: str
    quiesce_reason: str = ""  # why not the spec's strategy (e.g. collectives not abortable)
    # cold: new processes (torch imported inside the recovery); warm: standbys that ran
    # already (hot spares); none: training went on without the dead ranks
    replacement: str = ""
    detector: str = "death"  # what found it: death (the process ended) or heartbeat (a hang)
    restore_source: str
    interrupted_by: int | None = None
    phases: PhaseTimes
    reform: ReformParts = Field(default_factory=ReformParts)


class BaselineResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str
    step_time_s: float | None
    mean_step_time_s: float | None = None
    final_loss: float | None
    params_digest: str | None


class TrialResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    trial: int
    status: str
    step_time_s: float | None
    mean_step_time_s: float | None = None
    overhead_pct: float | None
    final_loss: float | None
    params_digest: str | None
    matches_baseline: bool | None
    match_expected: bool = False
    error: str | None = None
    failures: list[FailureResult] = Field(default_factory=list)


class ExperimentResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    experiment_id: str
    status: str
    spec: dict[str, Any]
    baseline: BaselineResult | None
    trials: list[TrialResult]


def failure_reason(result: ExperimentResult, limit: int = 2000) -> str | None:
    """Why an experiment failed, for its own row: each failed run's error, by name."""
    parts = []
    if result.baseline is not None and result.baseline.status == "failed":
        parts.append(f"baseline: {getattr(result.baseline, 'error', None) or 'failed'}")
    parts += [
        f"trial {t.trial}: {t.error or 'failed'}" for t in result.trials if t.status == "failed"
    ]
    text = "; ".join(parts)
    return (text[: limit - 3] + "...") if len(text) > limit else (text or None)


# ---------------------------------------------------------------------------------------------
# Pure analysis


def step_durations(records: Iterable[StepRecord]) -> dict[tuple[int, int], float]:
    """Duration of each (generation, step): the slowest rank's, since ranks wait for it."""
    out: dict[tuple[int, int], float] = {}
    for r in records:
        key = (r.generation, r.step)
        out[key] = max(out.get(key, 0.0), r.t_end - r.t_start)
    return out


def steady_state_steps(
    records: Sequence[StepRecord],
    failures: Sequence[FailureRecord],
    warmup_steps: int,
) -> list[float]:
    """Durations of the steady-state steps.

    Excluded: the first `warmup_steps` of every generation (first steps after a (re)wrap are slow:
    lazy imports, bucket rebuilds) and every step replayed or in flight during a recovery.
    """
    excluded: set[int] = set()
    for f in failures:
        lo = f.restored_from_step if f.restored_from_step is not None else f.injected_at_step
        excluded.update(range(lo + 1, f.injected_at_step + 1))
    first_step: dict[int, int] = {}
    for r in records:
        first_step[r.generation] = min(first_step.get(r.generation, r.step), r.step)
    durations = step_durations(records)
    return [
        d
        for (gen, step), d in sorted(durations.items())
        if step >= first_step[gen] + warmup_steps and step not in excluded
    ]


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def mean_or_none(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def overhead_pct(mean_step_s: float | None, baseline_mean_step_s: float | None) -> float | None:
    if mean_step_s is None or not baseline_mean_step_s:
        return None
    return 100.0 * (mean_step_s / baseline_mean_step_s - 1.0)


def step_losses(records: Sequence[StepRecord]) -> dict[int, float]:
    """The loss of each step: the mean over the ranks that see it, in the last generation that
    ran the step (ranks that never see the loss, inner pipeline stages, report NaN)."""
    latest: dict[int, int] = {}
    for r in records:
        latest[r.step] = max(latest.get(r.step, r.generation), r.generation)
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.generation == latest[r.step] and not math.isnan(r.loss):
            by_step[r.step].append(r.loss)
    return {step: statistics.fmean(v) for step, v in sorted(by_step.items())}


def final_loss(records: Sequence[StepRecord]) -> float | None:
    """The loss of the last step (see `step_losses`)."""
    losses = step_losses(records)
    return losses[max(losses)] if losses else None


def fill_resume_phases(failures: Sequence[FailureRecord], records: Sequence[StepRecord]) -> None:
    """Set `resumed` and `caught_up` of each failure from the step records.

    resumed: the first step after the restore is done on every rank of the new generation;
    caught up: the step that was in flight at the failure is done again on every rank.
    """
    done: dict[tuple[int, int], float] = defaultdict(float)
    started: dict[tuple[int, int], float] = {}
    for r in records:
        key = (r.generation, r.step)
        done[key] = max(done[key], r.t_end)
        started[key] = min(started.get(key, r.t_start), r.t_start)
    for f in failures:
        if f.restored_from_step is None or f.interrupted_by is not None:
            continue
        gens = sorted({g for (g, s) in done if s == f.restored_from_step + 1})
        # A step of the old generation can end just after the kill; the resumed one starts after.
        later = [g for g in gens if started[(g, f.restored_from_step + 1)] > f.t_injected]
        if not later:
            continue
        gen = later[0]
        f.phases["resumed"] = done[(gen, f.restored_from_step + 1)] - f.t_injected
        target = max(f.injected_at_step, f.restored_from_step + 1)
        t_caught = next(
            (done[(g, target)] for g in sorted(gens) if g >= gen and (g, target) in done), None
        )
        if t_caught is not None:
            f.phases["caught_up"] = t_caught - f.t_injected


def failure_result(f: FailureRecord) -> FailureResult:
    return FailureResult(
        ranks=list(f.ranks),
        kill_kind=f.kill_kind,
        trigger=f.trigger,
        injected_at_step=f.injected_at_step,
        restored_from_step=f.restored_from_step,
        lost_steps=f.lost_steps,
        quiesce=f.quiesce,
        quiesce_reason=f.quiesce_reason,
        replacement=f.replacement,
        detector=f.detector,
        restore_source=f.restore_source,
        interrupted_by=f.interrupted_by,
        phases=PhaseTimes(**{f"{p}_s": f.phases.get(p) for p in PHASES}),
        reform=ReformParts(**{f"{p}_s": f.reform.get(p) for p in f.reform}),
    )


def matches_baseline(
    digest: str | None, baseline_digest: str | None, match_expected: bool
) -> bool | None:
    """The correctness oracle: True/False where an exact match is expected, else None."""
    if not match_expected or digest is None or baseline_digest is None:
        return None
    return digest == baseline_digest


def throughput(records: Sequence[StepRecord], t_from: float, t_to: float) -> float | None:
    """Samples per second consumed by all ranks between two instants (whole steps only)."""
    inside = [r for r in records if r.t_start >= t_from and r.t_end <= t_to]
    if not inside:
        return None
    span = max(r.t_end for r in inside) - min(r.t_start for r in inside)
    return sum(r.samples for r in inside) / span if span > 0 else None


def throughput_around_failures(
    records: Sequence[StepRecord], failures: Sequence[FailureRecord], warmup_steps: int
) -> dict[str, float | None]:
    """Sample throughput before the first failure and after the last recovery resumed."""
    if not failures or not records:
        return {}
    first = min(f.t_injected for f in failures)
    last = max(failures, key=lambda f: f.t_injected)
    start = min((r.t_end for r in records if r.step == warmup_steps), default=0.0)
    resumed = last.phases.get("resumed")
    after = last.t_injected + resumed if resumed is not None else math.inf
    return {
        "samples_per_s_before_failure": throughput(records, start, first),
        "samples_per_s_after_recovery": throughput(records, after, math.inf),
    }


def throughput_around_slowdowns(
    records: Sequence[StepRecord], slowed: Sequence[tuple[float, float]], warmup_steps: int
) -> dict[str, float | None]:
    """Sample throughput before the first slowdown (a `straggler` that was not ended) and while
    it lasted; `slowed` holds (start, end) instants."""
    if not slowed or not records:
        return {}
    start = min((r.t_end for r in records if r.step == warmup_steps), default=0.0)
    first = min(t for t, _ in slowed)
    return {
        "samples_per_s_before_straggler": throughput(records, start, first),
        "samples_per_s_with_straggler": throughput(records, first, min(e for _, e in slowed)),
    }


def replica_spread(samples: Sequence[Sequence[float]]) -> float | None:
    """How far replicas are apart: max over ranks of |x_r - mean| / |mean| (relative L2)."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mean = [sum(col) / n for col in zip(*samples, strict=True)]
    norm = math.sqrt(sum(v * v for v in mean)) or 1.0
    return max(
        math.sqrt(sum((a - b) ** 2 for a, b in zip(x, mean, strict=True))) / norm for x in samples
    )


def mean_by_key(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the rows that have it."""
    keys = sorted({k for row in rows for k in row})
    return {k: statistics.fmean(row[k] for row in rows if k in row) for k in keys}


def sample_accounting(
    records: Sequence[StepRecord], batch_size: int, whole_batch: bool = True
) -> dict[str, int]:
    """What happened to the data, from the step records.

    A step's *final* execution is its records in the last generation that ran it; what earlier
    generations computed for it was rolled back. `samples_replayed`: samples trained again
    after a rollback (wasted work); `samples_skipped`: samples of a global batch that the final
    execution of its step did not train on (a rank gone and its share not re-balanced);
    `samples_duplicated`: samples the final execution trained on more than once.

    `whole_batch` (`Architecture.commits_whole_batch`): an execution that any rank completed
    waited for every member of its generation, so it also trained the shares of members that
    died before recording it (a parameter server publishes a step and dies before its workers
    pull it; a worker dies in its after-step hook, the step already applied). A member's share
    is what it recorded for its other steps of that generation.
    """
    final_gen: dict[int, int] = {}
    trained: dict[tuple[int, int], int] = defaultdict(int)  # (step, generation) -> samples
    ran: dict[tuple[int, int], set[int]] = defaultdict(set)  # (step, generation) -> ranks
    share: dict[int, dict[int, int]] = defaultdict(dict)  # generation -> rank -> samples
    for r in records:
        final_gen[r.step] = max(final_gen.get(r.step, r.generation), r.generation)
        trained[r.step, r.generation] += r.samples
        ran[r.step, r.generation].add(r.rank)
        share[r.generation][r.rank] = r.samples
    if whole_batch:
        for (step, gen), ranks in ran.items():
            trained[step, gen] += sum(n for rank, n in share[gen].items() if rank not in ranks)
    consumed = {step: trained[step, gen] for step, gen in final_gen.items()}
    replayed = sum(n for (step, gen), n in trained.items() if gen != final_gen[step])
    return {
        "samples_replayed": replayed,
        "samples_skipped": sum(max(0, batch_size - n) for n in consumed.values()),
        "samples_duplicated": sum(max(0, n - batch_size) for n in consumed.values()),
    }


def mechanism_costs(
    records: Sequence[StepRecord], events: Sequence[Any], steps: int
) -> dict[str, float | int | None]:
    """What the mechanism cost: bytes saved or replicated (per step), time the step was blocked
    per save, and what restores moved. `events` are `records.CheckpointEvent`s."""
    saves = [e for e in events if e.kind == "save"]
    copies = [e for e in events if e.kind == "replicate"]
    restores = [e for e in events if e.kind == "restore"]
    saved_at = {(e.rank, e.step) for e in saves + copies}
    blocked = [r.blocked_s for r in records if (r.rank, r.step) in saved_at]
    moved = sum(e.nbytes for e in saves) + sum(e.nbytes for e in copies)
    return {
        "saves": len(saves),
        "bytes_saved": sum(e.nbytes for e in saves),
        "save_s_mean": mean_or_none([e.duration_s for e in saves]),
        "replications": len(copies),
        "bytes_replicated": sum(e.nbytes for e in copies),
        "bytes_per_step": moved / steps if steps else None,
        "blocked_s_total": sum(r.blocked_s for r in records),
        "blocked_s_per_save": mean_or_none(blocked),
        "restores": len(restores),
        "restore_bytes": sum(e.nbytes for e in restores),
        "restore_s_max": max((e.duration_s for e in restores), default=None),
    }
