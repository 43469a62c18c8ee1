"""Issue 19: the heartbeat detector, at its default timeout (`DetectorSpec`).

1. Detection latency: a `hang` (SIGSTOP) and a `gil_hang` (a thread holds the GIL) of rank 1 at
   step 15 of the recovery job (ddp, 4 ranks, disk_ckpt); `detected_s` (injection -> the
   driver calls the rank hung) of every trial at most 2 s, each trial recovered and exact.
2. False alarms over 1,000 fault-free steps with natural jitter (the mechanism benchmarks' ddp
   job, 2.1M parameters, a disk checkpoint every 10 steps, on this shared machine): none.
3. Silent corruption: a `bitflip` and a `nan` of rank 1 at step 15 of the recovery job, each
   found by its check (digest, non-finite), rolled back and exact; and the steady-state cost of
   the checks at their default intervals (the fault-free job with the checks on and off, in
   alternating pairs: the median of the pairs' step-time ratios, goal at most 1.02).
4. Stragglers: on each architecture (4 ranks), rank 1 runs 2 times slower from step 60 to the
   end; the job's throughput with the straggler over before it (in the same run: the machine's
   drift between two runs would be as large as the effect), and whether and how soon the
   step-time outlier detector flagged rank 1 at its default threshold. No goal: synchronous
   architectures should slow to the straggler and gossip and async ps should not; this reports
   what happens.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from bench.common import ddp_spec, recovery_spec, run_spec, with_status

if TYPE_CHECKING:
    from bench.common import BenchConfig, Env

HANG_GOAL_S = 2.0
QUIET_STEPS = 1000
KINDS = ("hang", "gil_hang")
CORRUPTION = {"bitflip": "digest", "nan": "nonfinite"}
CHECK_COST_GOAL = 1.02
CHECKS_OFF = {"digest_every": None, "nonfinite_every": None}
STRAGGLER_K = 2.0
# Architecture -> its parameters, each on 4 ranks (ps: 1 server, 3 workers; rank 1 a worker).
STRAGGLER_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "tensor": ("tensor", {}),
    "pipeline": ("pipeline", {"microbatches": 4}),
    "hybrid": ("hybrid", {"dp": 2, "pp": 2, "microbatches": 2}),
    "gossip": ("gossip", {}),
    "ps_sync": ("ps", {"servers": 1, "mode": "sync"}),
    "ps_async": ("ps", {"servers": 1, "mode": "async"}),
}


def _latencies(env: Env, kind: str, trials: int) -> dict[str, Any]:
    spec = recovery_spec(
        f"bench-detect-{kind}",
        trials,
        failures={"kind": "single", "rank": 1, "at_step": 15, "kill": kind},
        # A corruption is judged by the oracle: its trials need the no-fault run to compare.
        baseline=kind in CORRUPTION,
    )
    result, wall = run_spec(env, spec)
    found = [f for t in result.trials for f in t.failures]
    times = [f.phases.detected_s for f in found if f.phases.detected_s is not None]
    return {
        "detected_s": times,
        "detectors": sorted({f.detector for f in found}),
        "p50_s": statistics.median(times) if times else None,
        "max_s": max(times) if times else None,
        "trials_completed": sum(t.status == "completed" for t in result.trials),
        "trials": len(result.trials),
        "exact": [t.matches_baseline for t in result.trials],
        "wall_s": wall,
    }


def _check_cost(env: Env, pairs: int) -> dict[str, Any]:
    """Mean steady step time with the corruption checks on (defaults) over off, pair by pair
    (alternating, so the machine's drift hits both alike; the order flips from pair to pair,
    on-off then off-on: with on always first, the second run was the faster in every pair, so
    a run's place in the pair may matter as much as the checks)."""
    ratios, on_s, off_s = [], [], []
    for i in range(pairs):
        times = {}
        order: tuple[tuple[str, dict[str, Any]], ...] = (("on", {}), ("off", CHECKS_OFF))
        for label, detectors in order if i % 2 == 0 else order[::-1]:
            spec = ddp_spec(f"bench-check-{label}-{i}", "none", steps=200, detectors=detectors)
            result, _ = run_spec(env, spec)
            times[label] = result.trials[0].mean_step_time_s
        if times["on"] and times["off"]:
            on_s.append(times["on"])
            off_s.append(times["off"])
            ratios.append(times["on"] / times["off"])
    median = statistics.median(ratios) if ratios else None
    return {
        "pairs": len(ratios),
        "step_time_on_s": on_s,
        "step_time_off_s": off_s,
        "ratios": ratios,
        "median_ratio": median,
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "met": median is not None and median <= CHECK_COST_GOAL,
    }


def straggler_spec(label: str, arch: str, params: dict[str, Any], steps: int) -> dict[str, Any]:
    return {
        "name": f"bench-straggler-{label}",
        "architecture": {"name": arch, "params": params},
        "world_size": 4,
        "model": {"kind": "mlp", "input_dim": 64, "hidden_dim": 256, "depth": 4},
        "steps": steps,
        "batch_size": 96,  # splits over 4 ranks, 3 ps workers and 4 microbatches
        "trials": 1,
        "baseline": False,
        "mechanism": {"name": "none"},
        "warmup_steps": 5,
        "failures": {
            "kind": "single",
            "rank": 1,
            "at_step": 60,
            "kill": "straggler",
            "kill_params": {"factor": STRAGGLER_K, "duration_s": 3600},
        },
    }


def _stragglers(env: Env, steps: int) -> dict[str, Any]:
    """Each architecture's throughput with one straggler at k=2 over without, in one run."""
    out: dict[str, Any] = {}
    for label, (arch, params) in STRAGGLER_ARCHS.items():
        result, wall = run_spec(env, straggler_spec(label, arch, params, steps))
        trial = result.trials[0]
        extra = trial.model_extra or {}
        before = extra.get("samples_per_s_before_straggler")
        during = extra.get("samples_per_s_with_straggler")
        flags = extra.get("stragglers") or []
        mine = [f for f in flags if f["rank"] == 1]
        out[label] = {
            "status": trial.status,
            "samples_per_s_before": before,
            "samples_per_s_with_straggler": during,
            "throughput_ratio": during / before if before and during else None,
            "flagged": bool(mine),
            "detected_s": mine[0]["detected_s"] if mine else None,
            "flag_ratio": mine[0]["ratio"] if mine else None,
            "other_ranks_flagged": sorted(f["rank"] for f in flags if f["rank"] != 1),
            "wall_s": wall,
        }
    return out


def goal_detectors(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    measured = {kind: _latencies(env, kind, cfg.trials) for kind in (*KINDS, *CORRUPTION)}
    quiet, wall = run_spec(
        env,
        ddp_spec(
            "bench-detect-quiet",
            {"name": "disk_ckpt", "params": {"interval": 10}},
            steps=QUIET_STEPS,
        ),
    )
    alarms = [f for t in quiet.trials for f in t.failures]
    flagged = [f for t in quiet.trials for f in (t.model_extra or {}).get("stragglers") or []]
    found_all = all(
        m["trials_completed"] == m["trials"] == len(m["detected_s"])
        and m["detectors"] == [CORRUPTION.get(kind, "heartbeat")]
        and (kind not in CORRUPTION or all(m["exact"]))
        for kind, m in measured.items()
    )
    fast = all(
        measured[k]["max_s"] is not None and measured[k]["max_s"] <= HANG_GOAL_S for k in KINDS
    )
    cost = _check_cost(env, max(3, cfg.trials))
    stragglers = _stragglers(env, 120 if cfg.quick else 200)
    return with_status(
        {
            "goal": f"every hang found by the heartbeat within {HANG_GOAL_S:g} s (default "
            f"timeout); no false alarm (a failure or a flagged straggler) in {QUIET_STEPS} "
            "fault-free steps; every corruption "
            f"found by its check and rolled back exactly; the checks cost at most "
            f"{(CHECK_COST_GOAL - 1) * 100:g}% of a step at their default intervals",
            "met": found_all
            and fast
            and not alarms
            and not flagged
            and quiet.trials[0].status == "completed"
            and cost["met"],
            "measured": measured,
            "check_cost": cost,
            "stragglers": stragglers,
            "quiet": {
                "steps": QUIET_STEPS,
                "status": quiet.trials[0].status,
                "false_alarms": [
                    {"ranks": f.ranks, "detector": f.detector, "kind": f.kill_kind} for f in alarms
                ]
                + [{"ranks": [f["rank"]], "detector": "step_time", "kind": None} for f in flagged],
                "step_time_s": quiet.trials[0].step_time_s,
                "wall_s": wall,
            },
        }
    )


def detectors_text(m: dict[str, Any]) -> str:
    parts = []
    for kind, r in m.get("measured", {}).items():
        got = ", ".join(f"{t:.2f}" for t in r.get("detected_s", []))
        parts.append(f"{kind} detected in {got} s (max {r.get('max_s') or 0:.2f})")
    q = m.get("quiet", {})
    c = m.get("check_cost", {})
    ratio = c.get("median_ratio")
    slow = "; ".join(
        f"{a} x{r['throughput_ratio']:.2f}"
        + (f" flagged in {r['detected_s']:.1f} s" if r.get("flagged") else " not flagged")
        for a, r in m.get("stragglers", {}).items()
        if r.get("throughput_ratio") is not None
    )
    return (
        "; ".join(parts)
        + f"; false alarms in {q.get('steps')} fault-free steps: {len(q.get('false_alarms', []))}"
        + f" (goal every hang <= {HANG_GOAL_S:g} s, none); corruption checks on/off step time: "
        + (f"median {ratio:.3f} over {c.get('pairs')} pairs" if ratio else "not measured")
        + f" (goal <= {CHECK_COST_GOAL:g}); a k={STRAGGLER_K:g} straggler, throughput with "
        + f"it over before: {slow or 'not measured'}"
    )
