"""`failbench recommend`: ranks the mechanisms that apply to an architecture by the expected
fraction of wall time spent on useful training (`reliability`), and says why.

Costs come from what the database measured (per GB of state per rank, and the fixed phases of
a recovery, with their trend over world size where several sizes were run) and otherwise from
defaults that say so. Failure rates come from `--mtbf-hours` (one worker's mean time between
failures) or a preset of published statistics; the job's MTBF is the worker's divided by the
world size. Each mechanism is also played through the seeded simulator (`simulator`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from failbench_ray.errors import UsageError
from failbench_ray.failure_curves import CURVES, FailureCurve
from failbench_ray.reliability import Profile, expected_ratio, interval, no_checkpoint_ratio
from failbench_ray.simulator import FAILURE_BUDGET, STEP_BUDGET, Failures, summarize

GB = 1 << 30
MIN_MTBF_HOURS = 1e-3  # below, denormal rates divided by zero and overflowed in the model


@dataclass(frozen=True)
class Preset:
    name: str
    source: str
    curve: FailureCurve | None = None  # the job's rate follows a published curve
    worker_mtbf_hours: float | None = None  # else: one worker's, the job's is it / world

    def job_mtbf_hours(self, world: int) -> float:
        if self.curve is not None:
            return self.curve.mttf_hours(world)
        assert self.worker_mtbf_hours is not None
        return self.worker_mtbf_hours / world


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama3", CURVES["llama3"].source, curve=CURVES["llama3"]),
        Preset("kokolis", CURVES["kokolis"].source, curve=CURVES["kokolis"]),
        Preset(
            "kokolis-1k",
            "job MTTF about 7.9 h at 1,024 GPUs (Kokolis et al., Revisiting Reliability in "
            "Large-Scale Machine Learning Research Clusters, HPCA 2025), each worker's rate the "
            "same at every size",
            worker_mtbf_hours=7.9 * 1024,
        ),
        Preset(
            "kokolis-16k",
            "job MTTF about 1.8 h at 16,384 GPUs (Kokolis et al., HPCA 2025), each worker's "
            "rate the same at every size",
            worker_mtbf_hours=1.8 * 16_384,
        ),
    )
}


class Question(BaseModel):
    """What `recommend` is asked (the CLI's flags, the API's query). Every number that sizes
    the work is bounded, so no question costs more than `FAILURE_BUDGET` simulated failures
    and `STEP_BUDGET` steps per mechanism."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    architecture: str
    # Lower bounds too: denormal floats (5e-324) divided by zero and overflowed in the model.
    state_gb: float = Field(
        ge=1e-6, le=1_000_000, description="Training state (model + optimizer) in GB."
    )
    world: int = Field(ge=1, le=1_048_576, description="Workers (ranks).")
    mtbf_hours: float | None = Field(
        None, le=10_000_000, description="One worker's MTBF, hours (at least 0.001: `_check`)."
    )
    preset: str | None = None
    step_s: float = Field(
        1.0, ge=1e-3, le=86_400, description="Time of one training step, seconds."
    )
    job_days: float = Field(
        30.0, ge=1e-3, le=3_650, description="Failure-free length of the job, days."
    )
    correlated: float = Field(
        0.01, ge=0, le=1, description="Share of failures that also take other nodes' memory."
    )
    simulate_runs: int = Field(20, ge=0, le=200, description="Seeded simulator runs.")
    repair_hours: float = Field(
        4.0,
        ge=0,
        le=8_760,
        description="Hours until a failed worker's machine is back (repaired or replaced): "
        "spares cover the failures meanwhile.",
    )


# -- unit costs ------------------------------------------------------------------------------
@dataclass
class Costs:
    """Seconds per GB of state per rank, and the fixed phases of a recovery (seconds)."""

    save_s_per_gb: float = 1.0  # blocking write to disk, fsync included
    read_s_per_gb: float = 0.5  # load a checkpoint from disk
    snapshot_s_per_gb: float = 0.2  # copy into memory (async snapshot, replication)
    copy_s_per_gb: float = 0.5  # from another process's memory (object store, network)
    detect_s: float = 0.05
    quiesce_s: float = 0.2
    start_s: float = 4.0  # a replacement worker comes up (process, torch import, actor)
    reform_s: float = 1.0  # a new process group forms
    adopt_s: float = 0.5  # a hot spare takes the dead rank's place
    source: dict[str, str] = field(default_factory=dict)  # cost -> where it came from

    def note(self, key: str) -> str:
        return self.source.get(key, "default")


def _gb(nbytes: Any) -> float | None:
    return nbytes / GB if isinstance(nbytes, int | float) and nbytes > 0 else None


