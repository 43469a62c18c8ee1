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
from dataclasses import dataclass, field
from typing import Literal

from failbench_ray.reliability import Profile, interval


@dataclass(frozen=True)
class Failures:
    mtbf_s: float  # mean time between failures of the whole job
    distribution: Literal["exponential", "weibull"] = "exponential"
    shape: float = 0.7  # Weibull shape (< 1: failures come in bursts)
    node_share: float = 0.0  # fraction of failures that take a whole node
    workers_per_node: int = 8
    # Failures at these times (seconds), none after: a run's own draws replayed (`failbench
    # validate` gives the simulator the failures the measured run had).
    schedule: tuple[float, ...] | None = None

    def next_after(self, t: float, rng: random.Random) -> float:
        """When the next failure after `t` strikes."""
        if self.schedule is not None:
            return next((s for s in self.schedule if s > t), math.inf)
        return t + self.draw(rng)

    def draw(self, rng: random.Random) -> float:
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.mtbf_s)
        scale = self.mtbf_s / math.gamma(1 + 1 / self.shape)  # same mean as exponential
        return rng.weibullvariate(scale, self.shape)


# Failures one run plays at most. Where failures come faster than the job progresses (a
# recovery longer than the time between failures) it would never end; a run cut short reports
# the useful share of the time it simulated, and says so (`finished`).
MAX_FAILURES = 20_000
# Steps (saves, failures, skipped stretches) one run takes at most. Failures are bounded above,
# but a job much longer than its save interval takes a step per save it cannot skip (a
# fallback's saves stop `skip_cycles` at each): a million-worker job of ten years took over a
# minute. A run cut short here says so, as above.
MAX_STEPS = 200_000


@dataclass(frozen=True)
class SimResult:
    ratio: float  # useful work / wall time
    wall_s: float
    failures: int
    fallbacks: int  # failures that also took the copies
    cascades: int  # failures during a recovery
    work_s: float = 0.0  # work done (job_s unless cut short)
    finished: bool = True  # False: stopped after `max_failures` before the job was done
    out_of_steps: bool = False  # stopped by `max_steps` (not by the failures)


def simulate(
    p: Profile,
    failures: Failures,
    job_s: float,
    world: int,
    seed: int = 0,
    max_failures: int = MAX_FAILURES,
    max_steps: int = MAX_STEPS,
    wall_s: float | None = None,
) -> SimResult:
    """One run of a job of `job_s` seconds of work on `world` workers (at most `max_failures`
    failures of it, and `max_steps` steps). With `wall_s`, the run lasts that wall time
    instead, however much work it gets done (a measured run's window, replayed with its
    failure times: every failure before its end strikes, however fast the simulated job)."""
    if wall_s is not None:
        job_s = math.inf
    sim = _Sim.start(p, failures, job_s, world, seed)
    sim.max_failures = max_failures
    sim.end_t = math.inf if wall_s is None else wall_s
    steps = 0
    while (
        sim.work < job_s and sim.t < sim.end_t and sim.n_fail < max_failures and steps < max_steps
    ):
        steps += 1
        sim.skip_cycles()
        if sim.advance():  # a failure at sim.t: roll back, then recover
            sim.fail()
    t, work = sim.t, min(sim.work, job_s)
    ratio = (work + sim.slowed) / t if t > 0 else 1.0
    done = work >= job_s or t >= sim.end_t
    return SimResult(
        ratio, t, sim.n_fail, sim.n_fb, sim.n_cascade, work, done, not done and steps >= max_steps
    )


