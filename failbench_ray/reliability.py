"""The analytic model behind `failbench recommend`: what fraction of wall time a job spends
on useful training under a mechanism, given its costs and the failure rate.

A mechanism is a `Profile` of costs (seconds, already scaled to the job's state size and world
size): what it costs while nothing fails (a periodic blocking save, a fixed overhead), what a
failure costs (downtime until training resumes, work lost), and what happens when a failure
also takes the in-memory copies it restores from (the `fallback` profile, with probability
`p_replica_loss`). Pure functions; `failbench_ray.simulator` plays the same profiles through
drawn failures and covers what the formulas cannot (Weibull arrivals, node failures, cascades).

References: J. W. Young, "A first order approximation to the optimum checkpoint interval",
CACM 1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 2006 (exponential failures; failures during saves and restarts included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    mechanism: str
    save_s: float = 0.0  # training blocked per periodic save (0: nothing periodic)
    durable_s: float = 0.0  # after a save, until it can be restored from (async persistence)
    overhead: float = 0.0  # steady-state slowdown not tied to saves (fraction of step time)
    restart_s: float = 0.0  # a failure's downtime: detect, quiesce, re-form, restore, resume
    lost_s: float | None = None  # work lost per failure when not tied to an interval
    degraded_s: float = 0.0  # elastic: time trained with fewer ranks before growing back
    degraded_share: float = 0.0  # the throughput missing meanwhile (1/N for one rank of N)
    # after a recovery, the seconds by which the steps that count run slower than steady ones
    # (a group on fewer ranks that keeps the batch, a replacement warming up, a respawn's CPU):
    # useful time by ETTR's definition, and wall time too
    slowed_s: float = 0.0
    p_replica_loss: float = 0.0  # chance a failure also takes the copies restored from
    fallback: Profile | None = None  # what recovery falls back to then
    interval_s: float | None = None  # fixed save interval; None: the optimum (Daly)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def periodic(self) -> bool:
        return self.save_s > 0


# exp() of more overflows a float; the ratios it would give are below 1e-300 anyway
_EXP_LIMIT = 700.0


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's optimum time between saves (work between two checkpoints)."""
    if save_s <= 0:
        return math.inf
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def young_interval(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def interval(p: Profile, mtbf_s: float) -> float:
    return p.interval_s if p.interval_s is not None else daly_interval(p.save_s, mtbf_s)


def periodic_ratio(tau: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful time / wall time with a save (cost `save_s`) after every `tau` of work and a
    restart of `restart_s` after each failure, for exponential failures of mean `mtbf_s`
    (Daly 2006, eq. 7: T_wall = M e^{R/M} (e^{(tau+delta)/M} - 1) T_s / tau)."""
    m = mtbf_s
    if max(restart_s, tau + save_s) / m > _EXP_LIMIT:
        return 0.0  # a restart or a segment thousands of MTBFs long: no work gets through
    wall_per_segment = m * math.exp(restart_s / m) * math.expm1((tau + save_s) / m)
    return tau / wall_per_segment


def event_ratio(lost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful / wall time when each failure costs `restart_s` of downtime (restarted if a
    failure strikes during it) and `lost_s` of work, with no periodic cost."""
    m = mtbf_s
    if restart_s / m > _EXP_LIMIT:
        return 0.0  # a recovery hundreds of MTBFs long: it practically never gets through
    recovery = m * math.expm1(restart_s / m)  # expected time to get one recovery through
    return max(0.0, m - lost_s) / (m + recovery)


def expected_ratio(p: Profile, mtbf_s: float) -> float:
    """Expected useful / wall time of `p` for job failures every `mtbf_s` on average."""
    if mtbf_s <= 0:
        raise ValueError("the mean time between failures must be positive")
    slow = 1.0 / (1.0 + p.overhead)
    if p.fallback is None:
        if p.periodic:
            # async persistence: the newest restorable state lags `durable_s` behind a save
            base = periodic_ratio(interval(p, mtbf_s), p.save_s, p.restart_s + p.durable_s, mtbf_s)
        else:
            base = event_ratio(p.lost_s or 0.0, p.restart_s, mtbf_s)
    else:
        # First order (Young): both pay their saves; a failure costs what the primary's costs,
        # or, when it also took the copies (chance q), what the fallback's costs. The fallback
        # saves at the optimum for the failures it serves (rate q/M).
        q, fb = p.p_replica_loss, p.fallback
        fb_mtbf = mtbf_s / q if q > 0 else math.inf
        steady = _save_share(p, mtbf_s) + _save_share(fb, fb_mtbf)
        per_failure = (1 - q) * failure_cost(p, mtbf_s) + q * failure_cost(fb, fb_mtbf)
        base = 1.0 - steady - per_failure / mtbf_s
    base -= p.degraded_s * p.degraded_share / mtbf_s
    ratio = max(0.0, base) * slow
    # each failure adds `slowed_s` of wall time that counts as useful: at one failure per
    # `mtbf_s` of wall time, a share slowed_s / mtbf_s of it
    share = min(1.0, p.slowed_s / mtbf_s)
    return ratio + (1.0 - ratio) * share


def _save_share(p: Profile, mtbf_s: float) -> float:
    if not p.periodic or math.isinf(mtbf_s) and p.interval_s is None:
        return 0.0
    tau = interval(p, mtbf_s)
    return p.save_s / (tau + p.save_s)


def failure_cost(p: Profile, mtbf_s: float) -> float:
    """Expected seconds one failure costs (downtime plus work lost), first order."""
    if p.periodic:
        tau = interval(p, mtbf_s) if not math.isinf(mtbf_s) or p.interval_s else 0.0
        return tau / 2 + p.durable_s + p.restart_s
    return (p.lost_s or 0.0) + p.restart_s


def no_checkpoint_ratio(job_s: float, restart_s: float, mtbf_s: float) -> float:
    """Without any saved state a failure restarts the job: expected wall time to finish
    `job_s` of work is (M + R)(e^{W/M} - 1) (exponential failures)."""
    m = mtbf_s
    exponent = job_s / m
    if exponent > 700:  # the job practically never finishes
        return 0.0
    return job_s / ((m + restart_s) * math.expm1(exponent))