def _trend(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """A fixed cost as a function of world size: a least-squares line in log2(world) where
    more than one size was measured, else the median."""
    sizes = {n for n, _ in points}
    if len(sizes) < 2:
        med = statistics.median(v for _, v in points)
        return lambda n: med
    xs = [math.log2(n) for n, _ in points]
    ys = [v for _, v in points]
    slope, icpt = statistics.linear_regression(xs, ys)
    return lambda n: max(0.0, icpt + slope * math.log2(n))


def measured_costs(results: Iterable[Any], world: int) -> Costs:
    """Unit costs from completed experiments (`ExperimentResult`s), scaled to `world`."""
    per_gb: dict[str, list[float]] = defaultdict(list)
    phases: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for res in results:
        mech = res.spec.get("mechanism", {}).get("name")
        n = int(res.spec.get("world_size", 2))
        for t in res.trials:
            extra = t.model_extra or {}
            gb = _gb(extra.get("state_bytes_per_rank"))
            ck = extra.get("checkpoint") or {}
            if t.status != "completed" or gb is None:
                continue
            _checkpoint_costs(mech, ck, gb, per_gb)
            _phase_costs(mech, n, t.failures, phases)
    costs = Costs()
    for key, values in per_gb.items():
        setattr(costs, key, statistics.median(values))
        costs.source[key] = f"measured: median of {len(values)} trials"
    for key, points in phases.items():
        setattr(costs, key, _trend(points)(world))
        sizes = sorted({n for n, _ in points})
        costs.source[key] = f"measured: {len(points)} recoveries at world sizes {sizes}"
    if "start_s" in phases:  # the measured re-formation includes the new process group
        costs.reform_s = 0.0
        costs.source["reform_s"] = "included in start_s (measured together)"
    return costs


def _checkpoint_costs(
    mech: Any, ck: dict[str, Any], gb: float, per_gb: dict[str, list[float]]
) -> None:
    """Add one trial's save and restore times, per GB, to the costs they measure."""
    if mech == "disk_ckpt" and ck.get("blocked_s_per_save"):
        per_gb["save_s_per_gb"].append(ck["blocked_s_per_save"] / gb)
    if mech in ("async_ckpt", "inmem_replica") and ck.get("blocked_s_per_save"):
        per_gb["snapshot_s_per_gb"].append(ck["blocked_s_per_save"] / gb)
    if ck.get("restore_s_max") and mech in ("disk_ckpt", "async_ckpt"):
        per_gb["read_s_per_gb"].append(ck["restore_s_max"] / gb)
    if ck.get("restore_s_max") and mech in ("inmem_replica", "live_recovery"):
        per_gb["copy_s_per_gb"].append(ck["restore_s_max"] / gb)


def _phase_costs(
    mech: Any, n: int, failures: Iterable[Any], phases: dict[str, list[tuple[int, float]]]
) -> None:
    """Add one trial's uninterrupted recoveries' phases, at world size `n`, to `phases`."""
    for f in failures:
        ph = f.phases.model_dump()  # seconds after the injection
        det, qui, ref = ph["detected_s"], ph["quiesced_s"], ph["reformed_s"]
        if f.interrupted_by is not None or None in (det, qui, ref):
            continue
        phases["detect_s"].append((n, det))
        phases["quiesce_s"].append((n, qui - det))
        key = "adopt_s" if mech == "hot_spare" else "start_s"
        phases[key].append((n, ref - qui))


# -- profiles --------------------------------------------------------------------------------
def profiles(
    q: Question, c: Costs, state_gb_per_rank: float, job_mtbf_s: float, replicated: bool = False
) -> list[Profile]:
    """Each mechanism's costs for this job. `replicated`: every rank holds the whole state
    (data parallel), so a neighbour's state is a rank's own and `redundant` copies nothing."""
    s = state_gb_per_rank
    down = c.detect_s + c.quiesce_s + c.start_s + c.reform_s  # a replacement joins
    disk = Profile("disk_ckpt", save_s=c.save_s_per_gb * s, restart_s=down + c.read_s_per_gb * s)
    copy_restore = down + c.copy_s_per_gb * s
    # A failure takes the in-memory copies too when it is correlated, or when a holder fails
    # before the recovery is through.
    loss = q.correlated + (1 - q.correlated) * -math.expm1(-copy_restore / job_mtbf_s)
    return [
        Profile("none", restart_s=down, notes=("a failure restarts the job from the start",)),
        disk,
        Profile(
            "async_ckpt",
            save_s=c.snapshot_s_per_gb * s,
            durable_s=c.save_s_per_gb * s,
            restart_s=disk.restart_s,
        ),
        Profile(
            "inmem_replica",
            save_s=c.snapshot_s_per_gb * s,
            restart_s=copy_restore,
            p_replica_loss=loss,
            fallback=disk,
        ),
        Profile(
            "jit_ckpt",
            lost_s=q.step_s,
            restart_s=down + (c.save_s_per_gb + c.read_s_per_gb) * s,
            p_replica_loss=loss,
            fallback=disk,
        ),
        Profile(
            "elastic",
            lost_s=q.step_s,
            restart_s=c.detect_s + c.quiesce_s + c.reform_s,
            degraded_s=c.start_s + c.reform_s + c.copy_s_per_gb * s,
            degraded_share=1 / q.world,
        ),
        Profile(
            "redundant",
            # a neighbour's state, every step (nothing to copy where it equals the rank's own)
            overhead=0.0 if replicated else (c.snapshot_s_per_gb + c.copy_s_per_gb) * s / q.step_s,
            lost_s=q.step_s,
            restart_s=copy_restore,
        ),
        Profile("live_recovery", lost_s=q.step_s, restart_s=copy_restore),
        Profile(
            "hot_spare",
            save_s=c.snapshot_s_per_gb * s,
            restart_s=c.detect_s + c.quiesce_s + c.adopt_s + c.reform_s,
        ),
    ]


def _why(p: Profile, mtbf_s: float, ratio: float) -> str:
    parts = []
    if p.periodic:
        tau = interval(p, mtbf_s)
        parts.append(f"saves block {p.save_s:.3g} s every {tau / 60:.3g} min (Daly's optimum)")
        if p.durable_s:
            parts.append(f"durable {p.durable_s:.3g} s later")
    if p.overhead:
        parts.append(f"{100 * p.overhead:.3g}% slower steps")
    lost = (interval(p, mtbf_s) / 2 if p.periodic else p.lost_s) or 0.0
    parts.append(f"a failure costs {p.restart_s:.3g} s down + {lost:.3g} s of lost work")
    if p.fallback is not None:
        parts.append(
            f"{100 * p.p_replica_loss:.2g}% of failures fall back to {p.fallback.mechanism}"
        )
    if p.degraded_s:
        parts.append(f"{p.degraded_s:.3g} s with one rank fewer")
    parts += p.notes
    return f"{100 * ratio:.1f}% useful: " + "; ".join(parts)


def _check(q: Question) -> None:
    """Raise UsageError on a question that cannot be asked."""
    from architectures import ARCHITECTURES

    if q.architecture not in ARCHITECTURES:
        raise UsageError(
            f"unknown architecture {q.architecture!r}; choose one of "
            f"{', '.join(sorted(ARCHITECTURES.names()))}"
        )
    if q.world < 2:
        raise UsageError(f"--world must be at least 2 (got {q.world}): one worker has no peer")
    if (q.mtbf_hours is None) == (q.preset is None):
        raise UsageError("give exactly one of --mtbf-hours and --preset")
    if q.preset is not None and q.preset not in PRESETS:
        raise UsageError(f"unknown preset {q.preset!r}; choose one of {', '.join(PRESETS)}")
    if q.mtbf_hours is not None and not q.mtbf_hours >= MIN_MTBF_HOURS:
        raise UsageError(
            f"--mtbf-hours must be at least {MIN_MTBF_HOURS:g} (3.6 s) (got {q.mtbf_hours:g})"
        )


def _ranked(q: Question, p: Profile, job_s: float, job_mtbf_s: float) -> dict[str, Any]:
    """One applicable mechanism's entry in the ranking: expected, and simulated."""
    if p.mechanism == "none":
        ratio = no_checkpoint_ratio(job_s, p.restart_s, job_mtbf_s)
    else:
        ratio = expected_ratio(p, job_mtbf_s)
    sim: dict[str, Any] | None = None
    if q.simulate_runs and (p.mechanism != "none" or job_s / job_mtbf_s < 20):
        failures = Failures(job_mtbf_s)
        got = summarize(p, failures, job_s, q.world, runs=q.simulate_runs)
        sim = {
            "ettr": got.ratio,
            "ci95": got.ci95,
            "job_interval95": [got.job_low, got.job_high],
            "runs": got.runs,
            "cut_short": got.cut_short,
        }
        by_failures = got.cut_short - got.out_of_steps
        notes = []
        if by_failures:
            notes.append(
                f"{by_failures} of {got.runs} runs stopped after their share of "
                f"{FAILURE_BUDGET:,} failures before the job was done: failures come about as "
                "fast as the job progresses"
            )
        if got.out_of_steps:
            notes.append(
                f"{got.out_of_steps} of {got.runs} runs stopped after their share of "
                f"{STEP_BUDGET:,} simulated saves and failures before the job was done"
            )
        sim["note"] = (
            "; ".join(notes) + "; the ratio is that of the time simulated" if notes else None
        )
    return {
        "mechanism": p.mechanism,
        "ettr": ratio,
        "simulated": sim,
        "interval_s": interval(p, job_mtbf_s) if p.periodic else None,
        "why": _why(p, job_mtbf_s, ratio),
        "_profile": p,
    }


def recommend(q: Question, results: Iterable[Any] = ()) -> dict[str, Any]:
    """The answer, as JSON-ready data. Raises UsageError on a question that cannot be asked."""
    from failbench_ray import catalog

    _check(q)
    preset = PRESETS[q.preset] if q.preset is not None else None
    job_mtbf_h = preset.job_mtbf_hours(q.world) if preset else float(q.mtbf_hours or 0) / q.world
    job_mtbf_s = job_mtbf_h * 3600
    applies = catalog.applicability(q.architecture)
    shards = catalog.shards(q.architecture, q.world)
    per_rank = q.state_gb / shards
    costs = measured_costs(results, q.world)
    job_s = q.job_days * 86400
    ranked: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for p in profiles(q, costs, per_rank, job_mtbf_s, replicated=shards == 1):
        if applies.get(p.mechanism, "not registered") is not None:
            refused.append({"mechanism": p.mechanism, "reason": applies.get(p.mechanism)})
            continue
        ranked.append(_ranked(q, p, job_s, job_mtbf_s))
    ranked.sort(key=lambda r: -r["ettr"])
    best = policy(q, ranked[0].pop("_profile"), ranked[0], job_mtbf_s) if ranked else None
    for r in ranked[1:]:
        r.pop("_profile")
    return {
        "question": q.model_dump(),
        "job_mtbf_hours": job_mtbf_s / 3600,
        "failures_expected": job_s / job_mtbf_s,
        "state_gb_per_rank": per_rank,
        "preset": preset.source if preset else None,
        "costs": {
            k: {"value": v, "source": costs.note(k)}
            for k, v in vars(costs).items()
            if k != "source"
        },
        "policy": best,
        "ranking": ranked,
        "not_applicable": refused,
    }


# The heartbeat timeout `make bench` measured with no false alarm over 1,000 fault-free steps
# (`detectors.heartbeat_timeout_s`'s default).
HANG_TIMEOUT_FLOOR_S = 1.5
SPARE_COVERAGE = 0.99  # spares for all but 1% of repair windows


def spares_needed(failures_per_h: float, repair_hours: float, coverage: float) -> int:
    """The fewest spares that cover the failures arriving while failed machines are repaired
    (Poisson, mean rate x repair time) in `coverage` of the windows."""
    mean = failures_per_h * repair_hours
    k, term = 0, math.exp(-mean)
    total = term
    while total < coverage and k < 1_000_000:
        k += 1
        term *= mean / k
        total += term
    return k


def policy(q: Question, p: Profile, entry: dict[str, Any], job_mtbf_s: float) -> dict[str, Any]:
    """What to set for the top-ranked mechanism: its checkpoint interval, the spares, the hang
    timeout, and the ETTR to expect, with the 95% range of one job's (the simulator's runs)."""
    sim = entry["simulated"]
    pause = max(p.save_s, p.fallback.save_s if p.fallback else 0.0)
    per_h = 3600 / job_mtbf_s
    spares = spares_needed(per_h, q.repair_hours, SPARE_COVERAGE)
    return {
        "mechanism": p.mechanism,
        "checkpoint_interval_s": entry["interval_s"],
        "spares": spares,
        "hang_timeout_s": max(HANG_TIMEOUT_FLOOR_S, 2 * pause),
        "ettr": entry["ettr"],
        "ettr_interval95": sim["job_interval95"] if sim else None,
        "why": (
            f"{spares} spare(s) cover {100 * SPARE_COVERAGE:g}% of {q.repair_hours:g} h repair "
            f"windows ({per_h * q.repair_hours:.3g} failures expected in one); the hang timeout "
            f"is the heartbeat's measured floor of {HANG_TIMEOUT_FLOOR_S:g} s or twice the "
            "longest blocking save, whichever is longer"
            + ("" if sim else "; no simulated runs, so no interval")
        ),
    }


_OPEN: dict[str, Any] = {}  # url -> Database, kept by a process that answers many questions


def recommend_stored(db_url: str, q: Question, limit: int = 500) -> dict[str, Any]:
    """`recommend` from the newest `limit` results stored at `db_url`: what the API's compute
    workers run (`api/offload.py`), the database reads included, off the server's threads."""
    from failbench_ray.storage.db import Database

    db = _OPEN.get(db_url)
    if db is None:
        db = _OPEN[db_url] = Database(db_url, migrate=False, pool_size=1)
    return recommend(q, stored_results(db, limit=limit))


def stored_results(db: Any, limit: int = 2000) -> list[Any]:
    """Results of the completed experiments in `db` (`ExperimentResult`s), newest first."""
    from failbench_ray.storage import repo

    with db.session() as s:
        ids = [e.id for e in repo.list_experiments(s, status="completed", limit=limit)]
        return [repo.load_result(s, i) for i in ids]
