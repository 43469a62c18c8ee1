"""Live training metrics, exported through Ray's metrics API (`ray.util.metrics`).

Workers and the trial controller record them; each Ray node's metrics agent serves them on its
Prometheus endpoint with the prefix `ray_` (so `failbench_loss` is scraped as
`ray_failbench_loss`). The service's own metrics (HTTP latency, the queue) stay on the API's
`/metrics` (`api/metrics.py`). `deploy/` holds the Prometheus config and Grafana dashboards that
read both; `tests/test_deploy.py` checks every dashboard query against `exported_names()`.

Recording is a few microseconds per step; `ExperimentSpec.metrics: false` turns it off (the
`metrics_overhead` benchmark compares a run with and without it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Ray prepends this to every application metric it exports.
RAY_PREFIX = "ray_"

# Labels of every training metric: which run, and (for per-rank metrics) which rank.
RUN_TAGS: tuple[str, ...] = ("experiment", "trial", "architecture", "mechanism")
RANK_TAGS: tuple[str, ...] = (*RUN_TAGS, "rank")

_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    def exported(self) -> list[str]:
        """The series names Prometheus sees for this metric."""
        base = RAY_PREFIX + self.name
        if self.kind == "histogram":
            return [f"{base}_bucket", f"{base}_count", f"{base}_sum"]
        return [base]


def _d(name: str, kind: Any, description: str, tags: tuple[str, ...], b: Any = ()) -> MetricDef:
    return MetricDef(name, kind, description, tags, tuple(b))


# Recorded by each worker, per rank.
STEP_SECONDS = _d(
    "failbench_step_seconds",
    "gauge",
    "Duration of this rank's last step (hooks included)",
    RANK_TAGS,
)
LOSS = _d("failbench_loss", "gauge", "Training loss of this rank's last step", RANK_TAGS)
SAMPLES_PER_SECOND = _d(
    "failbench_samples_per_second", "gauge", "Samples/s of this rank's last step", RANK_TAGS
)
STEP = _d("failbench_step", "gauge", "Last step this rank completed", RANK_TAGS)
STEPS_TOTAL = _d("failbench_steps_total", "counter", "Steps completed by this rank", RANK_TAGS)
SAMPLES_TOTAL = _d("failbench_samples_total", "counter", "Samples consumed by this rank", RANK_TAGS)
BLOCKED_SECONDS_TOTAL = _d(
    "failbench_step_blocked_seconds_total",
    "counter",
    "Time steps were blocked in the mechanism's after-step hook (checkpoint, replication)",
    RANK_TAGS,
)
STATE_BYTES_TOTAL = _d(
    "failbench_state_bytes_total",
    "counter",
    "Bytes of state saved, replicated or restored (kind: save, replicate, restore)",
    (*RANK_TAGS, "kind"),
)
STATE_SECONDS = _d(
    "failbench_state_transfer_seconds",
    "histogram",
    "Duration of one save, replication or restore (kind: save, replicate, restore)",
    (*RANK_TAGS, "kind"),
    _SECONDS_BUCKETS,
)
# Recorded by the trial controller (the driver), per trial.
WORLD_SIZE = _d("failbench_world_size", "gauge", "Ranks training in the trial now", RUN_TAGS)
FAILURES_TOTAL = _d(
    "failbench_failures_injected_total",
    "counter",
    "Failures injected (one per event, whatever the number of ranks it kills)",
    (*RUN_TAGS, "kill_kind"),
)
RANKS_KILLED_TOTAL = _d(
    "failbench_ranks_killed_total", "counter", "Ranks killed by injected failures", RUN_TAGS
)
PHASE_SECONDS = _d(
    "failbench_recovery_phase_seconds",
    "histogram",
    "Duration of each recovery phase (from the previous phase, or the injection, to this one)",
    (*RUN_TAGS, "phase"),
    _SECONDS_BUCKETS,
)
RECOVERY_SECONDS = _d(
    "failbench_recovery_seconds",
    "histogram",
    "From the injection to the first step after recovery (resumed)",
    RUN_TAGS,
    _SECONDS_BUCKETS,
)

DEFINITIONS: tuple[MetricDef, ...] = (
    STEP_SECONDS,
    LOSS,
    SAMPLES_PER_SECOND,
    STEP,
    STEPS_TOTAL,
    SAMPLES_TOTAL,
    BLOCKED_SECONDS_TOTAL,
    STATE_BYTES_TOTAL,
    STATE_SECONDS,
    WORLD_SIZE,
    FAILURES_TOTAL,
    RANKS_KILLED_TOTAL,
    PHASE_SECONDS,
    RECOVERY_SECONDS,
)


def exported_names() -> set[str]:
    """Every series name the training metrics appear under in Prometheus."""
    return {name for d in DEFINITIONS for name in d.exported()}


# Phases the controller sees happen; the later ones are known when the trial ends.
LIVE_PHASES = ("detected", "quiesced", "reformed", "restored")
LATE_PHASES = ("resumed", "caught_up")


def run_tags(experiment: str, trial: str, architecture: str, mechanism: str) -> dict[str, str]:
    return dict(zip(RUN_TAGS, (experiment, trial, architecture, mechanism), strict=True))


_PROCESS_METRICS: dict[str, Any] = {}


class Recorder:
    """Records `DEFINITIONS` with fixed run tags. Ray's metric objects are made on first use in
    the process that records (they need a connected Ray worker); disabled, every call is a no-op.
    """

    def __init__(self, tags: Mapping[str, str], *, enabled: bool = True) -> None:
        self.tags = dict(tags)
        self.enabled = enabled
        self._metrics: dict[str, Any] = {}
        self._base: dict[str, dict[str, str]] = {}  # per metric: its own tags, from `tags`

    def set_tag(self, key: str, value: str) -> None:
        """E.g. a hot spare that takes a rank."""
        self.tags[key] = value
        self._base.clear()

    def _metric(self, d: MetricDef) -> Any:
        # One Ray metric object per name and process: a pooled worker records trial after
        # trial through the same objects instead of registering the name again each time.
        m = self._metrics.get(d.name) or _PROCESS_METRICS.get(d.name)
        if m is None:
            from ray.util import metrics

            if d.kind == "gauge":
                m = metrics.Gauge(d.name, description=d.description, tag_keys=d.tags)
            elif d.kind == "counter":
                m = metrics.Counter(d.name, description=d.description, tag_keys=d.tags)
            else:
                m = metrics.Histogram(
                    d.name,
                    description=d.description,
                    boundaries=list(d.boundaries),
                    tag_keys=d.tags,
                )
            _PROCESS_METRICS[d.name] = m
        self._metrics[d.name] = m
        return m

    def _tags(self, d: MetricDef, extra: Mapping[str, str]) -> dict[str, str]:
        # Ray refuses a tag the metric does not declare and needs every declared one.
        base = self._base.get(d.name)
        if base is None:
            base = self._base[d.name] = {k: self.tags.get(k, "") for k in d.tags}
        return {**base, **extra} if extra else base

    def set(self, d: MetricDef, value: float, **extra: str) -> None:
        if self.enabled:
            self._metric(d).set(value, tags=self._tags(d, extra))

    def inc(self, d: MetricDef, value: float = 1.0, **extra: str) -> None:
        if self.enabled and value > 0:  # Ray's counters refuse 0
            self._metric(d).inc(value, tags=self._tags(d, extra))

    def observe(self, d: MetricDef, value: float, **extra: str) -> None:
        if self.enabled:
            self._metric(d).observe(value, tags=self._tags(d, extra))

    # -- what a worker records --------------------------------------------------------------
    def step(self, step: int, loss: float, seconds: float, samples: int, blocked_s: float) -> None:
        if not self.enabled:
            return
        self.set(STEP_SECONDS, seconds)
        self.set(LOSS, loss)
        self.set(STEP, step)
        if seconds > 0:
            self.set(SAMPLES_PER_SECOND, samples / seconds)
        self.inc(STEPS_TOTAL)
        self.inc(SAMPLES_TOTAL, samples)
        self.inc(BLOCKED_SECONDS_TOTAL, blocked_s)

    def state_transfer(self, kind: str, nbytes: int, seconds: float) -> None:
        self.inc(STATE_BYTES_TOTAL, nbytes, kind=kind)
        self.observe(STATE_SECONDS, seconds, kind=kind)

    # -- what the controller records --------------------------------------------------------
    def failure(self, kill_kind: str, ranks: int) -> None:
        self.inc(FAILURES_TOTAL, 1, kill_kind=kill_kind)
        self.inc(RANKS_KILLED_TOTAL, ranks)

    def recovery(self, phases: Mapping[str, float | None], which: Collection[str]) -> None:
        """Record the durations of the phases in `which`. Phase times are seconds after the
        injection, in order (None: not reached); a phase lasts from the one reached before it.
        The controller records up to `restored` as it happens, the runner the rest (`resumed`
        and `caught_up` are read off the step records when the trial ends)."""
        previous = 0.0
        for phase, t in phases.items():
            if t is None:
                continue
            if phase in which:
                self.observe(PHASE_SECONDS, max(0.0, t - previous), phase=phase)
            previous = t
        resumed = phases.get("resumed")
        if "resumed" in which and resumed is not None:
            self.observe(RECOVERY_SECONDS, resumed)
