"""A seeded discrete-event simulator: plays a mechanism's `reliability.Profile` through drawn
failures and measures the fraction of wall time spent on useful training.

What it covers that the formulas in `reliability` cannot: Weibull arrivals (failures cluster
after a failure when shape < 1), whole-node failures that take several workers at once,
failures during a save or a recovery (cascades: the recovery starts over), and failures that
also take the in-memory copies (recovery falls back, further back).

Time is in seconds. Work is measured in seconds of failure-free training; the job is done when
`job_s` of work is done.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from failbench_ray.reliability import Profile, interval


@dataclass(frozen=True)
class Failures:
    mtbf_s: float  # mean time between failures of the whole job
    distribution: Literal["exponential", "weibull"] = "exponential"
    shape: float = 0.7  # Weibull shape (< 1: failures come in bursts)
    node_share: float = 0.0  # fraction of failures that take a whole node
    workers_per_node: int = 8

    def draw(self, rng: random.Random) -> float:
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.mtbf_s)
        scale = self.mtbf_s / math.gamma(1 + 1 / self.shape)  # same mean as exponential
        return rng.weibullvariate(scale, self.shape)


@dataclass(frozen=True)
class SimResult:
    ratio: float  # useful work / wall time
    wall_s: float
    failures: int
    fallbacks: int  # failures that also took the copies
    cascades: int  # failures during a recovery


def simulate(p: Profile, failures: Failures, job_s: float, world: int, seed: int = 0) -> SimResult:  # noqa: C901
    """One run of a job of `job_s` seconds of work on `world` workers."""
    rng = random.Random(seed)
    slow = 1.0 + p.overhead  # wall seconds per second of work
    tau = interval(p, failures.mtbf_s) if p.periodic else math.inf
    fb = p.fallback
    q = p.p_replica_loss if fb is not None else 0.0
    fb_tau = math.inf
    if fb is not None and fb.periodic:
        fb_tau = interval(fb, failures.mtbf_s / q) if q > 0 else math.inf
    t, work = 0.0, 0.0
    saved: list[tuple[float, float]] = [(0.0, 0.0)]  # (work level, restorable from time)
    fb_saved = 0.0
    next_save, next_fb = tau, fb_tau
    degraded_until, degraded_share = 0.0, 0.0
    next_fail = failures.draw(rng)
    n_fail = n_fb = n_cascade = 0

    def restorable(now: float) -> float:
        return max(w for w, ready in saved if ready <= now)

    while work < job_s:
        if p.periodic and t >= degraded_until and math.isclose(work, next_save - tau):
            # Whole save cycles that end before the next failure: skip through them at once.
            cycle = tau * slow + p.save_s
            k = min(int((next_fail - t) // cycle), int((min(next_fb, job_s) - work) // tau)) - 1
            if k > 0:
                work, t = work + k * tau, t + k * cycle
                saved = [*saved[-3:], (work, t + p.durable_s)]
                next_save = work + tau
        target = min(next_save, next_fb, job_s)
        rate = slow / (1.0 - degraded_share) if t < degraded_until else slow
        t_reach = t + (target - work) * rate
        if t < degraded_until < t_reach:  # the group grows back before the target
            t_reach = degraded_until + (target - work - (degraded_until - t) / rate) * slow
        if next_fail >= t_reach:
            work, t = target, t_reach
            if work >= job_s:
                break
            pause = 0.0
            if work >= next_save:
                pause += p.save_s
            if work >= next_fb and fb is not None:
                pause += fb.save_s
            if next_fail < t + pause:  # failed while saving: the save never completes
                work = _progress_at(work, t, next_fail, 0.0)
                t = next_fail
            else:
                t += pause
                if work >= next_save:
                    saved.append((work, t + p.durable_s))
                    saved = saved[-4:]
                    next_save = work + tau
                if work >= next_fb:
                    fb_saved, next_fb = work, work + fb_tau
                continue
        else:
            work = _progress_at(work, t, next_fail, rate, degraded_until, slow)
            t = next_fail
        # -- a failure at time t: roll back, then recover (a failure meanwhile starts over)
        n_fail += 1
        took_copies = rng.random() < q
        node = rng.random() < failures.node_share
        killed = min(world - 1, failures.workers_per_node) if node else 1
        while True:
            if took_copies and fb is not None:
                n_fb += 1
                level, restart = fb_saved, fb.restart_s
            elif p.periodic:
                level, restart = restorable(t), p.restart_s
            elif p.lost_s is not None:
                level, restart = max(0.0, work - p.lost_s), p.restart_s
            else:  # nothing to restore from: the job starts over
                level, restart = 0.0, p.restart_s
            work = min(work, level)
            next_fail = t + failures.draw(rng)
            if next_fail >= t + restart:
                t += restart
                break
            t = next_fail  # a cascading failure during the recovery
            n_fail += 1
            n_cascade += 1
            took_copies = took_copies or rng.random() < q
        # what was restored is where the next failure rolls back to, until the next save
        saved = [(w, r) for w, r in saved if w < work][-3:] + [(work, t)]
        if p.periodic:
            next_save = work + tau
        if fb is not None and fb_saved > work:
            fb_saved = work
        if fb is not None:
            next_fb = fb_saved + fb_tau
        if p.degraded_s > 0:  # elastic: fewer ranks train until the group grows back
            degraded_until = t + p.degraded_s
            degraded_share = min(0.9, killed * p.degraded_share)
    return SimResult(job_s / t if t > 0 else 1.0, t, n_fail, n_fb, n_cascade)


def _progress_at(
    work: float,
    t: float,
    t_end: float,
    rate: float,
    degraded_until: float = 0.0,
    slow: float = 1.0,
) -> float:
    """Work done by `t_end`, training from `t` at `rate` wall s per work s (0: paused)."""
    if rate == 0.0:
        return work
    if t < degraded_until < t_end:
        return work + (degraded_until - t) / rate + (t_end - degraded_until) / slow
    return work + (t_end - t) / rate


def simulate_many(
    p: Profile, failures: Failures, job_s: float, world: int, runs: int = 20, seed: int = 0
) -> tuple[float, float]:
    """Useful / wall time over `runs` seeded runs (total work over total wall time, which is
    what the formulas give), and the half-width of its 95% bootstrap interval."""
    walls = [simulate(p, failures, job_s, world, seed + i).wall_s for i in range(runs)]
    ratio = job_s * runs / sum(walls)
    rng = random.Random(seed)
    boot = sorted(job_s * runs / sum(rng.choice(walls) for _ in walls) for _ in range(200))
    return ratio, (boot[194] - boot[4]) / 2
