"""Benchmark of live metrics: exporting them costs the training step <= 2%.

Measured two ways in the same run:
- end to end: the same DDP experiment with `metrics: true` and `metrics: false`, runs
  interleaved over rounds; the ratio of the medians of their mean steady-state step times;
- per step: inside a Ray actor, the time one step's worth of recording takes (what a worker
  records after each step: `Recorder.step` plus one state transfer), against the step time.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import ray

from bench.mechanisms import _ddp, _status

if TYPE_CHECKING:
    from bench.run import BenchConfig, Env

METRICS_GOAL = 1.02


@ray.remote(num_cpus=0)
def _record_cost(n: int) -> float:
    """Seconds per step of a worker's recording, timed over `n` steps in a real worker."""
    from failbench_ray import telemetry

    tags = {**telemetry.run_tags("bench", "trial0", "ddp", "disk_ckpt"), "rank": "0"}
    rec = telemetry.Recorder(tags)
    rec.step(0, 1.0, 0.01, 16, 0.001)  # the metric objects are made on first use
    t0 = time.perf_counter()
    for i in range(n):
        rec.step(i, 1.0, 0.01, 16, 0.001)
        rec.state_transfer("save", 1 << 20, 0.001)
    return (time.perf_counter() - t0) / n


def goal_metrics_overhead(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    from bench.run import run_spec

    rounds = 2 if cfg.quick else 4
    means: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        # alternate which goes first, so a drift in the machine's speed favours neither
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            spec = _ddp(f"bench-metrics-{mode}-{i}", "none", steps=120, metrics=mode == "on")
            result, _ = run_spec(env, spec)
            t = result.trials[0]
            if t.status != "completed" or t.mean_step_time_s is None:
                raise RuntimeError(f"metrics {mode}: {t.status}: {t.error}")
            means[mode].append(t.mean_step_time_s)
    med = {mode: statistics.median(v) for mode, v in means.items()}
    ratio = med["on"] / med["off"]
    per_step_s = ray.get(_record_cost.remote(2000))
    return _status(
        {
            "goal": f"step time with metrics on <= {METRICS_GOAL:.2f}x off (same run)",
            "met": ratio <= METRICS_GOAL,
            "rounds": rounds,
            "mean_step_s": means,
            "median_mean_step_s": med,
            "ratio": ratio,
            "record_s_per_step": per_step_s,
            "record_share_of_step": per_step_s / med["off"],
        }
    )