@dataclass
class _Sim:
    """The state of one `simulate` run; its steps are methods, which share that state."""

    p: Profile
    failures: Failures
    job_s: float
    world: int
    rng: random.Random
    slow: float  # wall seconds per second of work
    tau: float  # the save interval (inf: no periodic saves)
    q: float  # probability that a failure also takes the in-memory copies
    fb_tau: float  # the fallback's save interval
    next_save: float
    next_fb: float
    next_fail: float
    t: float = 0.0
    work: float = 0.0
    saved: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 0.0)])  # (work, ready)
    fb_saved: float = 0.0
    degraded_until: float = 0.0
    degraded_share: float = 0.0
    slowed: float = 0.0  # wall time of slowed steps after recoveries: useful by ETTR's definition
    n_fail: int = 0
    n_fb: int = 0
    n_cascade: int = 0
    max_failures: int = MAX_FAILURES  # a recovery that never gets through stops here too
    end_t: float = math.inf  # the run's wall time, when it is bounded by that (`simulate`)

    @classmethod
    def start(cls, p: Profile, failures: Failures, job_s: float, world: int, seed: int) -> _Sim:
        """A run at time 0, with its first failure drawn."""
        rng = random.Random(seed)
        tau = interval(p, failures.mtbf_s) if p.periodic else math.inf
        fb = p.fallback
        q = p.p_replica_loss if fb is not None else 0.0
        fb_tau = math.inf
        if fb is not None and fb.periodic:
            fb_tau = interval(fb, failures.mtbf_s / q) if q > 0 else math.inf
        slow = 1.0 + p.overhead
        next_fail = failures.next_after(0.0, rng)
        return cls(
            p, failures, job_s, world, rng, slow, tau, q, fb_tau,
            next_save=tau, next_fb=fb_tau, next_fail=next_fail,
        )  # fmt: skip

    def restorable(self, now: float) -> float:
        """The newest saved work level that is durable by `now`."""
        return max(w for w, ready in self.saved if ready <= now)

    def skip_cycles(self) -> None:
        """Whole save cycles that end before the next failure: skip through them at once."""
        p, tau, t, work = self.p, self.tau, self.t, self.work
        if not (
            p.periodic and t >= self.degraded_until and math.isclose(work, self.next_save - tau)
        ):
            return
        cycle = tau * self.slow + p.save_s
        end = min(self.next_fb, self.job_s)
        by_fail = math.inf if math.isinf(self.next_fail) else (self.next_fail - t) // cycle
        by_wall = math.inf if math.isinf(self.end_t) else (self.end_t - t) // cycle
        k = int(min(by_fail, by_wall, (end - work) // tau)) - 1
        if k > 0:
            self.work, self.t = work + k * tau, t + k * cycle
            self.saved = [*self.saved[-3:], (self.work, self.t + p.durable_s)]
            self.next_save = self.work + tau

    def advance(self) -> bool:
        """Train to the next save (and make it) or the end; True: a failure came first, at t."""
        slow, t, work, back = self.slow, self.t, self.work, self.degraded_until
        target = min(self.next_save, self.next_fb, self.job_s)
        rate = slow / (1.0 - self.degraded_share) if t < back else slow
        t_reach = t + (target - work) * rate
        if t < back < t_reach:  # the group grows back before the target
            t_reach = back + (target - work - (back - t) / rate) * slow
        if min(self.next_fail, t_reach) > self.end_t:  # the run's wall time ends first
            self.work = _progress_at(work, t, self.end_t, rate, back, slow)
            self.t = self.end_t
            return False
        if self.next_fail >= t_reach:
            self.work, self.t = target, t_reach
            if self.work >= self.job_s:
                return False
            return self._save()
        self.work = _progress_at(work, t, self.next_fail, rate, back, slow)
        self.t = self.next_fail
        return True

    def _save(self) -> bool:
        """The saves due at `work`; True: a failure came during them (they never complete)."""
        p, fb, work = self.p, self.p.fallback, self.work
        pause = 0.0
        if work >= self.next_save:
            pause += p.save_s
        if work >= self.next_fb and fb is not None:
            pause += fb.save_s
        if min(self.next_fail, self.t + pause) > self.end_t:  # the run ends while saving
            self.t = self.end_t
            return False
        if self.next_fail < self.t + pause:  # failed while saving: the save never completes
            self.work = _progress_at(work, self.t, self.next_fail, 0.0)
            self.t = self.next_fail
            return True
        self.t += pause
        if work >= self.next_save:
            self.saved.append((work, self.t + p.durable_s))
            self.saved = self.saved[-4:]
            self.next_save = work + self.tau
        if work >= self.next_fb:
            self.fb_saved, self.next_fb = work, work + self.fb_tau
        return False

    def fail(self) -> None:
        """A failure at time `t`: roll back, then recover (a failure meanwhile starts over)."""
        p, failures, rng = self.p, self.failures, self.rng
        self.n_fail += 1
        took_copies = rng.random() < self.q
        node = rng.random() < failures.node_share
        killed = min(self.world - 1, failures.workers_per_node) if node else 1
        while True:
            level, restart = self._restore_point(took_copies)
            self.work = min(self.work, level)
            self.next_fail = failures.next_after(self.t, rng)
            if min(self.next_fail, self.t + restart) > self.end_t:  # the run ends while down
                self.t = self.end_t
                return
            if self.next_fail >= self.t + restart:
                self.t += restart
                break
            self.t = self.next_fail  # a cascading failure during the recovery
            self.n_fail += 1
            self.n_cascade += 1
            if self.n_fail >= self.max_failures:
                return  # the run ends here, mid-recovery (cut short)
            took_copies = took_copies or rng.random() < self.q
        # what was restored is where the next failure rolls back to, until the next save
        self.saved = [(w, r) for w, r in self.saved if w < self.work][-3:] + [(self.work, self.t)]
        if p.periodic:
            self.next_save = self.work + self.tau
        if p.fallback is not None and self.fb_saved > self.work:
            self.fb_saved = self.work
        if p.fallback is not None:
            self.next_fb = self.fb_saved + self.fb_tau
        if p.slowed_s > 0:  # the steps after a recovery run slower (and count), until a failure
            until = min(self.t + p.slowed_s, self.next_fail, self.end_t)
            self.slowed += until - self.t
            self.t = until
        if p.degraded_s > 0:  # elastic: fewer ranks train until the group grows back
            self.degraded_until = self.t + p.degraded_s
            self.degraded_share = min(0.9, killed * p.degraded_share)

    def _restore_point(self, took_copies: bool) -> tuple[float, float]:
        """The work level a recovery restores, and how long it takes."""
        p, fb = self.p, self.p.fallback
        if took_copies and fb is not None:
            self.n_fb += 1
            return self.fb_saved, fb.restart_s
        if p.periodic:
            return self.restorable(self.t), p.restart_s
        if p.lost_s is not None:
            return max(0.0, self.work - p.lost_s), p.restart_s
        return 0.0, p.restart_s  # nothing to restore from: the job starts over


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


@dataclass(frozen=True)
class SimSummary:
    ratio: float  # total work over total wall time of the runs
    ci95: float  # half-width of its 95% bootstrap interval
    runs: int
    cut_short: int  # runs stopped after their failure or step budget, before the job was done
    out_of_steps: int = 0  # of those, the ones stopped by the step budget
    # where one job's own ratio falls: the 2.5th and 97.5th percentiles of the runs' ratios
    job_low: float = 0.0
    job_high: float = 0.0


# Failures all the runs of one `simulate_many` play at most, shared out among them: what one
# question to `recommend` may cost, whatever it asks.
FAILURE_BUDGET = 20_000
STEP_BUDGET = 400_000  # likewise for steps (MAX_STEPS)


def summarize(
    p: Profile, failures: Failures, job_s: float, world: int, runs: int = 20, seed: int = 0
) -> SimSummary:
    """`runs` seeded runs: useful / wall time (total work over total wall time, which is what
    the formulas give), its 95% bootstrap interval, and how many runs were cut short."""
    each = max(1, FAILURE_BUDGET // max(runs, 1))
    steps = max(1, STEP_BUDGET // max(runs, 1))
    got = [simulate(p, failures, job_s, world, seed + i, each, steps) for i in range(runs)]
    pairs = [(r.ratio * r.wall_s, r.wall_s) for r in got]  # useful time: work and slowed steps

    def ratio(sample: list[tuple[float, float]]) -> float:
        return sum(w for w, _ in sample) / sum(t for _, t in sample)

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(200))
    cut = sum(not r.finished for r in got)
    out = sum(r.out_of_steps for r in got)
    each_ratio = sorted(r.ratio for r in got)
    low, high = _percentile(each_ratio, 2.5), _percentile(each_ratio, 97.5)
    return SimSummary(ratio(pairs), (boot[194] - boot[4]) / 2, runs, cut, out, low, high)


def _percentile(ordered: list[float], pct: float) -> float:
    """Linear interpolation between the closest ranks of an ordered sample."""
    if not ordered:
        return math.nan
    x = (len(ordered) - 1) * pct / 100
    lo = math.floor(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)


def simulate_many(
    p: Profile, failures: Failures, job_s: float, world: int, runs: int = 20, seed: int = 0
) -> tuple[float, float]:
    """`summarize`'s ratio and the half-width of its 95% interval."""
    s = summarize(p, failures, job_s, world, runs, seed)
    return s.ratio, s.ci95
